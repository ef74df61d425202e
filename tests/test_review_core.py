"""Review of the core algorithm against the official code (google-research/vmoe; `shared/reference/soft-moe.md`).

What the existing `test_soft_moe.py` / `test_vit.py` did not pin down:
- the ViT's initializations as vmoe builds them: flax `MultiHeadDotProductAttention` with
  `kernel_init=xavier_uniform()` initializes q, k and v as three separate (d, d) kernels (flax's
  DenseGeneral flattens each to (d, heads·head_dim) before the initializer) with zero biases, and the
  patch embedding is a flax `nn.Conv` with its defaults (lecun-normal kernel, zero bias);
- a padding mask that masks a whole example (no NaN in the output or in any gradient);
- the step-by-step oracle under gradcheck, bf16 weights through both implementations, and the
  remaining architectural constants (LayerNorm eps, GELU form, no dropout, GAP after the final norm).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.vit import Mlp
from lit_softmoe.nn.soft_moe import BatchedExperts, SoftMoE

from soft_moe_layers import randn

TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated at ±2


def test_q_k_v_kernels_are_each_xavier_uniform_over_d_by_d():
    torch.manual_seed(0)
    d = 384
    tower = create_image_tower("vit-s16", depth=2)
    bound = math.sqrt(6.0 / (d + d))  # per projection; a fused (3d, d) xavier would give sqrt(6 / 4d)
    for block in tower.blocks:
        attn = block.attn
        for part in attn.qkv.weight.detach().chunk(3, dim=0):  # q, k, v rows
            assert part.abs().max() <= bound
            assert part.abs().max() > 0.99 * bound
            assert abs(part.std().item() / math.sqrt(1.0 / d) - 1.0) < 0.02
        # flax's attention Dense layers have zero-initialized biases.
        assert torch.equal(attn.qkv.bias, torch.zeros_like(attn.qkv.bias))
        assert torch.equal(attn.proj.bias, torch.zeros_like(attn.proj.bias))
        proj = attn.proj.weight.detach()
        assert proj.abs().max() <= bound and proj.abs().max() > 0.99 * bound


def test_patch_embedding_is_lecun_normal_with_zero_bias():
    torch.manual_seed(0)
    tower = create_image_tower("vit-b16", depth=1)
    weight, bias = tower.patch_embed.weight.detach(), tower.patch_embed.bias.detach()
    fan_in = 3 * 16 * 16
    std = 1.0 / math.sqrt(fan_in)
    assert abs(weight.std().item() / std - 1.0) < 0.02
    assert weight.abs().max() <= 2 * std / TRUNC_STD + 1e-7  # truncated at ±2σ of the untruncated normal
    assert weight.abs().max() > 0.98 * 2 * std / TRUNC_STD
    assert torch.equal(bias, torch.zeros_like(bias))


def test_other_initializations_are_unchanged():
    # MLP blocks: xavier-uniform kernels, N(0, 1e-6) biases; pos-embedding N(0, 0.02); LayerNorms 1 / 0.
    torch.manual_seed(0)
    tower = create_image_tower("soft-s16-128e", depth=2, moe_layers=(1,), num_experts=4, num_classes=10)
    d, mlp = 384, 1536
    fc1 = tower.blocks[0].mlp.fc1
    bound = math.sqrt(6.0 / (d + mlp))
    assert bound * 0.99 < fc1.weight.abs().max() <= bound
    assert 0 < fc1.bias.abs().max() < 1e-5
    assert abs(tower.pos_embed.std().item() / 0.02 - 1.0) < 0.02
    moe = tower.blocks[1].mlp
    assert isinstance(moe, SoftMoE) and moe.scale.item() == 1.0
    assert bound * 0.99 < moe.experts.w1.abs().max() <= bound
    assert torch.equal(tower.head.weight, torch.zeros_like(tower.head.weight))
    torch.testing.assert_close(tower.head.bias, torch.full((10,), -math.log(10)))


def test_layernorm_eps_gelu_form_no_dropout_and_gap_after_the_final_norm():
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e").eval()
    norms = [m for m in tower.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # norm1, norm2, q_norm, k_norm per block, final norm
    assert all(m.eps == 1e-6 for m in norms)  # flax's LayerNorm default
    assert not any(isinstance(m, nn.Dropout) for m in tower.modules())
    # GELU: flax's nn.gelu default, the tanh approximation, in dense and expert MLPs alike.
    v = torch.linspace(-4, 4, 101, dtype=torch.float64)[None, :, None].expand(1, 101, 32)
    tanh_gelu = lambda t: 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))
    mlp = Mlp(32, 32, dtype=torch.float64)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.eye(32)), mlp.fc1.bias.zero_()
        mlp.fc2.weight.copy_(torch.eye(32)), mlp.fc2.bias.zero_()
        torch.testing.assert_close(mlp(v), tanh_gelu(v), rtol=1e-12, atol=1e-12)
        experts = BatchedExperts(1, 32, 32, dtype=torch.float64)
        experts.w1.copy_(torch.eye(32)[None]), experts.b1.zero_()
        experts.w2.copy_(torch.eye(32)[None]), experts.b2.zero_()
        torch.testing.assert_close(experts(v), tanh_gelu(v), rtol=1e-12, atol=1e-12)
    pixels = randn(2, 1, 28, 28, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(tower.forward_features(pixels), tower.forward_tokens(pixels).mean(1))


def test_qk_norm_has_no_bias_as_flax_and_old_towers_keep_theirs(tmp_path):
    # flax's qk LayerNorm (use_bias=False) has a scale only; ours had a bias on q and k. A bias on k
    # adds one score to every key of a query (dead weight); one on q adds a per-key logit.
    import json

    from lit_softmoe.models.vit import ViTConfig
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import load_tower, save_tower
    tower = create_image_tower("soft-test-4e")
    assert tower.blocks[0].attn.q_norm.bias is None and tower.blocks[0].attn.k_norm.bias is None
    assert not [k for k in tower.state_dict() if k.endswith(("q_norm.bias", "k_norm.bias"))]
    # A tower saved before the key existed (its config.json lacks it) loads with its biases, exactly.
    torch.manual_seed(0)
    old = create_image_tower("soft-test-4e", qk_norm_bias=True).eval()
    with torch.no_grad():
        old.blocks[0].attn.q_norm.bias.normal_()
    save_tower(tmp_path / "old", old)
    meta = json.loads((tmp_path / "old" / "config.json").read_text())
    del meta["tower"]["qk_norm_bias"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(meta))
    loaded, _ = load_tower(tmp_path / "old")
    x = torch.randn(2, 1, 28, 28)
    assert loaded.cfg.qk_norm_bias and torch.equal(loaded.eval()(x), old(x))
    assert ViTConfig.from_dict(create_image_tower("vit-test").cfg.to_dict()).qk_norm_bias is False
