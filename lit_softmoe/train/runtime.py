"""What every recipe sets up first: threads, precision and the accelerate object."""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Iterator

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from lit_softmoe.config import to_yaml
from lit_softmoe.data.shards import CLASSNAMES_FILE, NSHARDS_FILE, SIZES_FILE
from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import RUN_CONFIG, checkpoints_newest_first, latest_checkpoint
from lit_softmoe.train.checkpoint import DamagedCheckpoint, load_training_state
from lit_softmoe.train.logging import RunLogger
from lit_softmoe.train.trackers import accelerator_trackers, check_trackers, start_trackers
from lit_softmoe.utils.atomic import write_text_atomic
from lit_softmoe.utils.device import autocast_dtype, precision_name
from lit_softmoe.utils.distributed import is_main_process
from lit_softmoe.utils.locks import LOCK_FILE, folder_lock
from lit_softmoe.utils.paths import check_folder_destination, check_writable

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def run_folder_lock(run_dir: str | Path) -> Iterator[None]:
    """One run at a time in a run folder: a second process training into it (another config, or the
    same command twice) is refused in one line instead of mixing its metrics, config and checkpoints
    with the first one's. Taken by the main process only (the other processes of a distributed run
    write nothing there); released when the block ends or the process dies."""
    if not is_main_process():
        yield
        return
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    refuse = "wait for that run to end, or start this one with another run_dir=..."
    with folder_lock(run_dir, refuse=refuse):
        try:
            yield
        except BaseException:
            # A mistake found before any work (a setting, the data) left the run folder that the
            # lock created holding the lock file alone: it goes, as it went before there was a lock.
            with contextlib.suppress(OSError):  # never hides the error itself
                if created and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
                    (run_dir / LOCK_FILE).unlink()
                    run_dir.rmdir()
            raise


def create_accelerator(precision: str = "auto", threads: int = 0, log_with=(),
                       run_dir=None) -> Accelerator:
    """`precision`: auto (bf16 on GPUs that support it, else fp32) | fp32 | bf16 | fp16 (autocast
    with a loss scaler: `accelerator.backward` scales the loss, `clip_grad_norm_` unscales the
    gradients and a step whose gradients overflowed is skipped). `log_with`: the experiment trackers
    (checked here, before any work), writing under `run_dir`; `open_run_folder` starts them."""
    check_trackers(log_with)
    if threads > 0:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mixed_precision = precision_name(autocast_dtype(precision, device)).replace("fp32", "no")
    # cpu=True on GPU-less machines: accelerate only forms a multi-process (gloo) group on the CPU
    # when told so, e.g. under `torchrun --nproc_per_node 2`.
    trackers = accelerator_trackers(log_with, run_dir)
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available(),
                              log_with=trackers or None,
                              project_dir=None if run_dir is None else str(run_dir))
    if mixed_precision == "fp16" and accelerator.scaler is None:
        # accelerate keeps fp16 autocast and loss scaling to accelerators; torch has both on the CPU
        # too, so fp16 runs the same step everywhere (slowly on a CPU: it is for GPUs without bf16).
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler(device.type)
    return accelerator


def loss_scaler_state(accelerator: Accelerator) -> dict | None:
    """The fp16 loss scaler's state (its scale and growth counter) for a checkpoint;
    None without one."""
    return accelerator.scaler.state_dict() if accelerator.scaler is not None else None


def restore_loss_scaler(accelerator: Accelerator, state: dict | None) -> None:
    """Put a checkpoint's loss-scaler state back, so a resumed fp16 run scales as the
    uninterrupted one."""
    if accelerator.scaler is not None and state:
        accelerator.scaler.load_state_dict(state)


def resume_state(checkpoints_dir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 total_steps: int, skip_prefixes: tuple[str, ...] = (),
                 load=load_training_state) -> tuple[int, dict, object]:
    """(step, the checkpoint's JSON metadata, the checkpoint) from the newest complete checkpoint,
    restored into `model` and `optimizer` by `load` (`sharded_checkpoint.load_sharded_state` for a
    sharded run); (0, {}, None) when there is none.

    A checkpoint past `total_steps` is refused: steps/epochs may change on a rerun to extend a run,
    but a shorter rerun would save the longer run's model as the shorter one (and its learning
    rates were those of the longer schedule)."""
    checkpoints = checkpoints_newest_first(checkpoints_dir)
    for latest in checkpoints:
        try:
            meta = load(latest, model, optimizer, skip_prefixes=skip_prefixes)
            break
        except DamagedCheckpoint as damage:
            # a disk filled or a copy cut short: the one before still holds
            _log.warning("%s is damaged (%s); resuming from the checkpoint before it", latest,
                         damage)
    else:
        if checkpoints:
            raise UserError(f"every checkpoint in {checkpoints_dir} is damaged (the newest: "
                            f"{checkpoints[0]}); restore them from a copy, or delete the folder to "
                            "start the run over")
        return 0, {}, None
    if meta["step"] > total_steps:
        raise UserError(f"{Path(checkpoints_dir).parent} holds a checkpoint at step "
                        f"{meta['step']}, past the {total_steps} steps this config trains; set "
                        "steps (or epochs) to at least that, or start this run with another "
                        "run_dir=...")
    return meta["step"], meta, latest


# Config keys a rerun into a run folder may change and still resume the run there: they set how
# long to train (steps/epochs extend a run; the learning-rate schedule stretches to the new end),
# how often to log, evaluate and checkpoint, which experiment trackers get a copy of the metrics
# (adding wandb to a run half done changes neither metrics.jsonl nor the model), how fast the same
# computation runs, or what only the final evaluation reports (two of them are what error messages
# tell a user to change and rerun). Every other key (the towers, the data and its order,
# data.workers included since the shards are split per worker, the optimizer, the loss, batch size,
# seed, the eval set logged during training) makes a different run, which a checkpoint of this one
# must not start.
RESUMABLE_KEYS = frozenset({
    "run_dir", "steps", "epochs",
    "log_every", "eval_every", "eval.every", "checkpoint_every", "keep_checkpoints",
    "threads", "compile", "precision", "eval_batch_size", "log_with", "log_project",
    "fewshot_shots", "eval.probe_train", "data.max_bad_fraction",
})


def _flatten(node: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} → {"a.b": 1}; an empty mapping (tower.options: {}) adds no key."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_UNSET = object()  # a key one of the two configs lacks


def _show(value) -> str:
    return "(unset)" if value is _UNSET else repr(value) if value == "" else str(value)


def check_run_dir(run_dir, output: str) -> None:
    """Refuse (one line) before any work a `run_dir` the run cannot use: a file, a read-only place,
    a link that loops where it writes its `output` folder (tower/ or model/) at the end, or a folder
    that holds something other than a run (a dataset, an export, a feature cache, a tower), which a
    run written there would spoil."""
    check_writable(run_dir, "run_dir", folder=True)
    run_dir = Path(run_dir)
    check_folder_destination(run_dir / output)  # now, not after training
    held = (_other_folder_kind(run_dir) if run_dir.is_dir() and not (run_dir / RUN_CONFIG).is_file()
            else None)
    # (a run writes its config.yaml before anything else; a user's own log file is welcome)
    if held is not None:
        raise UserError(f"run_dir {run_dir} holds {held}, not a run (it has no {RUN_CONFIG}), and "
                        "a run there would mix its files in; give a new or empty run_dir")


# What the folders lit-softmoe writes are recognized by: (a file or folder that only that kind
# holds, in words).
_FOLDER_MARKS = (("config.json", "an export, a tower or a model (config.json)"),
                 (NSHARDS_FILE, f"a dataset split ({NSHARDS_FILE})"),
                 (SIZES_FILE, f"a dataset split ({SIZES_FILE})"),
                 ("embed.json", "a feature cache (embed.json)"),
                 (CLASSNAMES_FILE, f"a dataset ({CLASSNAMES_FILE})"))


def _other_folder_kind(folder: Path) -> str | None:
    """The kind of folder `folder` is, in words, when it is one that lit-softmoe writes and no run:
    an export, a tower, a dataset or one of its splits, a feature cache, a run's checkpoints; else
    None."""
    for name, words in _FOLDER_MARKS:
        if (folder / name).exists():
            return words
    if any(folder.glob("*.tar")):
        return "shards (.tar files)"
    if any(folder.glob("*/nshards.txt")) or any(folder.glob("*/embed.json")):
        return "a dataset or feature cache (splits with nshards.txt or embed.json)"
    if any(folder.glob("step_*/state.json")):
        return "a run's checkpoints (step_N folders)"
    return None


def check_training_length(config) -> None:
    """`steps` wins when above 0, else `epochs` sets the length: both 0 would save an
    untrained model."""
    if config.steps <= 0 and config.epochs <= 0:
        raise UserError("steps=0 and epochs=0 train nothing; set steps=N or epochs=E (steps wins "
                        "when both are set)")


def check_same_run(run_dir, config) -> None:
    """Refuse (UserError, one line) to continue a run folder that holds another run: one whose
    config.yaml differs from `config` in a key outside RESUMABLE_KEYS, when the folder holds what
    this run would resume from or replace (a checkpoint, tower/ or model/). Without this check a
    different config silently resumed the old run's checkpoint and rewrote its config.yaml."""
    run_dir = Path(run_dir)
    saved_file = run_dir / RUN_CONFIG
    holds_run = latest_checkpoint(run_dir / "checkpoints") is not None \
        or (run_dir / "tower").is_dir() or (run_dir / "model").is_dir()
    if not saved_file.is_file() or not holds_run:
        # nothing to resume or replace: a run killed before its first checkpoint starts afresh
        return
    try:
        saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_file)) or {})
    except Exception as err:
        raise UserError(f"cannot read {saved_file} ({' '.join(str(err).split())}); "
                        "pass a new run_dir=...") from None
    new = _flatten(OmegaConf.to_container(OmegaConf.structured(config)))
    _check_same_recipe(run_dir, saved, new)
    # Every key of the schema is in a config.yaml this version saved; free-form mappings
    # (tower.options) hold what the run was given, so a key one side lacks there is a difference
    # like any other.
    schema = _flatten(OmegaConf.to_container(OmegaConf.structured(type(config))))
    lacking = sorted(key for key in schema.keys() - saved.keys() if key not in RESUMABLE_KEYS)
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise UserError(f"{saved_file} has no {', '.join(lacking[:3])}{more} (saved by another "
                        "version of lit-softmoe), so the run there cannot be resumed; start this "
                        "one with another run_dir=...")
    held_ep, new_ep = saved.get("expert_parallel", 1), new.get("expert_parallel", 1)
    if held_ep != new_ep:  # the same training either way, but its checkpoints are laid out by it
        raise UserError(f"{run_dir} was trained with expert_parallel={held_ep} and this run sets "
                        f"{new_ep}: each process's checkpoint file holds the expert chunks of "
                        "that layout, which are not resharded; rerun with "
                        f"expert_parallel={held_ep}, or start with another run_dir=...")
    changed = []
    for key in sorted(saved.keys() | new.keys()):
        if key in RESUMABLE_KEYS:
            continue
        old, value = saved.get(key, _UNSET), new.get(key, _UNSET)
        if old != value:
            changed.append(f"{key}: {_show(old)} → {_show(value)}")
    if changed:
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise UserError(f"{run_dir} holds another run ({', '.join(changed[:6])}{more}: its "
                        "config.yaml → this config); start this one with another run_dir=..., or "
                        "rerun with that one's config to resume it (steps, epochs and logging may "
                        "change)")


# What names a recipe's run: the key only its config has (LiT's locked tower, pretraining's tower
# to train).
_RECIPES = {"image_tower": "a LiT run (`lit-softmoe train`)",
            "tower": "a pretraining run (`lit-softmoe pretrain`)"}


def _check_same_recipe(run_dir: Path, saved: dict, new: dict) -> None:
    """Refuse a run folder of the other recipe in its own words (it read as one of
    another version)."""
    def recipe(keys) -> str | None:
        return next((name for key, name in _RECIPES.items()
                     if any(k == key or k.startswith(f"{key}.") for k in keys)),
                    None)

    held, this = recipe(saved), recipe(new)
    if held is not None and this is not None and held != this:
        raise UserError(f"{run_dir} holds {held}, and this is {this}; start this one with another "
                        "run_dir=...")


def open_run_folder(run_dir, config, step: int, is_main: bool, total_steps: int | None = None,
                    accelerator=None):
    """Write the run's config.yaml and open its metrics log, dropping records past `step`
    (what a killed run logged after its last checkpoint). At `step` == `total_steps` (a finished
    run rerun, or one killed after its final evaluation) the final evaluation runs again, so its
    earlier records are dropped as well: a rerun does not log them twice. Then `accelerator`'s
    experiment trackers start (`start_trackers`); the logger sends them each record."""
    logger = RunLogger(run_dir, enabled=is_main, accelerator=accelerator)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Renamed into place: a kill mid-write must not leave a half config for check_same_run.
        write_text_atomic(run_dir / RUN_CONFIG, to_yaml(config))
        logger.truncate_after(step, final=step == total_steps)
        if accelerator is not None:
            start_trackers(accelerator, logger, config, step)
    return logger


def global_loss(accelerator: Accelerator, loss: torch.Tensor, step: int) -> float:
    """The loss averaged over all processes (the global batch's); a non-finite one stops the run."""
    value = accelerator.reduce(loss.detach(), reduction="mean").item()
    if not math.isfinite(value):
        raise UserError(f"training diverged: loss is {value} at step {step}; "
                        "lower optim.lr or lengthen optim.warmup")
    return value
