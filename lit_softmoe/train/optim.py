"""AdamW parameter groups and learning-rate schedules (pure functions of the step).

The learning rate is computed from the step alone and written into the optimizer every step, so a
resumed run needs no scheduler state: the step is the whole story. Layer-wise lr decay (BEiT, Bao
et al. 2022; timm's `param_groups_layer_decay`) gives each group an `lr_scale` that `set_lr`
multiplies it by.
"""
from __future__ import annotations

import math

import torch

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError


def layer_depths(model: torch.nn.Module) -> dict[str, int]:
    """How many layers each parameter sits below the top of its tower (timm's
    `num_layers - 1 - layer_id`, from the tower's `layer_ids()`): 0 for its head or projection, 1
    for its last block and final norm, blocks + 1 for its embeddings (a tower without a head, as
    timm counts it: one less).

    A tower is a module with `layer_ids()` (`VisionTransformer`, the text towers): `model` itself
    (pretraining) or its children (LiT's two towers, each counted on its own). What belongs to no
    tower (LiT's logit scale, image head) is absent: depth 0. A tower with nothing to train is not
    asked."""
    if hasattr(model, "layer_ids"):
        towers = [("", model)]
    else:
        towers = [(f"{name}.", child) for name, child in model.named_children()
                  if hasattr(child, "layer_ids")
                  and any(p.requires_grad for p in child.parameters())]
    depths = {}
    for prefix, tower in towers:
        ids = tower.layer_ids()
        top = max(ids.values())
        depths.update({prefix + name: top - layer for name, layer in ids.items()})
    return depths


def param_groups(model: torch.nn.Module, weight_decay: float,
                 layer_decay: float = 1.0) -> list[dict]:
    """Decay matrices (kernels) and Soft MoE's `scale`, as the paper does; not biases, norms,
    position embeddings or phi (whose magnitude the layer normalizes away).

    `layer_decay` below 1: timm's `param_groups_layer_decay` with this weight-decay rule: a group
    per (layer, decay or not), each with `lr_scale = layer_decay ** depth` (`layer_depths`), which
    `set_lr` applies."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    depths = layer_depths(model) if layer_decay != 1.0 else {}
    # (depth, decayed) → group, in the order of named_parameters
    groups: dict[tuple[int, bool], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decayed = name.endswith(".scale") or (param.ndim >= 2 and name not in skip)
        depth = depths.get(name, 0)
        scale = {"lr_scale": layer_decay ** depth} if depths else {}
        groups.setdefault((depth, decayed),
                          {"params": [], "weight_decay": weight_decay if decayed else 0.0,
                           **scale})["params"].append(param)
    # off: the two groups, decayed first, even if one is empty (as checkpoints record them)
    if not depths:
        return [groups.get((0, decayed),
                           {"params": [], "weight_decay": weight_decay if decayed else 0.0})
                for decayed in (True, False)]
    return list(groups.values())


# Devices with torch's fused AdamW kernel (its own list, `_get_fused_kernels_supported_devices`):
# not meta.
_FUSED_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")


def create_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused (one kernel for every parameter's whole update, where
    torch's default runs several multi-tensor passes over the weights and moments) wherever every
    parameter's device has it."""
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay)
    fused = all(param.device.type in _FUSED_DEVICES and param.is_floating_point()
                for group in groups for param in group["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def check_optim_settings(cfg: OptimConfig) -> None:
    """torch's own checks of lr, betas and weight decay, on a stand-in parameter: run before any
    work, they are one UserError line instead of a ValueError traceback once the towers are
    built."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr,
                          betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    except ValueError as err:
        raise UserError(f"optim: {err}; fix optim.lr, optim.beta1, optim.beta2 or "
                        "optim.weight_decay") from None
    if not 0 < cfg.layer_decay <= 1:
        raise UserError(f"optim.layer_decay={cfg.layer_decay:g} must be above 0 and at most 1 (1: "
                        "off; fine-tuning recipes use 0.65 to 0.85)")
    if cfg.warmup >= 1 and cfg.warmup != int(cfg.warmup):
        raise UserError(f"optim.warmup={cfg.warmup:g} is neither a fraction of the run (below 1, "
                        "e.g. 0.05) nor a whole number of steps; give one of those")


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """`optim.warmup` in steps: below 1 it is a fraction of the run's `total_steps`."""
    return round(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)


def long_warmup_warning(cfg: OptimConfig, total_steps: int) -> str | None:
    """One line when the warmup takes more than half the run (the learning rate would rise for most
    of it and its decay barely happen, as a step count meant for a larger dataset does), else
    None."""
    steps = warmup_steps(cfg, total_steps)
    if total_steps < 1 or steps <= total_steps / 2:
        return None
    share = ("covers the whole" if steps >= total_steps
             else f"is {100 * steps / total_steps:.0f}% of this")
    return (f"warning: the warmup of {steps} steps {share} {total_steps}-step run, so the learning "
            "rate rises for most of it; give optim.warmup as a fraction of the run (e.g. "
            "optim.warmup=0.05) or fewer steps")


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for `step` (0-based): linear warmup, then cosine / rsqrt / constant."""
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if cfg.schedule == "rsqrt":
        # big_vision's rsqrt: lr · sqrt(warmup / step) after warmup, then a linear cooldown to 0.
        lr = cfg.lr * math.sqrt(max(warmup, 1) / max(step + 1, 1))
        cooldown_start = total_steps - cfg.cooldown_steps
        if cfg.cooldown_steps > 0 and step >= cooldown_start:
            lr *= max(0.0, (total_steps - step) / cfg.cooldown_steps)
        return lr
    return cfg.lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's `lr` into every group, times the group's `lr_scale` (layer-wise decay) where
    it has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
