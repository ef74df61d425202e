"""AdamW parameter groups and learning-rate schedules (pure functions of the step).

The learning rate is computed from the step alone and written into the optimizer every step, so a
resumed run needs no scheduler state: the step is the whole story.
"""
from __future__ import annotations

import math

import torch

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (kernels) and Soft MoE's `scale`, as the paper does; not biases, norms,
    position embeddings or phi (whose magnitude the layer normalizes away)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".scale") or (param.ndim >= 2 and name not in skip):
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2))


def check_optim_settings(cfg: OptimConfig) -> None:
    """torch's own checks of lr, betas and weight decay, on a stand-in parameter: run before any work,
    they are one UserError line instead of a ValueError traceback once the towers are built."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                          weight_decay=cfg.weight_decay)
    except ValueError as err:
        raise UserError(f"optim: {err}; fix optim.lr, optim.beta1, optim.beta2 or optim.weight_decay") from None
    if cfg.warmup >= 1 and cfg.warmup != int(cfg.warmup):
        raise UserError(f"optim.warmup={cfg.warmup:g} is neither a fraction of the run (below 1, e.g. 0.05) nor a "
                        "whole number of steps; give one of those")


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """`optim.warmup` in steps: below 1 it is a fraction of the run's `total_steps`."""
    return round(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)


def long_warmup_warning(cfg: OptimConfig, total_steps: int) -> str | None:
    """One line when the warmup takes more than half the run (the learning rate would rise for most
    of it and its decay barely happen, as a step count meant for a larger dataset does), else None."""
    steps = warmup_steps(cfg, total_steps)
    if total_steps < 1 or steps <= total_steps / 2:
        return None
    share = "covers the whole" if steps >= total_steps else f"is {100 * steps / total_steps:.0f}% of this"
    return (f"warning: the warmup of {steps} steps {share} {total_steps}-step run, so the learning rate rises for "
            "most of it; give optim.warmup as a fraction of the run (e.g. optim.warmup=0.05) or fewer steps")


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
    for group in optimizer.param_groups:
        group["lr"] = lr
