"""How the tests start processes as a user does: `python …` and torchrun (a port of its own for each run), each
process forked from a server that imported torch once (tests/forked_python.py) instead of importing it again."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_FORKED_PYTHON = Path(__file__).with_name("forked_python.py")
_server: tuple[subprocess.Popen, str, str] | None = None  # this process's server, its socket, its `python`


def _server_socket() -> str:
    """The socket of this process's server (each pytest-xdist worker its own), started the first time."""
    global _server
    if _server is None or _server[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="forked-python-")  # short: a socket's path has ~100 bytes at most
        path = os.path.join(folder, "socket")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST")}
        server = subprocess.Popen([sys.executable, str(_FORKED_PYTHON), "--serve", path], env=env,
                                  stdin=subprocess.DEVNULL)
        atexit.register(_stop, server, folder)
        deadline = time.time() + 120
        while not os.path.exists(path):
            assert server.poll() is None, f"the forked-python server ended with code {server.returncode}"
            assert time.time() < deadline, "the forked-python server did not start in 120 s"
            time.sleep(0.01)
        executable = os.path.join(folder, "python")  # one path, for what takes a python executable's
        with open(executable, "w") as script:
            script.write(f"#!/bin/sh\nexec '{sys.executable}' -S '{_FORKED_PYTHON}' '{path}' \"$@\"\n")
        os.chmod(executable, 0o755)
        _server = (server, path, executable)
    return _server[1]


def _stop(server: subprocess.Popen, folder: str) -> None:
    server.terminate()  # it kills the children it still has, then exits
    server.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def forked_python() -> str:
    """An executable that behaves as `python` does, with torch already imported: a shell script handing its
    arguments to this process's server (tests/forked_python.py). For what takes a python executable's path (a
    script's `sys.executable`, torchrun's `--no-python` entry point)."""
    _server_socket()
    return _server[2]


def python_command() -> list[str]:
    """What starts `python` in a test (`[*python_command(), "-m", "lit_softmoe.cli", …]`)."""
    return [forked_python()]


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process started with `python_command()` and every process under it (torchrun's workers), as
    `kill -9` of a whole job does; return once they are gone."""
    from forked_python import kill
    kill(_server_socket(), process.pid, tree=True)
    process.wait()


def kill_process(process: subprocess.Popen) -> None:
    """SIGKILL a process started with `python_command()`, as `kill -9 PID` does (what it started is left to notice);
    return once it is gone."""
    from forked_python import kill
    kill(_server_socket(), process.pid, tree=False)
    process.wait()


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
