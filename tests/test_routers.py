"""Tests of the sparse baselines (`lit_softmoe.nn.routers`) against `shared/reference/soft-moe.md` §3.

The routing tests feed the layers chosen gates (the router's logits are replaced by log-gates) and
experts that output a one-hot vector per expert (w1 = b1 = 0, so expert j returns b2[j] = e_j): the
layer's output for a token is then exactly its combine weights, one column per expert, which makes
the reference page's hand-checked vectors directly comparable.
"""
from __future__ import annotations

import pytest

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain


# ---- the tiny towers train in the pretraining recipe ---------------------------------------------

def _sparse_cfg(shards, run_dir, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}",
        "batch_size=64", "optim.warmup_steps=5", "optim.lr=3e-3", "log_every=1", "fewshot_shots=0",
        "data.max_test_samples=300", "checkpoint_every=1000", *extra])


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist_shards(out, limit=1000, allow_download=False)
    return out


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
