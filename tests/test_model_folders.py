"""lit_softmoe.model_folders: folders that are not a finished model are refused in one line."""
from __future__ import annotations

import pytest

from lit_runs import _one_error_line
from lit_softmoe import cli
from lit_softmoe.errors import UserError
from lit_softmoe.hub import load_pretrained


def test_unfinished_run_is_refused_with_the_resume_command(run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    line = _one_error_line(capsys, cli.main(["export", str(unfinished), "--out", str(tmp_path / "out")]))
    assert "training has not finished" in line and f"lit-softmoe train --config {unfinished / 'config.yaml'}" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="training has not finished"):
        load_pretrained(unfinished)


def test_not_a_model_folder(tmp_path, capsys):
    line = _one_error_line(capsys, cli.main(["export", str(tmp_path), "--out", str(tmp_path / "out")]))
    assert "expected an export folder" in line
    with pytest.raises(UserError, match="is not a folder"):
        load_pretrained(tmp_path / "missing")
