"""lit_softmoe.train.pretrain: classification pretraining on real Fashion-MNIST shards: it learns, resumes
exactly after a kill, trains the sparse towers, and refuses setting mistakes in one line before training."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from checkpoint_checks import finite_checkpoints
from cli_errors import one_line_error
from data_files import cut_at_sample
from launch import kill_process, python_command, torchrun_args
from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.errors import UserError
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain
from sharded_runs import built_fmnist_1000
from shared_builds import built_once

# A narrow tiny tower so these tests take seconds; the full-size bar is in the README.
SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]
# A narrow Tokens Choice tower (router noise on, tokens dropped) so that these tests take seconds.
SMALL_TC = ["tower.name=tc-tiny-p7-16e-k1", "tower.options.width=64", "tower.options.num_heads=2",
            "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]


def _sparse_cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=64", "optim.warmup=5", "optim.lr=3e-3", "log_every=1", "fewshot_shots=0",
        "data.max_test_samples=300", "checkpoint_every=1000", *extra])


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    return built_fmnist_1000(tmp_path_factory)


@pytest.mark.parametrize("name", ["tc-tiny-p7-16e-k1", "tc-tiny-p7-16e-k2", "ec-tiny-p7-16e"])
def test_tiny_sparse_towers_train_and_report_dropped_tokens(small_shards, tmp_path, name):
    results = pretrain(_sparse_cfg(small_shards, tmp_path / "run", f"tower.name={name}", "steps=15",
                                   "tower.options.width=64", "tower.options.mlp_dim=128", "tower.options.num_heads=2"))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert records[-1]["loss"] < 0.85 * records[0]["loss"]
    assert results["test_top1"] > 0.3  # 10 classes: chance is 0.1
    for r in records:
        assert 0 <= r["dropped_fraction"] <= 1
        assert (r["aux_loss"] > 0) == name.startswith("tc-")
    assert 0 <= results["dropped_fraction_test"] <= 1 and 0 <= results["dropped_fraction_train"] <= 1
    if name.startswith("ec-"):
        # C = round(16/16) = 1 token per expert for 16 tokens: some tokens must go unpicked unless
        # all 16 experts pick 16 different tokens.
        assert results["dropped_fraction_train"] > 0


def test_aux_loss_weight_enters_the_training_loss(small_shards, tmp_path):
    common = ["tower.name=tc-test-4e-k2", "steps=1", "data.max_train_samples=200"]
    without = pretrain(_sparse_cfg(small_shards, tmp_path / "a", *common, "aux_loss_weight=0"))
    with_aux = pretrain(_sparse_cfg(small_shards, tmp_path / "b", *common, "aux_loss_weight=1.0"))
    assert without["steps"] == with_aux["steps"] == 1
    a = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r][0]
    b = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r][0]
    # Same seed, same first batch and noise: the two losses differ by exactly the aux loss.
    assert a["aux_loss"] == pytest.approx(b["aux_loss"])
    assert b["loss"] - a["loss"] == pytest.approx(b["aux_loss"], rel=1e-4)


def _cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=64", "optim.warmup=20", "log_every=5", *SMALL_TOWER, *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return built_once(tmp_path_factory, "fmnist-3000",
                      lambda out: write_fashion_mnist_shards(out, limit=3000, allow_download=False))


def test_pretraining_learns_real_fashion_mnist(shards, tmp_path):
    results = pretrain(_cfg(shards, tmp_path / "run", "epochs=3", "optim.lr=3e-3"))
    # 3000 real images, 3 epochs of a 0.1M-param tower: far above chance (0.1) on the test images.
    assert results["test_top1"] > 0.65
    assert results["fewshot10_top1"] > 0.45
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]
    assert records[-1]["test_top1"] == results["test_top1"]
    # The saved tower reproduces the reported accuracy; its folder says how to preprocess.
    tower, meta = load_tower(tmp_path / "run" / "tower")
    assert meta["classnames"][7] == "sneaker" or "sneaker" in meta["classnames"][7].lower()
    assert meta["preprocess"]["mean"][0] == pytest.approx(0.286, abs=0.02)
    assert meta["preprocess"]["decode"] == "reduced"  # data.decode's default: embed and eval decode JPEGs so
    assert (tmp_path / "run" / "curves.png").stat().st_size > 5000
    assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_sigmoid_loss_and_rsqrt_schedule_also_train(shards, tmp_path):
    results = pretrain(_cfg(shards, tmp_path / "run", "epochs=2", "optim.lr=3e-3", "loss=sigmoid",
                            "optim.schedule=rsqrt", "optim.cooldown_steps=20", "fewshot_shots=0"))
    assert results["test_top1"] > 0.5


def test_killed_run_resumes_exactly(shards, tmp_path):
    common = ["steps=120", "checkpoint_every=10", "log_every=1", "keep_checkpoints=50", "fewshot_shots=0",
              "data.augment=true",  # per-batch random crops and flips must replay exactly too
              "data.max_train_samples=1000"]
    # The uninterrupted run.
    pretrain(_cfg(shards, tmp_path / "straight", *common))
    straight = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r}

    # The same run in a subprocess, killed with SIGKILL once it has written a checkpoint.
    killed_dir = tmp_path / "killed"
    overrides = [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={killed_dir}",
                 "batch_size=64", "optim.warmup=20", "log_every=5", *SMALL_TOWER, *common]
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    proc = subprocess.Popen([*python_command(), "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((killed_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        time.sleep(0.02)
    kill_process(proc)
    assert not (killed_dir / "tower").exists(), "the run finished before it could be killed"
    resumed_from = max(int(p.name.split("_")[1]) for p in (killed_dir / "checkpoints").glob("step_*"))
    assert 10 <= resumed_from < 120

    pretrain(_cfg(shards, killed_dir, *common))
    resumed = {r["step"]: r["loss"] for r in read_metrics(killed_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(resumed) == sorted(straight)  # one record per step: nothing lost, nothing twice
    for step in straight:
        assert resumed[step] == straight[step], f"loss differs at step {step} (resumed from {resumed_from})"
    a, _ = load_tower(tmp_path / "straight" / "tower")
    b, _ = load_tower(killed_dir / "tower")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def _cli(*args, **kwargs):
    return subprocess.run([*python_command(), "-m", "lit_softmoe.cli", *args], capture_output=True, text=True,
                          **kwargs)


def test_cli_mistakes_are_one_line_with_exit_code_2(shards, tmp_path, capsys, monkeypatch):
    config = "configs/pretrain/fmnist-soft-tiny.yaml"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # One as the installed command runs it, in its own process (exit code, stderr, no traceback) ...
    result = _cli("pretrain", "--config", config, f"data.train={tmp_path / 'nowhere'}", cwd=root)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "shards not found" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    # ... the others through the same `main` in this process: a subprocess would only add a torch import each.
    cases = {
        "unknown config key 'optim.lrr'": ["pretrain", "--config", config, "optim.lrr=1"],
        "unknown image tower 'soft-tiny-p4-61e'": ["pretrain", "--config", config, "tower.name=soft-tiny-p4-61e",
                                                    f"data.train={shards / 'train'}", f"data.test={shards / 'test'}"],
        "Fashion-MNIST not found": ["data", "fashion-mnist", "--out", str(tmp_path / "d"), "--source",
                                    str(tmp_path / "empty")],
    }
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(root)
    for expected, args in cases.items():
        assert expected in one_line_error(capsys, args), args


def test_another_config_in_a_run_folder_is_refused_and_a_longer_run_resumes(shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    pretrain(_cfg(shards, run_dir, "steps=10", "checkpoint_every=5", "fewshot_shots=0"))
    saved = (run_dir / "config.yaml").read_text()
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("{}\n")
    # Same run folder, a wider tower and another learning rate: another run, not a resume of this one.
    wider = [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}", "steps=20",
             "optim.warmup=20", *SMALL_TOWER, "tower.options.width=96", "tower.options.mlp_dim=192", "optim.lr=3e-3"]
    line = one_line_error(capsys, ["pretrain", "--config", str(yaml_file), *wider])
    assert f"{run_dir} holds another run (" in line and "another run_dir=" in line
    for change in ("tower.options.width: 64 → 96", "tower.options.mlp_dim: 128 → 192", "optim.lr: 0.001 → 0.003",
                   "batch_size: 64 → 128"):
        assert change in line, line
    assert (run_dir / "config.yaml").read_text() == saved
    # A run folder whose config.yaml is gone: the checkpoint's shapes still do not fit, in one line.
    (run_dir / "config.yaml").unlink()
    assert "does not fit the tower" in one_line_error(capsys, ["pretrain", "--config", str(yaml_file), *wider])
    (run_dir / "config.yaml").write_text(saved)
    # Longer, and logged, checkpointed and evaluated differently: the same run, resumed at step 10.
    results = pretrain(_cfg(shards, run_dir, "steps=14", "checkpoint_every=7", "fewshot_shots=2", "log_every=2",
                            "threads=1", "eval_batch_size=100"))
    assert results["steps"] == 14 and "fewshot2_top1" in results
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert logged == [5, 10, 12, 14]  # steps 1-10 were not trained again
    assert "steps: 14" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_two_processes_follow_the_single_process_curve(shards, tmp_path):
    """DDP on the CPU (gloo, launched by torchrun): the gradient averaged over two half batches is
    the full batch's gradient, so two processes retrace one process's loss curve."""
    common = ["steps=12", "log_every=1", "checkpoint_every=1000", "fewshot_shots=0", "data.max_train_samples=1000",
              "data.max_test_samples=200"]
    single = tmp_path / "single"
    pretrain(_cfg(shards, single, *common))
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    double = tmp_path / "double"
    overrides = [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={double}",
                 "batch_size=64", "optim.warmup=20", "log_every=5", *SMALL_TOWER, *common]
    result = subprocess.run([*python_command(), *torchrun_args(),
                             "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    one = [r["loss"] for r in read_metrics(single / "metrics.jsonl") if "loss" in r]
    two = [r["loss"] for r in read_metrics(double / "metrics.jsonl") if "loss" in r]
    assert len(one) == len(two) == 12
    assert one[-1] < one[0]
    for a, b in zip(one, two):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)


def test_bad_samples_are_counted_and_too_many_stop_the_run(shards, tmp_path):
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.errors import UserError
    images, labels = read_fashion_mnist("train", allow_download=False)

    def samples():
        for i in range(400):
            sample = {"png": _png_bytes(images[i]), "cls": str(int(labels[i])).encode()}
            if i % 20 == 0:
                sample["png"] = b"not a png"  # 20 corrupt images: 5% of the split
            if i % 50 == 7:
                del sample["cls"]  # 8 samples without a label
            yield sample

    write_split(samples(), tmp_path / "bad", "train", samples_per_shard=100)
    (tmp_path / "bad" / "classnames.txt").write_text((shards / "classnames.txt").read_text())
    overrides = [f"data.train={tmp_path / 'bad' / 'train'}", "steps=3", "fewshot_shots=0"]
    with pytest.raises(UserError, match=r"28 of 400 train samples were bad \(bad_image 20, missing_cls 8\)"):
        pretrain(_cfg(shards, tmp_path / "run", *overrides))
    results = pretrain(_cfg(shards, tmp_path / "run", *overrides, "data.max_bad_fraction=0.1"))
    assert results["bad_samples"]["train"] == {"bad_image": 20, "missing_cls": 8}


def test_a_train_shard_cut_at_a_sample_boundary_stops_the_run(tmp_path):
    """A tar cut at a member boundary is a valid, shorter archive: pretraining trained on the 100 samples
    left of 300 without a word. The 200 that sizes.json lists but the shard lost are bad samples."""
    write_fashion_mnist_shards(tmp_path / "data", samples_per_shard=300, limit=300, allow_download=False)
    cut_at_sample(tmp_path / "data" / "train" / "0.tar", 100)
    with pytest.raises(UserError) as raised:
        pretrain(_cfg(tmp_path / "data", tmp_path / "run", "steps=3", "fewshot_shots=0"))
    assert str(raised.value) == ("201 of 301 train samples were bad (missing_samples 200, truncated_shard 1), over "
                                 "data.max_bad_fraction=0.01; fix the shards or raise it")

def test_class_index_past_the_class_names_is_skipped_and_counted(shards, tmp_path):
    """A .cls of 10 with 10 class names, or of -1, is a bad sample: skipped and counted, and too
    many of them stop the run like any other bad samples (not an IndexError inside the loss)."""
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.errors import UserError
    images, labels = read_fashion_mnist("train", allow_download=False)

    def samples(n, bad_labels):
        for i in range(n):
            yield {"png": _png_bytes(images[i]), "cls": str(bad_labels.get(i, int(labels[i]))).encode()}

    write_split(samples(300, {5: 10, 6: -1}), tmp_path / "d", "train", samples_per_shard=100)
    write_split(samples(100, {0: 12, 1: -1}), tmp_path / "d", "test", samples_per_shard=100)
    (tmp_path / "d" / "classnames.txt").write_text((shards / "classnames.txt").read_text())
    overrides = [f"data.train={tmp_path / 'd' / 'train'}", f"data.test={tmp_path / 'd' / 'test'}", "steps=2",
                 "fewshot_shots=0"]
    with pytest.raises(UserError, match=r"2 of 100 test samples were bad \(bad_cls 2\)"):
        pretrain(_cfg(shards, tmp_path / "run", *overrides))
    results = pretrain(_cfg(shards, tmp_path / "run", *overrides, "data.max_bad_fraction=0.02"))
    assert results["bad_samples"] == {"train": {"bad_cls": 2}, "test": {"bad_cls": 2}}


def test_small_classes_skip_the_fewshot_probe_and_the_tower_is_saved(shards, tmp_path):
    """60 training images leave a class with fewer than 10: the run still ends with its tower and
    its test top-1, and says why the 10-shot probe was skipped."""
    results = pretrain(_cfg(shards, tmp_path / "run", "data.max_train_samples=60", "batch_size=30", "steps=2"))
    assert "fewshot10_top1" not in results
    assert "10-shot linear probe is skipped: class" in results["fewshot_skipped"]
    _, meta = load_tower(tmp_path / "run" / "tower")
    assert meta["pretrain"]["test_top1"] == results["test_top1"]
    assert meta["pretrain"]["fewshot_skipped"] == results["fewshot_skipped"]


def test_tower_is_saved_before_the_final_evaluation(shards, tmp_path, monkeypatch):
    import lit_softmoe.train.pretrain as recipe

    def failing_embed(*args, **kwargs):
        raise RuntimeError("out of memory in the evaluation")

    monkeypatch.setattr(recipe, "_embed", failing_embed)
    with pytest.raises(RuntimeError, match="out of memory"):
        pretrain(_cfg(shards, tmp_path / "run", "data.max_train_samples=200", "steps=2", "fewshot_shots=0"))
    _, meta = load_tower(tmp_path / "run" / "tower")
    assert meta["pretrain"]["steps"] == 2 and "test_top1" not in meta["pretrain"]


def test_class_names_are_found_beside_a_pattern_or_a_list_of_splits(shards, tmp_path):
    # A brace pattern or a '::' list as data.train looked for classnames.txt in the wrong folder and
    # silently named the classes "0" ... "9".
    from lit_softmoe.data.shards import dataset_dir
    from lit_softmoe.train.class_data import setup_class_data
    from lit_softmoe.train.pretrain import _validate_tower
    for spec in (f"{shards}/train", f"{shards}/train/{{0..0}}.tar", f"{shards}/train::{shards}/test",
                 f"{shards}/train/0.tar::{shards}/test/0.tar"):
        assert dataset_dir(spec) == shards, spec
    names = (shards / "classnames.txt").read_text().splitlines()
    cfg = _cfg(shards, tmp_path / "run", f"data.train={shards}/train/{{0..0}}.tar", "data.max_train_samples=100",
               "data.max_test_samples=100")
    data = setup_class_data(cfg, _validate_tower(cfg), 0, 1)
    assert data.classnames == names and len(names) == 10 and names[0] != "0"
    streamed = setup_class_data(_cfg(shards, tmp_path / "run", f"data.train={shards}/train/{{0..0}}.tar",
                                "data.loader=stream", "data.mean=[0.3]", "data.std=[0.3]"), _validate_tower(cfg), 0, 1)
    assert streamed.streamed and streamed.classnames == names


def _tc_cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=32", "optim.warmup=5", "fewshot_shots=0", "data.max_train_samples=400",
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


def test_run_dir_that_is_a_file_is_one_line_with_exit_code_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("not a folder\n")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    line = one_line_error(capsys, ["pretrain", "--config", "configs/pretrain/fmnist-soft-tiny.yaml",
                                   f"run_dir={tmp_path / 'a-file'}"])
    assert line == f"lit-softmoe pretrain: error: run_dir {tmp_path / 'a-file'} is a file; give a folder path"


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


def test_pretrain_names_an_impossible_tower_option_in_one_line():
    from lit_softmoe.config import PretrainConfig
    from lit_softmoe.errors import UserError
    from lit_softmoe.train.pretrain import _validate_tower
    cfg = PretrainConfig()
    cfg.tower.name, cfg.tower.options = "soft-test-4e", {"num_heads": 0}
    with pytest.raises(UserError, match="num_heads must be a positive integer, got 0"):
        _validate_tower(cfg)


def test_pretrain_rerun_with_fewer_epochs_than_its_checkpoint_is_refused(data, tmp_path):
    run = tmp_path / "run"
    common = [f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
              "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=0", "precision=fp32"]
    pretrain(load_config(PretrainConfig, None, [*common, "epochs=1"]))  # 6 steps
    with pytest.raises(UserError, match=f"{run} holds a checkpoint at step 6, past the 3 steps this config trains"):
        pretrain(load_config(PretrainConfig, None, [*common, "epochs=0.5"]))
    assert json.loads((run / "results.json").read_text())["steps"] == 6


def test_label_smoothing_with_the_sigmoid_loss_is_refused(data, tmp_path):
    """The sigmoid loss has no label smoothing: label_smoothing=0.1 trained exactly as 0 would."""
    with pytest.raises(UserError, match="label_smoothing=0.1 applies to loss=softmax only"):
        pretrain(load_config(PretrainConfig, None, [
            f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}",
            f"run_dir={tmp_path / 'run'}", "tower.name=soft-test-4e", "batch_size=50", "steps=2", "fewshot_shots=0",
            "loss=sigmoid", "label_smoothing=0.1"]))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stats, expected", [
    (["data.mean=[0.485,0.456,0.406]", "data.std=[0.229,0.224,0.225]"],
     "data.mean has 3 values and data.std 3, but tower 'soft-test-4e' takes 1-channel images; give one value per "
     "channel (e.g. data.mean=[0.5] data.std=[0.25]), or set both to [] to compute them from the training images"),
    (["data.mean=[0.5]", "data.std=[]"], "data.mean has 1 values and data.std 0, but tower 'soft-test-4e' takes"),
    (["data.mean=[0.5]", "data.std=[0]"], "data.std [0.0] holds a value ≤ 0 (pixels are divided by it)")])
def test_normalization_statistics_that_do_not_fit_the_towers_channels_are_one_line(data, tmp_path, capsys, stats,
                                                                                  expected):
    """An RGB config's mean/std on a gray tower broadcast its pixels to 3 channels: the first step ended
    in `mat1 and mat2 shapes cannot be multiplied (..x147 and 49x..)`; a zero std divided by zero."""
    line = one_line_error(capsys, [
        "pretrain", "--config", "pretrain/soft-s16-128e-imagenet1k", "tower.name=soft-test-4e",
        f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", "data.loader=memory",
        "data.augment=false", "data.randaugment=[]", "data.mixup=0", f"run_dir={tmp_path / 'run'}",
        "batch_size=50", "steps=1", "fewshot_shots=0", "log_with=[]", "compile=false", "precision=fp32", *stats])
    assert line == f"lit-softmoe pretrain: error: {expected}" if expected.endswith("images") else expected in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_pretrain_that_diverges_between_log_records_saves_no_diverged_checkpoint(data, tmp_path):
    """The loss was checked only at log records (every 100 steps here): the step-4 checkpoint held NaN
    weights, the run stopped later naming step 6, and rerunning it resumed the NaN model."""
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"training diverged: loss is nan at step 4;"):
        pretrain(load_config(PretrainConfig, None, [
            f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
            "tower.name=soft-test-4e", "batch_size=50", "steps=6", "fewshot_shots=0", "precision=fp32",
            "log_every=100", "checkpoint_every=2", "keep_checkpoints=10", "optim.lr=1e9", "optim.warmup=0",
            "optim.grad_clip=0"]))
    assert finite_checkpoints(run) == {2: True}


def _pretrain_cfg(data, run, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
        "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=3", "precision=fp32", "log_every=1", *extra])


def test_pretrain_rerun_of_a_finished_run_logs_its_final_evaluation_once(data, tmp_path):
    """The rerun resumed at the last step, evaluated again and appended a second final record (and a
    third on the next rerun). Now the new evaluation replaces the old one; periodic ones stay."""
    run = tmp_path / "run"
    first = pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2"))
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], "loss" in r) for r in records] == [(1, True), (2, True), (2, False), (3, True), (4, True),
                                                           (4, False)]
    for _ in range(2):
        again = pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2"))
        assert read_metrics(run / "metrics.jsonl") == records
        assert again["test_top1"] == first["test_top1"] and again["fewshot3_top1"] == first["fewshot3_top1"]
    # Extended, the old final evaluation is a record of step 4 like any other, and the new one follows.
    pretrain(_pretrain_cfg(data, run, "steps=6", "eval_every=2"))
    steps = [(r["step"], "loss" in r) for r in read_metrics(run / "metrics.jsonl")]
    assert steps == [(1, True), (2, True), (2, False), (3, True), (4, True), (4, False), (5, True), (6, True),
                     (6, False)]


# ---- pretrain's periodic evaluation runs in the main process only -----------------------------------

def test_pretrain_periodic_evaluation_runs_in_the_main_process_only(data, tmp_path, monkeypatch):
    """Under torchrun every process scored the whole test set at each eval_every step; only the main
    process's score was logged. Here one process plays a non-main rank of such a run."""
    from lit_softmoe.train import pretrain as recipe
    calls = []
    real_test_top1 = recipe._test_top1
    monkeypatch.setattr(recipe, "_test_top1", lambda *args: calls.append(1) or real_test_top1(*args))
    pretrain(_pretrain_cfg(data, tmp_path / "main", "steps=6", "eval_every=2", "fewshot_shots=0"))
    assert len(calls) == 2  # steps 2 and 4; the final evaluation is not _test_top1's

    class NonMain:  # the accelerator of a rank other than 0: the same, but not the main process
        def __init__(self, accelerator):
            self._accelerator = accelerator
        is_main_process = False

        def __getattr__(self, name):
            return getattr(self._accelerator, name)

    real_create = recipe.create_accelerator
    monkeypatch.setattr(recipe, "create_accelerator", lambda *args: NonMain(real_create(*args)))
    calls.clear()
    results = pretrain(_pretrain_cfg(data, tmp_path / "other", "steps=6", "eval_every=2", "fewshot_shots=0"))
    assert calls == [] and results["steps"] == 6 and "test_top1" not in results


@pytest.mark.slow
def test_two_process_pretrain_with_periodic_evaluation_logs_it_once(data, tmp_path):
    """The two gloo processes (torchrun) go on training while the main one evaluates."""
    import os
    import subprocess
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    run = tmp_path / "double"
    overrides = [f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
                 "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=0", "precision=fp32", "log_every=1",
                 "steps=6", "eval_every=2", "checkpoint_every=3"]
    result = subprocess.run([*python_command(), *torchrun_args(),
                             "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    evaluations = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "test_top1" in r]
    assert evaluations == [2, 4, 6]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_warmup_longer_than_half_the_run_is_said_once(small_shards, tmp_path, caplog):
    """The shipped configs' steps used on a small dataset: a warmup of 20 steps in a 10-step run.
    Pretraining says so in one warning line before training; 0.5 (half the run) says nothing."""
    with caplog.at_level("WARNING", logger="lit_softmoe.train.pretrain"):
        pretrain(_cfg(small_shards, tmp_path / "long", "steps=10", "optim.warmup=20", "fewshot_shots=0"))
    warnings = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert warnings == ["warning: the warmup of 20 steps covers the whole 10-step run, so the learning rate rises "
                        "for most of it; give optim.warmup as a fraction of the run (e.g. optim.warmup=0.05) or "
                        "fewer steps"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_softmoe.train.pretrain"):
        pretrain(_cfg(small_shards, tmp_path / "half", "steps=10", "optim.warmup=0.5", "fewshot_shots=0"))
    assert not [r for r in caplog.records if "warmup" in r.getMessage()]


def test_pretrain_rerun_over_a_truncated_newest_checkpoint_resumes_from_the_one_before(data, tmp_path, caplog):
    """A disk that filled while the step-4 checkpoint was copied: the rerun crashed in safetensors
    on every try. Now it resumes at step 2 and, training being exact on resume, ends with the
    same tower the uninterrupted run saved."""
    run = tmp_path / "run"
    cfg = ["steps=4", "checkpoint_every=2", "keep_checkpoints=10", "fewshot_shots=0"]
    pretrain(_pretrain_cfg(data, run, *cfg))
    first = load_tower(run / "tower")[0]
    tensors = run / "checkpoints" / "step_00000004" / "state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])
    shutil.rmtree(run / "tower")  # so the rerun must train steps 3 and 4 again to save it
    (run / "results.json").unlink()
    with caplog.at_level("WARNING"):
        again = pretrain(_pretrain_cfg(data, run, *cfg))
    assert again["steps"] == 4
    assert any(f"{run / 'checkpoints' / 'step_00000004'} is damaged" in r.getMessage() for r in caplog.records)
    for a, b in zip(first.state_dict().values(), load_tower(run / "tower")[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_one_color_image_among_gray_ones_is_named_as_the_reason_a_gray_tower_does_not_fit(tmp_path, caplog):
    """One RGB image among gray ones makes the split read as RGB: "holds 3×28px" alone, for a split
    the user knows is gray, hid the reason. (data.loader=auto streams such a split instead, converting
    each image to the tower's channels.)"""
    import PIL.Image

    from lit_softmoe.data.shards import write_split
    samples = [{"png": PIL.Image.new("L", (28, 28), 10 * i), "cls": i % 2} for i in range(9)]
    samples.append({"png": PIL.Image.new("RGB", (28, 28), (200, 10, 10)), "cls": 1})
    for split in ("train", "test"):
        write_split(samples, tmp_path / "ds", split)
    (tmp_path / "ds" / "classnames.txt").write_text("dark\nlight\n")
    train = tmp_path / "ds" / "train"
    with caplog.at_level("WARNING"), pytest.raises(UserError) as refused:
        pretrain(load_config(PretrainConfig, None, [
            f"data.train={train}", f"data.test={tmp_path / 'ds' / 'test'}", f"run_dir={tmp_path / 'run'}",
            "tower.name=soft-test-4e", "batch_size=5", "steps=1", "fewshot_shots=0", "data.loader=memory"]))
    assert str(refused.value) == (
        f"tower 'soft-test-4e' takes 1×28px images but {train} holds 3×28px (read as RGB: one or more of its "
        "images are in color); set data.loader=stream (it resizes and converts every image), pick a tower for "
        "this size, or set tower.options.image_size / tower.options.in_channels")
    assert f"1 of the 10 images of {train} are in color and the rest gray: the split is read as RGB" in caplog.text


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_the_rerun_resumes(small_shards, tmp_path, capsys,
                                                                                   monkeypatch):
    """ENOSPC while a checkpoint is written ended pretraining in a traceback. Now one line naming the
    file, exit code 2, no half-written checkpoint left for the rerun to trust, and the rerun (space
    again) resumes from the checkpoint before and finishes the run."""
    import errno

    from lit_softmoe import model_folders  # where a checkpoint's tensors file is written
    from lit_softmoe.cli import main

    real_save_file, written = model_folders.save_file, []

    def save_file(tensors, path, **kwargs):
        written.append(str(path))
        if len(written) == 2:  # the checkpoint of step 6
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save_file(tensors, path, **kwargs)

    monkeypatch.setattr(model_folders, "save_file", save_file)
    run_dir, config = tmp_path / "run", tmp_path / "empty.yaml"
    config.write_text("{}\n")
    argv = ["pretrain", "--config", str(config), f"data.train={small_shards / 'train'}",
            f"data.test={small_shards / 'test'}", f"run_dir={run_dir}", "batch_size=64", "optim.warmup=0.1",
            "log_every=1", "steps=6", "checkpoint_every=3", "fewshot_shots=0", "data.max_test_samples=100",
            *SMALL_TOWER]
    assert main(argv) == 2
    stderr = capsys.readouterr().err.splitlines()  # the progress bar's lines, then the error on its own
    assert stderr[-1] == (f"lit-softmoe pretrain: error: no space left on the device while writing {written[1]}; "
                          "free some space (or write to another disk) and rerun the same command")
    assert [line for line in stderr if "error" in line] == stderr[-1:]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000003"]  # no temporary folder either
    assert not (run_dir / "tower").exists()
    monkeypatch.setattr(model_folders, "save_file", real_save_file)  # space again
    assert main(argv) == 0
    assert "resuming from" in capsys.readouterr().out
    trained = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert trained == [1, 2, 3, 4, 5, 6]  # steps 1-3 once, then 4-6 after the resume
    assert (run_dir / "tower").is_dir()


def _tower_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_tower(run_dir / "tower")[0].state_dict())


def test_accumulation_and_grad_checkpointing_follow_the_plain_run(shards, tmp_path):
    """accum_steps=4 (four micro-batches of 16) with grad_checkpointing: the losses and the final weights of
    the plain batch-64 run, to 1e-4."""
    common = ("steps=8", "log_every=1", "fewshot_shots=0")
    pretrain(_cfg(shards, tmp_path / "plain", *common))
    pretrain(_cfg(shards, tmp_path / "levers", *common, "accum_steps=4", "grad_checkpointing=true"))
    losses = [[r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r]
              for run in ("plain", "levers")]
    assert len(losses[0]) == 8 and losses[0] == pytest.approx(losses[1], abs=1e-4)
    plain, levers = _tower_weights(tmp_path / "plain"), _tower_weights(tmp_path / "levers")
    assert plain.keys() == levers.keys()
    for name in plain:
        torch.testing.assert_close(levers[name], plain[name], atol=1e-4, rtol=0, msg=name)


def test_fp16_pretrain_trains_and_its_checkpoint_keeps_the_loss_scale(shards, tmp_path, fresh_accelerate_state):
    """precision=fp16 (torch's fp16 autocast and loss scaler on the CPU, slow there: a short run) trains as
    fp32 does on the same batches."""
    from accelerate.state import AcceleratorState

    common = ("steps=10", "optim.lr=3e-3", "optim.warmup=2", "checkpoint_every=10", "fewshot_shots=0",
              "data.max_test_samples=256")
    results = pretrain(_cfg(shards, tmp_path / "run", "precision=fp16", *common))
    AcceleratorState._reset_state(True)  # accelerate holds one precision per process
    pretrain(_cfg(shards, tmp_path / "fp32", "precision=fp32", *common))
    losses, fp32 = ([r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r]
                    for run in ("run", "fp32"))
    # fp16 rounds the matmuls' inputs to 11 significant bits (2^-11 = 4.9e-4 relative); over 10 steps the two
    # curves measured 1e-3 apart. 0.05 bounds that with room, and is a fraction of the 0.18 the loss falls.
    assert len(losses) == len(fp32) == 2 and losses == pytest.approx(fp32, abs=0.05)
    assert losses[-1] < losses[0] and results["test_top1"] > 0.3  # 10 classes: chance is 0.1; measured 0.43
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000010" / "state.json").read_text())
    assert state["loss_scaler"]["scale"] >= 1.0  # torch's GradScaler state, resumed with the run


def test_pretrain_takes_layer_decay_and_its_steps_apply_each_layers_scale(data, tmp_path):
    """optim is shared with LiT: fine-tuning a tower (init_from) with layer-wise lr decay, as timm's recipes do."""
    from lit_softmoe.train.optim import lr_at

    run = tmp_path / "run"
    cfg = load_config(PretrainConfig, None, [
        f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
        "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=0", "precision=fp32", "steps=3",
        "optim.layer_decay=0.5", "optim.warmup=1"])
    pretrain(cfg)
    info = json.loads((run / "checkpoints" / "step_00000003" / "state.json").read_text())
    # soft-test-4e has 2 blocks and a head: head 1, last block + norm 0.5, first block 0.25, embeddings 0.125.
    assert sorted({group["lr_scale"] for group in info["param_groups"]}) == [0.125, 0.25, 0.5, 1.0]
    scale = {name: group["lr_scale"] for group, names in zip(info["param_groups"], info["param_names"])
             for name in names}
    assert [scale[n] for n in ("head.weight", "norm.weight", "blocks.1.norm1.weight", "blocks.0.attn.qkv.weight",
                               "pos_embed", "patch_embed.weight")] == [1.0, 0.5, 0.5, 0.25, 0.125, 0.125]
    for group in info["param_groups"]:  # the last step's rate, scaled
        assert group["lr"] == pytest.approx(lr_at(2, 3, cfg.optim) * group["lr_scale"])
