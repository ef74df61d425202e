"""Tests of the sparse baselines (`lit_softmoe.nn.routers`) against `shared/reference/soft-moe.md` §3.

The routing tests feed the layers chosen gates (the router's logits are replaced by log-gates) and
experts that output a one-hot vector per expert (w1 = b1 = 0, so expert j returns b2[j] = e_j): the
layer's output for a token is then exactly its combine weights, one column per expert, which makes
the reference page's hand-checked vectors directly comparable.
"""
from __future__ import annotations

import pytest
import torch

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.models.registry import create_image_tower, image_tower_config
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.models.vit import ViTConfig
from lit_softmoe.nn.routers import TokensChoiceMoE
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain

from towers import count_params


# ---- towers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,experts", [
    ("tc-s16-32e-k1", 32), ("tc-s16-32e-k2", 32), ("tc-s16-64e-k1", 64), ("tc-s16-64e-k2", 64),
    ("tc-b16-32e-k1", 32), ("tc-b16-32e-k2", 32), ("tc-b16-64e-k1", 64), ("tc-b16-64e-k2", 64),
    ("ec-s16-32e", 32), ("ec-b16-32e", 32),
])
def test_big_sparse_towers_parameter_counts_on_meta(name, experts):
    cfg = image_tower_config(name, num_classes=29_593)
    tower = create_image_tower(name, device="meta", num_classes=29_593)
    assert all(p.is_meta for p in tower.parameters())
    assert cfg.moe_layers == tuple(range(6, 12)) and cfg.num_experts == experts
    d, mlp, n, L = cfg.width, cfg.mlp_dim, cfg.num_experts, len(cfg.moe_layers)
    dense = count_params(create_image_tower(f"vit-{name.split('-')[1]}", device="meta", num_classes=29_593))
    one_mlp = 2 * d * mlp + mlp + d
    # dense − L MLPs + L·n expert MLPs + L routers of d·n (no bias, no scale)
    assert count_params(tower) == dense - L * one_mlp + L * n * one_mlp + L * d * n
    # The Soft MoE tower with as many experts (one slot each) has one scalar `scale` more per layer.
    soft = create_image_tower(f"soft-{name.split('-')[1]}-128e", device="meta", num_classes=29_593, num_experts=n)
    assert count_params(soft) - count_params(tower) == L
    if name == "tc-s16-32e-k2":
        assert round(count_params(tower) / 1e6) == 253  # with the JFT head


def test_tiny_sparse_towers_match_the_soft_tower_width():
    soft = image_tower_config("soft-tiny-p7-16e")
    for name in ("tc-tiny-p7-16e-k1", "tc-tiny-p7-16e-k2", "ec-tiny-p7-16e"):
        cfg = image_tower_config(name)
        assert (cfg.width, cfg.depth, cfg.mlp_dim, cfg.moe_layers, cfg.num_experts, cfg.patch_size) == \
            (soft.width, soft.depth, soft.mlp_dim, soft.moe_layers, soft.num_experts, soft.patch_size)
    assert image_tower_config("tc-tiny-p7-16e-k2").num_selected_experts == 2


def test_tower_sums_aux_losses_and_averages_dropped_fractions():
    torch.manual_seed(0)
    tower = create_image_tower("tc-test-4e-k1", num_classes=3, depth=3, moe_layers=(1, 2)).train()
    x = torch.randn(5, 1, 28, 28)
    tower(x)
    layers = [tower.blocks[1].mlp, tower.blocks[2].mlp]
    torch.testing.assert_close(tower.moe_aux_loss(), layers[0].aux_loss + layers[1].aux_loss)
    torch.testing.assert_close(tower.moe_dropped_fraction(),
                               (layers[0].dropped_fraction + layers[1].dropped_fraction) / 2)
    dense = create_image_tower("vit-test")
    dense(x)
    assert dense.moe_aux_loss().item() == 0 and dense.moe_dropped_fraction().item() == 0


def test_old_tower_configs_load_as_soft_moe_and_sparse_towers_round_trip(tmp_path):
    old = image_tower_config("soft-test-4e").to_dict()
    for key in ("moe_type", "num_selected_experts", "capacity_factor", "batch_priority", "router_noise"):
        old.pop(key)
    assert ViTConfig.from_dict(old) == image_tower_config("soft-test-4e")  # a checkpoint from before
    with pytest.raises(ValueError, match="moe_type"):
        image_tower_config("soft-test-4e", moe_type="hash")
    torch.manual_seed(0)
    tower = create_image_tower("tc-test-4e-k2", num_classes=3).eval()
    save_tower(tmp_path / "tc", tower)
    loaded, _ = load_tower(tmp_path / "tc")
    assert loaded.cfg == tower.cfg and isinstance(loaded.blocks[1].mlp, TokensChoiceMoE)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded.eval().forward_features(x), tower.forward_features(x))


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
