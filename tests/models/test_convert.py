"""lit_softmoe.models.convert: vmoe (JAX) parameter trees → our towers: names and transposes checked against
flax's maths in numpy, and loud errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lit_softmoe.cli import main
from lit_softmoe.errors import UserError
from lit_softmoe.models.convert import load_vmoe_tower, vmoe_to_state
from lit_softmoe.models.registry import image_tower_config
from lit_softmoe.models.tower_folder import load_tower

D, HEADS, HD, MLP, N, P, CLASSES, PATCH = 32, 2, 16, 64, 4, 1, 10, 7


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
            tree[f"{b}/SelfAttention/{name}/kernel"] = r(D, HEADS, HD)
            tree[f"{b}/SelfAttention/{name}/bias"] = r(HEADS, HD)
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


def test_every_tensor_reads_back_with_the_right_layout(tmp_path):
    tree = vmoe_tree()
    tower = load_vmoe_tower(_save(tmp_path, tree), "soft-test-4e")
    s = {k: v.numpy() for k, v in tower.state_dict().items()}
    b0, b1 = "Encoder/encoderblock_0", "Encoder/encoderblock_1"
    assert tower.cfg.num_classes == CLASSES
    np.testing.assert_array_equal(s["patch_embed.weight"], tree["embedding/kernel"].transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(s["pos_embed"], tree["Encoder/posembed_input/pos_embedding"])
    np.testing.assert_array_equal(s["blocks.0.norm1.weight"], tree[f"{b0}/LayerNorm_0/scale"])
    np.testing.assert_array_equal(s["blocks.1.norm2.bias"], tree[f"{b1}/LayerNorm_1/bias"])
    # qkv rows: [q; k; v], each the (d, heads, head_dim) kernel flattened and transposed.
    attention = f"{b0}/SelfAttention"
    key_kernel = tree[f"{attention}/key/kernel"].reshape(D, D).T
    np.testing.assert_array_equal(s["blocks.0.attn.qkv.weight"][D:2 * D], key_kernel)
    np.testing.assert_array_equal(s["blocks.0.attn.qkv.bias"][2 * D:], tree[f"{attention}/value/bias"].reshape(D))
    np.testing.assert_array_equal(s["blocks.1.attn.q_norm.weight"], tree[f"{b1}/SelfAttention/query_ln/scale"])
    assert not [k for k in s if k.endswith(("q_norm.bias", "k_norm.bias"))]  # flax's qk LayerNorm has no bias, nor ours
    np.testing.assert_array_equal(s["blocks.0.attn.proj.weight"], tree[f"{attention}/out/kernel"].reshape(D, D).T)
    np.testing.assert_array_equal(s["blocks.0.mlp.fc2.weight"], tree[f"{b0}/Mlp/Dense_1/kernel"].T)
    np.testing.assert_array_equal(s["blocks.1.mlp.phi"], tree[f"{b1}/Moe/Router/mu"])
    assert s["blocks.1.mlp.scale"] == 3.0
    np.testing.assert_array_equal(s["blocks.1.mlp.experts.w2"], tree[f"{b1}/Moe/Mlp/Dense_1/kernel"])
    np.testing.assert_array_equal(s["blocks.1.mlp.experts.b1"], tree[f"{b1}/Moe/Mlp/Dense_0/bias"])
    np.testing.assert_array_equal(s["head.weight"], tree["head/kernel"].T)
    np.testing.assert_array_equal(s["norm.bias"], tree["Encoder/encoder_norm/bias"])
    out = tower.eval()(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, CLASSES) and torch.isfinite(out).all()


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_each_layer_computes_what_flax_computes_with_those_arrays():
    """The layouts are right if our modules give flax's outputs (written here in numpy) on the same input."""
    tree = vmoe_tree(1)
    state = vmoe_to_state(tree, image_tower_config("soft-test-4e", num_classes=CLASSES))
    from lit_softmoe.models.vit import VisionTransformer
    tower = VisionTransformer(image_tower_config("soft-test-4e", num_classes=CLASSES), device="meta")
    tower.load_state_dict(state, assign=True)
    rng = np.random.default_rng(0)
    b0, b1 = "Encoder/encoderblock_0", "Encoder/encoderblock_1"
    with torch.no_grad():
        # nn.Conv on NHWC with an HWIO kernel, VALID, stride = patch; tokens in row-major order.
        img = rng.standard_normal((2, 28, 28, 1)).astype(np.float32)
        patches = img.reshape(2, 4, PATCH, 4, PATCH, 1).transpose(0, 1, 3, 2, 4, 5)  # (b, gh, gw, ph, pw, c)
        flax_tokens = (np.einsum("bhwijc,ijcd->bhwd", patches, tree["embedding/kernel"]).reshape(2, 16, D)
                       + tree["embedding/bias"])
        ours = tower.patch_embed(torch.from_numpy(img).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
        np.testing.assert_allclose(ours.numpy(), flax_tokens, rtol=1e-4, atol=1e-4)
        # DenseGeneral q/k/v: einsum('bmd,dhk->bmhk'); out: einsum('bmhk,hkd->bmd').
        x = rng.standard_normal((2, 16, D)).astype(np.float32)
        qkv = tower.blocks[0].attn.qkv(torch.from_numpy(x)).numpy().reshape(2, 16, 3, HEADS, HD)
        for j, name in enumerate(("query", "key", "value")):
            flax = (np.einsum("bmd,dhk->bmhk", x, tree[f"{b0}/SelfAttention/{name}/kernel"])
                    + tree[f"{b0}/SelfAttention/{name}/bias"])
            np.testing.assert_allclose(qkv[:, :, j], flax, rtol=1e-4, atol=1e-4)
        heads = rng.standard_normal((2, 16, HEADS, HD)).astype(np.float32)
        flax = (np.einsum("bmhk,hkd->bmd", heads, tree[f"{b0}/SelfAttention/out/kernel"])
                + tree[f"{b0}/SelfAttention/out/bias"])
        np.testing.assert_allclose(tower.blocks[0].attn.proj(torch.from_numpy(heads.reshape(2, 16, D))).numpy(), flax,
                                   rtol=1e-4, atol=1e-4)
        # Dense MLP block: x @ kernel + bias, tanh GELU.
        hidden = _gelu_tanh(x @ tree[f"{b0}/Mlp/Dense_0/kernel"] + tree[f"{b0}/Mlp/Dense_0/bias"])
        flax = hidden @ tree[f"{b0}/Mlp/Dense_1/kernel"] + tree[f"{b0}/Mlp/Dense_1/bias"]
        np.testing.assert_allclose(tower.blocks[0].mlp(torch.from_numpy(x)).numpy(), flax, rtol=1e-4, atol=1e-4)
        # Soft MoE block: vmoe's SoftRouter + per-expert MlpBlock, with mu (d, n, p) and the experts'
        # (n, in, out) kernels.
        norm = lambda a, axis: a / np.sqrt((a ** 2).sum(axis, keepdims=True) + 1e-6)  # noqa: E731
        mu = tree[f"{b1}/Moe/Router/mu"]
        logits = np.einsum("gmd,dnp->gmnp", norm(x, -1), norm(mu, 0) * 3.0)
        dispatch = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        combine = np.exp(logits) / np.exp(logits).sum((2, 3), keepdims=True)
        slots = np.einsum("gmnp,gmd->gnpd", dispatch, x)
        w1, bias1 = tree[f"{b1}/Moe/Mlp/Dense_0/kernel"], tree[f"{b1}/Moe/Mlp/Dense_0/bias"]
        w2, bias2 = tree[f"{b1}/Moe/Mlp/Dense_1/kernel"], tree[f"{b1}/Moe/Mlp/Dense_1/bias"]
        hidden = _gelu_tanh(np.einsum("gnpd,ndk->gnpk", slots, w1) + bias1[None, :, None])
        outputs = np.einsum("gnpk,nkd->gnpd", hidden, w2) + bias2[None, :, None]
        flax = np.einsum("gmnp,gnpd->gmd", combine, outputs)
        np.testing.assert_allclose(tower.blocks[1].mlp(torch.from_numpy(x)).numpy(), flax, rtol=1e-4, atol=1e-4)
        # Head: Dense (d → classes).
        feats = rng.standard_normal((2, D)).astype(np.float32)
        np.testing.assert_allclose(tower.head(torch.from_numpy(feats)).numpy(),
                                   feats @ tree["head/kernel"] + tree["head/bias"], rtol=1e-4, atol=1e-4)


def test_missing_unused_and_misshaped_keys_are_named(tmp_path):
    cfg = image_tower_config("soft-test-4e", num_classes=CLASSES)
    tree = vmoe_tree()
    del tree["Encoder/encoderblock_1/Moe/Router/mu"]
    tree["cls"] = np.zeros((1, 1, D), np.float32)  # a class-token tower: our towers pool by GAP
    with pytest.raises(UserError, match=r"missing 1 keys \(e\.g\. Encoder/encoderblock_1/Moe/Router/mu\); "
                                        r"1 keys left unused \(e\.g\. cls\)"):
        vmoe_to_state(tree, cfg)
    # A dense-block tree loaded as a Soft MoE block: its Mlp keys are unused, the Moe keys missing.
    message = r"missing 6 keys .*Moe/Router/mu.*left unused .*encoderblock_1/Mlp/Dense_0/bias"
    with pytest.raises(UserError, match=message):
        vmoe_to_state(vmoe_tree(moe_blocks=()), cfg)
    with pytest.raises(UserError, match=r"^Encoder/encoderblock_1/Moe/Router/mu \(32, 4, 1\) does not fit "
                                        r"blocks\.1\.mlp\.phi \(32, 8, 1\); the checkpoint was trained as another"):
        vmoe_to_state(vmoe_tree(), image_tower_config("soft-test-4e", num_classes=CLASSES, num_experts=8))
    with pytest.raises(UserError, match=r"^embedding/kernel \(7, 7, 1, 32\) does not fit patch_embed\.weight "
                                        r"\(32, 3, 7, 7\) \(→ \(32, 1, 7, 7\) in our layout\)"):
        vmoe_to_state(vmoe_tree(), image_tower_config("soft-test-4e", num_classes=CLASSES, in_channels=3))
    # The tree nested under "params/" (a saved variables dict) loads the same.
    nested = {f"params/{k}": v for k, v in vmoe_tree().items()}
    phi = "blocks.1.mlp.phi"
    assert torch.equal(vmoe_to_state(nested, cfg)[phi], vmoe_to_state(vmoe_tree(), cfg)[phi])


def test_a_sparse_router_tower_is_refused_in_one_line(tmp_path):
    from lit_softmoe.models.convert import load_vmoe_tower
    path = _save(tmp_path, vmoe_tree())
    for name in ("tc-test-4e-k1", "ec-test-4e"):
        with pytest.raises(UserError, match=r"is a (tokens|experts)_choice tower; vmoe's Soft MoE checkpoints"):
            load_vmoe_tower(path, name)


def test_cli_convert_writes_a_loadable_tower(tmp_path, capsys):
    tree = vmoe_tree(2)
    path = _save(tmp_path, tree)
    assert main(["convert", "--from-vmoe", str(path), "--to", "soft-test-4e", "--out", str(tmp_path / "tower")]) == 0
    assert "soft-test-4e" in capsys.readouterr().out
    tower, meta = load_tower(tmp_path / "tower")
    np.testing.assert_array_equal(tower.state_dict()["blocks.1.mlp.experts.w1"].numpy(),
                                  tree["Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel"])
    assert meta["preprocess"] == {"image_size": 28, "mean": [0.5], "std": [0.5]}
    for argv, message in [(["--from-vmoe", str(tmp_path / "none.npz")], "does not exist"),
                          (["--from-vmoe", str(_save(tmp_path, {"x": np.zeros(1)}, "bad.npz"))], "missing"),
                          (["--from-vmoe", str(tmp_path / "tower" / "config.json")], "cannot read")]:
        assert main(["convert", *argv, "--to", "soft-test-4e", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def test_cli_convert_refuses_a_non_empty_out_unless_overwrite(tmp_path, capsys):
    # An unrelated file in --out was deleted without a word.
    path = _save(tmp_path, vmoe_tree(3))
    out = tmp_path / "cvdir"
    out.mkdir()
    (out / "important.txt").write_text("keep me")
    argv = ["convert", "--from-vmoe", str(path), "--to", "soft-test-4e", "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"lit-softmoe convert: error: --out {out} exists and is not empty; pass --overwrite " \
                  "to replace it, or pick another folder\n"
    assert (out / "important.txt").read_text() == "keep me"
    assert main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert main(argv) == 0  # the same conversion again: its own output is rewritten without --overwrite
    assert main([*argv[:3], "--to", "vit-test", "--out", str(out)]) == 2  # another tower there: refused
    assert "exists and is not empty" in capsys.readouterr().err


def test_a_bfloat16_tree_converts_exactly_and_other_files_are_one_line(tmp_path, capsys):
    """JAX trees are often bfloat16: np.savez stores those arrays as 2-byte voids, which ended in a
    torch TypeError traceback; so did a .npy file (np.load returns a bare array) and a tree of strings."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    tree = vmoe_tree(4)
    bf16 = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in tree.items()}
    tower = load_vmoe_tower(_save(tmp_path, bf16, "bf16.npz"), "soft-test-4e")
    for key, ours in (("Encoder/encoderblock_1/Moe/Router/mu", "blocks.1.mlp.phi"),
                      ("Encoder/encoderblock_1/Moe/Router/scale", "blocks.1.mlp.scale"),
                      ("head/bias", "head.bias")):
        np.testing.assert_array_equal(tower.state_dict()[ours].numpy(), bf16[key].astype(np.float32))
    np.save(tmp_path / "one.npy", np.zeros(3, np.float32))
    strings = dict(tree, **{"head/bias": np.array(["a"] * CLASSES)})
    for path, message in [(tmp_path / "one.npy", "holds a single array (.npy)"),
                          (_save(tmp_path, strings, "strings.npz"), "head/bias holds <U1 values, not numbers"),
                          (tmp_path, "is a folder")]:
        assert main(["convert", "--from-vmoe", str(path), "--to", "soft-test-4e", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


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


def test_a_tree_holding_python_objects_is_refused_without_advising_to_unpickle_it(tmp_path, capsys):
    """numpy's error for an object array says `allow_pickle=False`, which relayed read as advice to
    set it True: loading someone else's pickle runs their code."""
    marker = tmp_path / "unpickled"
    tree = dict(vmoe_tree(5), **{"head/bias": np.array([_Touch(marker)], dtype=object)})
    path = tmp_path / "objects.npz"
    np.savez(path, **tree)  # np.savez pickles the object array
    assert main(["convert", "--from-vmoe", str(path), "--to", "soft-test-4e", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == (f"lit-softmoe convert: error: cannot read {path} as .npz (it holds Python objects, which are "
                   "never unpickled); save the tree with np.savez(path, **flat_params) of numeric arrays\n")
    assert "allow_pickle" not in err and "weights_only" not in err
    assert not marker.exists() and not (tmp_path / "x").exists()


class _Touch:
    """An object whose unpickling creates a file: the proof that it was (not) unpickled."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_called_as_a_library_the_messages_name_parameters_not_cli_flags(tmp_path):
    """The CLI passes --to (and --out, --overwrite); a Python caller reads the parameter's name."""
    path = _save(tmp_path, vmoe_tree())
    with pytest.raises(UserError, match=r"give one of those as tower_name$") as err:
        load_vmoe_tower(path, "ec-test-4e")
    assert "--" not in str(err.value)
    with pytest.raises(UserError, match=r"pick the tower_name name with its width") as err:
        vmoe_to_state(vmoe_tree(), image_tower_config("soft-test-4e", num_classes=CLASSES, num_experts=8))
    assert "--" not in str(err.value)
