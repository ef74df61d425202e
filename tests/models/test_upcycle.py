"""lit_softmoe.models.upcycle: sparse upcycling (dense ViT → Soft MoE tower), weight by weight, on the meta
device, from timm checkpoints and through `lit-softmoe upcycle`."""
from __future__ import annotations

import json
import resource
import time

import pytest
import torch
from safetensors.torch import save_file

from cli_errors import one_line_error
from lit_softmoe.cli import main
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower, image_tower_config
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.models.upcycle import fresh_router, target_config, timm_to_ours, upcycle_state, upcycle_tower
from lit_softmoe.nn.soft_moe import SoftMoE

try:
    import timm  # a dependency of open_clip_torch
except ImportError:
    timm = None
needs_timm = pytest.mark.skipif(timm is None, reason="timm is not installed (a dependency of open_clip_torch)")


def _randomized(tower):
    """Every tensor random (norms and biases too), so 'copied unchanged' cannot pass by accident."""
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return tower.eval()


def _dense_test_tower(seed=0):
    torch.manual_seed(seed)
    return _randomized(create_image_tower("vit-test", num_classes=10))


@needs_timm
def test_every_expert_is_the_dense_mlp_phi_is_fresh_and_the_rest_is_unchanged():
    dense = _dense_test_tower()
    moe = upcycle_tower(dense, "soft-test-4e", seed=7)
    assert moe.cfg.moe_layers == (1,) and moe.cfg.num_experts == 4 and moe.cfg.num_classes == 10
    d_state, m_state = dense.state_dict(), moe.state_dict()
    fc1_w, fc1_b = d_state["blocks.1.mlp.fc1.weight"], d_state["blocks.1.mlp.fc1.bias"]  # (64, 32), (64,)
    fc2_w, fc2_b = d_state["blocks.1.mlp.fc2.weight"], d_state["blocks.1.mlp.fc2.bias"]  # (32, 64), (32,)
    for j in range(4):
        assert torch.equal(m_state["blocks.1.mlp.experts.w1"][j], fc1_w.t())
        assert torch.equal(m_state["blocks.1.mlp.experts.b1"][j], fc1_b)
        assert torch.equal(m_state["blocks.1.mlp.experts.w2"][j], fc2_w.t())
        assert torch.equal(m_state["blocks.1.mlp.experts.b2"][j], fc2_b)
    # phi is exactly what SoftMoE's own init draws right after seeding with seed + block index.
    fresh = SoftMoE(32, 4, 64, slots_per_expert=1)
    torch.manual_seed(7 + 1)
    fresh.reset_parameters()
    assert torch.equal(m_state["blocks.1.mlp.phi"], fresh.phi) and m_state["blocks.1.mlp.scale"].item() == 1.0
    # Everything else: the dense tensor, bit for bit.
    moe_only = {f"blocks.1.mlp.{k}" for k in ("phi", "scale", "experts.w1", "experts.b1", "experts.w2", "experts.b2")}
    assert set(m_state) - moe_only == set(d_state) - {k for k in d_state if k.startswith("blocks.1.mlp.")}
    for k in set(m_state) - moe_only:
        assert torch.equal(m_state[k], d_state[k]), k
    # Each expert owns its storage: an optimizer step on one leaves the others alone.
    with torch.no_grad():
        moe.blocks[1].mlp.experts.w1[0].add_(1.0)
    assert torch.equal(moe.blocks[1].mlp.experts.w1[1], fc1_w.t())


@needs_timm
def test_fresh_phi_has_the_init_statistics_and_depends_on_seed_and_block():
    small = create_image_tower("vit-test").state_dict()
    s0, fresh0 = upcycle_state(small, image_tower_config("soft-test-4e", moe_layers=(0, 1)), seed=0)
    s1, _ = upcycle_state(small, image_tower_config("soft-test-4e", moe_layers=(0, 1)), seed=1)
    assert fresh0 == ["blocks.0.mlp.phi", "blocks.0.mlp.scale", "blocks.1.mlp.phi", "blocks.1.mlp.scale"]
    assert not torch.equal(s0["blocks.1.mlp.phi"], s1["blocks.1.mlp.phi"])  # another seed
    assert not torch.equal(s0["blocks.0.mlp.phi"], s0["blocks.1.mlp.phi"])  # another block
    # Statistics of one S/16-128E router (d=384, n=128): truncated lecun-normal, std 1/sqrt(n·d).
    phi, scale = fresh_router(384, 128, 1, seed=3)
    std = 1 / (384 * 128) ** 0.5
    assert phi.shape == (384, 128, 1) and scale.item() == 1.0
    assert abs(phi.std().item() / std - 1) < 0.02 and abs(phi.mean().item()) < 0.02 * std
    assert phi.abs().max().item() <= 2 * std / 0.8796 + 1e-9  # truncated at ±2σ of the untruncated normal


@needs_timm
def test_upcycled_tower_agrees_with_the_dense_one_where_it_must():
    dense = _dense_test_tower(1)
    moe = upcycle_tower(dense, "soft-test-4e", seed=0).eval()
    x = torch.randn(2, 1, 28, 28)
    # (a) Blocks before the first Soft MoE block compute the same thing.
    seen = {}
    hooks = [t.blocks[0].register_forward_hook(lambda m, i, o, t=t: seen.__setitem__(id(t), o)) for t in (dense, moe)]
    with torch.no_grad():
        dense(x), moe(x)
    for h in hooks:
        h.remove()
    assert torch.equal(seen[id(dense)], seen[id(moe)])
    # (b) The Soft MoE block is the dense MLP applied to the slots: y = C · MLP(Dᵀ · x).
    tokens = torch.randn(2, 16, 32)
    dispatch, combine = moe.blocks[1].mlp.routing_weights(tokens)  # (2, 16, 4, 1) each
    dispatch, combine = dispatch.flatten(2), combine.flatten(2)
    expected = combine @ dense.blocks[1].mlp(dispatch.transpose(1, 2) @ tokens)
    with torch.no_grad():
        torch.testing.assert_close(moe.blocks[1].mlp(tokens), expected, rtol=1e-5, atol=1e-5)
        # ... which is NOT the dense MLP per token: Soft MoE mixes tokens (no false identity).
        assert (moe.blocks[1].mlp(tokens) - dense.blocks[1].mlp(tokens)).abs().max() > 1e-2
    # (c) When all tokens are equal (a constant image, no position embeddings) mixing changes
    # nothing, so the whole upcycled tower computes the dense function.
    with torch.no_grad():
        for t in (dense, moe):
            t.pos_embed.zero_()
        constant = torch.full((3, 1, 28, 28), 0.3) * torch.tensor([1.0, -2.0, 0.5]).view(3, 1, 1, 1)
        torch.testing.assert_close(moe(constant), dense(constant), rtol=1e-5, atol=1e-5)


@needs_timm
def test_meta_upcycle_of_huge_towers_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    dense = create_image_tower("vit-h14", device="meta")
    moe = upcycle_tower(dense, "soft-h14-256e", device="meta")
    assert time.perf_counter() - start < 10
    assert all(t.is_meta for t in moe.state_dict().values())
    # 54.1B parameters (the paper's Soft MoE-H/14 with 256 experts, without the JFT head) would be 216 GB in fp32.
    assert sum(p.numel() for p in moe.parameters()) == 54_139_498_256  # qk-norm without biases, as flax
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000


@needs_timm
def test_timm_vit_small_names_map_on_meta():
    with torch.device("meta"):
        timm_vit = timm.create_model("vit_small_patch16_224", pretrained=False)
    state, notes = timm_to_ours(timm_vit.state_dict())
    cfg = target_config(state, "soft-s16-128e")
    assert cfg.num_classes == 1000 and cfg.qk_norm is False  # timm's S/16 has no qk-norm
    moe_state, fresh = upcycle_state(state, cfg, device="meta")
    assert all(t.is_meta for t in moe_state.values())
    assert moe_state["pos_embed"].shape == (1, 196, 384)  # the class token's position dropped
    assert fresh == [f"blocks.{i}.mlp.{k}" for i in range(6, 12) for k in ("phi", "scale")]
    assert any("cls_token dropped" in n for n in notes)


def _tiny_timm(**kwargs):
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                              embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=10, **kwargs)
    return _randomized(model)


def main_ok(argv):
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@needs_timm
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_checkpoint_file_upcycles_tensor_by_tensor(tmp_path, suffix):
    model = _tiny_timm()  # class token, no qk-norm, like vit_small_patch16_224
    timm_state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / f"vit{suffix}"
    if suffix == ".pth":
        torch.save({"state_dict": {f"module.{k}": v for k, v in timm_state.items()}}, path)
    else:
        save_file(timm_state, path)
    info = main_ok(["upcycle", "--from", str(path), "--to", "soft-test-4e", "--out", str(tmp_path / "up")])
    tower, meta = load_tower(tmp_path / "up")
    s = tower.state_dict()
    assert tower.cfg.qk_norm is False and tower.cfg.num_classes == 10
    assert torch.equal(s["patch_embed.weight"], timm_state["patch_embed.proj.weight"])
    assert torch.equal(s["pos_embed"], timm_state["pos_embed"][:, 1:])
    for k in ("blocks.0.attn.qkv.weight", "blocks.1.attn.proj.bias", "blocks.1.norm2.weight", "norm.bias",
              "head.weight", "blocks.0.mlp.fc2.weight"):
        assert torch.equal(s[k], timm_state[k]), k
    assert torch.equal(s["blocks.1.mlp.experts.w1"][3], timm_state["blocks.1.mlp.fc1.weight"].t())
    # Fresh: the router only (cls_token and its position are dropped, documented in the notes).
    assert meta["upcycled"]["fresh"] == ["blocks.1.mlp.phi", "blocks.1.mlp.scale"]
    assert meta["preprocess"] == {"mean": [0.5], "std": [0.5], "image_size": 28}
    assert "cls_token" in info


@needs_timm
def test_timm_gap_qk_norm_tower_upcycles_to_the_same_function_on_uniform_tokens():
    # A timm ViT built like ours (qk-norm, GAP with the norm before pooling, tanh GELU): every part maps,
    # so on equal tokens (see above) the upcycled tower equals timm's model.
    model = _tiny_timm(class_token=False, global_pool="avg", fc_norm=False, qk_norm=True, act_layer="gelu_tanh")
    state, notes = timm_to_ours(model.state_dict())
    cfg = target_config(state, "soft-test-4e")
    assert cfg.qk_norm is True
    moe_state, _ = upcycle_state(state, cfg)
    from lit_softmoe.models.vit import VisionTransformer
    tower = VisionTransformer(cfg, device="meta")
    tower.load_state_dict(moe_state, assign=True)
    tower.eval()
    with torch.no_grad():
        model.pos_embed.zero_(), tower.pos_embed.zero_()
        constant = torch.full((2, 1, 28, 28), 0.7) * torch.tensor([1.0, -1.0]).view(2, 1, 1, 1)
        torch.testing.assert_close(tower(constant), model(constant), rtol=1e-5, atol=1e-5)
        # and the dense blocks before the Soft MoE block agree on any image
        x = torch.randn(2, 1, 28, 28)
        ours = tower.blocks[0](tower.patch_embed(x).flatten(2).transpose(1, 2))
        theirs = model.blocks[0](model.patch_embed(x))
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_timm
def test_mismatched_shapes_name_the_first_tensor_and_a_fix():
    dense = create_image_tower("vit-s16", device="meta")
    with pytest.raises(UserError, match=r"^pos_embed has shape \(1, 196, 384\) but the target's "
                                        r"pos_embed needs \(1, 196, 768\).*fit this checkpoint: soft-s16-128e$"):
        upcycle_tower(dense, "soft-b16-128e", device="meta")
    with pytest.raises(UserError, match="no tensor for .* target tensors"):
        state = {k: v for k, v in create_image_tower("vit-test").state_dict().items() if k != "norm.bias"}
        upcycle_state(state, image_tower_config("soft-test-4e"))
    with pytest.raises(UserError, match=r"no place in the target \(e\.g\. extra\.weight\)"):
        state = dict(create_image_tower("vit-test").state_dict(), **{"extra.weight": torch.zeros(1)})
        upcycle_state(state, image_tower_config("soft-test-4e"))


@needs_timm
def test_cli_round_trip_keeps_preprocess_and_names_errors(tmp_path, capsys):
    dense = _dense_test_tower(2)
    preprocess = {"image_size": 28, "mean": [0.28], "std": [0.35]}
    save_tower(tmp_path / "dense", dense, extra={"preprocess": preprocess, "classnames": list("abcdefghij")})
    printed = main_ok(["upcycle", "--from", str(tmp_path / "dense"), "--to", "soft-test-4e",
                       "--out", str(tmp_path / "moe"), "--seed", "5"])
    assert "soft-test-4e" in printed and "blocks.1.mlp.phi" in printed
    tower, meta = load_tower(tmp_path / "moe")
    assert meta["preprocess"] == preprocess and meta["classnames"] == list("abcdefghij")
    assert meta["upcycled"]["seed"] == 5 and meta["tower"]["moe_layers"] == [1]
    in_memory = upcycle_tower(dense, "soft-test-4e", seed=5)
    for k, v in in_memory.state_dict().items():
        assert torch.equal(tower.state_dict()[k], v), k
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # atomic: no leftovers

    capsys.readouterr()
    assert main(["upcycle", "--from", str(tmp_path / "dense"), "--to", "soft-s16-128e",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pos_embed has shape (1, 16, 32)" in err and "soft-test-4e" in err
    assert main(["upcycle", "--from", str(tmp_path / "nope"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["upcycle", "--from", str(tmp_path / "dense"), "--to", "soft-tset-4e",
                 "--out", str(tmp_path / "x")]) == 2
    assert "did you mean soft-test-4e" in capsys.readouterr().err
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    assert main(["upcycle", "--from", str(tmp_path / "junk.pth"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "x")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["upcycle", "--from", str(tmp_path / "dense"), "--to", "vit-test", "--out", str(tmp_path / "x")]) == 2
    assert "vit-test is a dense tower; upcycling makes Soft MoE towers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    json.loads((tmp_path / "moe" / "config.json").read_text())


@needs_timm
def test_qk_norm_follows_the_dense_tower_unless_asked():
    torch.manual_seed(3)
    dense = _randomized(create_image_tower("vit-test", qk_norm=False))
    assert upcycle_tower(dense, "soft-test-4e").cfg.qk_norm is False  # attention stays exact
    moe = upcycle_tower(dense, "soft-test-4e", qk_norm=True)  # the registered architecture, fresh qk-norm
    assert moe.cfg.qk_norm is True
    for i in range(2):
        assert torch.equal(moe.blocks[i].attn.q_norm.weight, torch.ones(16))
        assert moe.blocks[i].attn.k_norm.bias is None  # flax's qk LayerNorm: a scale, no bias
        assert torch.equal(moe.blocks[i].attn.qkv.weight, dense.blocks[i].attn.qkv.weight)


@needs_timm
def test_a_non_empty_out_is_refused_unless_overwrite_and_a_rerun_rewrites(tmp_path, capsys):
    # --out pointed at a pretraining run deleted its checkpoints and metrics.
    save_tower(tmp_path / "dense", _dense_test_tower(4), extra={"preprocess": {"image_size": 28}})
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000008").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    save_tower(run / "tower", _dense_test_tower(5))
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    argv = ["upcycle", "--from", str(tmp_path / "dense"), "--to", "soft-test-4e"]
    for out in (run, run / "tower"):  # a run folder, and a tower this command did not write
        capsys.readouterr()
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"lit-softmoe upcycle: error: --out {out} exists and is not empty; pass --overwrite " \
                      "to replace it, or pick another folder\n"
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing deleted
    # Rerunning the same upcycle into its own output rewrites it; another seed there needs --overwrite.
    main_ok([*argv, "--out", str(tmp_path / "up")])
    main_ok([*argv, "--out", str(tmp_path / "up")])
    assert main([*argv, "--out", str(tmp_path / "up"), "--seed", "1"]) == 2
    main_ok([*argv, "--out", str(tmp_path / "up"), "--seed", "1", "--overwrite"])
    assert json.loads((tmp_path / "up" / "config.json").read_text())["upcycled"]["seed"] == 1
    main_ok([*argv, "--out", str(run / "tower"), "--overwrite"])
    assert load_tower(run / "tower")[0].cfg.moe_layers == (1,) and (run / "metrics.jsonl").is_file()
    # Never the input itself, not even with --overwrite.
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path), "--overwrite"]) == 2
    assert "holds the input" in capsys.readouterr().err and (tmp_path / "dense" / "model.safetensors").is_file()
    # Nor a folder inside it: the next save of the input tower would replace its folder, and this with it.
    assert main([*argv, "--out", str(tmp_path / "dense" / "up")]) == 2
    assert capsys.readouterr().err == (f"lit-softmoe upcycle: error: --out {tmp_path / 'dense' / 'up'} is inside "
                                       f"the input tower folder {tmp_path / 'dense'}; pick a folder outside it\n")
    assert not (tmp_path / "dense" / "up").exists()


@needs_timm
def test_a_tower_that_is_already_soft_moe_is_refused(tmp_path, capsys):
    # It was "upcycled" with an empty list of fresh tensors.
    torch.manual_seed(0)
    save_tower(tmp_path / "soft", create_image_tower("soft-test-4e"))
    assert main(["upcycle", "--from", str(tmp_path / "soft"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "up")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is already a Soft MoE tower (experts in blocks [1])" in err
    assert "give the dense vit-* tower folder" in err and not (tmp_path / "up").exists()
    with pytest.raises(UserError, match="already a Soft MoE tower"):
        upcycle_tower(create_image_tower("soft-test-4e"), "soft-test-4e")


def _timm_named_state(tower):
    """Our dense tower's tensors under timm's names, with a class token and its position, as timm saves them."""
    state = {}
    for key, value in tower.state_dict().items():
        if key.startswith("patch_embed."):
            key = "patch_embed.proj." + key[len("patch_embed."):]
        if key == "pos_embed":
            value = torch.cat([torch.zeros(1, 1, value.shape[2]), value], dim=1)
        state[key] = value.contiguous()
    state["cls_token"] = torch.zeros(1, 1, tower.cfg.width)
    return state


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_checkpoint_upcycles_into_a_float32_tower_that_runs(tmp_path, capsys, dtype):
    """The tower kept the checkpoint's dtype, so embed, inspect-routing and LiT (float32 pixels) all
    ended in 'mat1 and mat2 must have the same dtype' tracebacks."""
    torch.manual_seed(0)
    dense = create_image_tower("vit-test", num_classes=10).eval()
    half = {k: v.to(dtype) for k, v in _timm_named_state(dense).items()}
    save_file(half, tmp_path / "vit.safetensors")
    assert main(["upcycle", "--from", str(tmp_path / "vit.safetensors"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "up")]) == 0
    tower, _ = load_tower(tmp_path / "up")
    assert {p.dtype for p in tower.state_dict().values()} == {torch.float32}
    # Copied tensors are the half values widened exactly; the fresh router is drawn in float32.
    assert torch.equal(tower.state_dict()["blocks.0.attn.qkv.weight"], half["blocks.0.attn.qkv.weight"].float())
    assert torch.equal(tower.state_dict()["blocks.1.mlp.experts.w1"][2], half["blocks.1.mlp.fc1.weight"].float().t())
    with torch.no_grad():
        assert tower.eval()(torch.randn(2, 1, 28, 28)).shape == (2, 10)


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


def test_upcycling_a_qk_norm_tower_with_qk_norm_off_names_the_mismatch():
    # It said "not a plain ViT of this family" about the dense tower's own q_norm/k_norm weights.
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.upcycle import upcycle_tower
    dense = create_image_tower("vit-test")  # qk-norm on, as registered
    with pytest.raises(UserError) as info:
        upcycle_tower(dense, "soft-test-4e", qk_norm=False)
    assert str(info.value).startswith("the dense tower has qk-norm (LayerNorm on queries and keys) and "
                                      "qk_norm=False would drop its trained norms")
    assert "leave qk_norm unset" in str(info.value)
    assert upcycle_tower(dense, "soft-test-4e").cfg.qk_norm  # unset: follows the dense tower
    plain = create_image_tower("vit-test", qk_norm=False)
    assert not upcycle_tower(plain, "soft-test-4e", qk_norm=False).cfg.qk_norm  # no qk-norm on either side


@pytest.fixture
def dense_tower_dir(tmp_path):
    from lit_softmoe.models.tower_folder import save_tower
    return save_tower(tmp_path / "dense", create_image_tower("vit-test"))


def test_upcycle_seed_out_of_range_is_one_line(tmp_path, capsys, dense_tower_dir):
    # It was torch's "Overflow when unpacking long long" traceback, after reading the checkpoint.
    line = one_line_error(capsys, ["upcycle", "--from", str(dense_tower_dir), "--to", "soft-test-4e",
                                    "--out", str(tmp_path / "up"), "--seed", str(2**64)])
    assert line == (f"lit-softmoe upcycle: error: --seed {2**64} is out of range; give an integer such as 0 "
                    "(|seed| < 2**63)")
    assert not (tmp_path / "up").exists()
    assert main(["upcycle", "--from", str(dense_tower_dir), "--to", "soft-test-4e", "--out", str(tmp_path / "up"),
                 "--seed", "-1"]) == 0  # a negative seed in range still works


@pytest.mark.parametrize("content, reason", [
    (b"\x89PNG\r\n\x1a\n" + bytes(32), "UnpicklingError: not a pickle of tensors only"),
    (b"", "EOFError: empty or truncated file")])
def test_upcycle_from_a_file_torch_cannot_read_is_one_line(tmp_path, capsys, content, reason):
    # torch's weights-only error ran over several lines (and suggested weights_only=False).
    source = tmp_path / "dense.pth"
    source.write_bytes(content)
    line = one_line_error(capsys, ["upcycle", "--from", str(source), "--to", "soft-test-4e",
                                    "--out", str(tmp_path / "up")])
    assert line == (f"lit-softmoe upcycle: error: cannot read {source} as a state dict ({reason}); "
                    "give a .safetensors file or a .pth/.bin holding only tensors")


def test_called_as_a_library_the_messages_name_parameters_not_cli_flags(tmp_path, dense_tower_dir):
    """The CLI passes its flags (--from, --out, --seed, --overwrite); a Python caller reads its own names."""
    from lit_softmoe.models.tower_folder import check_tower_out
    from lit_softmoe.models.upcycle import read_dense_checkpoint, upcycle_checkpoint
    with pytest.raises(UserError) as err:
        upcycle_checkpoint(dense_tower_dir, "soft-test-4e", tmp_path / "up", seed=2**64)
    assert str(err.value).startswith(f"seed {2**64} is out of range") and "--" not in str(err.value)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError) as err:
        check_tower_out(tmp_path / "busy", "upcycled", {}, overwrite=False, source=dense_tower_dir)
    assert str(err.value) == (f"out_dir {tmp_path / 'busy'} exists and is not empty; pass overwrite=True to "
                              "replace it, or pick another folder")
    save_tower(tmp_path / "soft", create_image_tower("soft-test-4e"))
    with pytest.raises(UserError, match=rf"^path {tmp_path / 'soft'} is already a Soft MoE tower") as err:
        read_dense_checkpoint(tmp_path / "soft")
    assert "--" not in str(err.value)
