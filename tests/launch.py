"""How the tests start processes as a user does: `python …` and torchrun (a port of its own for each run), each
process forked from a server that imported torch (and the package) once (tests/forked_python.py) instead of
importing them again."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_FORKED_PYTHON = Path(__file__).with_name("forked_python.py")
_ROOT = Path(__file__).resolve().parents[1]


class _Servers:
    """This process's two servers (each pytest-xdist worker its own): "torch" imported the torch stack,
    "package" that and lit_softmoe with the hub libraries; and the two `python` executables that use them.

    The package server is itself a child of the torch one (started through its `python`), so it imports only
    what the torch server has not: a pair took 4.9 CPU-s to start and fork a first child, against 6.9."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="forked-python-")  # short: a socket's path has ~100 bytes at most
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST")}
        self.sockets = {preload: os.path.join(self.folder, preload) for preload in ("torch", "package")}
        self.processes = []  # the package server's client last: stopped first, while the torch server reaps it
        atexit.register(self.stop)
        torch_python = self._executable("python-torch", self.sockets["torch"])
        for python, preload in ((sys.executable, "torch"), (torch_python, "package")):
            self.processes.append(subprocess.Popen([python, str(_FORKED_PYTHON), "--serve", self.sockets[preload],
                                                    preload], env=env, stdin=subprocess.DEVNULL))
            self._wait_for(self.sockets[preload])
        from forked_python import import_time_digest
        both = f"{self.sockets['torch']},{self.sockets['package']},{import_time_digest(env)},{_ROOT}"
        self.executables = {"package": self._executable("python", both), "torch": torch_python}

    def _wait_for(self, socket_path: str) -> None:
        deadline = time.time() + 120
        while not os.path.exists(socket_path):
            for server in self.processes:
                assert server.poll() is None, f"a forked-python server ended with code {server.returncode}"
            assert time.time() < deadline, "the forked-python servers did not start in 120 s"
            time.sleep(0.01)

    def _executable(self, name: str, servers: str) -> str:
        path = os.path.join(self.folder, name)
        with open(path, "w") as script:
            script.write(f"#!/bin/sh\nexec '{sys.executable}' -S '{_FORKED_PYTHON}' '{servers}' \"$@\"\n")
        os.chmod(path, 0o755)
        return path

    def running(self) -> bool:
        return all(server.poll() is None for server in self.processes)

    def stop(self) -> None:
        for server in reversed(self.processes):  # the package server first: the torch one reaps it
            server.terminate()  # it kills the children it still has, then exits
            server.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: _Servers | None = None


def _started() -> _Servers:
    global _servers
    if _servers is None or not _servers.running():
        _servers = _Servers()
    return _servers


def forked_python(preload: str = "package") -> str:
    """An executable that behaves as `python` does, without importing again what a server imported: a shell
    script handing its arguments to this process's servers (tests/forked_python.py). "package" (the default)
    forks from the server that imported torch, lit_softmoe and the hub libraries where the process would import
    the same (else from the torch one); "torch", for a process that must import lit_softmoe, timm or open_clip
    itself. For what takes a python executable's path (a script's `sys.executable`, torchrun's `--no-python`)."""
    return _started().executables[preload]


def python_command(preload: str = "package") -> list[str]:
    """What starts `python` in a test (`[*python_command(), "-m", "lit_softmoe.cli", …]`)."""
    return [forked_python(preload)]


def _child_of(client_pid: int) -> int | None:
    """The pid of the process that the client `client_pid` (a process a test started) stands for."""
    from forked_python import child_file
    with contextlib.suppress(FileNotFoundError):
        return int(Path(child_file(_started().folder, client_pid)).read_text())
    return None


def _kill(process: subprocess.Popen, tree: bool) -> None:
    import psutil
    child = _child_of(process.pid)
    targets, todo = [], [child] if child else [process.pid]
    while todo:  # the child, then (with `tree`) every process under it, following each client to its child
        pid = todo.pop(0)
        targets.append(pid)
        if not tree:
            break
        with contextlib.suppress(psutil.NoSuchProcess):
            for below in psutil.Process(pid).children():
                todo += [p for p in (below.pid, _child_of(below.pid)) if p and p not in targets + todo]
    for pid in targets:  # the first first: a launcher would otherwise see its workers die and tear down
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()  # the client ends once its server has reaped the child


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process started with `python_command()` and every process under it (torchrun's workers), as
    `kill -9` of a whole job does; return once it is gone."""
    _kill(process, tree=True)


def kill_process(process: subprocess.Popen) -> None:
    """SIGKILL a process started with `python_command()`, as `kill -9 PID` does (what it started is left to notice);
    return once it is gone."""
    _kill(process, tree=False)


def torchrun_args(nproc: int = 2) -> list[str]:
    """What follows `python_command()` to start `nproc` processes under torchrun, each `python -u` as torchrun
    starts them. `--standalone`: the launcher picks a free port for its rendezvous, so runs started at the same
    time (pytest-xdist's workers) never meet on one port."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--no-python", forked_python(), "-u"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it): a rendezvous port of a test's own, so
    that tests run at the same time (pytest-xdist's workers) never meet on one."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_node_args(node_rank: int, port: int, nnodes: int = 2, nproc: int = 1) -> list[str]:
    """What follows `python_command()` to start node `node_rank` of `nnodes` nodes of `nproc` processes each, as
    the runbook starts them (docs/training.md, "Several nodes"): torchrun's static rendezvous at the master's
    address and port, here 127.0.0.1, every simulated node on this machine."""
    return ["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}",
            "--no-python", forked_python(), "-u"]
