"""lit_softmoe.utils.paths: an --out that cannot be written is one line naming it, before any work."""
import os

import pytest

from cli_errors import one_line_error
from data_files import seeded_png
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError


def test_embed_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f.yaml").write_text("x")
    line = one_line_error(capsys, ["embed", "--tower", str(tmp_path / "tower"), "--shards", str(tmp_path),
                                    "--out", str(tmp_path / "f.yaml")])
    assert f"--out {tmp_path / 'f.yaml'} is a file; give a folder path" in line


def test_eval_out_that_cannot_be_written(tmp_path, capsys, suite):
    (tmp_path / "file").write_text("x")
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "run"), "--suite", suite,
                                    "--out", str(tmp_path / "file" / "sub" / "e.json"), "--device", "cpu"])
    assert f"{tmp_path / 'file'} is a file, not a folder; choose another --out" in line
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "run"), "--suite", suite,
                                    "--out", str(tmp_path), "--device", "cpu"])
    assert "is a folder; give a file path" in line
    if os.path.isdir("/proc/self"):  # Linux: nobody, root included, creates files in /proc
        line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "run"), "--suite", suite,
                                        "--out", "/proc/e.json", "--device", "cpu"])
        assert "cannot write in /proc" in line


def test_out_that_is_a_file_is_a_user_error(tmp_path, capsys):
    src = tmp_path / "photos"
    src.mkdir()
    (src / "a.png").write_bytes(seeded_png(0))
    (src / "a.txt").write_text("a caption")
    out = tmp_path / "out"
    out.write_text("I am a file")
    problem = f"{out} is a file; give a folder path"
    with pytest.raises(UserError, match=f"^out_dir {problem}"):  # a Python caller's name for it
        write_folder_shards(src, out)
    with pytest.raises(UserError, match=f"^out_dir {problem}"):
        write_fashion_mnist_shards(out, limit=5, allow_download=False)
    # The command line's words: its flag.
    for command in (["from-folder", str(src)], ["fashion-mnist", "--limit", "5"]):
        assert f"--out {problem}" in one_line_error(capsys, ["data", *command, "--out", str(out)])
    assert out.read_text() == "I am a file"
