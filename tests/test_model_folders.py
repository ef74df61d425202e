"""lit_softmoe.model_folders: folders that are not a finished model are refused in one line."""
from __future__ import annotations

import pytest

from cli_errors import one_error_line
from lit_softmoe import cli
from lit_softmoe.errors import UserError
from lit_softmoe.hub import load_pretrained


def test_unfinished_run_is_refused_with_the_resume_command(run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    line = one_error_line(capsys, cli.main(["export", str(unfinished), "--out", str(tmp_path / "out")]))
    assert "training has not finished" in line and f"lit-softmoe train --config {unfinished / 'config.yaml'}" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="training has not finished"):
        load_pretrained(unfinished)


def test_not_a_model_folder(tmp_path, capsys):
    line = one_error_line(capsys, cli.main(["export", str(tmp_path), "--out", str(tmp_path / "out")]))
    assert "expected an export folder" in line
    with pytest.raises(UserError, match="is not a folder"):
        load_pretrained(tmp_path / "missing")


def _run_with_checkpoints(run_dir, steps):
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("text: {}\n")
    for step in steps:
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir()
        (run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").write_text(f'{{"step": {step}}}')
    return run_dir


@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_checkpoint_the_run_pruned_is_said_so_with_the_newest_one(tmp_path, capsys, suite, command):
    """A run keeps only its newest checkpoints: eval or export of one it just deleted said "is not a folder;
    expected an export folder…", as if the path were wrong rather than gone."""
    run = _run_with_checkpoints(tmp_path / "run", [20, 30])
    pruned = run / "checkpoints" / "step_00000010"
    argv = ["export", str(pruned), "--out", str(tmp_path / "out")] if command == "export" else \
        ["eval", "--model", str(pruned), "--suite", suite, "--out", str(tmp_path / "e.json"), "--device", "cpu"]
    line = one_error_line(capsys, cli.main(argv))
    assert line == (f"lit-softmoe {command}: error: {pruned} was removed by its run, which keeps only its newest "
                    f"checkpoints (keep_checkpoints); the newest is {run / 'checkpoints' / 'step_00000030'}: point to "
                    "that one, or to the run folder once its training has finished")
    assert not (tmp_path / "out").exists() and not (tmp_path / "e.json").exists()


def test_a_missing_checkpoint_of_a_run_that_keeps_none_or_only_older_ones(tmp_path):
    run = _run_with_checkpoints(tmp_path / "run", [])
    with pytest.raises(UserError) as caught:
        load_pretrained(run / "checkpoints" / "step_00000010")
    assert str(caught.value) == (f"{run / 'checkpoints' / 'step_00000010'} does not exist, and the run {run} holds "
                                 "no checkpoint now; point to the run folder once its training has finished")
    _run_with_checkpoints(tmp_path / "older", [5])
    with pytest.raises(UserError, match=r"step_00000010 does not exist \(not written yet\?\); the newest checkpoint "
                                        r"of its run is .*older/checkpoints/step_00000005$"):
        load_pretrained(tmp_path / "older" / "checkpoints" / "step_00000010")
    with pytest.raises(UserError, match="is not a folder; expected an export folder"):  # not in a run folder
        load_pretrained(tmp_path / "elsewhere" / "checkpoints" / "step_00000010")


def test_a_missing_checkpoint_of_a_pretraining_run_is_not_pointed_to_its_siblings(tmp_path):
    """A pretraining run's checkpoints are no model folder: the line does not send the user to another one."""
    run = _run_with_checkpoints(tmp_path / "run", [20])
    (run / "config.yaml").write_text("tower: {}\n")
    with pytest.raises(UserError, match="is not a folder; expected an export folder"):
        load_pretrained(run / "checkpoints" / "step_00000010")


@pytest.mark.parametrize("how", ["state.json of another step", "tensors of another step"])
def test_eval_and_export_refuse_a_checkpoint_whose_files_disagree_with_its_name(tmp_path, capsys, how):
    """A checkpoint whose state.json says another step than its folder, or whose tensors are another step's,
    was evaluated and exported as if whole (the card recorded the state.json's step). It is damaged, as a
    resume finds it: one line, and nothing written."""
    import json
    import shutil

    from lit_runs import make_run
    from lit_softmoe.cli import main

    run = make_run(tmp_path)
    checkpoint = run / "checkpoints" / "step_00000010"
    if how == "state.json of another step":
        info = json.loads((checkpoint / "state.json").read_text())
        (checkpoint / "state.json").write_text(json.dumps({**info, "step": 4}))
    else:  # tensors copied in from the same run's checkpoint of step 4
        older = run / "checkpoints" / "step_00000004"
        shutil.copytree(checkpoint, older)
        info = json.loads((older / "state.json").read_text())
        (older / "state.json").write_text(json.dumps({**info, "step": 4}))
        from lit_softmoe.model_folders import load_step_tensors, save_step_tensors
        tensors = load_step_tensors(older / "state.safetensors", info)
        save_step_tensors(tensors, older / "state.safetensors", {**info, "step": 4})
        shutil.copy(older / "state.safetensors", checkpoint / "state.safetensors")
    with pytest.raises(UserError, match=rf"checkpoint {checkpoint} is damaged .*; use the checkpoint before it"):
        load_pretrained(checkpoint)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoint} is damaged" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "export").exists()
