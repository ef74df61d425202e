"""lit_softmoe.train.runtime: a run folder holds one run, and a run must train something."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from cli_errors import one_line_error
from lit_runs import ROOT
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.train.runtime import create_accelerator, loss_scaler_state, restore_loss_scaler


@pytest.mark.parametrize("held", ["lit", "pretrain"])
def test_a_run_folder_of_the_other_recipe_is_refused_in_its_own_words(tmp_path, held):
    """`pretrain run_dir=A_LIT_RUN` was refused as a run "saved by another version of lit-softmoe"."""
    from lit_softmoe.config import LiTConfig, PretrainConfig, to_yaml
    from lit_softmoe.train.runtime import check_same_run
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000008").mkdir(parents=True)
    (run / "checkpoints" / "step_00000008" / "state.json").write_text("{}")
    configs = {"lit": load_config(LiTConfig, None, [f"run_dir={run}"]),
               "pretrain": load_config(PretrainConfig, None, [f"run_dir={run}"])}
    (run / "config.yaml").write_text(to_yaml(configs[held]))
    names = {"lit": "a LiT run (`lit-softmoe train`)", "pretrain": "a pretraining run (`lit-softmoe pretrain`)"}
    other = "pretrain" if held == "lit" else "lit"
    with pytest.raises(UserError) as refused:
        check_same_run(run, configs[other])
    assert str(refused.value) == f"{run} holds {names[held]}, and this is {names[other]}; start this one with " \
                                 "another run_dir=..."
    check_same_run(run, configs[held])  # its own recipe resumes it


def test_a_run_folder_is_resumed_only_with_its_own_config(tmp_path):
    from lit_softmoe.config import PretrainConfig, to_yaml
    from lit_softmoe.train.runtime import check_same_run
    run = tmp_path / "run"
    saved = load_config(PretrainConfig, None, [f"run_dir={run}", "optim.lr=2e-3", "epochs=2"])
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(saved))
    other = load_config(PretrainConfig, None, [f"run_dir={run}", "optim.lr=1e-3", "epochs=3"])
    check_same_run(run, other)  # nothing to resume yet (killed before its first checkpoint): starts afresh
    (run / "checkpoints" / "step_00000008").mkdir(parents=True)
    (run / "checkpoints" / "step_00000008" / "state.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds another run \(optim\.lr: 0\.002 → 0\.001: its config\.yaml → this"):
        check_same_run(run, other)
    # Longer, logged and checkpointed differently, the run folder spelled otherwise: the same run.
    check_same_run(run, load_config(PretrainConfig, None, [
        f"run_dir={run}/", "optim.lr=2e-3", "epochs=3", "steps=100", "log_every=1", "checkpoint_every=7",
        "keep_checkpoints=0", "threads=1", "fewshot_shots=0", "eval_every=5", "data.max_bad_fraction=0.5"]))
    # A config.yaml without a key of the schema is refused in one line naming it, whatever the value now.
    (run / "config.yaml").write_text(to_yaml(saved).replace("label_smoothing: 0.0\n", ""))
    smoothed = load_config(PretrainConfig, None, [f"run_dir={run}", "optim.lr=2e-3", "label_smoothing=0.1"])
    for config in (saved, smoothed):
        with pytest.raises(UserError, match=r"config\.yaml has no label_smoothing \(saved by another version of "
                                            r"lit-softmoe\), so the run there cannot be resumed; start this one with "
                                            r"another run_dir=\.\.\.$"):
            check_same_run(run, config)
    # Tower options: a key added, changed or dropped is a different tower.
    (run / "config.yaml").write_text(to_yaml(load_config(PretrainConfig, None, ["tower.options.width=64"])))
    with pytest.raises(UserError, match=r"tower\.options\.depth: \(unset\) → 4, tower\.options\.width: 64 → 96"):
        check_same_run(run, load_config(PretrainConfig, None, ["tower.options.width=96", "tower.options.depth=4"]))
    with pytest.raises(UserError, match=r"tower\.options\.width: 64 → \(unset\)"):
        check_same_run(run, load_config(PretrainConfig, None, []))


@pytest.mark.parametrize("command", ["pretrain", "train"])
def test_a_run_of_zero_steps_and_zero_epochs_is_refused(tmp_path, capsys, command):
    # It trained nothing and saved an untrained model without a word.
    (tmp_path / "c.yaml").write_text(f"run_dir: {tmp_path / 'run'}\n")
    line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), "steps=0", "epochs=0"])
    assert "steps=0 and epochs=0 train nothing; set steps=N or epochs=E" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["pretrain", "train"])
@pytest.mark.parametrize("link", ["loop", "dangling", "to a file"])
def test_a_link_where_the_run_writes_its_model_is_refused_before_any_work(tmp_path, capsys, command, link):
    """A link that loops at RUN/tower (pretrain) or RUN/model (train) was refused only when the model was
    saved, after the whole training; the config here names no data, so any work would fail otherwise."""
    run = tmp_path / "run"
    run.mkdir()
    output = run / ("tower" if command == "pretrain" else "model")
    (tmp_path / "file").write_text("x")
    output.symlink_to({"loop": output, "dangling": tmp_path / "gone", "to a file": tmp_path / "file"}[link])
    (tmp_path / "c.yaml").write_text(f"run_dir: {run}\n")
    line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), f"data.train={tmp_path / 'none'}"])
    problem = {"loop": "is a symbolic link that loops", "dangling": f"is a symbolic link to {tmp_path / 'gone'}, "
               "which does not exist", "to a file": f"is a symbolic link to {tmp_path / 'file'}, not to a folder"}[link]
    assert line == f"lit-softmoe {command}: error: {output} {problem}; remove the link (rm {output}) or write to " \
                   "another path"
    assert sorted(p.name for p in run.iterdir()) == [output.name]  # nothing written: no config, no lock


@pytest.mark.parametrize("command", ["pretrain", "train"])
def test_a_run_dir_holding_something_else_is_refused_before_any_work(tmp_path, capsys, command):
    """`run_dir=` at a dataset, an export or a tower folder was taken: the run wrote its config.yaml, metrics and
    checkpoints among their files (an export then failed push's file check)."""
    held = tmp_path / "export"
    held.mkdir()
    for name in ("config.json", "open_clip_model.safetensors", "README.md"):
        (held / name).write_text("x")
    before = sorted(p.name for p in held.iterdir())
    (tmp_path / "c.yaml").write_text(f"run_dir: {held}\n")
    line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), f"data.train={tmp_path / 'none'}"])
    assert line == (f"lit-softmoe {command}: error: run_dir {held} holds an export, a tower or a model "
                    "(config.json), not a run (it has no config.yaml), and a run there would mix its files in; give a "
                    "new or empty run_dir")
    assert sorted(p.name for p in held.iterdir()) == before  # nothing written, no lock either
    for name, kind in (("nshards.txt", "a dataset split (nshards.txt)"), ("0.tar", "shards (.tar files)")):
        split = tmp_path / f"split-{name}"
        split.mkdir()
        (split / name).write_text("1")
        (tmp_path / "c.yaml").write_text(f"run_dir: {split}\n")
        line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), f"data.train={tmp_path / 'x'}"])
        assert f"run_dir {split} holds {kind}, not a run" in line, line
    # A user's own file in a new run folder (`... > RUN/log.txt` made it first) is no other kind of folder.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "log.txt").write_text("")
    (tmp_path / "c.yaml").write_text(f"run_dir: {mine}\n")
    line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), f"data.train={tmp_path / 'x'}"])
    assert "not a run" not in line and "mix its files" not in line, line


_HOLD = ("import sys, time\n"
         "from lit_softmoe.utils.locks import folder_lock\n"
         "with folder_lock(sys.argv[1]):\n"
         "    print('held', flush=True)\n"
         "    time.sleep(120)\n")


@pytest.mark.parametrize("command", ["pretrain", "train"])
def test_a_run_folder_in_use_by_a_live_process_is_refused_until_it_dies(tmp_path, capsys, command):
    """Two runs in one run folder mixed their metrics, configs and checkpoints. The lock is the
    kernel's: a holder killed with SIGKILL leaves nothing stale behind."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (tmp_path / "c.yaml").write_text(f"run_dir: {run}\n")
        argv = [command, "--config", str(tmp_path / "c.yaml"), f"data.train={tmp_path / 'none' / 'train'}"]
        if command == "train":
            argv.append(f"image_tower={tmp_path / 'no-tower'}")
        line = one_line_error(capsys, argv)
        assert f"{run} is in use by process {holder.pid}; wait for that run to end, or start this one with " \
               "another run_dir=..." in line
        assert sorted(p.name for p in run.iterdir()) == [".lit-softmoe.lock"]  # nothing written beside it
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    line = one_line_error(capsys, argv)  # past the lock: the next mistake of this config is told
    expected = "shards not found: " if command == "pretrain" else "no-tower is not a tower checkpoint"
    assert expected in line, line


def test_a_run_refused_before_any_work_leaves_no_run_folder_behind(tmp_path):
    """The lock created the run folder: a mistake found before any work left an empty run folder (a
    lock file alone) where there was none, unlike before the lock."""
    from lit_softmoe.train.runtime import run_folder_lock
    run = tmp_path / "run"
    with pytest.raises(UserError, match="a mistake"), run_folder_lock(run):
        assert sorted(p.name for p in run.iterdir()) == [".lit-softmoe.lock"]
        raise UserError("a mistake")
    assert not run.exists()
    run.mkdir()  # a folder that was there before stays, lock file and all
    with pytest.raises(UserError, match="a mistake"), run_folder_lock(run):
        raise UserError("a mistake")
    assert run.is_dir()
    with run_folder_lock(run):  # after work started (a file written), the folder stays whatever happens
        (run / "config.yaml").write_text("x")
    assert (run / "config.yaml").is_file()


def test_a_lock_whose_file_was_removed_meanwhile_is_not_trusted(tmp_path, monkeypatch):
    """A run that failed first removes the lock file it created; a second run that opened that file
    just before could then lock the removed file while a third locks a new one: two runs in one folder.
    The second finds its pid missing from the lock file and is refused."""
    from lit_softmoe.train.runtime import run_folder_lock
    from lit_softmoe.utils import locks
    run = tmp_path / "run"
    run.mkdir()
    real_flock = locks.fcntl.flock

    def flock(handle, operation):
        if operation & locks.fcntl.LOCK_EX:  # between our open and our lock, the failed run's cleanup
            (run / locks.LOCK_FILE).unlink(missing_ok=True)
        return real_flock(handle, operation)

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    with pytest.raises(UserError, match=rf"^{run} is in use by another process; wait for that run to end"):
        with run_folder_lock(run):
            pytest.fail("ran on a lock of a removed file")


def test_fp16_scales_the_loss_skips_an_overflowing_step_and_resumes_its_scale(fresh_accelerate_state):
    """precision=fp16 on the CPU runs the GPU's fp16 step (torch's autocast and loss scaler): the loss is
    scaled for backward, an overflow skips the step and halves the scale, and the scale is checkpointed."""
    accelerator = create_accelerator("fp16")
    assert accelerator.scaler is not None
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    scale = accelerator.scaler.get_scale()
    computed_in = []
    model.register_forward_pre_hook(lambda module, args: computed_in.append(torch.get_autocast_dtype("cpu")
                                                                            if torch.is_autocast_enabled("cpu")
                                                                            else None))

    with accelerator.autocast():
        loss = model(x).float().square().mean()
    assert computed_in == [torch.float16]
    accelerator.backward(loss)
    assert model.weight.grad.abs().max() > 100  # the scaled loss's gradient (scale 65536) ...
    accelerator.clip_grad_norm_(model.parameters(), 1e9)  # ... unscaled here, before clipping
    half = torch.nn.functional.linear(x.half().float(), model.weight.detach().half().float().requires_grad_(),
                                      model.bias.detach().half().float())
    expected = torch.autograd.grad(half.square().mean(), half)[0]  # d loss / d out
    torch.testing.assert_close(model.weight.grad, expected.T @ x.half().float(), atol=1e-2, rtol=1e-2)
    before = model.weight.detach().clone()
    optimizer.step()
    optimizer.zero_grad()
    assert not optimizer.step_was_skipped and not torch.equal(model.weight, before)

    with accelerator.autocast():
        loss = model(x).float().sum() * float("inf")
    accelerator.backward(loss)
    before = model.weight.detach().clone()
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.step_was_skipped and torch.equal(model.weight, before)
    assert accelerator.scaler.get_scale() == scale / 2

    state = loss_scaler_state(accelerator)
    accelerator.scaler.update(new_scale=7.0)
    restore_loss_scaler(accelerator, state)
    assert accelerator.scaler.get_scale() == scale / 2


def test_fp32_has_no_loss_scaler(fresh_accelerate_state):
    assert loss_scaler_state(create_accelerator("fp32")) is None
