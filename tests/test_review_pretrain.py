"""`lit-softmoe pretrain` as a demanding user runs it: a resumed sparse-router run reports what the
uninterrupted one does, setting mistakes are one line before any training, results.json is never half
written."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.errors import UserError
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain

# A narrow Tokens Choice tower (router noise on, tokens dropped) so that these tests take seconds.
SMALL_TC = ["tower.name=tc-tiny-p7-16e-k1", "tower.options.width=64", "tower.options.num_heads=2",
            "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist_shards(out, limit=1000, allow_download=False)
    return out


def _tc_cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=32", "optim.warmup_steps=5", "fewshot_shots=0", "data.max_train_samples=400",
        "data.max_test_samples=100", *SMALL_TC, *extra])


def test_resumed_tokens_choice_run_logs_and_reports_what_the_uninterrupted_run_does(small_shards, tmp_path):
    """A checkpoint between two log records (step 4, records every 3 steps): the resumed run's records
    of aux_loss / dropped_fraction and results.json's dropped_fraction_train covered only the steps
    after the resume, so they differed from the uninterrupted run's."""
    common = ["steps=12", "log_every=3", "checkpoint_every=4", "keep_checkpoints=10"]
    straight = tmp_path / "straight"
    pretrain(_tc_cfg(small_shards, straight, *common))
    # A run killed right after its step-4 checkpoint: its folder holds its config, log and that checkpoint.
    killed = tmp_path / "killed"
    (killed / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "config.yaml", killed / "config.yaml")
    shutil.copy(straight / "metrics.jsonl", killed / "metrics.jsonl")  # records past step 4 are dropped
    shutil.copytree(straight / "checkpoints" / "step_00000004", killed / "checkpoints" / "step_00000004")
    pretrain(_tc_cfg(small_shards, killed, *common))

    def records(run):
        return {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}

    a, b = records(straight), records(killed)
    assert sorted(a) == sorted(b) == [3, 6, 9, 12]
    for step in a:
        for key in ("loss", "aux_loss", "dropped_fraction"):
            assert b[step][key] == a[step][key], (step, key)
    results_a = json.loads((straight / "results.json").read_text())
    results_b = json.loads((killed / "results.json").read_text())
    assert 0 < results_a["dropped_fraction_train"] < 1
    assert results_b["dropped_fraction_train"] == results_a["dropped_fraction_train"]
    assert results_b["test_top1"] == results_a["test_top1"]


@pytest.mark.parametrize("overrides, expected", [
    (["tower.options.capacity_factor=0.0"], "gives no buffer place"),
    (["tower.name=ec-tiny-p7-16e", "tower.options.capacity_factor=0.01"], "tokens per expert (< 1)"),
    (["tower.name=soft-tiny-p7-16e", "tower.options.slots_per_expert=0"], "slots_per_expert must be >= 1"),
    (["tower.options.num_classes=5"], "tower.options.num_classes cannot be set"),
    (["optim.lr=-1"], "config key 'optim.lr' is -1.0; it must be at least 0"),  # refused by the config itself
    (["optim.beta2=1.5"], "optim: Invalid beta parameter"),
    (["label_smoothing=1.5"], "label_smoothing must be in [0, 1]"),
])
def test_setting_mistakes_are_one_user_error_before_training(small_shards, tmp_path, overrides, expected):
    """Each of these ended in a traceback (at the first step, or when the tower or optimizer was built)."""
    with pytest.raises(UserError) as err:
        pretrain(_tc_cfg(small_shards, tmp_path / "run", "steps=2", *overrides))
    assert expected in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_run_dir_that_is_a_file_is_one_line_with_exit_code_2(tmp_path):
    (tmp_path / "a-file").write_text("not a folder\n")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "pretrain", "--config",
                             "configs/pretrain/fmnist-soft-tiny.yaml", f"run_dir={tmp_path / 'a-file'}"],
                            capture_output=True, text=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"lit-softmoe pretrain: error: run_dir {tmp_path / 'a-file'} is a file; give a folder path"]


def test_results_json_is_never_half_written(small_shards, tmp_path, monkeypatch):
    """A run killed while writing results.json (a rerun re-evaluates and rewrites it) left it truncated."""
    run = tmp_path / "run"
    pretrain(_tc_cfg(small_shards, run, "steps=2"))
    before = (run / "results.json").read_text()
    real_write_text = Path.write_text

    def killed_mid_write(self, text, *args, **kwargs):
        if "results.json" in self.name:
            real_write_text(self, text[:len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt  # the kill
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        pretrain(_tc_cfg(small_shards, run, "steps=2"))  # resumes at step 2: evaluates and writes again
    assert json.loads((run / "results.json").read_text()) == json.loads(before)
