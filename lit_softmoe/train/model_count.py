"""What training a config's model keeps, counted once on the meta device (`ModelCount`: the
parameters that train, the weights held, what backward keeps, the inputs), whatever the batch, the
GPUs and the levers: the memory plan (`train.memory_plan`) scales it to a run."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.data.feature_cache import is_feature_cache
from lit_softmoe.data.shards import CLASSNAMES_FILE, dataset_dir, read_classnames_file
from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower, list_image_towers
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.models.timm_tower import is_timm_spec
from lit_softmoe.models.tower_folder import read_tower_meta, tower_skeleton
from lit_softmoe.models.tower_layers import check_unlockable, modules_of
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.nn.soft_moe import SoftMoE
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
from lit_softmoe.utils.device import PRECISIONS, autocast_dtype


@dataclass(frozen=True)
class ExpertCount:
    """A model's Soft MoE layers, what expert parallelism (`expert_parallel`) splits and moves.
    Every Soft MoE layer of a ViT has the same experts n, slots per expert p and width d."""
    per_layer: int = 0  # n; 0: no Soft MoE layer
    slots: int = 0  # n·p·d: a layer's slots per sample, what one of its all-to-alls moves
    layers: int = 0
    backward_layers: int = 0  # of them, those that train (their backward runs)
    forward_layers: int = 0  # those that run forward only (a locked tower on images)
    trained: int = 0  # expert parameters that train (part of ModelCount.trainable)
    frozen_bytes: int = 0  # locked expert weights, as held (part of ModelCount.frozen_bytes)
    # (parameters, expert parameters) of each block that FSDP gathers as one unit
    blocks: tuple[tuple[int, int], ...] = ()

    def largest_gathered(self, expert_parallel: int, largest_block: int) -> int:
        """Parameters of the largest block FSDP gathers: under expert parallelism each gathers its
        expert chunk, n/E experts (`largest_block`: without it)."""
        if expert_parallel == 1 or not self.blocks:
            return largest_block
        return max(p - e + e // expert_parallel for p, e in self.blocks)


@dataclass(frozen=True)
class ModelCount:
    """What one training step of a model keeps, whatever the batch, the GPUs and the levers
    (counted once)."""
    trainable: int  # parameters that train: fp32 weights, gradients and AdamW's moments
    frozen_bytes: int  # weights that do not train (a locked tower), in the dtype they are held in
    largest_block: int  # parameters of the largest block: what FSDP gathers at a time
    # bytes of an element in the compute dtype: 2 under bf16 / fp16 autocast, 4 in fp32
    compute_bytes: int
    saved: SavedBytes  # what the trained part keeps for backward, by block (in the order they run)
    # LiT: the contrastive loss of this GPU's rows against the global batch
    loss: PairBytes | None = None
    # LiT on images: bytes a sample of the locked tower's forward holds at its peak
    frozen_forward: int = 0
    # parameters that train in each of `saved.blocks`: their gradients
    block_params: tuple[int, ...] = ()
    input_bytes: int = 0  # bytes a sample of the batch takes on the GPU
    experts: ExpertCount = ExpertCount()  # the Soft MoE experts (none: zeros)


# ---- counting a config's model -------------------------------------------------------------------

def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype the run will compute in (None: fp32). `auto` is bf16 here unless this
    machine's GPU lacks it: a plan made without a GPU is for the GPUs these runs are for (bf16:
    compute capability 8.0 or more)."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return (torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
                else None)
    return autocast_dtype(precision, torch.device("cuda"))


def _element_bytes(dtype: torch.dtype | None) -> int:
    return torch.finfo(dtype or torch.float32).bits // 8


def count_pretrain(tower: str, options: dict, num_classes: int, precision: str,
                   loss: str = "softmax") -> ModelCount:
    """What pretraining the registered `tower` (with `options`) under a head of `num_classes`
    keeps."""
    dtype = compute_dtype(precision)
    model = create_image_tower(tower, device="meta", **{**options, "num_classes": num_classes})

    def step(tower: VisionTransformer, batch: int) -> torch.Tensor:
        cfg = tower.cfg
        logits = tower(torch.empty(batch, cfg.in_channels, cfg.image_size, cfg.image_size,
                                   device="cuda"))
        if loss == "sigmoid":
            task = F.binary_cross_entropy_with_logits(logits, torch.empty_like(logits),
                                                      reduction="none").sum(-1).mean()
        else:
            task = F.cross_entropy(logits, torch.zeros(batch, dtype=torch.long, device="cuda"))
        return task + tower.moe_aux_loss()

    trainable, sizes, block_params = _parameter_counts(model)
    blocks = [_parameter_names(model, block) for block in largest_module_list(model)]
    experts = _expert_count(model, set(dict(model.named_parameters())), runs=True, held_bytes=4,
                            blocks=blocks)
    cfg = model.cfg
    return ModelCount(trainable=trainable, frozen_bytes=0, largest_block=max(sizes, default=0),
                      compute_bytes=_element_bytes(dtype),
                      saved=count_saved_bytes(model, step, dtype), block_params=block_params,
                      # normalized fp32 images (`normalize_batch`), int64 labels
                      input_bytes=_image_bytes(cfg) + 8, experts=experts)


def count_lit(cfg: LiTConfig) -> ModelCount:
    """What LiT training of `cfg` keeps: the text tower (with the image head and the scale) trains,
    the image tower is locked (with cached features it never runs; on images its forward keeps
    nothing for backward) but for its last `unlocked_blocks`; the contrastive loss scores this GPU's
    rows against the global batch."""
    dtype = compute_dtype(cfg.precision)
    tower = _image_tower(cfg.image_tower)  # ours or a timm model's, on the meta device
    tower_cfg = tower.cfg  # both give width, size, channels
    text = _lit_text_side(cfg, tower_cfg.width)
    trainable, text_sizes, block_params = _parameter_counts(text)
    largest = max(text_sizes, default=0)
    # kept fp32, no moments
    locked_text = sum(p.numel() for p in text.parameters() if not p.requires_grad) * 4
    saved = count_saved_bytes(text, _lit_text_step(tower_cfg.width), dtype)
    on_images = cfg.unlocked_blocks or not _cached_features(cfg.data.train)
    # The batch on the GPU: fp32 images (or cached fp32 features) and int64 text ids.
    input_bytes = ((_image_bytes(tower_cfg) if on_images else tower_cfg.width * 4)
                   + text.text_tower.context_length * 8)
    unlocked = (0, 0)
    frozen_forward = 0
    trained, last = set(), []
    if cfg.unlocked_blocks:  # the last blocks and what runs after them train in fp32
        layers = check_unlockable(tower, cfg.unlocked_blocks)
        n = cfg.unlocked_blocks
        # each unlocked block's parameters
        last = [layers.block_parameters(i) for i in range(-n, 0)]
        trained = layers.unlocked(n)
        for name, param in tower.named_parameters():
            param.requires_grad_(name in trained)
        sizes = {name: p.numel() for name, p in tower.named_parameters()}
        block_sizes = [sum(sizes[name] for name in block) for block in last]
        unlocked = (sum(sizes[name] for name in trained), max(block_sizes))
        blocks = [modules_of(tower, block) for block in last]
        # spent: only sizes are read after
        tower_saved = count_saved_bytes(tower, _pooled_step, dtype, blocks)
        # The tower runs first: its unlocked blocks come before the text tower's in the order blocks
        # run.
        saved = SavedBytes(stem=saved.stem, blocks=tower_saved.blocks + saved.blocks,
                           block_inputs=tower_saved.block_inputs + saved.block_inputs,
                           head=Bytes(saved.head.fixed + tower_saved.head.fixed,
                                      saved.head.per_sample + tower_saved.head.per_sample))
        block_params = tuple(block_sizes) + block_params
        trainable, largest = trainable + unlocked[0], max(largest, unlocked[1])
    # names and sizes only: a count has moved the tower to the fake GPU, or will
    experts = _expert_count(tower, trained, runs=on_images, held_bytes=_element_bytes(dtype),
                            blocks=last)
    # FSDP gathers the unlocked blocks and the text tower's, which hold no experts
    experts = replace(experts, blocks=experts.blocks + tuple((p, 0) for p in text_sizes))
    if on_images and not cfg.unlocked_blocks:
        # locked, it runs without a graph: what its tensors hold at once, at most (its input aside)
        # held in the dtype it runs in (`LiTModel.hold_locked_image_in`)
        tower.to(dtype or torch.float32)
        frozen_forward = max(count_peak_bytes(tower, _pooled_step, dtype).per_sample
                             - _image_bytes(tower_cfg), 0)
    # The locked part is held in the dtype it runs in (`inference_dtype`: the compute dtype).
    frozen_bytes = ((sum(p.numel() for p in tower.parameters()) - unlocked[0])
                    * _element_bytes(dtype))
    loss = count_pair_bytes(_lit_loss(cfg), tower_cfg.width, dtype)
    return ModelCount(trainable=trainable, frozen_bytes=frozen_bytes + locked_text,
                      largest_block=largest, compute_bytes=_element_bytes(dtype), saved=saved,
                      loss=loss, frozen_forward=frozen_forward, block_params=block_params,
                      input_bytes=input_bytes, experts=experts)


def _image_bytes(cfg) -> int:
    """Bytes of one fp32 image of a tower's input size (a tower config: ours or a timm model's)."""
    return cfg.in_channels * cfg.image_size * cfg.image_size * 4


def _cached_features(train: str) -> bool:
    """Whether data.train holds cached features; a split not found here is planned as images
    (more memory)."""
    try:
        return is_feature_cache(train)
    except UserError:
        return False


def _parameter_counts(model: torch.nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(trainable parameters, each block's parameters, each block's trainable parameters) of a model
    built on the meta device; its blocks as `count_saved_bytes` finds them."""
    blocks = largest_module_list(model)
    sizes = tuple(sum(p.numel() for p in block.parameters()) for block in blocks)
    trained = tuple(sum(p.numel() for p in block.parameters() if p.requires_grad)
                    for block in blocks)
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sizes, trained


def _parameter_names(model: torch.nn.Module, module: torch.nn.Module) -> set[str]:
    """The names in `model` of `module`'s parameters."""
    prefix = next(name for name, m in model.named_modules() if m is module)
    return {f"{prefix}.{name}" for name, _ in module.named_parameters()}


def _expert_count(model: torch.nn.Module, trained: set[str], runs: bool, held_bytes: int,
                  blocks: list[set[str]]) -> ExpertCount:
    """`model`'s Soft MoE experts (`BatchedExperts`, what expert parallelism splits; the router's
    phi and scale stay with the other weights): `trained`, the names of the parameters that train;
    `runs`, whether its locked layers run (forward only); `held_bytes`, an element of a locked
    weight as held; `blocks`, the parameter names of each block FSDP gathers."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, SoftMoE)}
    if not layers:
        return ExpertCount()
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    owner = {f"{name}.experts.{p}": name for name, m in layers.items()
             for p, _ in m.experts.named_parameters()}
    trained_layers = {layer for name, layer in owner.items() if name in trained}
    first = next(iter(layers.values()))
    return ExpertCount(
        per_layer=first.num_experts, slots=first.num_experts * first.slots_per_expert * first.dim,
        layers=len(layers), backward_layers=len(trained_layers),
        forward_layers=len(layers) - len(trained_layers) if runs else 0,
        trained=sum(sizes[name] for name in owner if name in trained),
        frozen_bytes=sum(sizes[name] for name in owner if name not in trained) * held_bytes,
        blocks=tuple((sum(sizes[name] for name in block),
                      sum(sizes[name] for name in block if name in owner)) for block in blocks))


def _image_tower(path: str) -> torch.nn.Module:
    """The tower of a LiT config's `image_tower` (a folder or a `timm:` spec), on the meta device;
    for a plan only, a registered tower name too (`_registered`), so that a run can be planned
    before its tower is pretrained (training itself needs the folder)."""
    if _registered(path):
        return create_image_tower(path, device="meta")
    # one line when the folder is no tower (nor a registered name)
    return tower_skeleton(read_tower_meta(path).get("tower"), path)


def _registered(path: str) -> bool:
    """Whether a LiT config's `image_tower` names a registered tower rather than a folder (a folder
    of that name wins)."""
    return (not is_timm_spec(path) and path in list_image_towers()
            and not Path(path).exists())


def _lit_text_side(cfg: LiTConfig, width: int) -> LiTModel:
    """The trained side of the LiT model, on the meta device: text tower
    (locked as the config locks it), image head, scale (and bias)."""
    with torch.device("meta"):
        text = create_text_tower(cfg.text, embed_dim=width, pretrained_weights=False)
        return LiTModel(None, text, loss=cfg.loss, temperature_init=cfg.temperature_init,
                        image_head=cfg.image_head, text_locked=cfg.text.locked,
                        text_unlocked_layers=cfg.text.unlocked_layers)


def _lit_text_step(width: int):
    def step(model: LiTModel, batch: int) -> torch.Tensor:
        ids = torch.zeros(batch, model.text_tower.context_length, dtype=torch.long, device="cuda")
        zimg, ztxt = model(image_features=torch.empty(batch, width, device="cuda"), text=ids)[:2]
        return zimg.sum() + ztxt.sum()  # a sum keeps nothing: the loss is counted on its own
    return step


def _lit_loss(cfg: LiTConfig):
    """The recipe's loss of (zimg, ztxt) with the model's learned scale (and bias) as parameters."""
    def loss(zimg: torch.Tensor, ztxt: torch.Tensor) -> torch.Tensor:
        # made on the (fake) GPU of zimg
        scale = zimg.new_tensor(cfg.temperature_init, requires_grad=True)
        if cfg.loss == "sigmoid":
            return sigmoid_loss(zimg, ztxt, scale, zimg.new_tensor(-10.0, requires_grad=True),
                                gather=False)
        return contrastive_loss(zimg, ztxt, scale, gather=False)
    return loss


def _pooled_step(tower: VisionTransformer, batch: int) -> torch.Tensor:
    cfg = tower.cfg
    return tower.forward_pooled(torch.empty(batch, cfg.in_channels, cfg.image_size, cfg.image_size,
                                            device="cuda")).float().sum()


def count_config(cfg: PretrainConfig | LiTConfig) -> tuple[ModelCount, str]:
    """What training `cfg` keeps, and one line saying what was counted (and what was assumed)."""
    if isinstance(cfg, LiTConfig):
        count = count_lit(cfg)
        inputs = "cached features" if _cached_features(cfg.data.train) else "images"
        found = "" if inputs == "cached features" or _split_exists(cfg.data.train) else \
            " (data.train is not found here: planned as images, which need more)"
        tower = cfg.image_tower + (" (registered: counted from its config, no weights read)"
                                   if _registered(cfg.image_tower) else "")
        return count, (f"LiT: {cfg.text.kind} text tower, {count.trainable / 1e6:,.1f}M parameters "
                       f"trained, against the locked tower {tower} on {inputs}{found}")
    num_classes, note = _class_count(cfg.data.train)
    try:
        count = count_pretrain(cfg.tower.name, dict(cfg.tower.options), num_classes, cfg.precision,
                               cfg.loss)
    except (TypeError, ValueError) as err:  # e.g. a width that the number of heads does not divide
        raise UserError(f"tower {cfg.tower.name!r} with options {dict(cfg.tower.options)}: "
                        f"{err}") from None
    return count, (f"pretrain {cfg.tower.name}, {num_classes:,} classes{note}: "
                   f"{count.trainable / 1e6:,.1f}M parameters")


def _split_exists(train: str) -> bool:
    try:
        dataset_dir(train)
        return True
    except UserError:
        return False


def _class_count(train: str) -> tuple[int, str]:
    """(classes, a note): those of data.train's classnames.txt, else ImageNet-1k's 1,000 (the head
    is a small part of a paper-scale tower, so its size barely moves the plan)."""
    try:
        folder = dataset_dir(train)
    except UserError:
        folder = None
    names = read_classnames_file(folder / CLASSNAMES_FILE) if folder is not None else None
    if names:
        return len(names), ""
    return 1000, " (assumed: data.train has no classnames.txt here)"
