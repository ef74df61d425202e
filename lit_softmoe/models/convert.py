"""Load a vmoe (JAX/flax) Soft MoE ViT parameter tree into our tower.

The source is the official code of Puigcerver et al., "From Sparse to Soft Mixtures of Experts"
(ICLR 2024): google-research/vmoe, `vmoe/nn/vit_moe.py` (VisionTransformerMoe, EncoderMoe,
EncoderBlock, MlpMoeBlock) and `vmoe/projects/soft_moe/router.py` (SoftRouter). Its parameter
tree, flattened with '/' separators and saved as `.npz` (`np.savez(f, **flat)`), is read here;
the map below lists the names. As big_vision's loaders do, any key left unused or
missing is an error naming it (a silently half-loaded tower is the worst outcome).

Name and layout map (flax Dense kernels are (in, out), nn.Linear weights (out, in)):

    embedding/kernel (p, p, c, d) HWIO            → patch_embed.weight (d, c, p, p) OIHW
    Encoder/posembed_input/pos_embedding (1, m, d) → pos_embed
    Encoder/encoderblock_i/LayerNorm_0, _1         → blocks.i.norm1, norm2 (scale → weight)
      SelfAttention/{query,key,value}/kernel (d, heads, head_dim), bias (heads, head_dim)
                                                   → blocks.i.attn.qkv rows [q; k; v], each (d, d)ᵀ
      SelfAttention/{query,key}_ln/scale (head_dim) → attn.q_norm / k_norm (flax's qk LayerNorm has
                                                     no bias, nor have our towers)
      SelfAttention/out/kernel (heads, head_dim, d) → attn.proj.weight (d, d)ᵀ
      Mlp/Dense_{0,1}/kernel                       → mlp.fc1 / fc2 (dense blocks), transposed
      Moe/Router/mu (d, n, p), scale ()             → mlp.phi, mlp.scale (same layout)
      Moe/Mlp/Dense_0/kernel (n, d, k), bias (n, k) → mlp.experts.w1, b1 (same layout: (in, out)
                                                     per expert)
      Moe/Mlp/Dense_1/kernel (n, k, d), bias (n, d) → mlp.experts.w2, b2
    Encoder/encoder_norm                           → norm
    head/kernel (d, classes), bias                 → head.weight (classes, d), head.bias

Only the released Soft MoE architecture maps: learned position embeddings, GAP (no `cls`), no
`pre_logits` Dense, qk-norm on. flax's LayerNorm eps (1e-6) and tanh GELU are ours too.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import image_tower_config
from lit_softmoe.models.tower_folder import key_problems
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig


def _dense_t(kernel: np.ndarray) -> np.ndarray:
    """flax Dense kernel (in, out) → nn.Linear weight (out, in)."""
    return kernel.T


def _heads_in(kernel: np.ndarray) -> np.ndarray:
    """flax DenseGeneral q/k/v kernel (d, heads, head_dim) → Linear rows (heads·head_dim, d)."""
    return kernel.reshape(kernel.shape[0], -1).T


def _heads_out(kernel: np.ndarray) -> np.ndarray:
    """flax attention `out` kernel (heads, head_dim, d) → Linear weight (d, heads·head_dim)."""
    return kernel.reshape(-1, kernel.shape[-1]).T


def vmoe_names(cfg: ViTConfig) -> dict[str, list[tuple[str, callable]]]:
    """For each tensor of our tower: the vmoe keys it is built from, and how (a missing optional
    source is None). The order is the tower's state-dict order."""
    same = np.asarray
    plan: dict[str, list] = {
        "pos_embed": [("Encoder/posembed_input/pos_embedding", same)],
        # HWIO → OIHW
        "patch_embed.weight": [("embedding/kernel", lambda k: k.transpose(3, 2, 0, 1))],
        "patch_embed.bias": [("embedding/bias", same)],
    }
    for i in range(cfg.depth):
        src, dst = f"Encoder/encoderblock_{i}", f"blocks.{i}"
        att = f"{src}/SelfAttention"
        plan[f"{dst}.norm1.weight"] = [(f"{src}/LayerNorm_0/scale", same)]
        plan[f"{dst}.norm1.bias"] = [(f"{src}/LayerNorm_0/bias", same)]
        plan[f"{dst}.attn.qkv.weight"] = [(f"{att}/{n}/kernel", _heads_in)
                                          for n in ("query", "key", "value")]
        plan[f"{dst}.attn.qkv.bias"] = [(f"{att}/{n}/bias", lambda b: b.reshape(-1))
                                        for n in ("query", "key", "value")]
        if cfg.qk_norm:
            for ours, theirs in (("q_norm", "query_ln"), ("k_norm", "key_ln")):
                plan[f"{dst}.attn.{ours}.weight"] = [(f"{att}/{theirs}/scale", same)]
                # a tower asked for with the biases: flax has none, they start at 0
                if cfg.qk_norm_bias:
                    # '?': optional, else 0
                    plan[f"{dst}.attn.{ours}.bias"] = [(f"{att}/{theirs}/bias?", same)]
        plan[f"{dst}.attn.proj.weight"] = [(f"{att}/out/kernel", _heads_out)]
        plan[f"{dst}.attn.proj.bias"] = [(f"{att}/out/bias", same)]
        plan[f"{dst}.norm2.weight"] = [(f"{src}/LayerNorm_1/scale", same)]
        plan[f"{dst}.norm2.bias"] = [(f"{src}/LayerNorm_1/bias", same)]
        if i in cfg.moe_layers:
            moe = f"{src}/Moe"
            plan[f"{dst}.mlp.phi"] = [(f"{moe}/Router/mu", same)]
            plan[f"{dst}.mlp.scale"] = [(f"{moe}/Router/scale", same)]
            # vmoe vmaps flax's MlpBlock over a leading expert axis: (n, in, out) is already our
            # layout.
            for ours, theirs in (("w1", "Dense_0/kernel"), ("b1", "Dense_0/bias"),
                                 ("w2", "Dense_1/kernel"), ("b2", "Dense_1/bias")):
                plan[f"{dst}.mlp.experts.{ours}"] = [(f"{moe}/Mlp/{theirs}", same)]
        else:
            for ours, theirs in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
                plan[f"{dst}.mlp.{ours}.weight"] = [(f"{src}/Mlp/{theirs}/kernel", _dense_t)]
                plan[f"{dst}.mlp.{ours}.bias"] = [(f"{src}/Mlp/{theirs}/bias", same)]
    plan["norm.weight"] = [("Encoder/encoder_norm/scale", same)]
    plan["norm.bias"] = [("Encoder/encoder_norm/bias", same)]
    if cfg.num_classes:
        plan["head.weight"] = [("head/kernel", _dense_t)]
        plan["head.bias"] = [("head/bias", same)]
    return plan


def _strip_prefix(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Checkpoints saved from a TrainState or a variables dict nest the tree under one of these.
    for prefix in ("params/", "target/", "opt/target/"):
        if arrays and all(k.startswith(prefix) for k in arrays):
            return {k[len(prefix):]: v for k, v in arrays.items()}
    return arrays


def _as_numbers(key: str, array) -> np.ndarray:
    """`array` as a numeric numpy array. JAX trees are often bfloat16, which is no numpy type:
    np.savez stores it as 2-byte voids (ml_dtypes' bfloat16 is a 2-byte void kind too). Its bits are
    the top half of a float32's, so it widens exactly."""
    array = np.asarray(array)
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if array.dtype.kind not in "fiub":
        raise UserError(f"{key} holds {array.dtype} values, not numbers; save the tree's arrays as "
                        "float32 (or bfloat16) with np.savez(path, **flat_params)")
    return array


def vmoe_to_state(arrays: dict[str, np.ndarray], cfg: ViTConfig,
                  tower_setting: str = "tower_name") -> dict[str, torch.Tensor]:
    """A flat vmoe tree ('/'-joined names → arrays) → our state dict for `cfg`. Pure and loud:
    raises UserError naming missing keys, unused keys, or the first array whose shape does not fit;
    its advice calls the choice of tower `tower_setting`, the caller's name for it (the CLI passes
    "--to")."""
    arrays = _strip_prefix(arrays)
    expected = VisionTransformer(cfg, device="meta").state_dict()
    plan = vmoe_names(cfg)
    # the plan covers our tower exactly
    assert set(plan) == set(expected), sorted(set(plan) ^ set(expected))
    state, used, missing = {}, set(), []
    for name, ref in expected.items():
        parts = []
        for key, transform in plan[name]:
            optional = key.endswith("?")
            key = key.rstrip("?")
            if key not in arrays:
                if not optional:
                    missing.append(key)
                continue
            used.add(key)
            parts.append(np.asarray(transform(_as_numbers(key, arrays[key]))))
        if len(parts) < sum(not k.endswith("?") for k, _ in plan[name]):
            continue
        if not parts:  # an optional source that is absent: flax's qk LayerNorm has no bias
            state[name] = torch.zeros(ref.shape)
            continue
        value = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        if tuple(value.shape) != tuple(ref.shape):
            first = plan[name][0][0].rstrip("?")
            source_shape = tuple(_as_numbers(first, arrays[first]).shape)
            relaid = (f" (→ {tuple(value.shape)} in our layout)"
                      if tuple(value.shape) != source_shape else "")
            raise UserError(f"{first} {source_shape} does not fit {name} "
                            f"{tuple(ref.shape)}{relaid}; the checkpoint was trained as another "
                            f"tower: pick the {tower_setting} name with its width, depth, patch, "
                            "image size and number of experts")
        state[name] = torch.from_numpy(np.ascontiguousarray(value)).to(torch.float32)
    unused = sorted(set(arrays) - used)
    problems = key_problems(missing, unused=unused)
    if problems:
        raise UserError(f"the vmoe tree does not fit the tower: {'; '.join(problems)}; use the "
                        f"{tower_setting} tower the checkpoint was trained as (GAP, qk-norm, "
                        "learned position embeddings), or check the keys are flattened with '/'")
    return state


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"{path} {what}; give a .npz of the flattened vmoe parameter tree")
    try:
        loaded = np.load(path, allow_pickle=False)  # no pickles from a user's file
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy: one array, no names to map
            raise UserError(f"{path} holds a single array (.npy), not the named arrays of a "
                            "parameter tree; save the tree with np.savez(path, **flat_params)")
        with loaded as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        # numpy's message for object arrays names allow_pickle: never advise loading a user's
        # pickle.
        reason = ("it holds Python objects, which are never unpickled" if "allow_pickle" in str(err)
                  else err)
        raise UserError(f"cannot read {path} as .npz ({reason}); "
                        "save the tree with np.savez(path, **flat_params) of numeric "
                        "arrays") from None


def load_vmoe_tower(path: str | Path, tower_name: str, tower_setting: str = "tower_name",
                    **overrides) -> VisionTransformer:
    """Build the registered `tower_name` and load a vmoe .npz into it; the class count follows
    the checkpoint's head (0 when it has none), the slots per expert its Router/mu (d, n, p).
    Messages call `tower_name` `tower_setting`, the caller's name for it (the CLI passes "--to")."""
    arrays = _strip_prefix(read_npz(path))
    head = arrays.get("head/kernel")
    overrides.setdefault("num_classes", 0 if head is None else int(head.shape[-1]))
    # vmoe's SoftRouter takes num_slots or derives p from a capacity factor; the registry's towers
    # all have p = 1 (the released configs), and a --to name cannot say otherwise.
    mu = next((v for k, v in arrays.items() if k.endswith("/Moe/Router/mu") and np.ndim(v) == 3),
              None)
    if mu is not None and np.shape(mu)[-1] >= 1:
        overrides.setdefault("slots_per_expert", int(np.shape(mu)[-1]))
    cfg = image_tower_config(tower_name, **overrides)
    if cfg.moe_layers and cfg.moe_type != "soft":
        raise UserError(f"{tower_name} is a {cfg.moe_type} tower; vmoe's Soft MoE checkpoints load "
                        "into soft-* (or dense vit-*) towers: give one of those as "
                        f"{tower_setting}")
    state = vmoe_to_state(arrays, cfg, tower_setting)
    tower = VisionTransformer(cfg, device="meta")
    tower.load_state_dict(state, assign=True)
    return tower


def convert_vmoe_checkpoint(path: str | Path, tower_name: str, out_dir: str | Path,
                           overwrite: bool = False, *, tower_setting: str = "tower_name",
                           out_setting: str = "out_dir", overwrite_setting: str = "overwrite=True",
                           ) -> VisionTransformer:
    """`lit-softmoe convert --from-vmoe`: .npz → tower folder (written atomically).

    A non-empty `out_dir` is refused unless `overwrite`, or it holds this same conversion (a rerun).
    The *_setting names are what messages call those parameters (the CLI passes its flags).
    """
    from lit_softmoe.models.tower_folder import check_tower_out, save_tower
    check_tower_out(out_dir, "converted", {"from": str(path), "tower": tower_name}, overwrite,
                    source=path, out_setting=out_setting, overwrite_setting=overwrite_setting)
    tower = load_vmoe_tower(path, tower_name, tower_setting)
    # vmoe's input pipelines map pixels to [-1, 1] (value_range(-1, 1)): mean = std = 0.5.
    preprocess = {"image_size": tower.cfg.image_size, "mean": [0.5], "std": [0.5]}
    save_tower(out_dir, tower, extra={"preprocess": preprocess,
                                      "converted": {"from": str(path), "format": "vmoe npz",
                                                    "tower": tower_name}})
    return tower
