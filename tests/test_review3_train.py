"""Training loops as a demanding user runs them (review 3), on 300 + 300 Fashion-MNIST images and a
soft-test-4e tower: setting mistakes are one line before any work (LiT's run_dir and optimizer as in
pretrain, text towers that cannot be built, label smoothing with the sigmoid loss, eval class names
that miss classes); a rerun shorter than its checkpoint is refused; unlocked Soft MoE blocks decay
their scale; a run that diverges between log records writes no NaN checkpoint."""
import json

import pytest

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.errors import UserError
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.pretrain import pretrain

from checkpoint_checks import _finite_checkpoints
from lit_data import _lit


@pytest.mark.parametrize("overrides, expected", [
    (["optim.beta1=1.5"], "optim: Invalid beta parameter at index 0: 1.5"),
    (["optim.beta2=-0.1"], "optim: Invalid beta parameter at index 1: -0.1"),
])
def test_lit_refuses_optimizer_settings_before_any_work(data, tmp_path, overrides, expected):
    """torch's ValueError from AdamW was a traceback after the towers were built (pretrain refused it)."""
    with pytest.raises(UserError) as err:
        train_lit(_lit(data, tmp_path / "run", "steps=2", *overrides))
    assert expected in str(err.value) and "optim.beta1" in str(err.value)
    assert not (tmp_path / "run").exists()


def test_lit_run_dir_that_is_a_file_is_one_line(data, tmp_path):
    """It trained nothing and ended in NotADirectoryError from the metrics log (pretrain refused it)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    with pytest.raises(UserError, match=f"run_dir {tmp_path / 'a-file'} is a file; give a folder path"):
        train_lit(_lit(data, tmp_path / "a-file", "steps=2"))
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(data, tmp_path):
    """The embedding table had rows for ids below 1000 only: the first batch's ids (up to 49407, the
    end token every caption has) ended the run in an IndexError at step 1."""
    with pytest.raises(UserError, match="text.vocab_size 1000 is smaller than"):
        train_lit(_lit(data, tmp_path / "run", "steps=2", "text.vocab_size=1000"))
    assert not (tmp_path / "run").exists()
    # The default, and any larger table (unused rows), still train.
    results = train_lit(_lit(data, tmp_path / "larger", "steps=2", "text.vocab_size=49500", "eval.shards="))
    assert results["steps"] == 2


def test_lit_rerun_with_fewer_steps_than_its_checkpoint_is_refused(data, tmp_path):
    """steps may change on a rerun, to extend a run. Fewer steps than the newest checkpoint's
    resumed the 4-step model and saved it as a 2-step run (results.json: "steps": 2)."""
    run = tmp_path / "run"
    train_lit(_lit(data, run, "steps=4", "eval.shards="))
    model_before = (run / "model" / "model.safetensors").read_bytes()
    with pytest.raises(UserError) as err:
        train_lit(_lit(data, run, "steps=2", "eval.shards="))
    assert str(err.value) == (f"{run} holds a checkpoint at step 4, past the 2 steps this config trains; set steps "
                              "(or epochs) to at least that, or start this run with another run_dir=...")
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert (run / "model" / "model.safetensors").read_bytes() == model_before
    assert "steps: 4" in (run / "config.yaml").read_text()


def test_pretrain_rerun_with_fewer_epochs_than_its_checkpoint_is_refused(data, tmp_path):
    run = tmp_path / "run"
    common = [f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
              "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=0", "precision=fp32"]
    pretrain(load_config(PretrainConfig, None, [*common, "epochs=1"]))  # 6 steps
    with pytest.raises(UserError, match=f"{run} holds a checkpoint at step 6, past the 3 steps this config trains"):
        pretrain(load_config(PretrainConfig, None, [*common, "epochs=0.5"]))
    assert json.loads((run / "results.json").read_text())["steps"] == 6


@pytest.mark.parametrize("unlocked", [False, True])
def test_eval_classnames_fewer_than_the_eval_classes_are_refused_before_training(data, tmp_path, unlocked):
    """Three class names for a 10-class eval split scored every image of classes 3-9 as wrong and
    reported that number (zero-shot top-1 0.13) as the model's."""
    names = tmp_path / "three.txt"
    names.write_text("t-shirt\ntrouser\npullover\n")
    source = data / ("fmnist" if unlocked else "features")
    extra = ["unlocked_blocks=1"] if unlocked else []
    with pytest.raises(UserError) as err:
        train_lit(_lit(data, tmp_path / "run", "steps=2", f"data.train={source / 'train'}",
                       f"eval.shards={source / 'test'}", f"eval.classnames={names}", *extra))
    assert str(err.value) == (f"eval.shards {source / 'test'} holds class 9, but {names} names 3 classes; set "
                              "eval.classnames to a file naming every class of the split, one per line in class order")
    assert not (tmp_path / "run").exists()


def test_label_smoothing_with_the_sigmoid_loss_is_refused(data, tmp_path):
    """The sigmoid loss has no label smoothing: label_smoothing=0.1 trained exactly as 0 would."""
    with pytest.raises(UserError, match="label_smoothing=0.1 applies to loss=softmax only"):
        pretrain(load_config(PretrainConfig, None, [
            f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}",
            f"run_dir={tmp_path / 'run'}", "tower.name=soft-test-4e", "batch_size=50", "steps=2", "fewshot_shots=0",
            "loss=sigmoid", "label_smoothing=0.1"]))
    assert not (tmp_path / "run").exists()


# ---- a diverged run never writes a checkpoint ------------------------------------------------------

def test_pretrain_that_diverges_between_log_records_saves_no_diverged_checkpoint(data, tmp_path):
    """The loss was checked only at log records (every 100 steps here): the step-4 checkpoint held NaN
    weights, the run stopped later naming step 6, and rerunning it resumed the NaN model."""
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"training diverged: loss is nan at step 4;"):
        pretrain(load_config(PretrainConfig, None, [
            f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
            "tower.name=soft-test-4e", "batch_size=50", "steps=6", "fewshot_shots=0", "precision=fp32",
            "log_every=100", "checkpoint_every=2", "keep_checkpoints=10", "optim.lr=1e9", "optim.warmup_steps=0",
            "optim.grad_clip=0"]))
    assert _finite_checkpoints(run) == {2: True}


def test_lit_that_diverges_between_log_records_saves_no_diverged_checkpoint(data, tmp_path, monkeypatch):
    from lit_softmoe.train import lit as lit_recipe
    calls = []

    def diverging_loss(*args, **kwargs):  # NaN from step 3 on, as a blown-up run gives
        calls.append(1)
        loss = lit_recipe.contrastive_loss.__wrapped__(*args, **kwargs)
        return loss * float("nan") if len(calls) >= 3 else loss

    diverging_loss.__wrapped__ = lit_recipe.contrastive_loss
    monkeypatch.setattr(lit_recipe, "contrastive_loss", diverging_loss)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"training diverged: loss is nan at step 4;"):
        train_lit(_lit(data, run, "steps=6", "log_every=100", "checkpoint_every=2", "keep_checkpoints=10",
                       "eval.shards="))
    assert _finite_checkpoints(run) == {2: True}
