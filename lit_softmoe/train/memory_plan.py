"""A training run's memory per GPU, planned before any work: `lit-softmoe pretrain --plan`,
`train --plan`.

Per GPU, in bytes:
- weights, gradients, optimizer: from the parameter count. What trains is held in fp32 (autocast
  computes in bf16/fp16 from fp32 weights), so 4 + 4 + 8 (AdamW's two moments) = 16 bytes a
  parameter, each part divided by the GPU count under `sharding: fsdp`. Without sharding, several
  processes run DDP, whose all-reduce buckets are a second copy of the gradients (accelerate's
  default: `gradient_as_bucket_view=False`): 20 bytes a parameter. A locked tower (LiT) holds its
  weights in the dtype it runs in, with no gradient and no moments.
- activations: what backward keeps, counted from the model at the run's micro-batch and precision
  (`train.activation_count`: saved tensors of one forward on the meta device, as a GPU would keep
  them). With `grad_checkpointing`, each block keeps its input and backward recomputes one block at
  a time. Under `fsdp`, the weights arrive in the compute dtype (FSDP's mixed-precision policy), so
  nothing is cast and kept: the casts counted in the blocks give way to two gathered blocks (the one
  running and the one prefetched). LiT adds the contrastive loss of this GPU's rows against the
  global batch (B × N logits, both directions). A locked tower's forward keeps nothing: it holds at
  most what its tensors hold at once (counted too).
- inputs: the batch on the GPU (images in fp32, text ids, cached features), held through the step.
- AdamW's step holds nothing more: it is torch's fused kernel (`optim.create_optimizer`), which
  updates each parameter in place (the default multi-tensor path would hold one more fp32 copy of
  them).

The total is the step's peak, not the sum of the rows: gradients and activations are never held
whole at once. Backward walks the blocks from the last to the first, freeing each block's
activations as its gradients arrive, so the peak is the most of (activations not yet freed +
gradients made so far) over that walk (`_backward_peak`): at its start for a large batch, at its end
(all gradients) for a small one. With `accum_steps` > 1 the gradients of the first micro-batches are
held through the later ones' forward and backward: then both count whole.

A plan fits a GPU when its total is at most `GPU_FILL` of the GPU's memory. The plan is an estimate:
eager PyTorch, the GPU's fused attention, no allocator fragmentation; docs/training.md
("Scaling up") shows it for the shipped configs, and `tests/train/test_memory_plan.py -k cuda`
compares it with what a GPU holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lit_softmoe.config import LiTConfig, PretrainConfig, micro_batch_size
from lit_softmoe.errors import UserError
from lit_softmoe.train.model_count import ModelCount, compute_dtype, count_config
from lit_softmoe.utils.device import precision_name
from lit_softmoe.utils.distributed import local_rank, rank_and_world_size

# A plan may fill 90% of a GPU. Outside what it counts: the CUDA context and the cuBLAS / NCCL
# workspaces (0.5-2 GiB, outside PyTorch's allocator but inside the GPU's memory), the caching
# allocator's fragmentation (a few percent), and the transients of backward: the gradient of each
# activation while backward consumes it, a block's weight gradients in the compute dtype before they
# are cast to fp32.
GPU_FILL = 0.9
IGNORE_PLAN_ENV = "LIT_SOFTMOE_IGNORE_PLAN"
_GIB = 1 << 30
_ADAM_BYTES = 8  # AdamW's two fp32 moments per parameter


@dataclass(frozen=True)
class Levers:
    """The config keys that trade memory for time or communication."""
    grad_checkpointing: bool = False
    sharding: str = "none"  # none | fsdp
    accum_steps: int = 1

    @classmethod
    def of(cls, cfg: PretrainConfig | LiTConfig) -> "Levers":
        return cls(cfg.grad_checkpointing, cfg.sharding, cfg.accum_steps)

    def changes(self, base: "Levers") -> list[str]:
        """What differs from `base`, as `key=value` overrides, in the order they are tried."""
        fields = ("grad_checkpointing", "sharding", "accum_steps")
        return [f"{k}={str(getattr(self, k)).lower()}" for k in fields
                if getattr(self, k) != getattr(base, k)]


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of a training run (see the module docstring)."""
    weights: int
    gradients: int
    optimizer: int
    activations: int  # the model's, at the micro-batch
    loss_logits: int  # the contrastive loss's (LiT; 0 for pretraining)
    inputs: int  # the batch on this GPU
    # the most that gradients, activations and the loss logits hold at once (`_backward_peak`)
    peak: int
    gpus: int
    micro_batch: int
    levers: Levers

    @property
    def total(self) -> int:
        """The step's peak: weights, moments and the batch are held throughout; gradients and
        activations as `peak` counts them together."""
        return self.weights + self.optimizer + self.inputs + self.peak

    def fits(self, gpu_bytes: int) -> bool:
        return self.total <= GPU_FILL * gpu_bytes


def plan_memory(count: ModelCount, batch_size: int, gpus: int, levers: Levers) -> MemoryPlan:
    """The memory per GPU of training `count`'s model on a global `batch_size` over `gpus` GPUs."""
    micro = micro_batch_size(batch_size, gpus, levers.accum_steps)
    local = batch_size // gpus
    fsdp = levers.sharding == "fsdp"
    shards = gpus if fsdp else 1
    states = count.trainable * 4 // shards  # one fp32 copy, this GPU's share
    ddp_buckets = count.trainable * 4 if gpus > 1 and not fsdp else 0
    activations = count.saved.kept(micro, levers.grad_checkpointing, blocks_fixed=not fsdp)
    if fsdp:
        activations += 2 * count.largest_block * count.compute_bytes
    loss_logits = count.loss.at(local, batch_size) if count.loss is not None else 0
    # A locked tower runs before the text tower, so its forward's peak and the text side's are not
    # held together (the gradients of earlier micro-batches are, under accumulation).
    frozen = count.frozen_forward * micro
    peak = ddp_buckets + max(_backward_peak(count, micro, levers, shards, activations, states,
                                            loss_logits),
                             frozen + (states if levers.accum_steps > 1 else 0))
    return MemoryPlan(weights=states + count.frozen_bytes, gradients=states + ddp_buckets,
                      optimizer=count.trainable * _ADAM_BYTES // shards,
                      activations=max(activations, frozen),
                      loss_logits=loss_logits, inputs=count.input_bytes * local, peak=peak,
                      gpus=gpus, micro_batch=micro, levers=levers)


def _backward_peak(count: ModelCount, micro: int, levers: Levers, shards: int, activations: int,
                   gradients: int, loss_logits: int) -> int:
    """The most that the trained part's `activations` (the forward's, FSDP's gathered blocks
    included), its `gradients` (this GPU's share) and the loss logits hold at once in a step
    (see the module docstring): the end of the forward (every activation, the loss), then backward
    at each block from the last to the first (the activations of the blocks before it and its own,
    the gradients of the blocks after it and its own), then its end (every gradient)."""
    fsdp = levers.sharding == "fsdp"
    saved = count.saved
    # under fsdp: held throughout
    gathered = 2 * count.largest_block * count.compute_bytes if fsdp else 0
    if levers.accum_steps > 1:  # the first micro-batch's gradients are held through every later one
        return activations + loss_logits + gradients
    blocks = [block.at(micro) if not fsdp else block.per_sample * micro for block in saved.blocks]
    # With checkpointing a block before the one in backward holds its input only; that one,
    # recomputed, its all.
    before = [i.at(micro) for i in saved.block_inputs] if levers.grad_checkpointing else blocks
    block_gradients = [params * 4 // shards for params in count.block_params] or [0] * len(blocks)
    walk = [saved.stem.at(micro) + sum(before[:k]) + blocks[k] + sum(block_gradients[k:])
            for k in range(len(blocks))]
    # The gradients outside the blocks (embeddings, final norm, head) counted at the end only: an
    # embedding's arrives last, and the head's are small.
    start, end = activations + loss_logits, gathered + saved.stem.at(micro) + gradients
    return max(start, end, *(gathered + step for step in walk))


def levers_that_fit(count: ModelCount, batch_size: int, gpus: int, gpu_bytes: int,
                    current: Levers) -> list[Levers]:
    """The least changes to `current` under which the plan fits, best first: fewer levers changed,
    then grad_checkpointing before sharding before accum_steps (the smallest accum_steps that does
    it). []: none."""
    local = micro_batch_size(batch_size, gpus, 1)
    accums = [a for a in range(current.accum_steps, local + 1) if local % a == 0]
    shardings = dict.fromkeys([current.sharding, "fsdp" if gpus > 1 else current.sharding])
    fitting = []
    for checkpointing in dict.fromkeys([current.grad_checkpointing, True]):
        for sharding in shardings:
            for accum in accums:  # the smallest that fits; a larger one is no lesser change
                levers = Levers(checkpointing, sharding, accum)
                if (levers != current
                        and plan_memory(count, batch_size, gpus, levers).fits(gpu_bytes)):
                    fitting.append(levers)
                    break
    least = [lv for lv in fitting
             if not any(other != lv and _lesser(other, lv, current) for other in fitting)]
    order = {"grad_checkpointing": 0, "sharding": 1, "accum_steps": 2}
    return sorted(least, key=lambda lv: (len(lv.changes(current)),
                                         [order[c.split("=")[0]] for c in lv.changes(current)],
                                         lv.accum_steps))


def _lesser(a: Levers, b: Levers, current: Levers) -> bool:
    """Whether `a` changes no more than `b` does: each of its changes is one of b's, accum_steps no
    larger."""
    return (a.grad_checkpointing == current.grad_checkpointing
            or a.grad_checkpointing == b.grad_checkpointing) and \
        (a.sharding == current.sharding or a.sharding == b.sharding) and \
        a.accum_steps <= b.accum_steps


def fewest_gpus(count: ModelCount, batch_size: int, gpu_bytes: int, current: Levers,
                most: int = 1024):
    """(GPUs, levers): the fewest GPUs (dividing the batch) on which some levers make the plan fit;
    None if none."""
    for gpus in (n for n in range(1, min(most, batch_size) + 1) if batch_size % n == 0):
        if plan_memory(count, batch_size, gpus, current).fits(gpu_bytes):
            return gpus, current
        fitting = levers_that_fit(count, batch_size, gpus, gpu_bytes, current)
        if fitting:
            return gpus, fitting[0]
    return None


# ---- a config's plan: what --plan prints and what a recipe checks at its start -------------------

def plan_report(cfg: PretrainConfig | LiTConfig, gpus: int, gpu_bytes: int) -> tuple[str, bool]:
    """(the plan as `--plan` prints it, whether it fits)."""
    count, what = count_config(cfg)
    levers = Levers.of(cfg)
    plan = plan_memory(count, cfg.batch_size, gpus, levers)
    lines = [f"memory plan: {what}",
             f"batch {cfg.batch_size:,} on {_gpus(gpus)}: micro-batch {plan.micro_batch:,} per "
             f"GPU, {precision_name(compute_dtype(cfg.precision))}; sharding={levers.sharding} "
             f"grad_checkpointing={str(levers.grad_checkpointing).lower()} "
             f"accum_steps={levers.accum_steps}",
             ""]
    unit, size = ("GiB", _GIB) if plan.total >= _GIB else ("MiB", 1 << 20)
    lines.append(f"{'per GPU':<24}{unit:>8}")
    rows = [("weights", plan.weights,
             " (trained: fp32; a locked tower: as it runs)" if count.frozen_bytes else ""),
            ("gradients", plan.gradients, " (with DDP's all-reduce buckets)" if plan.gpus > 1 and
             levers.sharding == "none" else ""),
            ("optimizer (AdamW)", plan.optimizer, ""),
            ("activations", plan.activations, " (counted: saved for backward)")]
    if count.loss is not None:
        rows.append(("loss logits", plan.loss_logits,
                     f" ({cfg.batch_size // gpus:,} × {cfg.batch_size:,}, both ways)"))
    rows.append(("inputs", plan.inputs, " (the batch on the GPU)"))
    rows.append(("total", plan.total,
                 " (the step's peak: backward frees activations as gradients arrive)"
                 if levers.accum_steps == 1
                 else " (gradients held whole through the micro-batches)"))
    lines += [f"  {name:<22}{value / size:>8.1f}{note}" for name, value, note in rows]
    fits = plan.fits(gpu_bytes)
    lines.append(f"{'GPU memory':<24}{gpu_bytes / size:>8.1f} (a plan may fill {GPU_FILL:.0%}: "
                 f"{GPU_FILL * gpu_bytes / size:.1f})")
    lines.append(f"{'fits':<24}{'yes' if fits else 'no':>8}")
    if not fits:
        lines.append(f"does not fit: {_verdict(count, cfg.batch_size, gpus, gpu_bytes, levers)}")
    lines.append("an estimate: activations counted on the meta device, eager, with the GPU's fused "
                 "attention (docs/training.md, \"Scaling up\")")
    return "\n".join(lines), fits


def _verdict(count: ModelCount, batch_size: int, gpus: int, gpu_bytes: int, levers: Levers) -> str:
    """What would make a plan that does not fit fit: levers, else more GPUs."""
    fitting = levers_that_fit(count, batch_size, gpus, gpu_bytes, levers)
    if fitting:
        options = [f"{' '.join(lv.changes(levers))} "
                   f"({plan_memory(count, batch_size, gpus, lv).total / _GIB:.1f} GiB per GPU)"
                   for lv in fitting]
        return "set " + "; or ".join(options)
    more = fewest_gpus(count, batch_size, gpu_bytes, levers)
    if more is None:
        return "no lever makes it fit on up to 1,024 GPUs of this size"
    changes = " ".join(more[1].changes(levers))
    return (f"no lever makes it fit on {_gpus(gpus)}; on {more[0]} it fits"
            + (f" with {changes}" if changes else ""))


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n > 1 else ''}"


def visible_gpu_bytes() -> int | None:
    """The memory of this process's GPU; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(local_rank() % torch.cuda.device_count()).total_memory


def check_plan_fits(cfg: PretrainConfig | LiTConfig) -> None:
    """At a recipe's start on a GPU: a run whose plan does not fit this GPU (for the launcher's
    process count) is refused in one line naming the levers that make it fit. Nothing without CUDA,
    or with LIT_SOFTMOE_IGNORE_PLAN=1 (the plan is an estimate)."""
    gpu_bytes = visible_gpu_bytes()
    if gpu_bytes is None or os.environ.get(IGNORE_PLAN_ENV) == "1":
        return
    gpus = rank_and_world_size()[1]
    count, _ = count_config(cfg)
    levers = Levers.of(cfg)
    plan = plan_memory(count, cfg.batch_size, gpus, levers)
    if plan.fits(gpu_bytes):
        return
    command = "train" if isinstance(cfg, LiTConfig) else "pretrain"
    raise UserError(f"this run needs about {plan.total / _GIB:.1f} GiB per GPU, more than "
                    f"{GPU_FILL:.0%} of this GPU's {gpu_bytes / _GIB:.1f} GiB: "
                    f"{_verdict(count, cfg.batch_size, gpus, gpu_bytes, levers)} (`lit-softmoe "
                    f"{command} --plan` shows the plan; {IGNORE_PLAN_ENV}=1 runs it anyway)")
