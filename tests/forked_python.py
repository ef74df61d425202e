"""`python` for the processes a test starts, without each one importing torch again.

A test that runs the CLI (or torchrun and its workers) as a user does starts a fresh interpreter each time, and
each spends ~3.5 CPU-seconds importing torch, torchvision and torch.distributed before it does any work: most of
the CPU of the launched tests. Here servers per pytest worker import once and fork a child for each process a
test starts, as multiprocessing's forkserver does with its preload list
(https://docs.python.org/3/library/multiprocessing.html#multiprocessing.set_forkserver_preload): "torch" imports
the torch stack, "package" also lit_softmoe's recipes, the hub libraries (open_clip, transformers, timm),
matplotlib and CLIP_benchmark.

What the test starts is a small client, `python -S forked_python.py SERVERS [-u] ARGS`, where ARGS are what
follows `python` (`-m MODULE …`, `-c CODE …`, `SCRIPT …`): a stdlib-only process that hands a server its
standard streams (the file descriptors themselves), its environment, folder and resource limits (an address-space
cap a test sets with preexec_fn), and then lives as long as the child, exits with the child's code, passes on the
signals it gets, and its death kills the child. It records the child's pid beside the server's socket, for a
test's kill -9. So the tests use subprocess and torchrun as before: only the command's first word changes
(tests/launch.py: `python_command`, `forked_python`).

What differs from a fresh interpreter, and why it does not matter here: the child has the server's imports, whose
state at import is what a fresh process's would be (lit_softmoe reads its variables when called; the hub
libraries read theirs at import, so a process whose import-time variables, PYTHONPATH or first lit_softmoe on
its path differ from the "package" server's forks from the "torch" one); its thread count is set from
OMP_NUM_THREADS as at a fresh start; its sys.path is made as a fresh start makes it. Tests whose point is a
fresh interpreter (what an import loads) keep `sys.executable`.

Kept stdlib-only at the top: the client runs with `-S` and must start in milliseconds.
"""
from __future__ import annotations

import contextlib
import gc
import os
import pickle
import selectors
import signal
import socket
import struct
import sys

_LENGTH = struct.Struct("!Q")
_STATUS = struct.Struct("!q")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CPU")  # a test may set on its process
PRELOAD = {  # what a server imports before it forks: "torch", or "package" (the torch stack, ours, the hub's)
    "torch": ("torch", "torchvision", "numpy", "PIL.Image", "safetensors.torch", "torch.distributed.fsdp",
              "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.elastic.agent.server"),
}
PRELOAD["package"] = PRELOAD["torch"] + ("open_clip", "transformers", "timm", "lit_softmoe.train.lit",
                                         "lit_softmoe.train.pretrain", "lit_softmoe.train.embed",
                                         "lit_softmoe.evals.suite", "lit_softmoe.export",
                                         "matplotlib.pyplot")  # the runs' curves
PRELOAD_IF_INSTALLED = {"torch": (), "package": ("clip_benchmark.cli",)}  # the peer eval (a dev extra)
# The variables the hub libraries (and a second lit_softmoe on PYTHONPATH) read when they are imported: a
# process whose values differ from the "package" server's forks from the "torch" one, which has not imported them.
_IMPORT_TIME_VARIABLES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH_HOME", "XDG_", "TIMM", "OPENCLIP", "HOME",
                          "PYTHONPATH", "MPL")


def import_time_digest(environ) -> str:
    import hashlib
    seen = sorted((k, v) for k, v in environ.items() if k.startswith(_IMPORT_TIME_VARIABLES))
    return hashlib.sha256(repr(seen).encode()).hexdigest()[:16]


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other end closed")
        data += chunk
    return data


# ---- the client: what a test starts ------------------------------------------------------------------

def _open_standard_streams() -> list[int]:
    """fds 0, 1 and 2, any that is closed replaced by /dev/null (as a fresh interpreter would see it)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def _server_for(servers: str, args: list[str]) -> str:
    """`servers` is "TORCH_SOCKET" or "TORCH_SOCKET,PACKAGE_SOCKET,DIGEST,PACKAGE_ROOT": the package server where
    what it imported is what this process would import (the same import-time variables, and no other
    lit_softmoe folder first on sys.path), else the torch one; torchrun's agent always the torch one."""
    torch_socket, *package = servers.split(",")
    if not package or args[:2] == ["-m", "torch.distributed.run"]:
        # torchrun's agent imports only torch (its workers are processes of their own, `--no-python` this
        # executable), and its logging looks up the module of each caller among all of sys.modules: forked from
        # the package server it took 0.8 CPU-s a launch, from the torch one 0.3.
        return torch_socket
    package_socket, digest, root = package
    first = os.path.dirname(os.path.abspath(args[0])) if args and args[0] not in ("-m", "-c") else os.getcwd()
    other_package = os.path.isdir(os.path.join(first, "lit_softmoe")) and os.path.realpath(first) != root
    same = import_time_digest(os.environ) == digest and not other_package
    return package_socket if same else torch_socket


def run_client(servers: str, args: list[str]) -> None:
    import resource

    unbuffered = bool(args) and args[0] == "-u"
    args = args[1:] if unbuffered else args
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = _server_for(servers, args)
    conn.connect(server)
    limits = {number: resource.getrlimit(number)  # e.g. set by preexec_fn
              for number in (getattr(resource, name) for name in _LIMITS)}
    request = pickle.dumps({"args": args, "env": dict(os.environb), "cwd": os.getcwd(),
                            "unbuffered": unbuffered, "limits": limits, "client": os.getpid()})
    socket.send_fds(conn, [_LENGTH.pack(len(request))], _open_standard_streams())
    conn.sendall(request)
    (child,) = _STATUS.unpack(_receive_exactly(conn, _STATUS.size))
    record_file = child_file(os.path.dirname(server), os.getpid())  # written by the child
    for number in _FORWARDED:
        signal.signal(number, lambda received, frame: os.kill(child, received))
    (status,) = _STATUS.unpack(_receive_exactly(conn, _STATUS.size))
    with contextlib.suppress(FileNotFoundError):  # a child killed before it wrote it
        os.unlink(record_file)
    if status < 0:  # the child died of a signal: so does this process, as its stand-in
        if -status != signal.SIGKILL:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def child_file(folder: str, client_pid: int) -> str:
    """Where the pid of the child that the client `client_pid` of the servers in `folder` stands for is recorded."""
    return os.path.join(folder, f"child-of-{client_pid}")


# ---- the server ----------------------------------------------------------------------------------

def _child_main(request: dict, fds: list[int], default_threads: int, base_path: list[str]) -> None:
    """In the forked child: become the process the client asked for, run it, exit as Python would."""
    import atexit
    import faulthandler
    import io
    import resource
    import runpy
    import tempfile
    import threading
    import traceback
    import types

    import torch

    for number in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    wakeup = signal.set_wakeup_fd(-1)
    if wakeup >= 0:
        os.close(wakeup)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for number, limit in request["limits"].items():  # the client's resource limits, as if it had forked the child
        if resource.getrlimit(number) != limit:
            resource.setrlimit(number, limit)
    os.chdir(request["cwd"])
    os.environb.clear()
    os.environb.update(request["env"])
    tempfile.tempdir = None  # found again from this process's TMPDIR, as at a fresh start
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.open(1, "wb", closefd=False), encoding="utf-8",
                                                   line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.open(2, "wb", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", line_buffering=True)
    # A crash (SIGSEGV, SIGABRT) prints every thread's Python stack into the test's stderr, as pytest's own
    # faulthandler does for its process: a launched run that died of a signal said only "exitcode: -11".
    faulthandler.enable(sys.stderr, all_threads=True)
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() else default_threads)
    # sys.path as a fresh start makes it: the first entry (below), then PYTHONPATH's, then the site's
    sys.path[:] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), *base_path]

    args, code = request["args"], 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's file first
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as the interpreter does at exit: join non-daemon threads, then atexit
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError) as error:  # as the interpreter reports a failed flush at exit (status 120)
        print(f"Exception ignored in: {sys.stdout!r}\n{type(error).__name__}: {error}", file=sys.stderr)
        code = code or 120
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code & 0xFF)


class _Server:
    def __init__(self, socket_path: str, preload: str):
        # The imports' objects live as long as the server and every child: the cyclic garbage collector is off
        # while they are made, then they are frozen (https://docs.python.org/3/library/gc.html#gc.freeze, for a
        # pre-fork server), so that no collection in the server or a child walks them again. Children spent 10-25%
        # of their CPU in the collector walking the torch and hub libraries' objects.
        gc.disable()
        import torch
        for module in PRELOAD[preload]:
            __import__(module)
        for module in PRELOAD_IF_INSTALLED[preload]:
            try:
                __import__(module)
            except ImportError:
                pass
        gc.freeze()
        gc.enable()
        self.default_threads = torch.get_num_threads()  # no OMP_NUM_THREADS here: the machine's default
        own = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
        self.base_path = [p for p in sys.path[1:] if p not in own]  # the site's entries
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.folder = os.path.dirname(socket_path)
        self.listener.bind(socket_path + ".tmp")
        self.listener.listen(64)
        os.rename(socket_path + ".tmp", socket_path)  # the clients wait for this name: it appears ready
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self.stop)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "reap")
        self.children: dict[int, socket.socket] = {}  # child pid: its client's connection

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "reap":
                    os.read(self.wakeup_read, 4096)
                    self.reap()
                else:  # a client's connection: readable only when it closed (its client died)
                    self.kill([key.data])

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        header, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
        request = pickle.loads(_receive_exactly(conn, _LENGTH.unpack(header)[0]))
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            for held in [self.listener, conn, *self.children.values()]:
                held.close()
            os.close(self.wakeup_read)
            # Which child stands for the client, for kill -9 (tests/launch.py): recorded before the child runs
            # anything, so that a process it starts is never found before the record (written by the client
            # instead, a busy machine let a child start a process, and a test kill its tree, before the record).
            record = child_file(self.folder, request["client"])
            with open(record + ".tmp", "w") as file:
                file.write(str(os.getpid()))
            os.rename(record + ".tmp", record)
            _child_main(request, fds, self.default_threads, self.base_path)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        conn.sendall(_STATUS.pack(pid))
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def kill(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            if pid in self.children:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
                self.finish(pid, -signal.SIGKILL)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.finish(pid, os.waitstatus_to_exitcode(status))

    def finish(self, pid: int, status: int) -> None:
        if pid not in self.children:
            return
        conn = self.children.pop(pid)
        self.selector.unregister(conn)
        try:
            conn.sendall(_STATUS.pack(status))
        except OSError:
            pass  # its client is gone
        conn.close()

    def stop(self, *_) -> None:
        self.kill(list(self.children))
        os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _Server(sys.argv[2], sys.argv[3]).serve_forever()
    else:
        run_client(sys.argv[1], sys.argv[2:])
