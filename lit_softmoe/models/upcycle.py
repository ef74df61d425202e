"""Sparse upcycling: a dense ViT checkpoint becomes a Soft MoE tower.

Komatsuzaki et al., "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints"
(ICLR 2023), applied to Soft MoE (Puigcerver et al., "From Sparse to Soft Mixtures of Experts",
ICLR 2024: no Soft MoE checkpoint was released with it, so upcycling a dense one is the other way
to get a tower besides pretraining it).

What is copied and what is fresh, per tensor of the target tower:
- every expert of a Soft MoE block starts as a copy of that block's dense MLP
  (`w1[j] = fc1.weightᵀ`, `b1[j] = fc1.bias`, `w2[j] = fc2.weightᵀ`, `b2[j] = fc2.bias`);
- `phi` and `scale` of each Soft MoE block are fresh, drawn by `SoftMoE.reset_parameters` itself
  right after `torch.manual_seed(seed + block index)` (truncated lecun-normal phi, scale = 1);
- everything else (patch embedding, position embeddings, attention, qk-norm, norms, head) is the
  dense tensor unchanged. A source that already has MoE blocks is refused (`_refuse_moe_source`):
  it has no dense MLP there to copy into the experts.

The dense checkpoint is one of our tower folders or a timm `vit_*` state dict (.safetensors, or
.pth/.pt/.bin read with `torch.load(weights_only=True)`). A timm checkpoint is recognized by its
telltale keys and renamed to ours, as timm's `checkpoint_filter_fn`
(timm/models/vision_transformer.py) recognizes and rewrites foreign checkpoints. What cannot map
from timm (see `timm_to_ours`): the class token (our towers pool by global average, so it and its
position embedding are dropped), LayerScale, register tokens and pre-norms (refused). timm's GELU is
the exact erf form and ours the tanh form (they differ by at most 5e-4 per activation), so even the
dense part is not the same function; weights map exactly, the function is recovered by fine-tuning,
as in sparse upcycling.

Everything works on the meta device: `upcycle_tower(dense, "soft-h14-256e", device="meta")` maps
a 54B-parameter tower's names and shapes without allocating any weight.
"""
from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import image_tower_config, list_image_towers
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig
from lit_softmoe.nn.soft_moe import SoftMoE

_EXPERT_KEY = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(w1|b1|w2|b2)")
_ROUTER_KEY = re.compile(r"blocks\.(\d+)\.mlp\.(phi|scale)")
# expert weight → (dense key suffix, transpose?): nn.Linear stores (out, in), the experts (in, out).
_EXPERT_SOURCE = {"w1": ("fc1.weight", True), "b1": ("fc1.bias", False),
                  "w2": ("fc2.weight", True), "b2": ("fc2.bias", False)}


# ---- reading a dense checkpoint -----------------------------------------------------------------

def is_timm_vit_state(state: dict) -> bool:
    """timm's ViT names its patch embedding `patch_embed.proj` and fuses q, k, v into `attn.qkv`."""
    return "patch_embed.proj.weight" in state and any(k.endswith(".attn.qkv.weight") for k in state)


def _strip_wrappers(state: dict) -> dict:
    """Drop the prefixes that timm's own loader strips (DDP's `module.`, open_clip's
    `visual.trunk.`)."""
    for prefix in ("module.", "visual.trunk."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def timm_to_ours(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename a timm `VisionTransformer` state dict to our tower's names; returns (state, notes).

    Same layout on both sides (so no transposes): Linear (out, in), conv OIHW, qkv rows ordered
    [q; k; v] with heads inside each, patches in row-major order. The notes say what did not map.
    """
    state = _strip_wrappers(state)
    refused = [k for k in state
               if re.search(r"(^|\.)(ls[12]\.|reg_token|norm_pre\.|attn_pool\.)", k)]
    if refused:
        raise UserError(f"the timm checkpoint has parts our towers do not have ({refused[0]}; "
                        "LayerScale, register tokens, pre-norm and attention pooling cannot be "
                        "upcycled); use a plain timm vit_* checkpoint such as "
                        "vit_small_patch16_224")
    out, notes = {}, []
    for key, value in state.items():
        if key.startswith("patch_embed.proj."):
            out["patch_embed." + key[len("patch_embed.proj."):]] = value
        elif key == "cls_token":
            notes.append("cls_token dropped: our towers pool by global average (no class token)")
        elif key == "pos_embed":
            # (1, 1 + m, d) when the class token has a position of its own: keep the m patch
            # positions.
            grid = math.isqrt(value.shape[1] - 1)
            if "cls_token" in state and grid * grid == value.shape[1] - 1:
                value = value[:, 1:]
                notes.append("pos_embed of the class token dropped")
            out["pos_embed"] = value
        elif key.startswith("fc_norm."):
            # timm's GAP variants normalize after pooling, ours before: the closest place is our
            # final norm.
            out["norm." + key[len("fc_norm."):]] = value
            notes.append("fc_norm (after pooling in timm) became the final norm (before pooling in "
                         "ours)")
        else:
            # blocks.*, norm.*, head.* share our names; anything else is reported unused
            out[key] = value
    notes.append("timm's MLP uses the exact (erf) GELU, ours the tanh form")
    return out, notes


def read_dense_checkpoint(path: str | Path, path_setting: str = "path",
                          ) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A tower folder or a timm ViT state-dict file → (state in our names, extra config, notes).

    For a tower folder, extra also holds its `num_heads` (no tensor shape shows it without qk-norm).
    A Soft MoE tower is refused naming `path` as `path_setting`, the caller's name for it."""
    path = Path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        from lit_softmoe.models.tower_folder import TOWER_CONFIG, TOWER_WEIGHTS
        if not (path / TOWER_WEIGHTS).is_file() or not (path / TOWER_CONFIG).is_file():
            raise UserError(f"{path} is not a tower checkpoint (needs {TOWER_CONFIG} and "
                            f"{TOWER_WEIGHTS}); give a tower folder or a timm vit_* "
                            ".safetensors/.pth file")
        try:
            meta = json.loads((path / TOWER_CONFIG).read_text())
        except ValueError as err:
            raise UserError(f"{path / TOWER_CONFIG} is not valid JSON ({err}); "
                            "save the tower again") from None
        _refuse_moe_source(f"{path_setting} {path}",
                           (meta.get("tower") or {}) if isinstance(meta, dict) else {})
        extra = {k: meta[k] for k in ("preprocess", "classnames") if k in meta}
        extra["num_heads"] = ((meta.get("tower") or {}).get("num_heads") if isinstance(meta, dict)
                              else None)
        return load_file(path / TOWER_WEIGHTS), extra, []
    if not path.is_file():
        raise UserError(f"{path} does not exist; give a tower folder or a timm vit_* "
                        ".safetensors/.pth file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            # weights_only: a checkpoint handed to us is never unpickled into arbitrary objects.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's to fix
        # torch's weights-only message runs over several lines and suggests weights_only=False: keep
        # one line.
        reason = ("not a pickle of tensors only" if isinstance(err, pickle.UnpicklingError) else
                  next((line for line in str(err).splitlines() if line.strip()),
                       "empty or truncated file"))
        raise UserError(f"cannot read {path} as a state dict ({type(err).__name__}: {reason}); "
                        "give a .safetensors file or a .pth/.bin holding only tensors") from None
    for wrapper in ("state_dict", "model"):  # training checkpoints nest the weights
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} holds no flat state dict of tensors; save `model.state_dict()`")
    state = _strip_wrappers(state)
    if not is_timm_vit_state(state):
        raise UserError(f"{path} is not a timm ViT state dict (no patch_embed.proj.weight / "
                        "attn.qkv keys); give a timm vit_* checkpoint or one of our tower folders")
    state, notes = timm_to_ours(state)
    # timm's vit_* weights (augreg and the original) take [-1, 1] inputs: mean = std = 0.5.
    return state, {"preprocess": {"mean": [0.5], "std": [0.5]}}, notes


def _refuse_moe_source(what: str, tower_cfg: dict) -> None:
    """Upcycling copies each dense MLP into the experts: a tower that has experts already has no
    dense MLP there, and "upcycling" it would only report nothing new."""
    if tower_cfg.get("moe_layers"):
        kind = {"soft": "Soft MoE"}.get(tower_cfg.get("moe_type", "soft"),
                                        f"{tower_cfg.get('moe_type')} MoE")
        raise UserError(f"{what} is already a {kind} tower (experts in blocks "
                        f"{list(tower_cfg['moe_layers'])}); give the dense vit-* tower folder or "
                        "timm vit_* weights to upcycle, or train this tower as it is")


# ---- mapping ------------------------------------------------------------------------------------

def fresh_router(dim: int, num_experts: int, slots_per_expert: int, seed: int,
                 dtype=torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi, scale) as `SoftMoE.reset_parameters` draws them right after `torch.manual_seed(seed)`;
    on meta, empty meta tensors."""
    if device is not None and torch.device(device).type == "meta":
        return (torch.empty(dim, num_experts, slots_per_expert, dtype=dtype, device="meta"),
                torch.ones((), dtype=dtype, device="meta"))
    # The layer's own init, run on a layer whose experts stay on meta: reset_parameters skips meta
    # experts, so only phi (d, n, p) and scale are materialized and drawn.
    layer = SoftMoE(dim, num_experts, 1, slots_per_expert=slots_per_expert, device="meta")
    layer.phi = torch.nn.Parameter(torch.empty(dim, num_experts, slots_per_expert))
    layer.scale = torch.nn.Parameter(torch.empty(()))
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        layer.reset_parameters()
    return (layer.phi.detach().to(dtype=dtype, device=device),
            layer.scale.detach().to(dtype=dtype, device=device))


def _dense_signature(state: dict[str, torch.Tensor]) -> dict | None:
    """The shape-fixing numbers of a dense checkpoint (our names), to suggest matching targets."""
    try:
        patch = state["patch_embed.weight"]  # (d, c, p, p)
        depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
        fc1 = next(v for k, v in state.items() if k.endswith(".mlp.fc1.weight"))  # (mlp, d)
        return dict(width=patch.shape[0], in_channels=patch.shape[1], patch_size=patch.shape[2],
                    num_patches=state["pos_embed"].shape[1], depth=depth, mlp_dim=fc1.shape[0])
    except (KeyError, StopIteration, ValueError, IndexError):
        return None


def _matching_targets(state: dict[str, torch.Tensor]) -> list[str]:
    sig = _dense_signature(state)
    if sig is None:
        return []
    names = []
    for name in list_image_towers():
        cfg = image_tower_config(name)
        same_shape = all(getattr(cfg, k) == v for k, v in sig.items() if k != "num_patches")
        if (cfg.moe_layers and cfg.moe_type == "soft" and same_shape
                and cfg.num_patches == sig["num_patches"]):
            names.append(name)
    return names


def _mismatch(source_key: str, got: tuple, target_key: str, want: tuple, state) -> UserError:
    matches = _matching_targets(state)
    fix = (f"targets that fit this checkpoint: {', '.join(matches)}" if matches else
           "choose a Soft MoE target with the dense tower's width, depth, MLP width, patch and "
           "image size (e.g. vit-s16 → soft-s16-128e; `lit-softmoe models` lists them)")
    return UserError(f"{source_key} has shape {got} but the target's {target_key} needs {want}: "
                     f"the dense checkpoint is not the dense counterpart of the target; {fix}")


def upcycle_state(dense_state: dict[str, torch.Tensor], target_cfg: ViTConfig, seed: int = 0,
                  device=None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map a dense state dict (our names) onto `target_cfg`; returns (target state, fresh tensor
    names).

    Pure: reads only the dense tensors' shapes and values. Works on meta tensors (nothing is
    allocated: expert copies are `expand` views, made contiguous only for real tensors so that an
    optimizer's in-place update of one expert never writes into the others). `device` places the
    result (default: where the dense tensors are). Raises UserError naming the first tensor whose
    shape does not fit, then any target tensor with no source, then any source tensor left unused.
    """
    expected = VisionTransformer(target_cfg, device="meta").state_dict()  # names and shapes only
    some = next(iter(dense_state.values()))
    device = torch.device(device) if device is not None else some.device
    dtype = dense_state.get("patch_embed.weight", some).dtype
    state, fresh, used, missing = {}, [], set(), []
    for name, ref in expected.items():
        want = tuple(ref.shape)
        expert, router = _EXPERT_KEY.fullmatch(name), _ROUTER_KEY.fullmatch(name)
        if name in dense_state:  # unchanged; also a block that is a Soft MoE on both sides
            got = tuple(dense_state[name].shape)
            if got != want:
                raise _mismatch(name, got, name, want, dense_state)
            state[name] = dense_state[name].to(device)
            used.add(name)
        elif expert:
            block, which = expert.groups()
            suffix, transpose = _EXPERT_SOURCE[which]
            source = f"blocks.{block}.mlp.{suffix}"
            if source not in dense_state:
                missing.append(f"{name} (from {source})")
                continue
            weight = dense_state[source].to(device)
            weight = weight.t() if transpose else weight  # fc1.weight (k, d) → (d, k), as w1[j]
            if tuple(weight.shape) != want[1:]:
                raise _mismatch(source, tuple(dense_state[source].shape), name, want, dense_state)
            copies = weight.unsqueeze(0).expand(want)  # (n, …): one copy per expert
            state[name] = copies if device.type == "meta" else copies.contiguous()
            used.add(source)
        elif router:
            block, which = int(router.group(1)), router.group(2)
            if which == "phi":
                d, n, p = want
                state[name], state[f"blocks.{block}.mlp.scale"] = fresh_router(
                    d, n, p, seed + block, dtype=dtype, device=device)
                fresh += [name, f"blocks.{block}.mlp.scale"]
        else:
            missing.append(name)
    if missing:
        raise UserError(f"the dense checkpoint has no tensor for {len(missing)} target tensors "
                        f"(e.g. {', '.join(missing[:3])}); it is not a ViT of this family, or the "
                        "target has parts (qk-norm, a head) that the checkpoint lacks")
    unused = [k for k in dense_state if k not in used]
    if unused:
        raise UserError(f"{len(unused)} tensors of the dense checkpoint have no place in the "
                        f"target (e.g. {', '.join(unused[:3])}); the checkpoint is not a plain ViT "
                        "of this family")
    return state, fresh


def target_config(dense_state: dict[str, torch.Tensor], target_name: str,
                  qk_norm: bool | None = None, dense_num_heads: int | None = None) -> ViTConfig:
    """The registered `target_name`, with the head and (by default) qk-norm taken from the
    checkpoint.

    The head is copied, so its class count follows the dense tower. qk-norm follows the dense
    tower too unless `qk_norm` says otherwise: a fresh qk-norm would change every pretrained
    attention map, while leaving it out keeps the attention exact. `dense_num_heads`, where known
    (our tower folders record it; a timm state dict does not), must be the target's: without qk-norm
    no tensor shape depends on it, and the same weights split into other heads compute another
    attention.
    """
    base = image_tower_config(target_name)
    if not base.moe_layers or getattr(base, "moe_type", "soft") != "soft":
        kind = getattr(base, "moe_type", "soft") if base.moe_layers else "dense"
        raise UserError(f"{target_name} is a {kind} tower; upcycling makes Soft MoE towers, so "
                        "give a soft-* target (`lit-softmoe models` lists them)")
    patch = dense_state.get("patch_embed.weight")
    # else a shape error names the misfit
    same_width = patch is not None and patch.shape[0] == base.width
    if dense_num_heads is not None and dense_num_heads != base.num_heads and same_width:
        raise UserError(f"the dense tower has {dense_num_heads} attention heads and {target_name} "
                        f"has {base.num_heads}: its attention weights would be split into other "
                        "heads and compute another function; upcycle a dense tower with "
                        f"{base.num_heads} heads into {target_name}")
    head = dense_state.get("head.weight")
    has_qk_norm = any(k.endswith(".attn.q_norm.weight") for k in dense_state)
    if qk_norm is False and has_qk_norm:
        raise UserError("the dense tower has qk-norm (LayerNorm on queries and keys) and "
                        "qk_norm=False would drop its trained norms, changing every attention map; "
                        "leave qk_norm unset to follow the dense tower (or pass qk_norm=True)")
    # A dense qk-norm with biases (timm's, or a tower built with qk_norm_bias) keeps them.
    has_qk_bias = any(k.endswith(".attn.q_norm.bias") for k in dense_state)
    return image_tower_config(target_name, num_classes=0 if head is None else head.shape[0],
                              qk_norm=has_qk_norm if qk_norm is None else qk_norm,
                              qk_norm_bias=has_qk_bias)


def upcycle_tower(dense_tower: VisionTransformer, target_name: str, seed: int = 0, device=None,
                  qk_norm: bool | None = None) -> VisionTransformer:
    """Upcycle a dense tower (in memory) into the registered `target_name`.

    `device="meta"` maps names and shapes only (the dense tower may be on meta too): this is how a
    vit-h14 → soft-h14-256e upcycle is checked without 216 GB of fp32 weights.
    """
    _refuse_moe_source("the tower to upcycle", dense_tower.cfg.to_dict())
    dense_state = dense_tower.state_dict()
    if device is not None and torch.device(device).type == "meta":
        dense_state = {k: v.to("meta") for k, v in dense_state.items()}
    cfg = target_config(dense_state, target_name, qk_norm, dense_tower.cfg.num_heads)
    if qk_norm and not dense_tower.cfg.qk_norm:
        dense_state = dict(dense_state, **_fresh_qk_norms(cfg, dense_state))
    state, _ = upcycle_state(dense_state, cfg, seed=seed, device=device)
    tower = VisionTransformer(cfg, device="meta")
    tower.load_state_dict(state, assign=True)
    return tower


def _fresh_qk_norms(cfg: ViTConfig, dense_state) -> dict[str, torch.Tensor]:
    """LayerNorm's own init (weight 1, bias 0) for a qk-norm the dense tower does not have."""
    some = dense_state["patch_embed.weight"]
    head_dim = cfg.width // cfg.num_heads
    out = {}
    for i in range(cfg.depth):
        for which in ("q_norm", "k_norm"):
            out[f"blocks.{i}.attn.{which}.weight"] = torch.ones(head_dim, dtype=some.dtype,
                                                                device=some.device)
            if cfg.qk_norm_bias:
                out[f"blocks.{i}.attn.{which}.bias"] = torch.zeros(head_dim, dtype=some.dtype,
                                                                   device=some.device)
    return out


def upcycle_checkpoint(source: str | Path, target_name: str, out_dir: str | Path, seed: int = 0,
                       qk_norm: bool | None = None, overwrite: bool = False, *,
                       source_setting: str = "source", out_setting: str = "out_dir",
                       seed_setting: str = "seed",
                       overwrite_setting: str = "overwrite=True") -> dict:
    """Read a dense checkpoint, upcycle it into `target_name`, write a tower folder atomically.

    The dense tower's `preprocess` (and class names) are kept in config.json; an `upcycled` entry
    records the source, the seed, the fresh tensors and what did not map. Returns that entry.
    A non-empty `out_dir` is refused unless `overwrite`, or it holds this same upcycle (a rerun).
    The *_setting names are what messages call those parameters (the CLI passes its flags).
    """
    from lit_softmoe.models.tower_folder import check_tower_out, save_tower
    # block b's router is drawn with seed + b: torch takes [-2**63, 2**64)
    if not -2**63 <= seed < 2**63:
        raise UserError(f"{seed_setting} {seed} is out of range; give an integer such as 0 "
                        "(|seed| < 2**63)")
    check_tower_out(out_dir, "upcycled", {"from": str(source), "target": target_name, "seed": seed},
                    overwrite, source=source, out_setting=out_setting,
                    overwrite_setting=overwrite_setting)
    dense_state, extra, notes = read_dense_checkpoint(source, source_setting)
    dense_num_heads = extra.pop("num_heads", None)
    # Towers are float32 everywhere downstream (embed, LiT, export feed them float32 pixels); a half
    # precision checkpoint (fp16/bf16 weights) is widened exactly, as `convert` does.
    dense_state = {k: v.float() if v.is_floating_point() else v for k, v in dense_state.items()}
    cfg = target_config(dense_state, target_name, qk_norm, dense_num_heads)
    fresh_norms = {}
    if cfg.qk_norm and not any(k.endswith(".attn.q_norm.weight") for k in dense_state):
        fresh_norms = _fresh_qk_norms(cfg, dense_state)
        notes.append("qk-norm is fresh (LayerNorm init): the dense checkpoint has none")
    elif not cfg.qk_norm and image_tower_config(target_name).qk_norm:
        notes.append(f"no qk-norm: the dense checkpoint has none (registered {target_name} has it)")
    state, fresh = upcycle_state({**dense_state, **fresh_norms}, cfg, seed=seed, device="cpu")
    tower = VisionTransformer(cfg, device="meta")
    tower.load_state_dict(state, assign=True)
    preprocess = dict(extra.get("preprocess") or {})
    preprocess.setdefault("image_size", cfg.image_size)
    info = {"from": str(source), "target": target_name, "seed": seed,
            "moe_blocks": list(cfg.moe_layers), "fresh": fresh + sorted(fresh_norms),
            "notes": notes}
    save_tower(out_dir, tower, extra={**extra, "preprocess": preprocess, "upcycled": info})
    return info
