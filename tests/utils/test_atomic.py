"""lit_softmoe.utils.atomic: folders written atomically: nothing under the final name after a failure, stale
leftovers removed, a killed replace recovered, the umask followed."""
import pytest
import torch

from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.utils.atomic import FolderTakenError, write_folder_atomically


def test_failed_write_leaves_nothing_under_the_final_name(tmp_path):
    def write(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert list(tmp_path.iterdir()) == []
    # An older complete checkpoint survives a failed overwrite.
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "ok").write_text("1"))
    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert (tmp_path / "ckpt" / "ok").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_without_replace_a_folder_filled_meanwhile_is_kept(tmp_path):
    def write(text):
        return lambda tmp: (tmp / "f").write_text(text)

    (tmp_path / "empty").mkdir()
    write_folder_atomically(tmp_path / "empty", write("new"), replace=False)  # an empty folder is taken
    assert (tmp_path / "empty" / "f").read_text() == "new"

    def filled_meanwhile(tmp):
        (tmp / "f").write_text("mine")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "f").write_text("theirs")  # another writer, after any check at the start

    with pytest.raises(FolderTakenError):
        write_folder_atomically(tmp_path / "out", filled_meanwhile, replace=False)
    assert (tmp_path / "out" / "f").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]  # no temporary folder left
    write_folder_atomically(tmp_path / "out", write("replaced"))  # replace=True swaps it
    assert (tmp_path / "out" / "f").read_text() == "replaced"


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_saved_folders_follow_the_umask_not_mkdtemps_private_mode(tmp_path, umask, folder_mode, file_mode):
    # mkdtemp makes 0700 folders and safetensors 0600 files: other users could not read a saved tower.
    import os
    import stat
    old = os.umask(umask)
    try:
        save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tower").stat().st_mode) == folder_mode
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tower").iterdir()} == \
        {"model.safetensors": file_mode, "config.json": file_mode}


def _dead_pid() -> int:
    """The pid of a process that has ended (and, right after, is not reused)."""
    import subprocess
    import sys
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_killed_writes_are_removed_even_with_this_pid(tmp_path):
    """A run killed mid-replace leaves `.NAME.old-PID-…` / `.NAME.tmp-PID-…`; a rerun in a fresh
    container often has the same pid. The next write removes them instead of failing on them."""
    import os
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text("1"))
    for leftover in (f".ckpt.old-{os.getpid()}-uvw", f".ckpt.tmp-{os.getpid()}-abc", f".ckpt.old-{_dead_pid()}-xyz"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "v").write_text("stale")
    alive = tmp_path / f".ckpt.tmp-{os.getppid()}-def"  # another live process may be writing this one
    alive.mkdir()
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text("2"))
    assert (tmp_path / "ckpt" / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", alive.name])


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_replace_with_and_without_an_atomic_exchange(tmp_path, monkeypatch, atomic_exchange):
    from lit_softmoe.utils import atomic
    if not atomic_exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    for version in "123":
        write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text(version))
        assert (tmp_path / "ckpt" / "v").read_text() == version
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_replace_killed_between_its_renames_is_recovered(tmp_path):
    """Without an atomic exchange the old folder is renamed away first; killed right then, only
    the old folder's holder is left, and loading (or the next save) puts it back."""
    tower = create_image_tower("vit-test", num_classes=3)
    save_tower(tmp_path / "prev", tower)
    holder = tmp_path / f".tower.old-{_dead_pid()}-k1ll3d"
    holder.mkdir()
    (tmp_path / "prev").rename(holder / "tower")
    loaded, _ = load_tower(tmp_path / "tower")
    assert torch.equal(loaded.state_dict()["pos_embed"], tower.state_dict()["pos_embed"])
    assert [p.name for p in tmp_path.iterdir()] == ["tower"]


def test_atomic_exchange_swaps_two_folders(tmp_path):
    from lit_softmoe.utils.atomic import _exchange
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / name / "v").write_text(name)
    if not _exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system or filesystem: two renames are used")
    assert (tmp_path / "a" / "v").read_text() == "b" and (tmp_path / "b" / "v").read_text() == "a"


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_replacing_a_folder_through_a_symlink_keeps_the_link(tmp_path, monkeypatch, atomic_exchange):
    """The link itself was replaced: with two renames it became a real folder and its target was never
    updated; with the atomic exchange the temporary name got the link, and removing it failed
    ("Cannot call rmtree on a symbolic link")."""
    from lit_softmoe.utils import atomic
    if not atomic_exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    (tmp_path / "disk" / "target").mkdir(parents=True)
    (tmp_path / "disk" / "target" / "v").write_text("1")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "disk" / "target", target_is_directory=True)
    write_folder_atomically(link, lambda tmp: (tmp / "v").write_text("2"))
    assert link.is_symlink() and link.readlink() == tmp_path / "disk" / "target"
    assert (tmp_path / "disk" / "target" / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["target"]  # no temporary folder left


def _link(path, how: str, tmp_path):
    """A symbolic link at `path`: looping, dangling, to a folder or to a file (the last two outside `path`'s folder)."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    if how == "loop":
        path.symlink_to(path.name)
    elif how == "dangling":
        path.symlink_to(tmp_path / "elsewhere" / "missing")
    elif how == "to a folder":
        (tmp_path / "elsewhere" / "folder").mkdir()
        (tmp_path / "elsewhere" / "folder" / "v").write_text("theirs")
        path.symlink_to(tmp_path / "elsewhere" / "folder", target_is_directory=True)
    else:
        (tmp_path / "elsewhere" / "file").write_text("theirs")
        path.symlink_to(tmp_path / "elsewhere" / "file")


@pytest.mark.parametrize("how", ["loop", "dangling", "to a folder", "to a file"])
@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_link_at_a_folder_the_caller_owns_is_replaced_not_followed(tmp_path, monkeypatch, how, atomic_exchange):
    """A looping link at a checkpoint's name ended every save in `RuntimeError: Symlink loop` (resolve()),
    so the run could never finish; a dangling one had the checkpoint written where it pointed."""
    from lit_softmoe.utils import atomic
    if not atomic_exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    (tmp_path / "checkpoints").mkdir()
    final = tmp_path / "checkpoints" / "step_00000030"
    _link(final, how, tmp_path)
    assert write_folder_atomically(final, lambda tmp: (tmp / "v").write_text("new"), through_link=False) == final
    assert not final.is_symlink() and (final / "v").read_text() == "new"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000030"]  # no temporary folder left
    # What the link pointed to is not the caller's: untouched.
    assert sorted(str(p.relative_to(tmp_path / "elsewhere")) for p in (tmp_path / "elsewhere").rglob("*")) == \
        {"loop": [], "dangling": [], "to a folder": ["folder", "folder/v"], "to a file": ["file"]}[how]


@pytest.mark.parametrize("how", ["loop", "dangling", "to a file"])
def test_a_link_followed_to_no_folder_is_one_user_error(tmp_path, how):
    """Followed (a user's --out), a looping link was `RuntimeError: Symlink loop`, a dangling one was
    followed to create its target, and one to a file had the file swapped for the folder."""
    from lit_softmoe.errors import UserError
    final = tmp_path / "out"
    _link(final, how, tmp_path)
    problem = {"loop": "is a symbolic link that loops",
               "dangling": f"is a symbolic link to {tmp_path / 'elsewhere' / 'missing'}, which does not exist",
               "to a file": f"is a symbolic link to {tmp_path / 'elsewhere' / 'file'}, not to a folder"}[how]
    with pytest.raises(UserError) as caught:
        write_folder_atomically(final, lambda tmp: (tmp / "v").write_text("new"))
    assert str(caught.value) == f"{final} {problem}; remove the link (rm {final}) or write to another path"
    assert final.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ([] if how != "to a file" else ["file"])


def _full(filename=None, code=None):
    """A write that meets a full disk: an OSError with or without its path, or safetensors' own error."""
    import os

    from safetensors import SafetensorError

    def write(tmp):
        if code is None:
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
        raise OSError(code, os.strerror(code), *([filename] if filename else []))
    return write


@pytest.mark.parametrize("writer", ["folder", "file"])
@pytest.mark.parametrize("how", ["ENOSPC without a path", "EDQUOT without a path", "in safetensors' words",
                                 "ENOSPC with a path"])
def test_a_full_disk_is_raised_with_the_path_being_written(tmp_path, writer, how):
    """A write() on an open file, safetensors and torch report a full disk without the path: the CLI's
    one line could not say where ("while writing PATH", as docs/reliability.md promises)."""
    import errno

    from lit_softmoe.utils.atomic import replacing
    code = {"ENOSPC without a path": errno.ENOSPC, "EDQUOT without a path": errno.EDQUOT,
            "ENOSPC with a path": errno.ENOSPC}.get(how)
    own = str(tmp_path / "own-name") if how.endswith("with a path") else None
    write = _full(own, code)
    final = tmp_path / ("ckpt" if writer == "folder" else "results.json")
    with pytest.raises(OSError) as caught:
        if writer == "folder":
            write_folder_atomically(final, write)
        else:
            with replacing(final) as temporary:
                write(temporary)
    assert caught.value.errno == (code or errno.ENOSPC)
    assert caught.value.filename == (own or str(final))
    assert list(tmp_path.iterdir()) == []  # nothing half-written left


def test_an_error_that_is_not_a_full_disk_passes_unchanged(tmp_path):
    import errno

    def write(tmp):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as caught:
        write_folder_atomically(tmp_path / "ckpt", write)
    assert (caught.value.errno, caught.value.filename) == (errno.EIO, None)
