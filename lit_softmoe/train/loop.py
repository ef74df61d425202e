"""The training skeleton both recipes share (pretraining, LiT): what happens around their own
model, data and loss.

A recipe reads top to bottom against it:

    run = start_run(cfg, "pretrain", check_settings)    # refusals first, then accelerate
    ... its model, optimizer and data; run.total_steps, run.steps_per_epoch ...
    checkpoint_meta, latest = resume(run, model, optimizer)
    ... its own checks of the checkpoint ...
    announce_resume(run, latest)
    ... accelerator.prepare, compile ...
    open_run(run)
    train(run, model, module, optimizer, batches, StepFunctions(...))
    ... its final evaluation and saved model ...
    return finish_run(run, results, curve_keys, title)

`train` owns the step: the learning rate, the recipe's forward and backward over its
micro-batches, gradient clipping, the optimizer step, then the log, evaluation and checkpoint
cadence. A checkpoint holds the model, optimizer and RNG state (`checkpoint`,
`sharded_checkpoint`) plus the recipe's metadata, so a resumed run continues exactly where the
uninterrupted one would be.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from lit_softmoe.train.checkpoint import load_training_state, prune_checkpoints, save_training_state
from lit_softmoe.train.logging import RunLogger, plot_curves, read_metrics
from lit_softmoe.train.memory_plan import check_plan_fits
from lit_softmoe.train.optim import long_warmup_warning, lr_at, set_lr
from lit_softmoe.train.runtime import (
    check_same_run,
    check_training_length,
    create_accelerator,
    global_loss,
    loss_scaler_state,
    open_run_folder,
    restore_loss_scaler,
    resume_state,
)
from lit_softmoe.train.sharded_checkpoint import load_sharded_state, save_sharded_state
from lit_softmoe.train.sharding import check_sharding, clip_grad_norm
from lit_softmoe.utils.atomic import write_text_atomic

_log = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    """One run's place: its config (a `config.TrainingRunConfig`), accelerate, its folder, and
    how far it has trained. `total_steps` and `steps_per_epoch` are the recipe's to set once its
    data is read."""
    cfg: Any
    accelerator: Accelerator
    run_dir: Path
    sharded: bool  # sharding=fsdp: every process holds 1/N of the model and writes its shards
    total_steps: int = 0
    steps_per_epoch: int = 0
    step: int = 0  # optimizer steps done
    train_seconds: float = 0.0  # time in training steps, over every resume
    # The open logging window: the step and train_seconds of the last metrics record.
    last_log_step: int = 0
    last_log_seconds: float = 0.0
    logger: RunLogger | None = None

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def say(self, line: str) -> None:
        """Print `line` once per run, on the main process (accelerate's `print` prints once per
        machine: N times in a log of N nodes)."""
        if self.is_main:
            print(line, flush=True)

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def no_sync(self, model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
        """The context each micro-batch's backward but the last runs in: DDP then syncs the
        gradients once per step; FSDP reduce-scatters after each micro-batch, so that no process
        ever holds a whole gradient."""
        if self.sharded:
            return contextlib.nullcontext
        return lambda: self.accelerator.no_sync(model)


def start_run(cfg, command: str, check_settings: Callable[[Any], None],
              make_accelerator: Callable[..., Accelerator] = create_accelerator) -> TrainingRun:
    """Everything that can refuse the run before any work (another run in the folder, the
    length, the recipe's `check_settings`, a memory plan that does not fit), then accelerate and
    the process group that sharding needs. `command`: the CLI command, named in sharding's
    errors. `make_accelerator`: `runtime.create_accelerator`'s signature (a recipe passes the
    name it imported, which tests replace)."""
    run_dir = Path(cfg.run_dir)
    check_same_run(run_dir, cfg)  # before any work: a folder of another run is not resumed
    check_training_length(cfg)
    check_settings(cfg)  # settings torch would refuse only once the model is built
    check_plan_fits(cfg)  # on a GPU: a run that would not fit is refused now, naming the lever
    # The experiment trackers are checked here.
    accelerator = make_accelerator(cfg.precision, cfg.threads, cfg.log_with, run_dir)
    # needs the launch's process group
    check_sharding(cfg.sharding, cfg.precision, command, cfg.expert_parallel)
    return TrainingRun(cfg=cfg, accelerator=accelerator, run_dir=run_dir,
                       sharded=cfg.sharding == "fsdp")


def resume(run: TrainingRun, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           skip_prefixes: tuple[str, ...] = ()) -> tuple[dict, Path | None]:
    """Restore the newest complete checkpoint of the run folder, if any, into `model` and
    `optimizer`, and the run's step, training time, logging window and fp16 loss scale;
    → (its metadata, where it is), or ({}, None) for a run that starts now.
    `skip_prefixes`: what its checkpoints leave out."""
    load = load_sharded_state if run.sharded else load_training_state
    run.step, meta, latest = resume_state(run.checkpoints_dir, model, optimizer, run.total_steps,
                                          skip_prefixes=skip_prefixes, load=load)
    run.train_seconds = meta.get("train_seconds", 0.0)
    run.last_log_step, run.last_log_seconds = run.step, run.train_seconds
    restore_loss_scaler(run.accelerator, meta.get("loss_scaler"))  # fp16: the scale it reached
    return meta, latest


def announce_resume(run: TrainingRun, latest: Path | None) -> None:
    """Called after every check of the checkpoint: a refused run says one line, no warning
    first."""
    warning = long_warmup_warning(run.cfg.optim, run.total_steps)
    if warning and run.is_main:
        _log.warning(warning)
    if latest is not None:
        run.say(f"resuming from {latest} (step {run.step} of {run.total_steps})")


def open_run(run: TrainingRun) -> None:
    """Write config.yaml and open metrics.jsonl (and the trackers), from the run's step on."""
    run.logger = open_run_folder(run.run_dir, run.cfg, run.step, run.is_main, run.total_steps,
                                 run.accelerator)


@dataclass(frozen=True)
class LogWindow:
    """What `train` hands a recipe to build a metrics record: the steps since the last one."""
    step: int
    epoch: float
    loss: float  # the global batch's, averaged over processes
    lr: float
    rate: float  # samples per second of training time over the window
    steps: int  # steps in the window
    grad_norm: torch.Tensor | None  # before clipping; None without clipping


@dataclass
class StepFunctions:
    """A recipe's part of each training step.

    forward_backward(batch) → the step's loss (detached): the forward and backward passes over
        the batch's `accum_steps` micro-batches, gradients left in the parameters
        (`TrainingRun.no_sync`).
    log_record(window) → the metrics record of a log step.
    checkpoint_meta() → what a checkpoint stores besides the model, optimizer and RNG (read back
        by the recipe after `resume`); "train_seconds" and "loss_scaler" are added to it.
    evaluate() → metrics logged at an evaluation step (None on processes that log nothing).
        Called on every process: a sharded model is gathered first, a collective.
    after_update(): after each optimizer step (e.g. a cap on a parameter).
    """
    forward_backward: Callable[[Any], torch.Tensor]
    log_record: Callable[[LogWindow], dict]
    checkpoint_meta: Callable[[], dict]
    evaluate: Callable[[], dict | None] | None = None
    after_update: Callable[[], None] | None = None


def train(run: TrainingRun, model: torch.nn.Module, module: torch.nn.Module,
          optimizer: torch.optim.Optimizer, batches: Iterable, step_functions: StepFunctions, *,
          desc: str, eval_every: int = 0, skip_prefixes: tuple[str, ...] = (),
          time_data_wait: bool = False) -> None:
    """Train from `run.step` to `run.total_steps`, one step per batch of `batches`, which ends
    there (a recipe's batches may read one past the last step, as its loader did).

    `model`: what runs the step (possibly DDP- or compile-wrapped); `module`: the plain module
    that checkpoints save, sharing its parameters. `eval_every`: steps between evaluations (0:
    none during training). `skip_prefixes`: what an unsharded checkpoint leaves out.
    `time_data_wait`: count the wait for each batch in train_seconds (and the logged rate)."""
    cfg, accelerator = run.cfg, run.accelerator
    model.train()
    progress = tqdm(total=run.total_steps, initial=run.step, desc=desc, disable=not run.is_main,
                    dynamic_ncols=True)
    batches = iter(batches)
    while True:
        fetch_tic = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        tic = fetch_tic if time_data_wait else time.perf_counter()
        lr = lr_at(run.step, run.total_steps, cfg.optim)
        set_lr(optimizer, lr)
        loss = step_functions.forward_backward(batch)
        grad_norm = None
        if cfg.optim.grad_clip > 0:  # a sharded model's gradients are DTensors, maybe on two meshes
            grad_norm = (clip_grad_norm(model.parameters(), cfg.optim.grad_clip) if run.sharded
                         else accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
        optimizer.step()
        if step_functions.after_update is not None:
            step_functions.after_update()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        progress.update(1)
        run.train_seconds += time.perf_counter() - tic
        step = run.step

        if step % cfg.log_every == 0 or step == run.total_steps:
            loss_value = global_loss(accelerator, loss, step)
            window_steps = step - run.last_log_step
            seconds = max(run.train_seconds - run.last_log_seconds, 1e-9)
            run.last_log_step, run.last_log_seconds = step, run.train_seconds
            run.logger.log(step_functions.log_record(LogWindow(
                step=step, epoch=step / run.steps_per_epoch, loss=loss_value, lr=lr,
                rate=cfg.batch_size * window_steps / seconds, steps=window_steps,
                grad_norm=grad_norm)))
            progress.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}")
        if step_functions.evaluate is not None and eval_every and step % eval_every == 0 \
                and step < run.total_steps:
            metrics = step_functions.evaluate()
            if run.is_main:
                run.logger.log({"step": step, **metrics})
        if step % cfg.checkpoint_every == 0 or step == run.total_steps:
            # Also between log records (a log step checked it already): a diverged model is
            # never saved, or a rerun would resume it.
            if step % cfg.log_every and step != run.total_steps:
                global_loss(accelerator, loss, step)
            _save_checkpoint(run, module, optimizer, step_functions.checkpoint_meta(),
                             skip_prefixes)
    progress.close()


def _save_checkpoint(run: TrainingRun, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     meta: dict, skip_prefixes: tuple[str, ...]) -> None:
    run.accelerator.wait_for_everyone()
    meta = {"train_seconds": run.train_seconds, "loss_scaler": loss_scaler_state(run.accelerator),
            **meta}
    folder = run.checkpoints_dir / f"step_{run.step:08d}"
    if run.sharded:  # every process writes its shards
        save_sharded_state(folder, run.step, module, optimizer, meta=meta)
    elif run.is_main:
        save_training_state(folder, run.step, module, optimizer, meta=meta,
                            skip_prefixes=skip_prefixes)
    if run.is_main:
        prune_checkpoints(run.checkpoints_dir, run.cfg.keep_checkpoints)


def finish_run(run: TrainingRun, results: dict, curve_keys: tuple[str, ...], title: str) -> dict:
    """results.json and curves.png (main process), then every process waits for the others."""
    if run.is_main:
        # Atomic: a kill mid-write must not leave half a JSON file for export's model card.
        write_text_atomic(run.run_dir / "results.json", json.dumps(results, indent=2) + "\n")
        plot_curves(read_metrics(run.logger.path), run.run_dir / "curves.png", keys=curve_keys,
                    title=title)
    run.logger.close()
    run.accelerator.wait_for_everyone()
    return results
