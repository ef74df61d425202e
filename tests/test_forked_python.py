"""The `python` the tests start processes with (tests/forked_python.py): what a fresh interpreter would do, for
what the tests rely on (exit codes, death by a signal, arguments, environment, folder, streams, sys.path, threads,
resource limits, kill -9 of a process and of what it started)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import psutil

from launch import forked_python, kill_process, kill_tree, python_command

_REPORT = textwrap.dedent("""
    import json, os, sys, torch
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_CHECK"),
                      "threads": torch.get_num_threads(), "path0": sys.path[0], "stdin": sys.stdin.read(),
                      "lit_softmoe": any(m.startswith("lit_softmoe") for m in sys.modules),
                      "extra": "/nonexistent/forked-check" in sys.path}))
""")


def _run(argv, **kwargs):
    return subprocess.run([*python_command(), *argv], capture_output=True, text=True, timeout=120, **kwargs)


def test_arguments_environment_folder_stdin_threads_and_path_are_the_callers(tmp_path):
    env = {**os.environ, "FORKED_CHECK": "yes", "OMP_NUM_THREADS": "3", "PYTHONPATH": "/nonexistent/forked-check"}
    done = _run(["-c", _REPORT, "a", "b c"], cwd=tmp_path, env=env, input="from stdin")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["-c", "a", "b c"] and seen["cwd"] == str(tmp_path) and seen["env"] == "yes"
    assert seen["threads"] == 3 and seen["stdin"] == "from stdin" and seen["path0"] == ""
    # another PYTHONPATH: sys.path has it, and the process forks from the server that imported no lit_softmoe
    assert seen["extra"] and not seen["lit_softmoe"]
    script = tmp_path / "report.py"
    script.write_text(_REPORT)
    done = _run([str(script)], env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    seen = json.loads(done.stdout)
    assert seen["path0"] == str(tmp_path) and seen["argv"] == [str(script)] and not seen["extra"]
    assert seen["threads"] == len(os.sched_getaffinity(0))  # torch's default without OMP_NUM_THREADS
    assert seen["lit_softmoe"]  # the same import-time variables: the package server's fork
    torch_only = subprocess.run([*python_command("torch"), str(script)], capture_output=True, text=True)
    assert not json.loads(torch_only.stdout)["lit_softmoe"]


def test_another_lit_softmoe_first_on_the_path_is_the_one_imported(tmp_path):
    (tmp_path / "lit_softmoe").mkdir()
    (tmp_path / "lit_softmoe" / "__init__.py").write_text("")
    done = _run(["-c", "import lit_softmoe; print(lit_softmoe.__file__)"], cwd=tmp_path)
    assert done.stdout.strip() == str(tmp_path / "lit_softmoe" / "__init__.py")


def test_exit_codes_and_errors_are_the_interpreters():
    assert _run(["-c", "import sys; sys.exit(3)"]).returncode == 3
    assert _run(["-c", "raise SystemExit('no')"]).returncode == 1
    failed = _run(["-c", "raise ValueError('bad value')"])
    assert failed.returncode == 1 and "ValueError: bad value" in failed.stderr and "Traceback" in failed.stderr
    module = _run(["-m", "json.tool", "--help"])
    assert module.returncode == 0 and "json.tool" in module.stdout
    assert _run(["-c", "import atexit; atexit.register(print, 'at exit'); print('body')"]).stdout == "body\nat exit\n"


def test_the_temporary_folder_is_the_callers(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    assert _run(["-c", "import tempfile; print(tempfile.gettempdir())"], env=env).stdout.strip() == str(tmp_path)


def test_resource_limits_are_the_callers():
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    code = "import resource; print(resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_NOFILE))"
    capped = _run(["-c", code], preexec_fn=cap)
    assert capped.stdout.strip() == f"({8 << 30}, {8 << 30}) (200, 200)", capped.stderr
    ours = f"{resource.getrlimit(resource.RLIMIT_AS)} {resource.getrlimit(resource.RLIMIT_NOFILE)}"
    assert _run(["-c", code]).stdout.strip() == ours  # the next process has the server's (the caller's) again
    # 6 GiB more than the 3-4 GiB the process maps: over the cap (a fresh interpreter without it reserves them)
    over = _run(["-c", "import torch; torch.empty(6 << 30, dtype=torch.uint8)"], preexec_fn=cap)
    assert over.returncode == 1 and "DefaultCPUAllocator: can't allocate memory" in over.stderr, over.stderr[-2000:]


def test_a_signal_ends_it_as_it_ends_a_process():
    assert _run(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]).returncode == -signal.SIGTERM
    process = subprocess.Popen([*python_command(), "-c", "import time; print('up', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"
    process.terminate()  # the stand-in passes SIGTERM on
    assert process.wait(timeout=30) == -signal.SIGTERM


def test_a_crash_ends_it_with_its_signal_and_every_threads_python_stack_on_stderr():
    crashed = _run(["-c", "import ctypes\ndef deep():\n    ctypes.string_at(0)\ndeep()"])
    assert crashed.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in crashed.stderr, crashed.stderr
    assert 'line 3 in deep' in crashed.stderr and 'File "<string>"' in crashed.stderr


def _alive(process: psutil.Process) -> bool:
    """Running, not a zombie (killed, with its parent gone, until the container's init reaps it)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_ends_the_process_and_kill_tree_what_it_started_too(tmp_path):
    code = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    for kill, grandchild_survives in ((kill_process, True), (kill_tree, False)):
        process = subprocess.Popen([*python_command(), "-c", code], stdout=subprocess.PIPE, text=True)
        grandchild = psutil.Process(int(process.stdout.readline()))
        kill(process)
        assert process.returncode == -signal.SIGKILL
        time.sleep(0.1)
        assert _alive(grandchild) == grandchild_survives
        if grandchild_survives:
            grandchild.kill()


def test_the_executable_serves_torchrun_as_its_entry_point():
    done = subprocess.run([forked_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--no-python", forked_python(), "-u", "-c",
                           "import os; print('rank', os.environ['RANK'], os.environ['WORLD_SIZE'])"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == ["rank 0 2", "rank 1 2"]

