"""Classification pretraining of an image tower: the recipe behind `lit-softmoe pretrain`.

`_pretrain` reads top to bottom (torchtune / big_vision style) against the skeleton both recipes
share (`train.loop`): set up accelerate, data, tower and optimizer; resume if the run folder holds a
checkpoint; train (this recipe's part of a step: `_step_functions`); save the tower as safetensors +
JSON for the LiT stage; evaluate it (test top-1 and the paper's 10-shot linear probe), adding the
results to its JSON.

Towers with the sparse baselines (Tokens Choice / Experts Choice, `lit_softmoe.nn.routers`) add
their balancing losses to the task loss (`aux_loss_weight`, V-MoE's 0.005) and report the fraction
of tokens no expert processed (`dropped_fraction`, in metrics.jsonl and results.json); Soft MoE and
dense towers have neither (0), so their training is unchanged.

The training split is either decoded into memory once (small sets of one size: Fashion-MNIST is
47 MB) or streamed from its shards by loader workers every epoch (any size, flat memory):
`data.loader`, and `lit_softmoe.data.class_batches` for both. Either way every batch is a function
of (seed, epoch, rank) and its position in the epoch, so a killed run resumed from its checkpoint
replays exactly the batches the uninterrupted run would have seen. The test split and the few-shot
probe's shots are read the way the training split is. A rerun into a run folder resumes only with
the same config, up to `runtime.RESUMABLE_KEYS` (training length, frequencies, speed); another
config there is refused, naming the keys that differ.

`init_from=FOLDER` starts a fresh run from a tower folder's weights (`upcycle`'s, `convert`'s, an
earlier run's) instead of a random init: `lit_softmoe.train.init_from` says what is kept and
checked.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from lit_softmoe.config import PretrainConfig, micro_batch_size
from lit_softmoe.data.class_batches import (
    InMemoryClassBatches,
    StreamedClassBatches,
)
from lit_softmoe.data.transforms import BatchNormalize
from lit_softmoe.errors import UserError
from lit_softmoe.evals.probes import fewshot_probe
from lit_softmoe.model_folders import checkpoints_newest_first
from lit_softmoe.models.preprocess import Preprocess, per_channel
from lit_softmoe.models.registry import create_image_tower, image_tower_config
from lit_softmoe.models.tower_folder import save_tower, update_tower_meta
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.train.accumulation import split_batch
from lit_softmoe.train.class_data import ClassData, fewshot_skip_reason, setup_class_data
from lit_softmoe.train.init_from import (
    check_unchanged,
    head_decision,
    load_init_weights,
    read_init_source,
)
from lit_softmoe.train.loop import (
    LogWindow,
    StepFunctions,
    TrainingRun,
    announce_resume,
    finish_run,
    open_run,
    resume,
    start_run,
    train,
)
from lit_softmoe.train.optim import check_optim_settings, create_optimizer
from lit_softmoe.train.runtime import check_run_dir, create_accelerator, run_folder_lock
from lit_softmoe.train.sharding import gather_tower, shard_tower
from lit_softmoe.utils.device import resolve_compile

_log = logging.getLogger(__name__)


def _validate_tower(cfg: PretrainConfig):
    """The tower's config, checked before any data is read (unknown names and options fail fast)."""
    if "num_classes" in cfg.tower.options:  # create_image_tower gets it from the class names below
        raise UserError("tower.options.num_classes cannot be set: the head has one output per "
                        "class name of data.train (its classnames.txt); leave the option out")
    try:
        tower_cfg = image_tower_config(cfg.tower.name, **cfg.tower.options)
        # The layers' own checks (slots_per_expert, a capacity_factor that leaves an expert no
        # place for the tower's tokens) would otherwise fail as a traceback at the first step.
        for block in VisionTransformer(tower_cfg, device="meta").blocks:
            if hasattr(block.mlp, "capacity"):
                block.mlp.capacity(tower_cfg.num_patches)
        return tower_cfg
    except (TypeError, ValueError) as err:  # e.g. a width that the number of heads does not divide
        raise UserError(f"tower {cfg.tower.name!r} with options {dict(cfg.tower.options)}: "
                        f"{err}") from None


def _check_normalization(cfg: PretrainConfig, tower_cfg) -> None:
    """data.mean and data.std give one value per channel of the tower's input (3 for a gray tower
    broadcast its pixels to RGB: a shape error at the first step), each std above 0."""
    mean, std, channels = list(cfg.data.mean), list(cfg.data.std), tower_cfg.in_channels
    if not mean and not std:
        return
    example = (f"data.mean=[{','.join(['0.5'] * channels)}] "
               f"data.std=[{','.join(['0.25'] * channels)}]")
    if len(mean) != channels or len(std) != channels:
        raise UserError(f"data.mean has {len(mean)} values and data.std {len(std)}, but tower "
                        f"{cfg.tower.name!r} takes {channels}-channel images; give one value per "
                        f"channel (e.g. {example}), or set both to [] to compute them from the "
                        "training images")
    if min(std) <= 0:
        raise UserError(f"data.std {std} holds a value ≤ 0 (pixels are divided by it); give "
                        "positive values, or set data.mean=[] data.std=[] to compute them from the "
                        "training images")


def _check_settings(cfg: PretrainConfig) -> None:
    """Settings torch refuses only once training runs (a traceback after the data is read), checked
    first."""
    if not 0.0 <= cfg.label_smoothing <= 1.0:
        raise UserError(f"label_smoothing must be in [0, 1], got {cfg.label_smoothing}")
    # _loss_fn's sigmoid loss has none: it would be ignored
    if cfg.label_smoothing and cfg.loss != "softmax":
        raise UserError(f"label_smoothing={cfg.label_smoothing:g} applies to loss=softmax only; "
                        f"set label_smoothing=0 with loss={cfg.loss}")
    check_optim_settings(cfg.optim)


def _loss_fn(cfg: PretrainConfig, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """labels: class indices (B,), or class probabilities (B, C) where mixup mixed the batch."""
    if cfg.loss == "sigmoid":
        targets = (labels.to(logits.dtype) if labels.ndim == 2
                   else F.one_hot(labels, logits.shape[-1]).to(logits.dtype))
        # Summed over classes, averaged over examples: big_vision's sigmoid_xent.
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1).mean()
    return F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)


@torch.inference_mode()
def _embed(tower, batches, normalize: BatchNormalize, accelerator, with_logits=True):
    """(features (N, d), logits (N, C) or None, labels (N,), fraction of MoE tokens dropped) for
    batches of (uint8 images, labels), no gradient."""
    tower.eval()
    features, logits, labels, dropped, count = [], [], [], 0.0, 0
    for images, batch_labels in batches:
        pixels = normalize(images.to(accelerator.device))
        with accelerator.autocast():
            tokens = tower.forward_features(pixels)  # (b, m, d)
            # pooled (b, d)
            features.append(tower.forward_head(tokens, pre_logits=True).float().cpu())
            if with_logits:
                logits.append(tower.forward_head(tokens).float().cpu())
        labels.append(batch_labels)
        dropped += float(tower.moe_dropped_fraction()) * len(pixels)
        count += len(pixels)
    tower.train()
    return (torch.cat(features), torch.cat(logits) if with_logits else None, torch.cat(labels),
            dropped / max(count, 1))


def _batches_from(train: InMemoryClassBatches | StreamedClassBatches, run: TrainingRun):
    """The training batches of steps `run.step` to `run.total_steps` - 1, epoch after epoch, each
    the uninterrupted run's batch of its step; none is read past the last (a stream's workers stop
    there)."""
    epoch, start = divmod(run.step, run.steps_per_epoch)
    while run.step < run.total_steps:
        with contextlib.closing(train.epoch(epoch, start)) as epoch_batches:
            for batch in epoch_batches:
                yield batch  # `train` takes its step before asking for the next one
                if run.step >= run.total_steps:
                    return
        epoch, start = epoch + 1, 0


def _test_top1(tower, data: ClassData, normalize: BatchNormalize, cfg, accelerator) -> float:
    _, logits, labels, _ = _embed(tower, data.test_batches(cfg.eval_batch_size), normalize,
                                  accelerator)
    return (logits.argmax(1) == labels).float().mean().item()


def _mixup(cfg: PretrainConfig, pixels: torch.Tensor, labels: torch.Tensor, num_classes: int,
           step: int, rank: int):
    """torchvision's MixUp on a normalized batch (one Beta(alpha, alpha) ratio, the batch mixed with
    itself rolled by one, as big_vision's mixup), its draw seeded with (seed, step, rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((cfg.seed * 1_000_003 + step) * 1013 + rank)
        return v2.MixUp(alpha=cfg.data.mixup, num_classes=num_classes)(pixels, labels)


def pretrain(cfg: PretrainConfig) -> dict:
    """Train the tower of `cfg` on its class shards; returns the final metrics."""
    # a file, a dataset there, a read-only parent: one line, now
    check_run_dir(cfg.run_dir, "tower")
    with run_folder_lock(cfg.run_dir):  # one run in a run folder at a time
        return _pretrain(cfg)


def _pretrain(cfg: PretrainConfig) -> dict:
    run = start_run(cfg, "pretrain", _check_settings, create_accelerator)
    accelerator = run.accelerator

    # ---- data, tower, optimizer
    resuming = bool(checkpoints_newest_first(run.checkpoints_dir))
    tower_cfg, source, data = _setup_data(cfg, run, resuming)
    tower, num_params = _setup_tower(cfg, run, tower_cfg, data, source, resuming)
    optimizer = create_optimizer(tower, cfg.optim)
    run.steps_per_epoch = data.train.steps_per_epoch
    if run.steps_per_epoch == 0:
        raise UserError(f"batch_size {cfg.batch_size} exceeds the {data.train.num_samples} "
                        "training images")
    run.total_steps = cfg.steps if cfg.steps > 0 else math.ceil(cfg.epochs * run.steps_per_epoch)

    # ---- resume from the newest complete checkpoint in the run folder
    checkpoint_meta, latest = resume(run, tower, optimizer)
    # What the run started from, as its checkpoint recorded it (also if that folder is gone).
    if latest is not None:
        check_unchanged(checkpoint_meta.get("init_from"), source)
        source = checkpoint_meta.get("init_from")
    # Normalized as the source tower was trained (and as the saved tower records).
    if source is not None:
        data.mean, data.std = source["preprocess"]["mean"], source["preprocess"]["std"]
    init_record = None if source is None else {k: v for k, v in source.items() if k != "classnames"}
    announce_resume(run, latest)
    # The plain module: saved, evaluated; `tower` may become DDP / compiled wrappers.
    tower_module = tower
    if not run.sharded:  # a sharded tower is FSDP's already: DDP would wrap it again
        tower, optimizer = accelerator.prepare(tower, optimizer)
    # Expert parallel runs eager: its all-to-alls and DTensor chunks have not been through
    # torch.compile on a GPU here (embed does the same).
    compiled = resolve_compile(cfg.compile, accelerator.device) and cfg.expert_parallel == 1
    if compiled:
        tower = torch.compile(tower)  # shares parameters with the module we save
    open_run(run)
    run.say(
        f"tower {cfg.tower.name}: {num_params / 1e6:.2f}M params, {data.train.num_samples} "
        f"train / {data.num_test} test images ({'streamed' if data.streamed else 'in memory'}), "
        f"{run.total_steps} steps of {cfg.batch_size}; on {accelerator.device}, "
        f"{accelerator.mixed_precision if accelerator.mixed_precision != 'no' else 'fp32'}, "
        f"{'compiled' if compiled else 'eager'} (compile={cfg.compile}"
        f"{f', expert_parallel={cfg.expert_parallel}' if cfg.expert_parallel > 1 else ''})")

    # ---- train
    # The open logging window and the dropped-token totals are part of the checkpoint: a resumed
    # run then logs, and reports in results.json, what the uninterrupted run does, also when a
    # checkpoint falls between two records.
    window = checkpoint_meta.get("log_window", {})
    run.last_log_step = window.get("step", run.step)
    run.last_log_seconds = window.get("seconds", run.train_seconds)
    routing = _RoutingStats(checkpoint_meta, window, accelerator.device)
    # The preprocessing the saved tower records; uint8 batches are normalized on the device.
    channels = tower_cfg.in_channels
    normalize = BatchNormalize(Preprocess(tower_cfg.image_size, channels,
                                          per_channel(data.mean, channels),
                                          per_channel(data.std, channels), cfg.data.decode))
    steps = _step_functions(cfg, run, tower, tower_module, data, normalize, routing, init_record,
                            is_moe=bool(tower_cfg.moe_layers))
    train(run, tower, tower_module, optimizer, _batches_from(data.train, run), steps,
          desc="pretrain", eval_every=cfg.eval_every, time_data_wait=True)

    # ---- save the tower, then evaluate it
    if run.sharded:  # the main process saves and evaluates a plain tower with the full weights
        tower_module = gather_tower(tower_module, accelerator.device)
    results = _save_and_evaluate(cfg, run, tower_module, data, normalize, num_params,
                                 init_record, routing, is_moe=bool(tower_cfg.moe_layers))
    return finish_run(run, results, curve_keys=("loss", "lr", "test_top1"),
                      title=f"pretrain {cfg.tower.name}")


def _setup_data(cfg: PretrainConfig, run: TrainingRun, resuming: bool) -> tuple:
    """(the tower's config, the init_from source or None, the class data), each checked before the
    next is read: a wrong tower name or init_from folder is said before any data is read."""
    accelerator = run.accelerator
    tower_cfg = _validate_tower(cfg)
    _check_normalization(cfg, tower_cfg)
    source = read_init_source(cfg.init_from, cfg.run_dir, cfg.tower.name, cfg.tower.options,
                              tower_cfg, resuming) if cfg.init_from else None
    # The batch splits evenly over processes and micro-batches, or one line says why not.
    micro_batch_size(cfg.batch_size, accelerator.num_processes, cfg.accum_steps)
    data = setup_class_data(cfg, tower_cfg, accelerator.process_index, accelerator.num_processes)
    if not data.streamed:  # said now, so that a user who wants the probe need not wait for the end
        fewshot_skipped = fewshot_skip_reason(cfg.fewshot_shots, data.train.labels, data.classnames)
        if fewshot_skipped:
            _log.warning(fewshot_skipped)
    return tower_cfg, source, data


def _setup_tower(cfg: PretrainConfig, run: TrainingRun, tower_cfg, data: ClassData,
                 source: dict | None, resuming: bool) -> tuple[torch.nn.Module, int]:
    """(the tower, random or init_from's weights, sharded where the run is; its parameter count)."""
    accelerator = run.accelerator
    torch.manual_seed(cfg.seed)
    # Sharded, the main process alone makes the weights (the others build the tower on the meta
    # device, no memory), and `shard_tower` sends each process its shards: a host holds one tower,
    # not one per GPU.
    weights_here = run.is_main or not run.sharded
    tower = create_image_tower(cfg.tower.name, num_classes=len(data.classnames),
                               device=None if weights_here else "meta", **cfg.tower.options)
    if source is not None and not resuming:  # a resumed run restores its own (trained) weights
        keep_head, why = head_decision(source, data.classnames)
        if weights_here:
            load_init_weights(tower, source, keep_head)
        source["head"] = "kept" if keep_head else "replaced"
        run.say(f"init_from {cfg.init_from}: weights loaded; class head "
                          f"{source['head']} ({why}); inputs normalized with its preprocess mean "
                          "and std")
    num_params = sum(p.numel() for p in tower.parameters())
    tower.set_grad_checkpointing(cfg.grad_checkpointing)
    if run.sharded:  # before the optimizer, which then holds (and updates) the shards
        shard_tower(tower, accelerator.device, cfg.expert_parallel)
    return tower, num_params


class _RoutingStats:
    """The sparse layers' balancing loss and fraction of tokens no expert processed: sums over the
    open logging window (device tensors: no sync per step) and the dropped totals of the run (this
    process's batches, for results.json). Saved in every checkpoint, restored from
    `checkpoint_meta`."""

    def __init__(self, checkpoint_meta: dict, window: dict, device: torch.device):
        self.window_aux = torch.tensor(window.get("aux", 0.0), device=device)
        self.window_dropped = torch.tensor(window.get("dropped", 0.0), device=device)
        self.dropped_steps = checkpoint_meta.get("dropped_steps", 0)
        self.dropped_total = checkpoint_meta.get("dropped_total", 0.0)

    def close_window(self, window_steps: int) -> dict:
        """The window's means per step, added to the run's totals; the window starts again."""
        record = {"aux_loss": float(self.window_aux) / window_steps,
                  "dropped_fraction": float(self.window_dropped) / window_steps}
        self.dropped_steps += window_steps
        self.dropped_total += float(self.window_dropped)
        self.window_aux.zero_()
        self.window_dropped.zero_()
        return record


def _step_functions(cfg: PretrainConfig, run: TrainingRun, tower, tower_module, data: ClassData,
                    normalize: BatchNormalize, routing: _RoutingStats,
                    init_record: dict | None, is_moe: bool) -> StepFunctions:
    """Pretraining's part of each step (`loop.StepFunctions`): `tower` runs the step (DDP- or
    compile-wrapped), `tower_module` is the plain tower under it."""
    accelerator = run.accelerator
    no_sync = run.no_sync(tower)

    def forward_backward(batch) -> torch.Tensor:
        # uint8 (local_batch, C, H, W), as the uninterrupted run's batch of this step
        pixels = normalize(batch.images.to(accelerator.device, non_blocking=True))
        labels = batch.labels.to(accelerator.device)
        if cfg.data.mixup:
            pixels, labels = _mixup(cfg, pixels, labels, len(data.classnames), run.step,
                                    accelerator.process_index)
        # accum_steps micro-batches, each loss / accum_steps: their gradients add up to the whole
        # batch's (mixup above mixed the whole batch, as without them).
        loss = 0.0
        micro_batches = split_batch((pixels, labels), cfg.accum_steps)
        for index, (micro_pixels, micro_labels) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else no_sync():
                with accelerator.autocast():
                    micro_loss = _loss_fn(cfg, tower(micro_pixels), micro_labels)
                    # The sparse layers' balancing losses from this forward (a zero tensor for other
                    # towers).
                    aux_loss = tower_module.moe_aux_loss()
                    micro_loss = (micro_loss + cfg.aux_loss_weight * aux_loss) / cfg.accum_steps
                accelerator.backward(micro_loss)
            loss = loss + micro_loss.detach()
            routing.window_aux += aux_loss.detach() / cfg.accum_steps
            # A tensor: no device sync.
            routing.window_dropped += tower_module.moe_dropped_fraction() / cfg.accum_steps
        return loss

    def log_record(window: LogWindow) -> dict:
        record = {"step": window.step, "epoch": window.epoch, "loss": window.loss, "lr": window.lr,
                  "train_seconds": round(run.train_seconds, 2),
                  "images_per_s": round(window.rate, 1)}
        if window.grad_norm is not None:
            record["grad_norm"] = float(window.grad_norm)
        if is_moe:  # means over the steps since the last record (this process's batches)
            record.update(routing.close_window(window.steps))
        return record

    def evaluate() -> dict | None:
        # The main process alone, on the plain module (no collective): the others go on to the next
        # step and wait for it at the gradient all-reduce. A sharded tower is gathered first (a
        # collective) into a plain copy there.
        eval_tower = gather_tower(tower_module, accelerator.device) if run.sharded else tower_module
        if not run.is_main:
            return None
        return {"test_top1": _test_top1(eval_tower, data, normalize, cfg, accelerator)}

    def checkpoint_meta() -> dict:
        init_from = {"init_from": init_record} if init_record else {}
        return {"dropped_steps": routing.dropped_steps, **init_from,
                "dropped_total": routing.dropped_total,
                "log_window": {"step": run.last_log_step, "seconds": run.last_log_seconds,
                               "aux": float(routing.window_aux),
                               "dropped": float(routing.window_dropped)}}

    return StepFunctions(forward_backward, log_record, checkpoint_meta, evaluate=evaluate)


def _save_and_evaluate(cfg: PretrainConfig, run: TrainingRun, tower_module, data: ClassData,
                       normalize: BatchNormalize, num_params: int,
                       init_record: dict | None, routing: _RoutingStats, is_moe: bool) -> dict:
    """Save the tower (main process), then evaluate it: test top-1 and the few-shot linear probe
    on frozen features. An evaluation that fails must not cost the training (a rerun resumes at the
    last step and evaluates again); its results are added to the tower's config.json after.
    → results."""
    accelerator = run.accelerator
    results = {"tower": cfg.tower.name, "params": num_params, "steps": run.total_steps,
               "train_seconds": round(run.train_seconds, 1)}
    if init_record:
        results["init_from"] = {k: init_record[k] for k in ("path", "tower_sha256", "head")}
    if not run.is_main:
        return results
    pretrain_meta = {"config": str(run.run_dir / "config.yaml"), **results}
    save_tower(run.run_dir / "tower", tower_module, extra={
        "classnames": data.classnames,
        "preprocess": {"image_size": tower_module.cfg.image_size, "mean": data.mean,
                       "std": data.std, "decode": cfg.data.decode},
        "pretrain": pretrain_meta,
    })
    eval_tic = time.perf_counter()
    test_features, test_logits, test_labels, test_dropped = _embed(
        tower_module, data.test_batches(cfg.eval_batch_size), normalize, accelerator)
    results["test_top1"] = (test_logits.argmax(1) == test_labels).float().mean().item()
    if is_moe:  # tokens no expert processed: in training (noisy routing) and on the test images
        results["dropped_fraction_train"] = routing.dropped_total / max(routing.dropped_steps, 1)
        results["dropped_fraction_test"] = test_dropped
    shots = data.shots(cfg.fewshot_shots, cfg.seed) if cfg.fewshot_shots > 0 else None
    if isinstance(shots, str):  # why the probe cannot run
        _log.warning(shots)
        results["fewshot_skipped"] = shots
    elif shots is not None:
        shot_images, shot_labels = shots
        shot_features, _, _, _ = _embed(tower_module, zip(shot_images.split(cfg.eval_batch_size),
                                                          shot_labels.split(cfg.eval_batch_size)),
                                        normalize, accelerator, with_logits=False)
        results.update(fewshot_probe(shot_features, shot_labels, test_features, test_labels,
                                     shots=cfg.fewshot_shots))
    results["eval_seconds"] = round(time.perf_counter() - eval_tic, 1)
    run.logger.log({"step": run.total_steps, **{k: v for k, v in results.items()
                                                if k.startswith(("test_", "fewshot", "dropped_"))
                                                and k != "fewshot_skipped"}})
    update_tower_meta(run.run_dir / "tower", {"pretrain": {**pretrain_meta, **results}})
    results["bad_samples"] = data.bad_samples()
    return results
