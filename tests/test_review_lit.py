"""Review of `lit-softmoe train` / `embed` as a user meets them: the zero-shot eval of a multi-process
run scores the whole eval set, a Hugging Face text tower trains under DDP, `embed` never replaces
the image shards it reads, the logit scale is refused outside (0, 100] and keeps learning at its
cap, and results.json is written atomically."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lit_softmoe.config import LiTConfig, load_config
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.train import lit as lit_recipe
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics

from lit_data import PREPROCESS


def _lit_text32(data, run_dir, *extra) -> LiTConfig:
    return load_config(LiTConfig, None, [
        f"run_dir={run_dir}", f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
        f"eval.shards={data / 'features' / 'test'}", "data.workers=0", "batch_size=50", "log_every=1",
        "precision=fp32", "text.width=32", "text.layers=1", "text.heads=2", *extra])


def test_eval_set_of_a_two_process_run_is_read_whole(six_shard_data, tmp_path, monkeypatch):
    """Under torchrun (RANK/WORLD_SIZE set) only the main process evaluates; its eval loader took only
    its rank's share of the shards, so zero-shot top-1 (and the linear probe) scored half the eval set."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _lit_text32(six_shard_data, tmp_path / "run")
    assert len(shard_urls(str(six_shard_data / "features" / "test"))) == 6
    features, labels = lit_recipe._class_features(cfg, str(six_shard_data / "features" / "test"), None, None, None)
    assert features.shape[0] == labels.shape[0] == 300


def test_embed_refuses_to_replace_an_image_split(six_shard_data, tmp_path):
    """`embed --shards DATA/train --out DATA` (the dataset folder, not a new one) replaced the user's
    image shards by their features: the images were gone. A split that is not a feature cache is
    refused; an earlier feature split is still replaced as before."""
    shutil.copytree(six_shard_data / "fmnist", tmp_path / "fmnist")
    before = {p.name: p.read_bytes() for p in (tmp_path / "fmnist" / "train").iterdir()}
    with pytest.raises(UserError, match="not a feature cache"):
        embed_shards(six_shard_data / "tower", str(tmp_path / "fmnist" / "train"), tmp_path / "fmnist")
    with pytest.raises(UserError, match="not a feature cache"):  # another split of image shards
        embed_shards(six_shard_data / "tower", str(tmp_path / "fmnist" / "train"), tmp_path / "fmnist", split="test")
    assert {p.name: p.read_bytes() for p in (tmp_path / "fmnist" / "train").iterdir()} == before
    assert not (tmp_path / "fmnist" / "train" / "embed.json").exists()
    # A feature split of its own is rewritten (here: with the features of another source).
    shutil.copytree(six_shard_data / "features" / "train", tmp_path / "features" / "train")
    summary = embed_shards(six_shard_data / "tower", str(six_shard_data / "fmnist" / "test"), tmp_path / "features", split="train")
    assert summary["skipped"] is False and summary["num_samples"] == 300


def test_recipe_keeps_the_logit_scale_learning_at_its_cap(six_shard_data, tmp_path):
    run = tmp_path / "run"
    train_lit(_lit_text32(six_shard_data, run, "steps=4", "eval.shards=''", "temperature_init=100", "optim.lr=1e-2",
                          "optim.warmup_steps=0"))
    temperatures = [r["temperature"] for r in read_metrics(run / "metrics.jsonl") if "temperature" in r]
    assert len(temperatures) == 4 and all(t <= 100.0 + 1e-3 for t in temperatures)
    assert temperatures[-1] != temperatures[0]  # it learned (it sat at exactly 100 before)
    log_scale = load_file(run / "model" / "model.safetensors")["log_scale"]
    assert float(log_scale) <= math.log(100.0) + 1e-6


def test_results_json_is_written_atomically(six_shard_data, tmp_path, monkeypatch):
    """A kill while results.json is written (a rerun of a finished run rewrites it) left half a JSON
    file, which export's model card then fails to read."""
    run = tmp_path / "run"
    cfg = _lit_text32(six_shard_data, run, "steps=2", "eval.shards=''")
    train_lit(cfg)
    saved = (run / "results.json").read_text()
    write_text = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        if "results.json" in self.name:
            write_text(self, text[:len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        train_lit(cfg)  # resumes at its last step, evaluates and writes again
    monkeypatch.undo()
    assert json.loads((run / "results.json").read_text()) == json.loads(saved)


def test_feature_caches_joined_with_colons_or_a_pattern_train_as_features(six_shard_data, tmp_path):
    """`data.train=A::B` over two embed outputs (or DIR/{0..5}.tar) was taken for image shards and
    ended in 'none of the first 1000 samples could be used (missing_image: 1000); fix the shards'."""
    train, test = six_shard_data / "features" / "train", six_shard_data / "features" / "test"
    results = train_lit(_lit_text32(six_shard_data, tmp_path / "joined", "steps=2", f"data.train={train}::{test}",
                                    f"eval.shards={test}"))
    assert results["cached_features"] and "zeroshot_top1" in results
    results = train_lit(_lit_text32(six_shard_data, tmp_path / "pattern", "steps=2", f"data.train={train}/{{0..5}}.tar",
                                    "eval.shards=''"))
    assert results["cached_features"]
    with pytest.raises(UserError, match="mixes feature shards"):
        train_lit(_lit_text32(six_shard_data, tmp_path / "mixed", "steps=2", f"data.train={train}::{six_shard_data / 'fmnist' / 'train'}"))
    # Every cache of the list is checked against the tower: a stale one is refused.
    torch.manual_seed(1)
    save_tower(tmp_path / "other", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": PREPROCESS})
    embed_shards(tmp_path / "other", str(six_shard_data / "fmnist" / "test"), tmp_path / "stale", batch_size=100)
    with pytest.raises(UserError, match="made with another tower"):
        train_lit(_lit_text32(six_shard_data, tmp_path / "stale_run", "steps=2", "eval.shards=''",
                              f"data.train={train}::{tmp_path / 'stale' / 'test'}"))
