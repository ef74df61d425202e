"""lit_softmoe.utils.locks: one writer per folder. A second holder waits for the first, or is refused in one
line naming the holder; a killed holder's lock goes with its process."""
import os
import signal
import time

import pytest

from lit_softmoe.errors import UserError
from lit_softmoe.utils.locks import LOCK_FILE, folder_lock
from lock_holders import in_thread, lock_held_by_another_process, start_holder


def _take(folder, entered: list) -> None:
    with folder_lock(folder):
        entered.append(time.monotonic())


def test_a_second_holder_waits_until_the_first_releases(tmp_path, caplog):
    folder = tmp_path / "data"
    with lock_held_by_another_process(folder) as holder:
        entered = []
        thread, outcome = in_thread(_take, folder, entered)
        thread.join(1.0)
        assert thread.is_alive() and not entered  # waiting, not writing beside the holder
        released = time.monotonic()
    thread.join(30)
    assert not thread.is_alive() and "error" not in outcome
    assert entered and entered[0] >= released
    assert (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"  # the new holder, for messages
    assert holder.returncode == 0
    assert any(f"waiting for process {holder.pid}, which is writing {folder}" in record.getMessage()
               for record in caplog.records)


def test_a_second_holder_in_this_process_waits_too(tmp_path):
    """flock is per open file, so two threads of one process exclude each other as two processes do."""
    entered = []
    with folder_lock(tmp_path):
        thread, outcome = in_thread(_take, tmp_path, entered)
        thread.join(0.5)
        assert thread.is_alive() and not entered
        released = time.monotonic()
    thread.join(30)
    assert not thread.is_alive() and "error" not in outcome and entered[0] >= released


def test_refuse_names_the_holder_and_the_fix(tmp_path):
    with lock_held_by_another_process(tmp_path / "run") as holder:
        with pytest.raises(UserError) as raised:
            with folder_lock(tmp_path / "run", refuse="wait for it to finish or choose another run_dir"):
                pytest.fail("entered a folder another process holds")
    assert str(raised.value) == (f"{tmp_path / 'run'} is in use by process {holder.pid}; "
                                 "wait for it to finish or choose another run_dir")
    # Released: the same call now enters.
    with folder_lock(tmp_path / "run", refuse="unused"):
        pass


def test_a_killed_holders_lock_goes_with_its_process(tmp_path):
    holder = start_holder(tmp_path)
    with pytest.raises(UserError, match=f"in use by process {holder.pid}"):
        with folder_lock(tmp_path, refuse="x"):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).read_text() == f"{holder.pid}\n"  # the file stays, the lock does not
    with folder_lock(tmp_path, refuse="x"):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_the_lock_creates_a_missing_folder_and_is_released_on_an_exception(tmp_path):
    folder = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError):
        with folder_lock(folder):
            assert folder.is_dir()
            raise RuntimeError("the write failed")
    with folder_lock(folder, refuse="x"):
        pass


def test_a_waiting_holder_whose_lock_file_was_removed_takes_the_new_one(tmp_path, monkeypatch):
    """A lock on a removed file excludes nobody: a waiter that locked it takes the lock of the file
    at the path now, instead of writing beside a holder of that one."""
    from lit_softmoe.utils import locks
    real_flock, locked = locks.fcntl.flock, []

    def flock(handle, operation):
        if operation & locks.fcntl.LOCK_EX:
            locked.append(handle)
            if len(locked) == 1:  # between the first open and its lock, the file goes
                (tmp_path / locks.LOCK_FILE).unlink()
        return real_flock(handle, operation)

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    with folder_lock(tmp_path):
        assert len(locked) == 2 and locked[0].closed  # the removed file's lock let go, the new one taken
        held = tmp_path / locks.LOCK_FILE
        assert os.fstat(locked[1].fileno()).st_ino == held.stat().st_ino
        assert held.read_text() == f"{os.getpid()}\n"


def test_a_killed_holder_releases_the_lock_at_once_though_its_forked_child_lives_on(tmp_path):
    """A run killed with SIGKILL while its DataLoader workers (forked children) still live: the folder
    is free at once, not when the orphans notice their parent is gone."""
    import multiprocessing

    ready = multiprocessing.get_context("fork").Event()

    def holder():
        with folder_lock(tmp_path):
            child = os.fork()
            if child == 0:  # the "worker": lives on for a while, then leaves without cleaning up
                time.sleep(30)
                os._exit(0)
            ready.set()
            time.sleep(60)

    process = multiprocessing.get_context("fork").Process(target=holder)
    process.start()
    assert ready.wait(30)
    with pytest.raises(UserError, match="is in use by process"):  # held while the holder lives
        with folder_lock(tmp_path, refuse="wait"):
            pass
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    with folder_lock(tmp_path, refuse="wait"):  # the orphaned child does not hold it
        pass
