"""lit_softmoe.models.registry: the named towers: the paper's sizes and parameter counts (built on the
meta device), where the MoE blocks sit, every registered tower builds, unknown names and options."""
from __future__ import annotations

import pytest
import torch

from lit_softmoe.models.registry import create_image_tower, image_tower_config, list_image_towers
from lit_softmoe.models.vit import Mlp
from lit_softmoe.nn.routers import ExpertsChoiceMoE, TokensChoiceMoE
from lit_softmoe.nn.soft_moe import SoftMoE
from towers import JFT_CLASSES, count_params, images, meta_tower, tiny

PAPER_COUNTS = {  # name -> parameters with the 29,593-class JFT head
    "soft-s16-128e": 933e6,
    "soft-b16-128e": 3.7e9,
    "soft-l16-128e": 13.1e9,
    "soft-h14-128e": 27.3e9,
    "soft-h14-256e": 54.1e9,
    "vit-s16": 33e6,
    "vit-b16": 108e6,
    "vit-l16": 333e6,
    "vit-h14": 669e6,
}


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_parameter_count_matches_the_paper(name):
    count = count_params(meta_tower(name, num_classes=JFT_CLASSES))
    want = PAPER_COUNTS[name]
    assert abs(count - want) / want < 0.01, f"{name}: {count / 1e6:.1f}M vs paper {want / 1e6:.0f}M"


def test_parameter_count_soft_s14_256e():
    # Published as "1.8B", i.e. rounded to 0.1B: the exact count only has to round to it.
    count = count_params(meta_tower("soft-s14-256e", num_classes=JFT_CLASSES))
    assert round(count / 1e9, 1) == 1.8, count


@pytest.mark.parametrize("name,moe_blocks,depth", [
    ("soft-s16-128e", range(6, 12), 12),
    ("soft-s14-256e", range(6, 12), 12),
    ("soft-b16-128e", range(6, 12), 12),
    ("soft-l16-128e", range(12, 24), 24),
    ("soft-h14-128e", range(16, 32), 32),
    ("soft-h14-256e", range(16, 32), 32),
])
def test_moe_sits_in_the_contiguous_last_half(name, moe_blocks, depth):
    tower = meta_tower(name)
    assert len(tower.blocks) == depth
    is_moe = [i for i, block in enumerate(tower.blocks) if isinstance(block.mlp, SoftMoE)]
    assert is_moe == list(moe_blocks)
    cfg = tower.cfg
    for i, block in enumerate(tower.blocks):
        if i in moe_blocks:
            assert block.mlp.num_experts == cfg.num_experts and block.mlp.slots_per_expert == 1
            assert block.mlp.phi.shape == (cfg.width, cfg.num_experts, 1)
            assert block.mlp.experts.w1.shape == (cfg.num_experts, cfg.width, cfg.mlp_dim)
        else:
            assert isinstance(block.mlp, Mlp)


def test_dense_towers_have_no_moe():
    for name in ("vit-s16", "vit-b16", "vit-l16", "vit-h14", "vit-test"):
        tower = meta_tower(name)
        assert not any(isinstance(m, SoftMoE) for m in tower.modules())


@pytest.mark.parametrize("name,width,depth,mlp,heads", [
    ("vit-ti16", 192, 12, 768, 3), ("vit-s16", 384, 12, 1536, 6), ("vit-b16", 768, 12, 3072, 12),
    ("vit-l16", 1024, 24, 4096, 16), ("vit-h14", 1280, 32, 5120, 16),
])
def test_size_table(name, width, depth, mlp, heads):
    cfg = image_tower_config(name)
    assert (cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads) == (width, depth, mlp, heads)
    assert cfg.image_size == 224 and cfg.num_classes == 0 and cfg.qk_norm
    assert cfg.num_patches == (224 // cfg.patch_size) ** 2


@pytest.mark.parametrize("name", list_image_towers())
def test_every_registered_tower_builds(name):
    cfg = image_tower_config(name)
    if "test" in name or "tiny" in name:
        tower = tiny(name, num_classes=5)
        out = tower(images(cfg, b=2))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        feats = tower.forward_pooled(images(cfg, b=2))
        assert feats.shape == (2, cfg.width) and torch.isfinite(feats).all()
    else:
        tower = meta_tower(name)
        assert count_params(tower) > 0
        assert len(tower.blocks) == cfg.depth
    moe_class = {"soft": SoftMoE, "tokens_choice": TokensChoiceMoE, "experts_choice": ExpertsChoiceMoE}[cfg.moe_type]
    assert sum(isinstance(b.mlp, moe_class) for b in tower.blocks) == len(cfg.moe_layers)
    assert name.startswith(("soft-", "tc-", "ec-")) == bool(cfg.moe_layers)
    assert name.startswith("tc-") == (cfg.moe_type == "tokens_choice")
    assert name.startswith("ec-") == (cfg.moe_type == "experts_choice")


def test_unknown_name_raises_with_a_suggestion():
    with pytest.raises(KeyError, match="soft-s16-128e"):
        create_image_tower("soft-s16-128")
    with pytest.raises(KeyError, match="did you mean"):
        image_tower_config("vit-b-16")


def test_unknown_override_raises():
    with pytest.raises(KeyError, match="num_clases"):
        create_image_tower("vit-test", num_clases=10)
    tower = create_image_tower("vit-test", num_classes=3, depth=3)
    assert len(tower.blocks) == 3 and tower.head.out_features == 3


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
