"""Tests of the ViT towers and their registry (`shared/reference/soft-moe.md` §2).

Paper-sized towers are only ever built on the meta device (no memory allocated); everything that
runs real numbers uses the tiny `*-test*` / `*-tiny*` towers.
"""
from __future__ import annotations

import math

import pytest
import torch

from lit_softmoe.models.registry import create_image_tower, image_tower_config, list_image_towers
from lit_softmoe.models.vit import Mlp, ViTConfig
from lit_softmoe.nn.routers import ExpertsChoiceMoE, TokensChoiceMoE
from lit_softmoe.nn.soft_moe import SoftMoE

from soft_moe_reference import reference_forward
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


# ---- parameter counts: the paper's Table 8 / soft-moe.md §2 ----------------------------------------

@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_parameter_count_matches_the_paper(name):
    count = count_params(meta_tower(name, num_classes=JFT_CLASSES))
    want = PAPER_COUNTS[name]
    assert abs(count - want) / want < 0.01, f"{name}: {count / 1e6:.1f}M vs paper {want / 1e6:.0f}M"


def test_parameter_count_soft_s14_256e():
    # Published as "1.8B", i.e. rounded to 0.1B: the exact count only has to round to it.
    count = count_params(meta_tower("soft-s14-256e", num_classes=JFT_CLASSES))
    assert round(count / 1e9, 1) == 1.8, count


@pytest.mark.parametrize("name", ["soft-s16-128e", "soft-b16-128e", "soft-l16-128e", "soft-h14-128e",
                                  "soft-h14-256e", "soft-s14-256e"])
def test_closed_form_count_of_the_reference_page(name):
    # Total = dense ViT − L_moe·(one MLP) + L_moe·n·(2·d·mlp + mlp + d) + L_moe·d·n·p
    cfg = image_tower_config(name, num_classes=JFT_CLASSES)
    d, mlp, n, p, L = cfg.width, cfg.mlp_dim, cfg.num_experts, cfg.slots_per_expert, len(cfg.moe_layers)
    dense = count_params(meta_tower(name, num_classes=JFT_CLASSES, moe_layers=(), num_experts=0))
    one_mlp = 2 * d * mlp + mlp + d
    formula = dense - L * one_mlp + L * n * one_mlp + L * d * n * p
    count = count_params(meta_tower(name, num_classes=JFT_CLASSES))
    assert abs(count - formula) / formula < 0.01
    # In fact exact, up to the one learnable `scale` scalar of each Soft MoE layer.
    assert count - formula == L


# ---- MoE placement --------------------------------------------------------------------------------

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


# ---- tiny towers: real numbers --------------------------------------------------------------------

def test_forward_shapes_with_and_without_head():
    tower = tiny(num_classes=10)
    x = images(tower.cfg)
    feats = tower.forward_features(x)
    assert feats.shape == (3, tower.cfg.width) == (3, 32)
    assert tower(x).shape == (3, 10)
    torch.testing.assert_close(tower(x), tower.forward_head(feats))
    headless = tiny()
    assert isinstance(headless.head, torch.nn.Identity)
    body = {k: v for k, v in tower.state_dict().items() if not k.startswith("head.")}
    headless.load_state_dict(body)  # strict: the two towers differ only by the head
    torch.testing.assert_close(headless(x), feats)
    assert tower.forward_tokens(x).shape == (3, tower.cfg.num_patches, 32)


def test_head_init_gives_uniform_probabilities():
    tower = tiny(num_classes=7)
    assert torch.equal(tower.head.weight, torch.zeros_like(tower.head.weight))
    torch.testing.assert_close(tower.head.bias, torch.full((7,), -math.log(7)))
    logits = tower(images(tower.cfg))
    torch.testing.assert_close(logits.softmax(-1), torch.full((3, 7), 1 / 7))
    torch.testing.assert_close(torch.sigmoid(logits), torch.full((3, 7), 1 / 8))  # 1 / (1 + C)


def test_runs_at_another_resolution():
    tower = tiny()
    cfg = tower.cfg  # 28 px, patch 7 -> a 4x4 grid
    out = tower(images(cfg, size=42))  # a 6x6 grid
    assert out.shape == (3, cfg.width) and torch.isfinite(out).all()
    assert tower.forward_tokens(images(cfg, size=42)).shape == (3, 36, cfg.width)
    # At the native grid the learned embedding is used as is.
    assert tower._pos_embed(16) is tower.pos_embed
    # Resampling a per-channel constant grid gives that constant; a grid varying along one axis
    # keeps its range and its monotone order.
    with torch.no_grad():
        tower.pos_embed.copy_(torch.arange(32.0).expand(1, 16, 32))
        torch.testing.assert_close(tower._pos_embed(36), torch.arange(32.0).expand(1, 36, 32))
        ramp = torch.arange(4.0).repeat(4)  # (16,): varies along the x axis of the 4x4 grid
        tower.pos_embed.copy_(ramp[None, :, None].expand(1, 16, 32))
        row = tower._pos_embed(64)[0, :8, 0]  # first row of the 8x8 grid
        assert (row.diff() >= 0).all() and row[0] == 0 and row[-1] == 3


@pytest.mark.parametrize("name", list_image_towers())
def test_every_registered_tower_builds(name):
    cfg = image_tower_config(name)
    if "test" in name or "tiny" in name:
        tower = tiny(name, num_classes=5)
        out = tower(images(cfg, b=2))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        feats = tower.forward_features(images(cfg, b=2))
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


@pytest.mark.parametrize("name", ["soft-s16-128e", "vit-b32"])
def test_meta_forward_gives_shapes_without_memory(name):
    tower = meta_tower(name, num_classes=1000)
    out = tower(torch.empty(2, 3, 224, 224, device="meta"))
    assert out.is_meta and out.shape == (2, 1000)


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


def test_invalid_configs_raise():
    with pytest.raises(ValueError, match="divisible"):
        image_tower_config("vit-test", num_heads=5)
    with pytest.raises(ValueError, match="outside"):
        image_tower_config("soft-test-4e", moe_layers=(2,))
    with pytest.raises(ValueError, match="num_experts"):
        image_tower_config("vit-test", moe_layers=(1,))


def test_config_round_trips_through_a_dict():
    cfg = image_tower_config("soft-s16-128e", num_classes=10)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        ViTConfig.from_dict({**cfg.to_dict(), "widht": 3})


def test_output_of_one_image_ignores_the_rest_of_the_batch():
    tower = tiny("soft-test-4e", num_classes=4, dtype=torch.float64)
    with torch.no_grad():
        tower.head.weight.normal_()  # a zero head would hide everything
    x = images(tower.cfg, b=4, dtype=torch.float64)
    others = x.clone()
    others[1:] = images(tower.cfg, b=3, seed=9, dtype=torch.float64) * 3
    with torch.no_grad():
        y, y_others, y_alone = tower(x), tower(others), tower(x[:1])
    torch.testing.assert_close(y_others[0], y[0])
    torch.testing.assert_close(y_alone[0], y[0])
    assert not torch.allclose(y_others[1], y[1])


def test_tiny_soft_tower_trains_every_part():
    tower = tiny("soft-test-4e", num_classes=3)
    tower.train()
    with torch.no_grad():
        tower.head.weight.normal_()
    loss = torch.nn.functional.cross_entropy(tower(images(tower.cfg)), torch.tensor([0, 1, 2]))
    loss.backward()
    no_grad = [n for n, p in tower.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


def test_no_weight_decay_names():
    tower = tiny("soft-test-4e", num_classes=3)
    skip = tower.no_weight_decay()
    names = dict(tower.named_parameters())
    assert skip <= set(names)
    for name in ("pos_embed", "blocks.1.mlp.phi", "blocks.1.mlp.experts.b1", "blocks.1.mlp.experts.b2",
                 "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "head.bias", "norm.weight"):
        assert name in skip, name
    # Kernels and Soft MoE's scale are decayed (the released configs decay the router scale).
    for name in ("blocks.1.mlp.scale", "blocks.1.mlp.experts.w1", "blocks.1.mlp.experts.w2",
                 "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "head.weight",
                 "patch_embed.weight"):
        assert name not in skip, name


def test_residual_stream_is_contiguous_in_every_block():
    """The patch embedding's transposed view must not leak into the residual stream: elementwise ops keep
    their first input's layout, so one strided add would make every later add and LayerNorm pay a copy."""
    tower = tiny("soft-test-4e")
    seen = []
    for block in tower.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    block_out = []
    tower.blocks[-1].register_forward_hook(lambda module, args, out: block_out.append(out.is_contiguous()))
    with torch.no_grad():
        tower.forward_features(images(tower.cfg, b=3))
    assert seen == [True] * tower.cfg.depth
    assert block_out == [True]


@pytest.mark.parametrize("size", [28, 31, 56])  # 31: a remainder the convolution drops; 56: another grid
def test_patch_embedding_equals_the_strided_convolution(size):
    tower = tiny("vit-test", dtype=torch.float64)
    x = images(tower.cfg, b=3, size=size, dtype=torch.float64)
    want = tower.patch_embed(x).flatten(2).transpose(1, 2)  # (b, m, d), the convolution's answer
    got = tower.embed_patches(x)
    assert got.shape == want.shape == (3, (size // 7) ** 2, 32)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _attention_by_hand(attn, x: torch.Tensor) -> torch.Tensor:
    """Multi-head self-attention with per-head LayerNorm on q and k, written out with explicit heads."""
    b, m, d = x.shape
    h, hd = attn.num_heads, attn.head_dim
    w, bias = attn.qkv.weight.detach(), attn.qkv.bias.detach()
    q, k, v = (x @ w[i * d:(i + 1) * d].T + bias[i * d:(i + 1) * d] for i in range(3))  # (b, m, d) each
    out = torch.zeros_like(x)
    for head in range(h):
        cols = slice(head * hd, (head + 1) * hd)
        qh, kh, vh = q[..., cols], k[..., cols], v[..., cols]
        qh = torch.nn.functional.layer_norm(qh, (hd,), attn.q_norm.weight.detach(), None, 1e-6)
        kh = torch.nn.functional.layer_norm(kh, (hd,), attn.k_norm.weight.detach(), None, 1e-6)
        scores = (qh @ kh.transpose(1, 2)) / math.sqrt(hd)  # (b, m queries, m keys)
        out[..., cols] = scores.softmax(dim=-1) @ vh
    return out @ attn.proj.weight.detach().T + attn.proj.bias.detach()


def test_tower_forward_equals_a_block_by_block_reference():
    """patches + position embedding → per block x + attn(LN1 x), then x + MLP/MoE(LN2 x) → final LN → mean
    over tokens, with attention written out by hand. Every LayerNorm gets a random gain and bias (at init
    they are 1 and 0, which would hide a swapped norm1/norm2 or a missing final norm)."""
    tower = tiny("soft-test-4e", dtype=torch.float64)
    assert not tower.cfg.qk_norm_bias and tower.cfg.qk_norm
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in tower.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=g, dtype=torch.float64))
                if module.bias is not None:
                    module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=g, dtype=torch.float64))
        for block in tower.blocks:
            block.attn.qkv.bias.normal_(std=0.3)
    x = images(tower.cfg, b=2, dtype=torch.float64)
    ln = lambda norm, t: torch.nn.functional.layer_norm(t, (t.shape[-1],), norm.weight, norm.bias, 1e-6)  # noqa: E731
    with torch.no_grad():
        tokens = tower.patch_embed(x).flatten(2).transpose(1, 2) + tower.pos_embed
        for block in tower.blocks:
            tokens = tokens + _attention_by_hand(block.attn, ln(block.norm1, tokens))
            mixed = ln(block.norm2, tokens)
            tokens = tokens + (reference_forward(block.mlp, mixed) if isinstance(block.mlp, SoftMoE) else block.mlp(mixed))
        want_tokens = ln(tower.norm, tokens)
        torch.testing.assert_close(tower.forward_tokens(x), want_tokens, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(tower.forward_features(x), want_tokens.mean(dim=1), rtol=1e-10, atol=1e-10)
    assert want_tokens.std() > 0.1  # far from a degenerate output
