"""Another process holding a folder's lock (`lit_softmoe.utils.locks.folder_lock`), for the tests of what a
second writer does meanwhile."""
import contextlib
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_HOLD = """
import sys
from lit_softmoe.utils.locks import folder_lock
with folder_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
print("released", flush=True)
"""


def start_holder(folder) -> subprocess.Popen:
    """A process that has taken the lock of `folder` (it holds it until its stdin is closed or it is killed)."""
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], cwd=REPO, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout.readline() == "held\n"
    return process


@contextlib.contextmanager
def lock_held_by_another_process(folder):
    """Yield the holder process; on leaving, it releases the lock and exits."""
    process = start_holder(folder)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.stdin.close()
            process.wait(timeout=30)


def in_thread(target, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run `target` in a daemon thread; the dict gets its "result" or "error" when it ends."""
    outcome = {}

    def run():
        try:
            outcome["result"] = target(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 — handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
