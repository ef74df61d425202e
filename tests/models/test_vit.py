"""lit_softmoe.models.vit: the ViT tower's architecture (Puigcerver et al., ICLR 2024, §2): shapes,
initializations as vmoe's flax modules make them, config checks, and the forward against a
block-by-block reference."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower, image_tower_config
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.models.vit import Mlp
from lit_softmoe.models.vit_config import ViTConfig
from lit_softmoe.nn.routers import TokensChoiceMoE
from lit_softmoe.nn.soft_moe import BatchedExperts, SoftMoE
from soft_moe_layers import randn
from soft_moe_reference import reference_forward
from towers import JFT_CLASSES, count_params, images, meta_tower, tiny

TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated at ±2


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


def test_forward_shapes_with_and_without_head():
    tower = tiny(num_classes=10)
    x = images(tower.cfg)
    feats = tower.forward_pooled(x)
    assert feats.shape == (3, tower.cfg.width) == (3, 32)
    assert tower(x).shape == (3, 10)
    tokens = tower.forward_features(x)
    torch.testing.assert_close(tower(x), tower.forward_head(tokens))
    assert torch.equal(tower.forward_head(tokens, pre_logits=True), feats)
    headless = tiny()
    assert isinstance(headless.head, torch.nn.Identity)
    body = {k: v for k, v in tower.state_dict().items() if not k.startswith("head.")}
    headless.load_state_dict(body)  # strict: the two towers differ only by the head
    torch.testing.assert_close(headless(x), feats)
    assert tower.forward_features(x).shape == (3, tower.cfg.num_patches, 32)


def test_timm_contract_of_the_tower():
    # timm's: forward_features → tokens, forward_head pools, reset/get_classifier, num_features, global_pool "".
    tower = tiny(num_classes=10)
    x = images(tower.cfg)
    assert (tower.num_classes, tower.num_features, tower.head_hidden_size, tower.in_chans) == (10, 32, 32, 1)
    assert tower.get_classifier() is tower.head
    tower.reset_classifier(0)
    assert tower.num_classes == tower.cfg.num_classes == 0 and isinstance(tower.get_classifier(), nn.Identity)
    torch.testing.assert_close(tower(x), tower.forward_pooled(x))
    tower.reset_classifier(5, global_pool="")
    assert tower(x).shape == (3, tower.cfg.num_patches, 5)  # unpooled, as timm's ViT with global_pool=""
    torch.testing.assert_close(tower.get_classifier().bias, torch.full((5,), -math.log(5)))
    with pytest.raises(ValueError, match="global_pool"):
        tower.reset_classifier(0, global_pool="token")
    matcher = tower.group_matcher()
    assert {"stem", "blocks"} == set(matcher)


def test_grad_checkpointing_gives_the_same_output_and_gradients():
    tower = tiny(num_classes=10)
    x = images(tower.cfg)
    want = tower(x)
    want.sum().backward()
    grads = {n: p.grad.clone() for n, p in tower.named_parameters()}
    tower.zero_grad()
    tower.set_grad_checkpointing()
    got = tower(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for n, p in tower.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


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
    assert tower.forward_features(images(cfg, size=42)).shape == (3, 36, cfg.width)
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


@pytest.mark.parametrize("in_channels, given, fix", [
    (1, 3, "convert the images to gray first: PIL's image.convert('L'), timm's create_dataset(..., "
           "input_img_mode='L')"),
    (3, 1, "convert the images to RGB first: PIL's image.convert('RGB')"),
    (1, 4, "give images of the tower's channel count")])
def test_images_of_another_channel_count_are_named_with_the_fix(in_channels, given, fix):
    """A gray tower fed timm's RGB transform's output failed in the patch matmul: `mat1 and mat2 shapes cannot
    be multiplied (..x147 and 49x..)`, naming neither channel count."""
    tower = tiny(in_channels=in_channels)
    names = {1: "1-channel (gray)", 3: "3-channel (RGB)", 4: "4-channel"}
    with pytest.raises(ValueError) as err:
        tower(torch.zeros(2, given, 28, 28))
    assert str(err.value).startswith(f"the tower takes {names[in_channels]} images, got {names[given]} ones "
                                     f"(pixels of shape (2, {given}, 28, 28)); {fix}")
    assert tower(torch.zeros(2, in_channels, 28, 28)).shape == (2, tower.cfg.width)


@pytest.mark.parametrize("name", ["soft-s16-128e", "vit-b32"])
def test_meta_forward_gives_shapes_without_memory(name):
    tower = meta_tower(name, num_classes=1000)
    out = tower(torch.empty(2, 3, 224, 224, device="meta"))
    assert out.is_meta and out.shape == (2, 1000)


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
    with pytest.raises(UserError, match=r"^unknown tower config keys \['widht'\]; known keys: \['batch_priority', "):
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
        tower.forward_pooled(images(tower.cfg, b=3))
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
            moe = isinstance(block.mlp, SoftMoE)
            tokens = tokens + (reference_forward(block.mlp, mixed) if moe else block.mlp(mixed))
        want_tokens = ln(tower.norm, tokens)
        torch.testing.assert_close(tower.forward_features(x), want_tokens, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(tower.forward_pooled(x), want_tokens.mean(dim=1), rtol=1e-10, atol=1e-10)
    assert want_tokens.std() > 0.1  # far from a degenerate output


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


def test_a_tower_config_without_the_moe_keys_is_soft_moe_and_sparse_towers_round_trip(tmp_path):
    short = image_tower_config("soft-test-4e").to_dict()
    for key in ("moe_type", "num_selected_experts", "capacity_factor", "batch_priority", "router_noise"):
        short.pop(key)
    assert ViTConfig.from_dict(short) == image_tower_config("soft-test-4e")  # the fields' defaults
    with pytest.raises(ValueError, match="moe_type"):
        image_tower_config("soft-test-4e", moe_type="hash")
    torch.manual_seed(0)
    tower = create_image_tower("tc-test-4e-k2", num_classes=3).eval()
    save_tower(tmp_path / "tc", tower)
    loaded, _ = load_tower(tmp_path / "tc")
    assert loaded.cfg == tower.cfg and isinstance(loaded.blocks[1].mlp, TokensChoiceMoE)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded.eval().forward_pooled(x), tower.forward_pooled(x))


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
    def tanh_gelu(t):
        return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))
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
        torch.testing.assert_close(tower.forward_pooled(pixels), tower.forward_features(pixels).mean(1))


def test_qk_norm_has_no_bias_as_flax_unless_asked_and_its_config_says_which(tmp_path):
    # flax's qk LayerNorm (use_bias=False) has a scale only. A bias on k adds one score to every key of
    # a query (dead weight); one on q adds a per-key logit.
    import json

    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import load_tower, save_tower
    from lit_softmoe.models.vit_config import ViTConfig
    tower = create_image_tower("soft-test-4e")
    assert tower.blocks[0].attn.q_norm.bias is None and tower.blocks[0].attn.k_norm.bias is None
    assert not [k for k in tower.state_dict() if k.endswith(("q_norm.bias", "k_norm.bias"))]
    # With qk_norm_bias, saved and loaded: its biases, exactly.
    torch.manual_seed(0)
    biased = create_image_tower("soft-test-4e", qk_norm_bias=True).eval()
    with torch.no_grad():
        biased.blocks[0].attn.q_norm.bias.normal_()
    save_tower(tmp_path / "biased", biased)
    loaded, _ = load_tower(tmp_path / "biased")
    x = torch.randn(2, 1, 28, 28)
    assert loaded.cfg.qk_norm_bias and torch.equal(loaded.eval()(x), biased(x))
    # A config.json without the key means the field's default, no bias: biases in the weights are refused.
    meta = json.loads((tmp_path / "biased" / "config.json").read_text())
    del meta["tower"]["qk_norm_bias"]
    (tmp_path / "biased" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"model.safetensors does not fit the tower: unexpected 4 keys \(e\.g\. "
                                        r"blocks\.0\.attn\.k_norm\.bias"):
        load_tower(tmp_path / "biased")
    assert ViTConfig.from_dict({}).qk_norm_bias is False


def test_non_square_image_gets_a_position_grid_of_its_own_rows_and_columns():
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e").eval()  # 28 px, patch 7: a 4×4 learned grid
    with torch.no_grad():
        # The learned grid holds its row index in every channel: resampled to 4 rows × 5 columns,
        # the rows are kept exactly (same count) and each row stays constant across its columns.
        rows = torch.arange(4.0).repeat_interleave(4)  # (16,), row-major
        tower.pos_embed.copy_(rows[None, :, None].expand(1, 16, tower.cfg.width))
        wide = tower._pos_embed(20, (4, 5))  # (1, 20, d)
        assert wide.shape == (1, 20, tower.cfg.width)
        torch.testing.assert_close(wide[0, :, 0], torch.arange(4.0).repeat_interleave(5))
        # The transposed grid: a column index, 5 rows × 4 columns.
        tower.pos_embed.copy_(torch.arange(4.0).repeat(4)[None, :, None].expand(1, 16, tower.cfg.width))
        tall = tower._pos_embed(20, (5, 4))
        torch.testing.assert_close(tall[0, :, 0], torch.arange(4.0).repeat(5))
        # The native square grid is still the learned tensor itself.
        assert tower._pos_embed(16, (4, 4)) is tower.pos_embed

    for name in ("soft-test-4e", "tc-test-4e-k2", "ec-test-4e", "vit-test"):
        tower = create_image_tower(name, num_classes=3).eval()
        for h, w in ((28, 35), (35, 28)):  # 4×5 and 5×4 patches
            pixels = torch.randn(2, 1, h, w)
            assert tower.forward_features(pixels).shape == (2, 20, tower.cfg.width)
            logits = tower(pixels)
            assert logits.shape == (2, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("options,message", [
    (dict(num_heads=0), "num_heads must be a positive integer"),  # was ZeroDivisionError
    (dict(patch_size=0), "patch_size must be a positive integer"),  # was ZeroDivisionError
    (dict(width=0), "width must be a positive integer"),  # was ZeroDivisionError in the init
    (dict(in_channels=0), "in_channels must be a positive integer"),  # was ZeroDivisionError in the init
    (dict(num_heads=-2), "num_heads must be a positive integer"),  # was torch's "negative dimension"
    (dict(image_size=0), "image_size must be a positive integer"),  # was a tower of 0 patches: NaN output
    (dict(num_classes=-1), "num_classes must be an integer >= 0"),
    (dict(moe_layers=(1.5,)), "moe_layers must be block indices"),  # was silently a dense tower
])
def test_impossible_tower_options_are_one_value_error(options, message):
    # ValueError is what pretrain's option check turns into one UserError line (TypeError too);
    # ZeroDivisionError and RuntimeError went through it as tracebacks.
    with pytest.raises(ValueError, match=message):
        image_tower_config("soft-test-4e", **options)


@pytest.mark.parametrize("height, width", [(6, 6), (6, 28), (28, 3)])
def test_an_image_smaller_than_one_patch_is_one_clear_error(height, width):
    tower = create_image_tower("vit-test")  # patch 7, trained at 28x28
    with pytest.raises(ValueError) as info:
        tower(torch.randn(1, 1, height, width))
    assert str(info.value) == (f"image of {height}x{width} pixels is smaller than one 7x7 patch; "
                               "resize it to at least 7x7 (the tower was trained at 28x28)")
    assert tower(torch.randn(1, 1, 7, 14)).shape == (1, 32)  # one row of two patches still works


def test_forward_intermediates_are_the_block_outputs_and_end_at_forward_features():
    """timm's ViT contract: intermediates are block outputs as (b, d, rows, cols) maps, the final norm
    only with `norm=True`; the last one normed, as tokens, is forward_features."""
    tower = tiny("soft-tiny-p7-16e", num_classes=3)  # 6 blocks, Soft MoE in 3-5, 28 px in patches of 7
    x = images(tower.cfg, b=2)
    rows = cols = tower.cfg.image_size // tower.cfg.patch_size
    blocks, h = [], tower.embed_patches(x) + tower.pos_embed
    for block in tower.blocks:  # by hand: every block's output (b, m, d)
        h = block(h)
        blocks.append(h)
    with torch.no_grad():
        final, maps = tower.forward_intermediates(x)
        assert torch.equal(final, tower.forward_features(x))
        assert len(maps) == len(tower.feature_info) == tower.cfg.depth == 6
        assert all(m.shape == (2, tower.cfg.width, rows, cols) for m in maps)
        for got, want in zip(maps, blocks):
            torch.testing.assert_close(got, want.transpose(1, 2).reshape(2, -1, rows, cols), rtol=0, atol=0)
        normed = tower.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
        tokens = tower.forward_features(x)  # (b, m, d) → (b, d, rows, cols)
        torch.testing.assert_close(normed[0], tokens.transpose(1, 2).reshape(2, -1, rows, cols), rtol=0, atol=0)
        for indices, picked in ((2, [4, 5]), ([0, -1], [0, 5]), ([1, 3], [1, 3]), (None, list(range(6)))):
            got = tower.forward_intermediates(x, indices=indices, output_fmt="NLC", intermediates_only=True)
            assert len(got) == len(picked), indices
            for g, i in zip(got, picked):
                torch.testing.assert_close(g, blocks[i], rtol=0, atol=0, msg=f"{indices}: block {i}")
        early, (tap,) = tower.forward_intermediates(x, indices=[2], stop_early=True)
        torch.testing.assert_close(early, tower.norm(blocks[2]), rtol=0, atol=0)  # no block after the tap ran
    assert [f["module"] for f in tower.feature_info] == [f"blocks.{i}" for i in range(6)]
    assert {(f["num_chs"], f["reduction"]) for f in tower.feature_info} == {(tower.cfg.width, tower.cfg.patch_size)}
    for bad in (dict(indices=7), dict(indices=[6]), dict(indices=[-7]), dict(output_fmt="NHWC")):
        with pytest.raises(ValueError):
            tower.forward_intermediates(x, **bad)


def test_prune_intermediate_layers_keeps_the_blocks_needed_and_their_outputs():
    tower = tiny("soft-tiny-p7-16e", num_classes=3)
    x = images(tower.cfg, b=2)
    with torch.no_grad():
        taps = tower.forward_intermediates(x, intermediates_only=True)
        logits = tower(x)
        same = copy.deepcopy(tower)
        assert same.prune_intermediate_layers([5], prune_head=False) == [5]
        torch.testing.assert_close(same(x), logits, rtol=0, atol=0)  # nothing after the last block to drop
        pruned = copy.deepcopy(tower)
        assert pruned.prune_intermediate_layers([1, -3]) == [1, 3]
        assert len(pruned.blocks) == pruned.cfg.depth == 4 and pruned.cfg.moe_layers == (3,)
        assert pruned.num_classes == 0 and pruned.global_pool == ""  # timm's: the head goes
        got = pruned.forward_intermediates(x, indices=[1, 3], intermediates_only=True)
        for g, want in zip(got, (taps[1], taps[3])):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        bare = copy.deepcopy(tower)
        bare.prune_intermediate_layers(2, prune_norm=True)  # the last two: nothing to drop but the norm
        assert isinstance(bare.norm, nn.Identity) and len(bare.blocks) == 6
        torch.testing.assert_close(bare.forward_features(x).transpose(1, 2).reshape(taps[5].shape), taps[5],
                                   rtol=0, atol=0)
    # The pruned tower trains: every parameter it kept gets a gradient (the final norm through the tokens).
    pruned.train()
    final, got = pruned.forward_intermediates(x, indices=[1, 3])
    sum(t.sum() for t in [final, *got]).backward()
    assert not [n for n, p in pruned.named_parameters() if p.grad is None]


@pytest.mark.parametrize("name", ["vit-test", "soft-test-4e", "ec-test-4e", "tc-test-4e-k1"])
def test_building_a_tower_draws_each_weight_once(name):
    # Built on the meta device and then drawn: building is exactly one `reset_parameters` from the same
    # seed. Layers built in place would first draw PyTorch's defaults, shifting every later draw.
    torch.manual_seed(3)
    built = create_image_tower(name, num_classes=10)
    again = create_image_tower(name, num_classes=10, device="meta").to_empty(device="cpu")
    torch.manual_seed(3)
    again.reset_parameters()
    for (key, value), other in zip(built.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(value, other), key


def test_a_layer_the_init_does_not_know_is_refused_not_left_uninitialized():
    tower = create_image_tower("vit-test")
    tower.blocks[1].extra = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"draws no init for \['blocks\.1\.extra'\]"):
        tower.reset_parameters()
