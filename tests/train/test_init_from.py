"""pretrain `init_from`: a fresh run starts from a tower folder's weights (an upcycled one here), keeps
or replaces its class head, refuses a folder of another architecture in one line, and resumes exactly
(from its own checkpoint, refusing a source that changed since)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from launch import python_command
from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import image_tower_config
from lit_softmoe.models.tower_folder import load_tower, update_tower_meta
from lit_softmoe.models.upcycle import upcycle_checkpoint
from lit_softmoe.train.init_from import head_decision, read_init_source
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import _validate_tower, pretrain
from shared_builds import built_once


def _cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}", "batch_size=50",
        "log_every=1", "fewshot_shots=0", "precision=fp32", "log_with=[]", "optim.warmup=2", *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return built_once(tmp_path_factory, "fmnist-500",
                      lambda out: write_fashion_mnist_shards(out, limit=500, allow_download=False))


@pytest.fixture(scope="module")
def upcycled(shards, tmp_path_factory):
    """A dense vit-test pretrained for 30 steps, upcycled into soft-test-4e."""
    def build(root):
        pretrain(_cfg(shards, root / "dense", "tower.name=vit-test", "steps=30", "optim.lr=3e-3"))
        upcycle_checkpoint(root / "dense" / "tower", "soft-test-4e", root / "upcycled")
    return built_once(tmp_path_factory, "upcycled-vit-test", build) / "upcycled"


def _weights(folder):
    return load_file(folder / "model.safetensors")


def test_a_fresh_run_starts_from_the_folders_weights_and_keeps_its_head(shards, upcycled, tmp_path, capsys):
    run = tmp_path / "run"
    # lr 0: the weights the run saves are those it started from.
    results = pretrain(_cfg(shards, run, "tower.name=soft-test-4e", f"init_from={upcycled}", "steps=1",
                            "optim.lr=0"))
    assert "class head kept (its 10 classes are data.train's)" in capsys.readouterr().out
    source, saved = _weights(upcycled), _weights(run / "tower")
    assert source.keys() == saved.keys()
    for name in source:
        assert torch.equal(source[name], saved[name]), name
    assert results["init_from"]["head"] == "kept" and len(results["init_from"]["tower_sha256"]) == 64
    assert json.loads((run / "tower" / "config.json").read_text())["pretrain"]["init_from"] == results["init_from"]

    # The first step's loss is the loaded tower's on the first batch, normalized with the folder's preprocess.
    tower, meta = load_tower(upcycled)
    images, labels, _ = load_class_split(shards / "train")
    batch = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:50]
    mean = torch.tensor(meta["preprocess"]["mean"])[:, None, None]
    std = torch.tensor(meta["preprocess"]["std"])[:, None, None]
    expected = F.cross_entropy(tower((images[batch].float() / 255 - mean) / std), labels[batch]).item()
    first = next(r for r in read_metrics(run / "metrics.jsonl") if "loss" in r)
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_head_of_other_classes_is_replaced_by_a_fresh_one(shards, upcycled, tmp_path, capsys):
    source = tmp_path / "other-classes"
    shutil.copytree(upcycled, source)
    names = json.loads((source / "config.json").read_text())["classnames"]
    update_tower_meta(source, {"classnames": ["cat", *names[1:]]})
    pretrain(_cfg(shards, tmp_path / "run", "tower.name=soft-test-4e", f"init_from={source}", "steps=1",
                  "optim.lr=0"))
    assert f"class head replaced (the folder's class 0 is 'cat', data.train's is {names[0]!r})" in \
        capsys.readouterr().out
    before, saved = _weights(source), _weights(tmp_path / "run" / "tower")
    for name in before:
        if not name.startswith("head."):
            assert torch.equal(before[name], saved[name]), name
    # Initialized as at construction: zero weights, every class at probability 1/C.
    assert torch.equal(saved["head.weight"], torch.zeros_like(before["head.weight"]))
    assert torch.allclose(saved["head.bias"], torch.full((10,), -torch.log(torch.tensor(10.0)).item()))


def test_head_decision_says_why():
    source = {"tower": {"num_classes": 10}, "classnames": [str(i) for i in range(10)]}
    names = [str(i) for i in range(10)]
    assert head_decision(source, names) == (True, "its 10 classes are data.train's")
    assert head_decision({**source, "tower": {"num_classes": 0}}, names)[1] == "the folder has no class head"
    assert head_decision({**source, "tower": {"num_classes": 1000}}, names)[1] == \
        "the folder's 1000 classes are not data.train's 10"
    assert head_decision({**source, "classnames": None}, names)[1] == \
        "the folder records no class names to compare with data.train's"


def test_another_architecture_is_one_line_with_exit_code_2(shards, upcycled, tmp_path):
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    # The dense counterpart named instead of the upcycled tower: the fix names the registered one.
    result = subprocess.run([*python_command(), "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             f"data.train={shards / 'train'}", f"data.test={shards / 'test'}",
                             f"run_dir={tmp_path / 'run'}", "steps=1", "log_with=[]", "tower.name=vit-test",
                             f"init_from={upcycled}"], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"init_from {upcycled} is not a vit-test tower: moe_layers [1] (config: []), num_experts 4 (config: 0); "
            "set tower.name=soft-test-4e (and no tower.options) to train it") in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, expected", [
    (["tower.options.num_experts=8"], "num_experts 4 (config: 8); set tower.options.num_experts=4 to train it"),
    (["init_from={tmp}"], "init_from {tmp} is not a tower folder (needs config.json and model.safetensors)"),
    (["init_from={tmp}/run/tower"], "init_from {tmp}/run/tower is this run's own tower folder"),
])
def test_a_wrong_source_is_refused_before_the_data_is_read(upcycled, tmp_path, extra, expected):
    extra = [item.format(tmp=tmp_path) for item in extra]
    cfg = _cfg(tmp_path / "no-data", tmp_path / "run", "tower.name=soft-test-4e", f"init_from={upcycled}", *extra)
    with pytest.raises(UserError, match=re.escape(expected.format(tmp=tmp_path))):
        pretrain(cfg)


def test_a_run_from_a_folder_resumes_exactly_and_refuses_a_changed_source(shards, upcycled, tmp_path, caplog):
    common = ["tower.name=soft-test-4e", "steps=8", "checkpoint_every=4", "keep_checkpoints=10",
              "data.augment=true", "optim.lr=3e-3"]
    pretrain(_cfg(shards, tmp_path / "straight", f"init_from={upcycled}", *common))
    straight = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r}

    # The same run, as if killed after its step-4 checkpoint: what came after it is gone.
    source, run = tmp_path / "source", tmp_path / "run"
    shutil.copytree(upcycled, source)
    pretrain(_cfg(shards, run, f"init_from={source}", *common))
    for later in (run / "checkpoints" / "step_00000008", run / "tower"):
        shutil.rmtree(later)
    (run / "results.json").unlink()

    # A source changed since the run started from it is refused before anything is trained (rewritten whole, as
    # a writer of tower folders does: config.json and weights carry the new folder's id).
    weights = _weights(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "folder_id": "rewritten"}))
    save_file({k: v + 1 if k == "norm.weight" else v for k, v in weights.items()}, source / "model.safetensors",
              metadata={"folder_id": "rewritten"})
    with pytest.raises(UserError, match=f"init_from {source} changed since this run started from it \\(its weights\\)"):
        pretrain(_cfg(shards, run, f"init_from={source}", *common))

    # A source that is gone: the checkpoint holds the weights, so the run resumes (and says so).
    shutil.rmtree(source)
    results = pretrain(_cfg(shards, run, f"init_from={source}", *common))
    assert f"init_from {source} is gone" in caplog.text
    resumed = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert resumed == straight
    a, b = _weights(tmp_path / "straight" / "tower"), _weights(run / "tower")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert results["init_from"]["head"] == "kept"


def test_a_tokens_choice_tower_trained_on_keeps_its_balancing_loss(shards, tmp_path):
    pretrain(_cfg(shards, tmp_path / "tc", "tower.name=tc-test-4e-k1", "steps=3"))
    pretrain(_cfg(shards, tmp_path / "on", "tower.name=tc-test-4e-k1", f"init_from={tmp_path / 'tc' / 'tower'}",
                  "steps=3", "aux_loss_weight=1.0"))
    records = [r for r in read_metrics(tmp_path / "on" / "metrics.jsonl") if "loss" in r]
    assert all(r["aux_loss"] > 0 for r in records)


def test_the_shipped_upcycle_config_fits_what_upcycle_writes(tmp_path):
    cfg = load_config(PretrainConfig, "pretrain/upcycle-fmnist-tiny")
    dense = load_config(PretrainConfig, "pretrain/fmnist-dense-tiny")
    assert cfg.init_from and cfg.tower.name == "soft-tiny-p7-16e"
    assert cfg.optim.lr < dense.optim.lr  # continued at a lower learning rate than the dense run's peak
    tower_cfg = _validate_tower(cfg)
    # The folder `upcycle --to soft-tiny-p7-16e` writes from the dense tower is what this config trains.
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    dense_tower = create_image_tower(dense.tower.name, num_classes=10)
    save_tower(tmp_path / "dense", dense_tower, extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]}})
    upcycle_checkpoint(tmp_path / "dense", "soft-tiny-p7-16e", tmp_path / "upcycled")
    source = read_init_source(str(tmp_path / "upcycled"), cfg.run_dir, cfg.tower.name, cfg.tower.options, tower_cfg,
                              resuming=False)
    assert source["tower"]["moe_layers"] == list(image_tower_config("soft-tiny-p7-16e").moe_layers)
