"""Experiment trackers through accelerate (`log_with: [tensorboard, wandb, mlflow, ...]`).

accelerate's trackers do the work: `Accelerator(log_with=...)`, `init_trackers(project, config)`,
`accelerator.log(values, step=...)` on the main process only. This module checks the names before
any work, keeps TensorBoard in RUN/tensorboard (where the toolkit always wrote it) and makes a
resumed run tell TensorBoard the same story as metrics.jsonl, which stays the record the toolkit
reads back.
"""
from __future__ import annotations

import difflib
import time
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, TensorBoardTracker, get_available_trackers
from accelerate.utils import LoggerType
from omegaconf import OmegaConf

from lit_softmoe.errors import UserError
from lit_softmoe.train.logging import read_metrics

# The pip extra that installs each tracker's package (pyproject.toml); tensorboard is a dependency.
TRACKER_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "aim": "aim", "comet_ml": "comet_ml",
                  "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
                  "trackio": "trackio"}
TENSORBOARD_FOLDER = "tensorboard"  # RUN/tensorboard


def check_trackers(log_with) -> None:
    """One line (UserError) for a name accelerate does not know, or a tracker whose package is
    missing: accelerate itself would drop that tracker with a debug message, and the run would log
    nowhere."""
    available = {str(tracker) for tracker in get_available_trackers()}
    for name in log_with:
        # "all" too: which trackers a run logs to must not depend on the machine
        if name not in LOGGER_TYPE_TO_CLASS:
            close = difflib.get_close_matches(name, LOGGER_TYPE_TO_CLASS, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"log_with names {name!r}, a tracker accelerate does not know{hint}; "
                            f"choose from {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}, or "
                            "log_with=[] for metrics.jsonl alone")
        # a registered custom tracker has no package
        if name in LoggerType.list() and name not in available:
            install = (f"pip install 'lit-softmoe[{TRACKER_EXTRAS[name]}]'"
                       if name in TRACKER_EXTRAS else f"pip install {name}")
            raise UserError(f"log_with names {name!r}, but its package is not installed: "
                            f"{install}, or drop {name} from log_with")


def accelerator_trackers(log_with, run_dir) -> list:
    """`log_with` as `Accelerator(log_with=...)` takes it. TensorBoard is an instance of
    accelerate's tracker writing to RUN/tensorboard: given by name, it would write to
    RUN/<project name>."""
    trackers = []
    for name in dict.fromkeys(log_with):  # a name twice is one tracker
        trackers.append(TensorBoardTracker(TENSORBOARD_FOLDER, str(run_dir))
                        if name == "tensorboard" else name)
    return trackers


def _flat_config(config) -> dict:
    """The config as flat `a.b: value` pairs of the types every tracker stores (TensorBoard's
    hparams take numbers, strings and booleans only: a list is written as its text)."""
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = (value if isinstance(value, (bool, int, float, str))
                                          else str(value))
    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return flat


def _after_the_newest_event_file(folder: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a resumed run's purge_step hides
    what the files before its own hold from that step on: its file must sort last. The name starts
    with the second the file was opened (then host, pid and a per-process count that is not
    zero-padded: 10 sorts before 9), so a run restarted within the second its folder's newest file
    was opened waits for the next second. Only runs shorter than a second ever wait."""
    names = [p.name.split(".") for p in folder.glob("events.out.tfevents.*")]
    opened = [int(name[3]) for name in names if len(name) > 3 and name[3].isdigit()]
    if opened:
        time.sleep(max(0.0, max(opened) + 1 - time.time()))


def start_trackers(accelerator, logger, config, step: int) -> None:
    """Start `accelerator`'s trackers for the run (call on the main process, after `logger` dropped
    the records past `step`), with the config as the run's hyperparameters.

    Resuming at `step`: TensorBoard hides what the earlier files hold from `step` on
    (SummaryWriter's purge_step: a killed run may have logged past its checkpoint), and the records
    metrics.jsonl kept at `step` are sent again, so TensorBoard shows what metrics.jsonl holds.
    wandb, mlflow and the others start a new run each time (unless told to resume one, e.g.
    WANDB_RUN_ID + WANDB_RESUME); it holds the steps after `step` and the records at `step`."""
    if not accelerator.log_with:
        return
    run_dir = logger.run_dir
    for tracker in accelerator.log_with:
        # Ours (accelerator_trackers); its SummaryWriter opens in start(), which init_trackers calls
        # (accelerate >= 1.8), so its keyword arguments can still change here.
        if isinstance(tracker, TensorBoardTracker):
            tracker.init_kwargs["purge_step"] = step
            _after_the_newest_event_file(run_dir / TENSORBOARD_FOLDER)
    # The run folder names the run; wandb keeps its files there rather than in the working
    # directory.
    init_kwargs = {"wandb": {"name": run_dir.name, "dir": str(run_dir)},
                   "mlflow": {"run_name": run_dir.name}}
    try:
        accelerator.init_trackers(config.log_project, config=_flat_config(config),
                                  init_kwargs=init_kwargs)
    except Exception as err:
        # a tracker's own setup: a login, a server, a mode (WANDB_MODE=offline)
        names = ", ".join(str(getattr(t, "name", t)) for t in accelerator.log_with)
        raise UserError(f"starting the trackers ({names}) failed: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:300]}; fix that tracker's set-up or drop it "
                        "from log_with") from None
    if step > 0:
        for record in read_metrics(logger.path):
            if record.get("step") == step:
                logger.send_to_trackers(record)
