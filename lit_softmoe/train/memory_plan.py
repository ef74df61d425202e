"""A training run's memory per GPU, planned before any work: `lit-softmoe pretrain --plan`, `train --plan`.

Per GPU, in bytes:
- weights, gradients, optimizer: from the parameter count. What trains is held in fp32 (autocast computes in
  bf16/fp16 from fp32 weights), so 4 + 4 + 8 (AdamW's two moments) = 16 bytes a parameter, each part divided by
  the GPU count under `sharding: fsdp`. Without sharding, several processes run DDP, whose all-reduce buckets
  are a second copy of the gradients (accelerate's default: `gradient_as_bucket_view=False`): 20 bytes a
  parameter. A locked tower (LiT) holds its weights in the dtype it runs in, with no gradient and no moments.
- activations: what backward keeps, counted from the model at the run's micro-batch and precision
  (`train.activation_count`: saved tensors of one forward on the meta device, as a GPU would keep them). With
  `grad_checkpointing`, each block keeps its input and backward recomputes one block at a time. Under `fsdp`,
  the weights arrive in the compute dtype (FSDP's mixed-precision policy), so nothing is cast and kept: the
  casts counted in the blocks give way to two gathered blocks (the one running and the one prefetched).
  LiT adds the contrastive loss of this GPU's rows against the global batch (B × N logits, both directions).
  A locked tower's forward keeps nothing: it holds at most what its tensors hold at once (counted too).
- inputs: the batch on the GPU (images in fp32, text ids, cached features), held through the step.
- AdamW's step holds nothing more: it is torch's fused kernel (`optim.create_optimizer`), which updates each
  parameter in place (the default multi-tensor path would hold one more fp32 copy of them).

The total is the step's peak, not the sum of the rows: gradients and activations are never held whole at
once. Backward walks the blocks from the last to the first, freeing each block's activations as its gradients
arrive, so the peak is the most of (activations not yet freed + gradients made so far) over that walk
(`_backward_peak`): at its start for a large batch, at its end (all gradients) for a small one. With
`accum_steps` > 1 the gradients of the first micro-batches are held through the later ones' forward and
backward: then both count whole.

A plan fits a GPU when its total is at most `GPU_FILL` of the GPU's memory. The plan is an estimate: eager
PyTorch, the GPU's fused attention, no allocator fragmentation; docs/training.md ("Scaling up") shows it for
the shipped configs, and `tests/train/test_memory_plan.py -k cuda` compares it with what a GPU holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_softmoe.config import LiTConfig, PretrainConfig, micro_batch_size
from lit_softmoe.data.feature_cache import is_feature_cache
from lit_softmoe.data.shards import CLASSNAMES_FILE, dataset_dir, read_classnames_file
from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.models.tower_folder import read_tower_meta, tower_skeleton
from lit_softmoe.models.tower_layers import check_unlockable, modules_of
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.train.activation_count import (
    Bytes,
    PairBytes,
    SavedBytes,
    count_pair_bytes,
    count_peak_bytes,
    count_saved_bytes,
    largest_module_list,
)
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss
from lit_softmoe.utils.device import PRECISIONS, autocast_dtype, precision_name
from lit_softmoe.utils.distributed import local_rank, rank_and_world_size

# A plan may fill 90% of a GPU. Outside what it counts: the CUDA context and the cuBLAS / NCCL workspaces
# (0.5-2 GiB, outside PyTorch's allocator but inside the GPU's memory), the caching allocator's fragmentation
# (a few percent), and the transients of backward: the gradient of each activation while backward consumes it,
# a block's weight gradients in the compute dtype before they are cast to fp32.
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
        return [f"{k}={str(getattr(self, k)).lower()}" for k in fields if getattr(self, k) != getattr(base, k)]


@dataclass(frozen=True)
class ModelCount:
    """What one training step of a model keeps, whatever the batch, the GPUs and the levers (counted once)."""
    trainable: int  # parameters that train: fp32 weights, gradients and AdamW's moments
    frozen_bytes: int  # weights that do not train (a locked tower), in the dtype they are held in
    largest_block: int  # parameters of the largest block: what FSDP gathers at a time
    compute_bytes: int  # bytes of an element in the compute dtype: 2 under bf16 / fp16 autocast, 4 in fp32
    saved: SavedBytes  # what the trained part keeps for backward, by block (in the order they run)
    loss: PairBytes | None = None  # LiT: the contrastive loss of this GPU's rows against the global batch
    frozen_forward: int = 0  # LiT on images: bytes a sample of the locked tower's forward holds at its peak
    block_params: tuple[int, ...] = ()  # parameters that train in each of `saved.blocks`: their gradients
    input_bytes: int = 0  # bytes a sample of the batch takes on the GPU


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of a training run (see the module docstring)."""
    weights: int
    gradients: int
    optimizer: int
    activations: int  # the model's, at the micro-batch
    loss_logits: int  # the contrastive loss's (LiT; 0 for pretraining)
    inputs: int  # the batch on this GPU
    peak: int  # the most that gradients, activations and the loss logits hold at once (`_backward_peak`)
    gpus: int
    micro_batch: int
    levers: Levers

    @property
    def total(self) -> int:
        """The step's peak: weights, moments and the batch are held throughout; gradients and activations as
        `peak` counts them together."""
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
    # A locked tower runs before the text tower, so its forward's peak and the text side's are not held together
    # (the gradients of earlier micro-batches are, under accumulation).
    frozen = count.frozen_forward * micro
    peak = ddp_buckets + max(_backward_peak(count, micro, levers, shards, activations, states, loss_logits),
                             frozen + (states if levers.accum_steps > 1 else 0))
    return MemoryPlan(weights=states + count.frozen_bytes, gradients=states + ddp_buckets,
                      optimizer=count.trainable * _ADAM_BYTES // shards, activations=max(activations, frozen),
                      loss_logits=loss_logits, inputs=count.input_bytes * local, peak=peak,
                      gpus=gpus, micro_batch=micro, levers=levers)


def _backward_peak(count: ModelCount, micro: int, levers: Levers, shards: int, activations: int, gradients: int,
                   loss_logits: int) -> int:
    """The most that the trained part's `activations` (the forward's, FSDP's gathered blocks included), its
    `gradients` (this GPU's share) and the loss logits hold at once in a step (see the module docstring): the
    end of the forward (every activation, the loss), then backward at each block from the last to the first
    (the activations of the blocks before it and its own, the gradients of the blocks after it and its own),
    then its end (every gradient)."""
    fsdp = levers.sharding == "fsdp"
    saved = count.saved
    gathered = 2 * count.largest_block * count.compute_bytes if fsdp else 0  # under fsdp: held throughout
    if levers.accum_steps > 1:  # the first micro-batch's gradients are held through every later one
        return activations + loss_logits + gradients
    blocks = [block.at(micro) if not fsdp else block.per_sample * micro for block in saved.blocks]
    # With checkpointing a block before the one in backward holds its input only; that one, recomputed, its all.
    before = [i.at(micro) for i in saved.block_inputs] if levers.grad_checkpointing else blocks
    block_gradients = [params * 4 // shards for params in count.block_params] or [0] * len(blocks)
    walk = [saved.stem.at(micro) + sum(before[:k]) + blocks[k] + sum(block_gradients[k:])
            for k in range(len(blocks))]
    # The gradients outside the blocks (embeddings, final norm, head) counted at the end only: an embedding's
    # arrives last, and the head's are small.
    start, end = activations + loss_logits, gathered + saved.stem.at(micro) + gradients
    return max(start, end, *(gathered + step for step in walk))


def levers_that_fit(count: ModelCount, batch_size: int, gpus: int, gpu_bytes: int, current: Levers) -> list[Levers]:
    """The least changes to `current` under which the plan fits, best first: fewer levers changed, then
    grad_checkpointing before sharding before accum_steps (the smallest accum_steps that does it). []: none."""
    local = micro_batch_size(batch_size, gpus, 1)
    accums = [a for a in range(current.accum_steps, local + 1) if local % a == 0]
    shardings = dict.fromkeys([current.sharding, "fsdp" if gpus > 1 else current.sharding])
    fitting = []
    for checkpointing in dict.fromkeys([current.grad_checkpointing, True]):
        for sharding in shardings:
            for accum in accums:  # the smallest that fits; a larger one is no lesser change
                levers = Levers(checkpointing, sharding, accum)
                if levers != current and plan_memory(count, batch_size, gpus, levers).fits(gpu_bytes):
                    fitting.append(levers)
                    break
    least = [lv for lv in fitting if not any(other != lv and _lesser(other, lv, current) for other in fitting)]
    order = {"grad_checkpointing": 0, "sharding": 1, "accum_steps": 2}
    return sorted(least, key=lambda lv: (len(lv.changes(current)),
                                         [order[c.split("=")[0]] for c in lv.changes(current)], lv.accum_steps))


def _lesser(a: Levers, b: Levers, current: Levers) -> bool:
    """Whether `a` changes no more than `b` does: each of its changes is one of b's, accum_steps no larger."""
    return (a.grad_checkpointing == current.grad_checkpointing or a.grad_checkpointing == b.grad_checkpointing) and \
        (a.sharding == current.sharding or a.sharding == b.sharding) and a.accum_steps <= b.accum_steps


def fewest_gpus(count: ModelCount, batch_size: int, gpu_bytes: int, current: Levers, most: int = 1024):
    """(GPUs, levers): the fewest GPUs (dividing the batch) on which some levers make the plan fit; None if none."""
    for gpus in (n for n in range(1, min(most, batch_size) + 1) if batch_size % n == 0):
        if plan_memory(count, batch_size, gpus, current).fits(gpu_bytes):
            return gpus, current
        fitting = levers_that_fit(count, batch_size, gpus, gpu_bytes, current)
        if fitting:
            return gpus, fitting[0]
    return None


# ---- counting a config's model --------------------------------------------------------------------------

def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype the run will compute in (None: fp32). `auto` is bf16 here unless this machine's GPU
    lacks it: a plan made without a GPU is for the GPUs these runs are for (bf16: compute capability 8.0 or more)."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else None
    return autocast_dtype(precision, torch.device("cuda"))


def _element_bytes(dtype: torch.dtype | None) -> int:
    return torch.finfo(dtype or torch.float32).bits // 8


def count_pretrain(tower: str, options: dict, num_classes: int, precision: str, loss: str = "softmax") -> ModelCount:
    """What pretraining the registered `tower` (with `options`) under a head of `num_classes` keeps."""
    dtype = compute_dtype(precision)
    model = create_image_tower(tower, device="meta", **{**options, "num_classes": num_classes})

    def step(tower: VisionTransformer, batch: int) -> torch.Tensor:
        cfg = tower.cfg
        logits = tower(torch.empty(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device="cuda"))
        if loss == "sigmoid":
            task = F.binary_cross_entropy_with_logits(logits, torch.empty_like(logits), reduction="none").sum(-1).mean()
        else:
            task = F.cross_entropy(logits, torch.zeros(batch, dtype=torch.long, device="cuda"))
        return task + tower.moe_aux_loss()

    trainable, largest, block_params = _parameter_counts(model)
    cfg = model.cfg
    return ModelCount(trainable=trainable, frozen_bytes=0, largest_block=largest, compute_bytes=_element_bytes(dtype),
                      saved=count_saved_bytes(model, step, dtype), block_params=block_params,
                      input_bytes=_image_bytes(cfg) + 8)  # normalized fp32 images (`normalize_batch`), int64 labels


def count_lit(cfg: LiTConfig) -> ModelCount:
    """What LiT training of `cfg` keeps: the text tower (with the image head and the scale) trains, the image
    tower is locked (with cached features it never runs; on images its forward keeps nothing for backward)
    but for its last `unlocked_blocks`; the contrastive loss scores this GPU's rows against the global batch."""
    dtype = compute_dtype(cfg.precision)
    tower = _image_tower(cfg.image_tower)  # ours or a timm model's, on the meta device
    tower_cfg = tower.cfg  # both give width, size, channels
    text = _lit_text_side(cfg, tower_cfg.width)
    trainable, largest, block_params = _parameter_counts(text)
    locked_text = sum(p.numel() for p in text.parameters() if not p.requires_grad) * 4  # kept fp32, no moments
    saved = count_saved_bytes(text, _lit_text_step(tower_cfg.width), dtype)
    on_images = cfg.unlocked_blocks or not _cached_features(cfg.data.train)
    # The batch on the GPU: fp32 images (or cached fp32 features) and int64 text ids.
    input_bytes = (_image_bytes(tower_cfg) if on_images else tower_cfg.width * 4) + text.text_tower.context_length * 8
    unlocked = (0, 0)
    frozen_forward = 0
    if cfg.unlocked_blocks:  # the last blocks and what runs after them train in fp32
        layers = check_unlockable(tower, cfg.unlocked_blocks)
        n = cfg.unlocked_blocks
        last = [layers.block_parameters(i) for i in range(-n, 0)]  # each unlocked block's parameters
        trained = layers.unlocked(n)
        for name, param in tower.named_parameters():
            param.requires_grad_(name in trained)
        sizes = {name: p.numel() for name, p in tower.named_parameters()}
        block_sizes = [sum(sizes[name] for name in block) for block in last]
        unlocked = (sum(sizes[name] for name in trained), max(block_sizes))
        blocks = [modules_of(tower, block) for block in last]
        tower_saved = count_saved_bytes(tower, _pooled_step, dtype, blocks)  # spent: only sizes are read after
        # The tower runs first: its unlocked blocks come before the text tower's in the order blocks run.
        saved = SavedBytes(stem=saved.stem, blocks=tower_saved.blocks + saved.blocks,
                           block_inputs=tower_saved.block_inputs + saved.block_inputs,
                           head=Bytes(saved.head.fixed + tower_saved.head.fixed,
                                      saved.head.per_sample + tower_saved.head.per_sample))
        block_params = tuple(block_sizes) + block_params
        trainable, largest = trainable + unlocked[0], max(largest, unlocked[1])
    elif on_images:  # locked, it runs without a graph: what its tensors hold at once, at most (its input aside)
        tower.to(dtype or torch.float32)  # held in the dtype it runs in (`LiTModel.hold_locked_image_in`)
        frozen_forward = max(count_peak_bytes(tower, _pooled_step, dtype).per_sample - _image_bytes(tower_cfg), 0)
    # The locked part is held in the dtype it runs in (`inference_dtype`: the compute dtype).
    frozen_bytes = (sum(p.numel() for p in tower.parameters()) - unlocked[0]) * _element_bytes(dtype)
    loss = count_pair_bytes(_lit_loss(cfg), tower_cfg.width, dtype)
    return ModelCount(trainable=trainable, frozen_bytes=frozen_bytes + locked_text, largest_block=largest,
                      compute_bytes=_element_bytes(dtype), saved=saved, loss=loss, frozen_forward=frozen_forward,
                      block_params=block_params, input_bytes=input_bytes)


def _image_bytes(cfg) -> int:
    """Bytes of one fp32 image of a tower's input size (a tower config: ours or a timm model's)."""
    return cfg.in_channels * cfg.image_size * cfg.image_size * 4


def _cached_features(train: str) -> bool:
    """Whether data.train holds cached features; a split not found here is planned as images (more memory)."""
    try:
        return is_feature_cache(train)
    except UserError:
        return False


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int, tuple[int, ...]]:
    """(trainable parameters, the largest block's parameters, each block's trainable parameters) of a model built
    on the meta device; its blocks as `count_saved_bytes` finds them."""
    blocks = largest_module_list(model)
    largest = max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0)
    trained = tuple(sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks)
    return sum(p.numel() for p in model.parameters() if p.requires_grad), largest, trained


def _image_tower(path: str) -> torch.nn.Module:
    """The tower of a LiT config's `image_tower` (a folder or a `timm:` spec), on the meta device."""
    return tower_skeleton(read_tower_meta(path).get("tower"), path)  # one line when the folder is no tower


def _lit_text_side(cfg: LiTConfig, width: int) -> LiTModel:
    """The trained side of the LiT model, on the meta device: text tower (locked as the config locks it), image
    head, scale (and bias)."""
    with torch.device("meta"):
        text = create_text_tower(cfg.text, embed_dim=width, pretrained_weights=False)
        return LiTModel(None, text, loss=cfg.loss, temperature_init=cfg.temperature_init, image_head=cfg.image_head,
                        text_locked=cfg.text.locked, text_unlocked_layers=cfg.text.unlocked_layers)


def _lit_text_step(width: int):
    def step(model: LiTModel, batch: int) -> torch.Tensor:
        ids = torch.zeros(batch, model.text_tower.context_length, dtype=torch.long, device="cuda")
        zimg, ztxt = model(image_features=torch.empty(batch, width, device="cuda"), text=ids)[:2]
        return zimg.sum() + ztxt.sum()  # a sum keeps nothing: the loss is counted on its own
    return step


def _lit_loss(cfg: LiTConfig):
    """The recipe's loss of (zimg, ztxt) with the model's learned scale (and bias) as parameters."""
    def loss(zimg: torch.Tensor, ztxt: torch.Tensor) -> torch.Tensor:
        scale = zimg.new_tensor(cfg.temperature_init, requires_grad=True)  # made on the (fake) GPU of zimg
        if cfg.loss == "sigmoid":
            return sigmoid_loss(zimg, ztxt, scale, zimg.new_tensor(-10.0, requires_grad=True), gather=False)
        return contrastive_loss(zimg, ztxt, scale, gather=False)
    return loss


def _pooled_step(tower: VisionTransformer, batch: int) -> torch.Tensor:
    cfg = tower.cfg
    return tower.forward_pooled(torch.empty(batch, cfg.in_channels, cfg.image_size, cfg.image_size,
                                            device="cuda")).float().sum()


# ---- a config's plan: what --plan prints and what a recipe checks at its start ---------------------------

def count_config(cfg: PretrainConfig | LiTConfig) -> tuple[ModelCount, str]:
    """What training `cfg` keeps, and one line saying what was counted (and what was assumed)."""
    if isinstance(cfg, LiTConfig):
        count = count_lit(cfg)
        inputs = "cached features" if _cached_features(cfg.data.train) else "images"
        found = "" if inputs == "cached features" or _split_exists(cfg.data.train) else \
            " (data.train is not found here: planned as images, which need more)"
        return count, (f"LiT: {cfg.text.kind} text tower, {count.trainable / 1e6:,.1f}M parameters trained, against "
                       f"the locked tower {cfg.image_tower} on {inputs}{found}")
    num_classes, note = _class_count(cfg.data.train)
    try:
        count = count_pretrain(cfg.tower.name, dict(cfg.tower.options), num_classes, cfg.precision, cfg.loss)
    except (TypeError, ValueError) as err:  # e.g. a width that the number of heads does not divide
        raise UserError(f"tower {cfg.tower.name!r} with options {dict(cfg.tower.options)}: {err}") from None
    return count, f"pretrain {cfg.tower.name}, {num_classes:,} classes{note}: {count.trainable / 1e6:,.1f}M parameters"


def _split_exists(train: str) -> bool:
    try:
        dataset_dir(train)
        return True
    except UserError:
        return False


def _class_count(train: str) -> tuple[int, str]:
    """(classes, a note): those of data.train's classnames.txt, else ImageNet-1k's 1,000 (the head is a small
    part of a paper-scale tower, so its size barely moves the plan)."""
    try:
        folder = dataset_dir(train)
    except UserError:
        folder = None
    names = read_classnames_file(folder / CLASSNAMES_FILE) if folder is not None else None
    if names:
        return len(names), ""
    return 1000, " (assumed: data.train has no classnames.txt here)"


def plan_report(cfg: PretrainConfig | LiTConfig, gpus: int, gpu_bytes: int) -> tuple[str, bool]:
    """(the plan as `--plan` prints it, whether it fits)."""
    count, what = count_config(cfg)
    levers = Levers.of(cfg)
    plan = plan_memory(count, cfg.batch_size, gpus, levers)
    lines = [f"memory plan: {what}",
             f"batch {cfg.batch_size:,} on {_gpus(gpus)}: micro-batch {plan.micro_batch:,} per GPU, "
             f"{precision_name(compute_dtype(cfg.precision))}; sharding={levers.sharding} "
             f"grad_checkpointing={str(levers.grad_checkpointing).lower()} accum_steps={levers.accum_steps}",
             ""]
    unit, size = ("GiB", _GIB) if plan.total >= _GIB else ("MiB", 1 << 20)
    lines.append(f"{'per GPU':<24}{unit:>8}")
    rows = [("weights", plan.weights, " (trained: fp32; a locked tower: as it runs)" if count.frozen_bytes else ""),
            ("gradients", plan.gradients, " (with DDP's all-reduce buckets)" if plan.gpus > 1 and
             levers.sharding == "none" else ""),
            ("optimizer (AdamW)", plan.optimizer, ""),
            ("activations", plan.activations, " (counted: saved for backward)")]
    if count.loss is not None:
        rows.append(("loss logits", plan.loss_logits, f" ({cfg.batch_size // gpus:,} × {cfg.batch_size:,}, both ways)"))
    rows.append(("inputs", plan.inputs, " (the batch on the GPU)"))
    rows.append(("total", plan.total, " (the step's peak: backward frees activations as gradients arrive)"
                 if levers.accum_steps == 1 else " (gradients held whole through the micro-batches)"))
    lines += [f"  {name:<22}{value / size:>8.1f}{note}" for name, value, note in rows]
    fits = plan.fits(gpu_bytes)
    lines.append(f"{'GPU memory':<24}{gpu_bytes / size:>8.1f} (a plan may fill {GPU_FILL:.0%}: "
                 f"{GPU_FILL * gpu_bytes / size:.1f})")
    lines.append(f"{'fits':<24}{'yes' if fits else 'no':>8}")
    if not fits:
        lines.append(f"does not fit: {_verdict(count, cfg.batch_size, gpus, gpu_bytes, levers)}")
    lines.append("an estimate: activations counted on the meta device, eager, with the GPU's fused attention "
                 "(docs/training.md, \"Scaling up\")")
    return "\n".join(lines), fits


def _verdict(count: ModelCount, batch_size: int, gpus: int, gpu_bytes: int, levers: Levers) -> str:
    """What would make a plan that does not fit fit: levers, else more GPUs."""
    fitting = levers_that_fit(count, batch_size, gpus, gpu_bytes, levers)
    if fitting:
        options = [f"{' '.join(lv.changes(levers))} ({plan_memory(count, batch_size, gpus, lv).total / _GIB:.1f} GiB "
                   "per GPU)" for lv in fitting]
        return "set " + "; or ".join(options)
    more = fewest_gpus(count, batch_size, gpu_bytes, levers)
    if more is None:
        return "no lever makes it fit on up to 1,024 GPUs of this size"
    changes = " ".join(more[1].changes(levers))
    return f"no lever makes it fit on {_gpus(gpus)}; on {more[0]} it fits" + (f" with {changes}" if changes else "")


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n > 1 else ''}"


def visible_gpu_bytes() -> int | None:
    """The memory of this process's GPU; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(local_rank() % torch.cuda.device_count()).total_memory


def check_plan_fits(cfg: PretrainConfig | LiTConfig) -> None:
    """At a recipe's start on a GPU: a run whose plan does not fit this GPU (for the launcher's process
    count) is refused in one line naming the levers that make it fit. Nothing without CUDA, or with
    LIT_SOFTMOE_IGNORE_PLAN=1 (the plan is an estimate)."""
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
    raise UserError(f"this run needs about {plan.total / _GIB:.1f} GiB per GPU, more than {GPU_FILL:.0%} of this GPU's "
                    f"{gpu_bytes / _GIB:.1f} GiB: {_verdict(count, cfg.batch_size, gpus, gpu_bytes, levers)} "
                    f"(`lit-softmoe {command} --plan` shows the plan; {IGNORE_PLAN_ENV}=1 runs it anyway)")
