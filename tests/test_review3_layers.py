"""Review 3 of the layers and towers (nn/, models/vit.py, upcycle, convert): each test failed before its fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_softmoe.models.registry import create_image_tower, image_tower_config

D, HEADS, HD, MLP, N, P, CLASSES, PATCH = 32, 2, 16, 64, 4, 1, 10, 7


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
            assert tower.forward_tokens(pixels).shape == (2, 20, tower.cfg.width)
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


def test_pretrain_names_an_impossible_tower_option_in_one_line():
    from lit_softmoe.config import PretrainConfig
    from lit_softmoe.errors import UserError
    from lit_softmoe.train.pretrain import _validate_tower
    cfg = PretrainConfig()
    cfg.tower.name, cfg.tower.options = "soft-test-4e", {"num_heads": 0}
    with pytest.raises(UserError, match="num_heads must be a positive integer, got 0"):
        _validate_tower(cfg)


def _save(tmp_path, tree, name="vmoe.npz"):
    path = tmp_path / name
    np.savez(path, **tree)
    return path


def vmoe_tree(seed=0, moe_blocks=(1,), depth=2):
    """A flattened vmoe VisionTransformerMoe tree for soft-test-4e (GAP, qk-norm, 10 classes)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    tree = {"embedding/kernel": r(PATCH, PATCH, 1, D), "embedding/bias": r(D),
            "Encoder/posembed_input/pos_embedding": r(1, 16, D),
            "Encoder/encoder_norm/scale": r(D), "Encoder/encoder_norm/bias": r(D),
            "head/kernel": r(D, CLASSES), "head/bias": r(CLASSES)}
    for i in range(depth):
        b = f"Encoder/encoderblock_{i}"
        for ln in ("LayerNorm_0", "LayerNorm_1"):
            tree[f"{b}/{ln}/scale"], tree[f"{b}/{ln}/bias"] = r(D), r(D)
        for name in ("query", "key", "value"):
            tree[f"{b}/SelfAttention/{name}/kernel"], tree[f"{b}/SelfAttention/{name}/bias"] = r(D, HEADS, HD), r(HEADS, HD)
        tree[f"{b}/SelfAttention/query_ln/scale"], tree[f"{b}/SelfAttention/key_ln/scale"] = r(HD), r(HD)
        tree[f"{b}/SelfAttention/out/kernel"], tree[f"{b}/SelfAttention/out/bias"] = r(HEADS, HD, D), r(D)
        if i in moe_blocks:
            tree[f"{b}/Moe/Router/mu"], tree[f"{b}/Moe/Router/scale"] = r(D, N, P), np.float32(3.0).reshape(())
            tree[f"{b}/Moe/Mlp/Dense_0/kernel"], tree[f"{b}/Moe/Mlp/Dense_0/bias"] = r(N, D, MLP), r(N, MLP)
            tree[f"{b}/Moe/Mlp/Dense_1/kernel"], tree[f"{b}/Moe/Mlp/Dense_1/bias"] = r(N, MLP, D), r(N, D)
        else:
            tree[f"{b}/Mlp/Dense_0/kernel"], tree[f"{b}/Mlp/Dense_0/bias"] = r(D, MLP), r(MLP)
            tree[f"{b}/Mlp/Dense_1/kernel"], tree[f"{b}/Mlp/Dense_1/bias"] = r(MLP, D), r(D)
    return tree


def test_vmoe_tree_with_two_slots_per_expert_converts_with_its_slots(tmp_path):
    """vmoe's SoftRouter has p = num_slots, or round(m·cf / n) from a capacity factor; every registered
    tower has p = 1 and `convert` takes no tower options, so a p = 2 tree was refused with a message
    naming width, depth, patch, image size and experts, none of which was wrong."""
    import numpy as np

    from lit_softmoe.models.convert import load_vmoe_tower

    tree = vmoe_tree(5)
    rng = np.random.default_rng(5)
    mu = rng.standard_normal((32, 4, 2)).astype(np.float32)  # (d, n, p = 2)
    tree["Encoder/encoderblock_1/Moe/Router/mu"] = mu
    tower = load_vmoe_tower(_save(tmp_path, tree), "soft-test-4e")
    assert tower.cfg.slots_per_expert == 2 and tower.blocks[1].mlp.num_slots == 8
    np.testing.assert_array_equal(tower.blocks[1].mlp.phi.detach().numpy(), mu)
    # The layer routes over all 8 slots: combine sums to 1 over (n, p) for every token.
    x = torch.randn(2, 16, 32)
    dispatch, combine = tower.blocks[1].mlp.routing_weights(x)
    assert dispatch.shape == combine.shape == (2, 16, 4, 2)
    torch.testing.assert_close(combine.sum(dim=(2, 3)), torch.ones(2, 16))
    # The released p = 1 trees still load as before.
    assert load_vmoe_tower(_save(tmp_path, vmoe_tree(6), "p1.npz"), "soft-test-4e").cfg.slots_per_expert == 1


def test_upcycle_refuses_a_dense_tower_with_other_attention_heads(tmp_path, capsys):
    """Without qk-norm no tensor shape depends on the number of heads: a dense vit-test built with 4
    heads upcycled into soft-test-4e (2 heads) silently, and its attention became another function."""
    from lit_softmoe.cli import main
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.tower_folder import save_tower
    from lit_softmoe.models.upcycle import upcycle_tower

    torch.manual_seed(0)
    dense = create_image_tower("vit-test", num_heads=4, qk_norm=False).eval()
    with pytest.raises(UserError, match="the dense tower has 4 attention heads and soft-test-4e has 2"):
        upcycle_tower(dense, "soft-test-4e")
    save_tower(tmp_path / "dense", dense, extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    assert main(["upcycle", "--from", str(tmp_path / "dense"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "soft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 attention heads and soft-test-4e has 2" in err
    assert not (tmp_path / "soft").exists()
    # The same heads upcycle as before, and the output's config is the target's (no stray key).
    same = create_image_tower("vit-test", qk_norm=False).eval()
    save_tower(tmp_path / "dense2", same, extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    assert main(["upcycle", "--from", str(tmp_path / "dense2"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "soft2")]) == 0
    import json
    meta = json.loads((tmp_path / "soft2" / "config.json").read_text())
    assert meta["tower"]["num_heads"] == 2 and "num_heads" not in meta
    pixels = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(upcycle_tower(same, "soft-test-4e").blocks[0](same.embed_patches(pixels)),
                               same.blocks[0](same.embed_patches(pixels)))
