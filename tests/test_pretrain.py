"""Classification pretraining on real Fashion-MNIST shards: it learns, it resumes exactly after a
kill, and a user's mistake ends in one line with exit code 2."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain

# A narrow tiny tower so these tests take seconds; the full-size bar is in the README.
SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]


def _cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=64", "optim.warmup_steps=20", "log_every=5", *SMALL_TOWER, *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist_shards(out, limit=3000, allow_download=False)
    return out


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
                 "batch_size=64", "optim.warmup_steps=20", "log_every=5", *SMALL_TOWER, *common]
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    proc = subprocess.Popen([sys.executable, "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((killed_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
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
    return subprocess.run([sys.executable, "-m", "lit_softmoe.cli", *args], capture_output=True, text=True,
                          **kwargs)


def test_cli_mistakes_are_one_line_with_exit_code_2(shards, tmp_path):
    config = "configs/pretrain/fmnist-soft-tiny.yaml"
    cases = {
        "shards not found": ["pretrain", "--config", config, f"data.train={tmp_path / 'nowhere'}"],
        "unknown config key 'optim.lrr'": ["pretrain", "--config", config, "optim.lrr=1"],
        "unknown image tower 'soft-tiny-p4-61e'": ["pretrain", "--config", config, "tower.name=soft-tiny-p4-61e",
                                                    f"data.train={shards / 'train'}", f"data.test={shards / 'test'}"],
        "Fashion-MNIST not found": ["data", "fashion-mnist", "--out", str(tmp_path / "d"), "--source",
                                    str(tmp_path / "empty")],
    }
    (tmp_path / "empty").mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for expected, args in cases.items():
        result = _cli(*args, cwd=root)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_another_config_in_a_run_folder_is_refused_and_a_longer_run_resumes(shards, tmp_path):
    run_dir = tmp_path / "run"
    pretrain(_cfg(shards, run_dir, "steps=10", "checkpoint_every=5", "fewshot_shots=0"))
    saved = (run_dir / "config.yaml").read_text()
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("{}\n")
    # Same run folder, a wider tower and another learning rate: another run, not a resume of this one.
    wider = [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}", "steps=20",
             "optim.warmup_steps=20", *SMALL_TOWER, "tower.options.width=96", "tower.options.mlp_dim=192", "optim.lr=3e-3"]
    result = _cli("pretrain", "--config", str(yaml_file), *wider)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{run_dir} holds another run (" in result.stderr and "another run_dir=" in result.stderr
    for change in ("tower.options.width: 64 → 96", "tower.options.mlp_dim: 128 → 192", "optim.lr: 0.001 → 0.003",
                   "batch_size: 64 → 128"):
        assert change in result.stderr, result.stderr
    assert (run_dir / "config.yaml").read_text() == saved
    # A run folder whose config.yaml is gone: the checkpoint's shapes still do not fit, in one line.
    (run_dir / "config.yaml").unlink()
    result = _cli("pretrain", "--config", str(yaml_file), *wider)
    assert result.returncode == 2
    assert "does not fit the tower" in result.stderr and len(result.stderr.strip().splitlines()) == 1
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
                 "batch_size=64", "optim.warmup_steps=20", "log_every=5", *SMALL_TOWER, *common]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29517", "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    one = [r["loss"] for r in read_metrics(single / "metrics.jsonl") if "loss" in r]
    two = [r["loss"] for r in read_metrics(double / "metrics.jsonl") if "loss" in r]
    assert len(one) == len(two) == 12
    assert one[-1] < one[0]
    for a, b in zip(one, two):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)


def test_bad_samples_are_counted_and_too_many_stop_the_run(shards, tmp_path):
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
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


def test_class_index_past_the_class_names_is_skipped_and_counted(shards, tmp_path):
    """A .cls of 10 with 10 class names, or of -1, is a bad sample: skipped and counted, and too
    many of them stop the run like any other bad samples (not an IndexError inside the loss)."""
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
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
    from lit_softmoe.train.pretrain import _setup_data
    for spec in (f"{shards}/train", f"{shards}/train/{{0..0}}.tar", f"{shards}/train::{shards}/test",
                 f"{shards}/train/0.tar::{shards}/test/0.tar"):
        assert dataset_dir(spec) == shards, spec
    names = (shards / "classnames.txt").read_text().splitlines()
    data = _setup_data(_cfg(shards, tmp_path / "run", f"data.train={shards}/train/{{0..0}}.tar",
                            "data.max_train_samples=100", "data.max_test_samples=100"))
    assert data.classnames == names and len(names) == 10 and names[0] != "0"
