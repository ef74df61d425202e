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
- expert parallelism (`expert_parallel` E, with `sharding: fsdp`): each GPU holds n/E of every
  Soft MoE layer's n experts. What trains shards that chunk over the GPUs / E that hold it, so its
  states are 1/GPUs of the experts' as under FSDP alone, but FSDP gathers n/E experts per block
  instead of n; a locked tower holds its chunk whole, in the dtype it runs in: 1/E of its experts.
- AdamW's step holds nothing more: it is torch's fused kernel (`optim.create_optimizer`), which
  updates each parameter in place (the default multi-tensor path would hold one more fp32 copy of
  them).

The total is the step's peak, not the sum of the rows: gradients and activations are never held
whole at once. Backward walks the blocks from the last to the first, freeing each block's
activations as its gradients arrive, so the peak is the most of (activations not yet freed +
gradients made so far) over that walk (`_backward_peak`): at its start for a large batch, at its end
(all gradients) for a small one. With `accum_steps` > 1 the gradients of the first micro-batches are
held through the later ones' forward and backward: then both count whole.

`bytes_moved` counts what a step moves per GPU: FSDP's all-gathers and reduce-scatters, and expert
parallelism's all-to-alls of the slots (docs/training.md, "Expert parallelism, on paper").

A plan fits a GPU when its total is at most `GPU_FILL` of the GPU's memory. The plan is an estimate:
eager PyTorch, the GPU's fused attention, no allocator fragmentation; docs/training.md
("Scaling up") shows it for the shipped configs, and `tests/train/test_memory_plan.py -k cuda`
compares it with what a GPU holds.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

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
    expert_parallel: int = 1  # E: the GPUs that split each Soft MoE layer's experts (sharding=fsdp)

    @classmethod
    def of(cls, cfg: PretrainConfig | LiTConfig) -> "Levers":
        return cls(cfg.grad_checkpointing, cfg.sharding, cfg.accum_steps, cfg.expert_parallel)

    def changes(self, base: "Levers") -> list[str]:
        """What differs from `base`, as `key=value` overrides (expert_parallel beside the sharding
        it needs)."""
        fields = ("grad_checkpointing", "sharding", "expert_parallel", "accum_steps")
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
    experts: int = 0  # of `weights`: the Soft MoE experts this GPU holds (its chunk, under EP)

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
    experts, group = count.experts, levers.expert_parallel
    states, trained_experts = _trained_share(count, gpus, levers, 4)  # one fp32 copy, this GPU's
    ddp_buckets = count.trainable * 4 if gpus > 1 and not fsdp else 0
    # FSDP gathers two blocks at a time (the one running and the one prefetched)
    gathered = (2 * experts.largest_gathered(group, count.largest_block) * count.compute_bytes
                if fsdp else 0)
    activations = count.saved.kept(micro, levers.grad_checkpointing, blocks_fixed=not fsdp)
    activations += gathered
    loss_logits = count.loss.at(local, batch_size) if count.loss is not None else 0
    # A locked tower runs before the text tower, so its forward's peak and the text side's are not
    # held together (the gradients of earlier micro-batches are, under accumulation).
    frozen = (count.frozen_forward + _exchange_buffers(count, levers)) * micro
    peak = ddp_buckets + max(_backward_peak(count, micro, levers, shards, activations, states,
                                            loss_logits, gathered),
                             frozen + (states if levers.accum_steps > 1 else 0))
    # A locked tower's experts: this GPU's chunk, whole.
    frozen_experts = experts.frozen_bytes // group
    return MemoryPlan(weights=states + count.frozen_bytes - experts.frozen_bytes + frozen_experts,
                      gradients=states + ddp_buckets,
                      optimizer=_trained_share(count, gpus, levers, _ADAM_BYTES)[0],
                      activations=max(activations, frozen),
                      loss_logits=loss_logits, inputs=count.input_bytes * local, peak=peak,
                      gpus=gpus, micro_batch=micro, levers=levers,
                      experts=trained_experts + frozen_experts)


def _trained_share(count: ModelCount, gpus: int, levers: Levers, size: int) -> tuple[int, int]:
    """(bytes, of which the experts') of the trained parameters at `size` bytes each that this GPU
    holds: all of them without sharding; under fsdp 1/GPUs of them, and under expert parallelism
    1/(GPUs / E) of its expert chunk (n/E experts), the GPUs holding that chunk: 1/GPUs again."""
    experts = count.experts.trained
    if levers.sharding != "fsdp":
        return count.trainable * size, experts * size
    group = levers.expert_parallel
    if group == 1:
        return count.trainable * size // gpus, experts * size // gpus
    chunk = experts // group * size // (gpus // group)
    return (count.trainable - experts) * size // gpus + chunk, chunk


def _exchange_buffers(count: ModelCount, levers: Levers) -> int:
    """Bytes a sample adds to a locked tower's forward peak under expert parallelism: beside the
    slots it sends, a Soft MoE layer holds the slots it receives and their copy regrouped by expert
    (`nn.expert_exchange.experts_in_parallel`), as large. Counted on top of the forward's peak,
    wherever that is: an upper bound. What backward keeps does not change: the experts' matmul keeps
    the regrouped slots where it kept the slots, and the all-to-alls keep nothing."""
    if levers.expert_parallel == 1 or not count.experts.forward_layers:
        return 0
    return 2 * count.experts.slots * count.compute_bytes


def _backward_peak(count: ModelCount, micro: int, levers: Levers, shards: int, activations: int,
                   gradients: int, loss_logits: int, gathered: int) -> int:
    """The most that the trained part's `activations` (the forward's, FSDP's gathered blocks
    included), its `gradients` (this GPU's share) and the loss logits hold at once in a step
    (see the module docstring): the end of the forward (every activation, the loss), then backward
    at each block from the last to the first (the activations of the blocks before it and its own,
    the gradients of the blocks after it and its own), then its end (every gradient)."""
    fsdp = levers.sharding == "fsdp"
    saved = count.saved
    # `gathered`: FSDP's gathered blocks, held throughout (0 without it)
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
    then grad_checkpointing before sharding before accum_steps before expert_parallel (the smallest
    accum_steps and expert group that do it: expert parallelism is new code, and its all-to-alls
    need a fast interconnect). []: none."""
    if gpus % current.expert_parallel:
        return []
    local = micro_batch_size(batch_size, gpus, 1)
    accums = [a for a in range(current.accum_steps, local + 1) if local % a == 0]
    shardings = dict.fromkeys([current.sharding, "fsdp" if gpus > 1 else current.sharding])
    fitting = []
    for checkpointing in dict.fromkeys([current.grad_checkpointing, True]):
        for sharding in shardings:
            for group in expert_groups(count, gpus, current.expert_parallel):
                if group > 1 and sharding != "fsdp":  # expert parallelism needs fsdp
                    continue
                for accum in accums:  # the smallest that fits; a larger one is no lesser change
                    levers = Levers(checkpointing, sharding, accum, group)
                    if (levers != current
                            and plan_memory(count, batch_size, gpus, levers).fits(gpu_bytes)):
                        fitting.append(levers)
                        break
    least = [lv for lv in fitting
             if not any(other != lv and _lesser(other, lv, current) for other in fitting)]
    order = {"grad_checkpointing": 0, "sharding": 1, "accum_steps": 2, "expert_parallel": 3}
    return sorted(least, key=lambda lv: (len(lv.changes(current)),
                                         sorted(order[c.split("=")[0]]
                                                for c in lv.changes(current)),
                                         lv.accum_steps, lv.expert_parallel))


def expert_groups(count: ModelCount, gpus: int, least: int = 1) -> list[int]:
    """The expert_parallel values from `least` up that divide both the experts of each Soft MoE
    layer and the GPUs."""
    common = math.gcd(count.experts.per_layer, gpus) if count.experts.per_layer else 1
    return [least] + [e for e in range(least + 1, common + 1) if common % e == 0]


def _lesser(a: Levers, b: Levers, current: Levers) -> bool:
    """Whether `a` changes no more than `b` does: each of its changes is one of b's, accum_steps and
    expert_parallel no larger."""
    return (a.grad_checkpointing == current.grad_checkpointing
            or a.grad_checkpointing == b.grad_checkpointing) and \
        (a.sharding == current.sharding or a.sharding == b.sharding) and \
        a.accum_steps <= b.accum_steps and a.expert_parallel <= b.expert_parallel


def fewest_gpus(count: ModelCount, batch_size: int, gpu_bytes: int, current: Levers,
                most: int = 1024):
    """(GPUs, levers): the fewest GPUs (dividing the batch) on which some levers make the plan fit;
    None if none."""
    # the GPU counts that split the batch, and that the expert group (if any) divides
    for gpus in (n for n in range(1, min(most, batch_size) + 1)
                 if batch_size % n == 0 and n % current.expert_parallel == 0):
        if plan_memory(count, batch_size, gpus, current).fits(gpu_bytes):
            return gpus, current
        fitting = levers_that_fit(count, batch_size, gpus, gpu_bytes, current)
        if fitting:
            return gpus, fitting[0]
    return None


@dataclass(frozen=True)
class Traffic:
    """What a training step moves per GPU (`bytes_moved`), in bytes."""
    sharded: int  # parameters FSDP gathers on this GPU (over a group of more than one)
    gathers: int  # all-gathers of each per step (its reduce-scatters: `accum_steps`)
    fsdp: int  # FSDP's all-gathers and reduce-scatters
    all_to_alls: int  # expert parallelism's, per step
    all_to_all: int  # each one's

    @property
    def total(self) -> int:
        return self.fsdp + self.all_to_alls * self.all_to_all


def bytes_moved(count: ModelCount, batch_size: int, gpus: int, levers: Levers) -> Traffic:
    """What a step moves per GPU under `levers`: each collective counted as the buffer it fills on a
    GPU, as docs/training.md counts them ((N - 1)/N of it crosses the links, N the processes of its
    group); a group of one process moves nothing."""
    micro = micro_batch_size(batch_size, gpus, levers.accum_steps)
    group, experts = levers.expert_parallel, count.experts
    # LiT's accumulation runs each micro-batch forward twice: without a graph for the whole batch's
    # embeddings, then again for its backward (`train.accumulation`).
    forwards = 2 if count.loss is not None and levers.accum_steps > 1 else 1
    sharded = gathers = 0
    if levers.sharding == "fsdp":
        # Each micro-batch gathers every unit before each forward and again before its backward
        # (with grad_checkpointing its recompute runs inside that backward, gathered), then
        # reduce-scatters its gradients: all in fp32, the parameters' dtype (`train.sharding` sets
        # no mixed-precision policy). The other weights are sharded over every GPU, an expert chunk
        # over the GPUs / E that hold it; a locked tower is not sharded: it moves nothing.
        sharded = ((count.trainable - experts.trained if gpus > 1 else 0)
                   + (experts.trained // group if gpus // group > 1 else 0))
        gathers = (forwards + 1) * levers.accum_steps
    fsdp = sharded * 4 * (gathers + levers.accum_steps)
    if group == 1:
        return Traffic(sharded, gathers, fsdp, 0, 0)
    # Per micro-batch, a Soft MoE layer's forward sends its slots (b·n·p values) to the experts'
    # GPUs and takes their outputs back: two all-to-alls. Backward, for a layer that trains, runs
    # both again in reverse (two more; with grad_checkpointing its forward's two first). A locked
    # layer (LiT's tower, or its locked blocks) runs forward only: no gradient flows back into it.
    trained = 2 * forwards + 2 + (2 if levers.grad_checkpointing else 0)
    per_micro = experts.backward_layers * trained + experts.forward_layers * 2 * forwards
    return Traffic(sharded, gathers, fsdp, per_micro * levers.accum_steps,
                   micro * experts.slots * count.compute_bytes)


def check_expert_parallel(count: ModelCount, gpus: int, levers: Levers) -> None:
    """One UserError line, naming the fix, for an expert_parallel the run cannot take."""
    group, experts = levers.expert_parallel, count.experts.per_layer
    if group == 1:
        return
    if not experts:
        raise UserError(f"expert_parallel={group} splits the experts of Soft MoE layers, and this "
                        "model has none; set expert_parallel=1")
    if levers.sharding != "fsdp":
        raise UserError(f"expert_parallel={group} needs sharding=fsdp (the other weights shard "
                        "over every GPU, each expert chunk over the GPUs that hold it); set "
                        "sharding=fsdp")
    if experts % group or gpus % group:
        choices = expert_groups(count, gpus)[1:]
        fix = (f"set it to {' or '.join(map(str, choices))}" if choices
               else "set expert_parallel=1")
        raise UserError(f"expert_parallel={group} must divide both the {experts} experts of each "
                        f"Soft MoE layer and the {_gpus(gpus)}; {fix}")


# ---- a config's plan: what --plan prints and what a recipe checks at its start -------------------

def plan_report(cfg: PretrainConfig | LiTConfig, gpus: int, gpu_bytes: int) -> tuple[str, bool]:
    """(the plan as `--plan` prints it, whether it fits)."""
    count, what = count_config(cfg)
    levers = Levers.of(cfg)
    check_expert_parallel(count, gpus, levers)
    plan = plan_memory(count, cfg.batch_size, gpus, levers)
    experts = count.experts
    lines = [f"memory plan: {what}",
             f"batch {cfg.batch_size:,} on {_gpus(gpus)}: micro-batch {plan.micro_batch:,} per "
             f"GPU, {precision_name(compute_dtype(cfg.precision))}; sharding={levers.sharding} "
             f"grad_checkpointing={str(levers.grad_checkpointing).lower()} "
             f"accum_steps={levers.accum_steps}"
             + (f" expert_parallel={levers.expert_parallel}" if experts.per_layer else ""),
             ""]
    unit, size = ("GiB", _GIB) if plan.total >= _GIB else ("MiB", 1 << 20)
    lines.append(f"{'per GPU':<24}{unit:>8}")
    rows = [("weights", plan.weights,
             " (trained: fp32; a locked tower: as it runs)" if count.frozen_bytes else ""),
            *([("  experts", plan.experts, _chunk_note(count, gpus, levers))]
              if experts.per_layer else []),
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
    fitting = [] if fits else levers_that_fit(count, cfg.batch_size, gpus, gpu_bytes, levers)
    if not fits:
        lines.append("does not fit: "
                     + _verdict(count, cfg.batch_size, gpus, gpu_bytes, levers, fitting))
    if gpus > 1:
        lines += _traffic_lines(count, cfg.batch_size, gpus, levers, fitting,
                                precision_name(compute_dtype(cfg.precision)))
    lines.append("an estimate: activations counted on the meta device, eager, with the GPU's fused "
                 "attention (docs/training.md, \"Scaling up\")")
    return "\n".join(lines), fits


def _chunk_note(count: ModelCount, gpus: int, levers: Levers) -> str:
    """What the experts row holds: this GPU's chunk, and how."""
    experts, group = count.experts, levers.expert_parallel
    how = [f"of the weights: {experts.per_layer // group} of {experts.per_layer} experts in each "
           f"of {experts.layers} Soft MoE layers"]
    if experts.trained and levers.sharding == "fsdp" and gpus // group > 1:
        how.append(f"trained: 1/{gpus // group} of them")
    if experts.frozen_bytes:
        how.append("locked: whole")
    return f" ({'; '.join(how)})"


def _traffic_lines(count: ModelCount, batch_size: int, gpus: int, levers: Levers,
                   fitting: list[Levers], dtype: str) -> list[str]:
    """What a step moves per GPU with FSDP alone and with expert parallelism (the run's expert
    group, else the one a lever names, else the largest the experts and GPUs allow); the
    all-to-alls in `dtype`, the compute dtype's name."""
    fsdp = Levers(levers.grad_checkpointing, "fsdp", levers.accum_steps)
    named = [lv.expert_parallel for lv in fitting if lv.expert_parallel > 1]
    if levers.expert_parallel > 1:
        group = levers.expert_parallel
    else:
        group = named[0] if named else expert_groups(count, gpus)[-1]
    alone = bytes_moved(count, batch_size, gpus, fsdp)
    rows = [("FSDP", alone.total, f"sharding=fsdp: {alone.sharded / 1e6:,.1f}M trained parameters "
             f"gathered {alone.gathers}×, their gradients reduce-scattered "
             f"{levers.accum_steps}×, fp32")]
    if group > 1:
        ep = bytes_moved(count, batch_size, gpus, replace(fsdp, expert_parallel=group))
        exchanges = (f"{ep.all_to_alls} all-to-alls of {ep.all_to_all / 1e6:,.1f} MB, {dtype}"
                     if ep.all_to_alls else "no all-to-alls: no Soft MoE layer runs in a step")
        rows.append(("expert parallel", ep.total, f"expert_parallel={group}: {exchanges}, "
                     f"+ FSDP's {ep.fsdp / 1e9:,.2f} GB"))
    unit, size = ("GB", 1e9) if max(r[1] for r in rows) >= 1e9 else ("MB", 1e6)
    return ([f"{'moved per step, per GPU':<24}{unit:>8}"]
            + [f"  {name:<22}{value / size:>8.1f} ({note})" for name, value, note in rows])


def _verdict(count: ModelCount, batch_size: int, gpus: int, gpu_bytes: int, levers: Levers,
             fitting: list[Levers] | None = None) -> str:
    """What would make a plan that does not fit fit: levers (`fitting`, if found already), else
    more GPUs."""
    if fitting is None:
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
    check_expert_parallel(count, gpus, levers)
    plan = plan_memory(count, cfg.batch_size, gpus, levers)
    if plan.fits(gpu_bytes):
        return
    command = "train" if isinstance(cfg, LiTConfig) else "pretrain"
    raise UserError(f"this run needs about {plan.total / _GIB:.1f} GiB per GPU, more than "
                    f"{GPU_FILL:.0%} of this GPU's {gpu_bytes / _GIB:.1f} GiB: "
                    f"{_verdict(count, cfg.batch_size, gpus, gpu_bytes, levers)} (`lit-softmoe "
                    f"{command} --plan` shows the plan; {IGNORE_PLAN_ENV}=1 runs it anyway)")
