"""Run metrics: one JSON line per record in `metrics.jsonl`, the same scalars in the experiment
trackers (`log_with`: TensorBoard by default, through accelerate), PNG curves.

metrics.jsonl is the record the toolkit reads back (curves.png, resume, tests); the trackers get a
copy of each record's numbers. Only the main process writes. On resume, records past the resumed
step are dropped first, so the file tells one consistent story even when a killed run had logged
beyond its last checkpoint; a finished run rerun (it resumes at its last step and evaluates again)
also drops its final evaluation's records, so the new ones replace them instead of repeating them.
A run killed mid-append (or a full disk) can leave a torn last line: readers drop it with a
warning, and the resume's rewrite goes through a temporary file, so a kill then cannot lose the log.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import naming_full_disk, write_text_atomic

logger = logging.getLogger(__name__)


def _parse_records(path: Path) -> list[dict]:
    """The records of a metrics file. A last line that is not JSON is what a kill mid-append leaves:
    dropped. A bad line anywhere else is not something a kill does, so it is reported."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise UserError(f"{path} line {number} is not JSON ({line[:60]!r}); "
                                "fix or delete that line") from None
            logger.warning("%s: dropping its torn last line %r (a run killed while logging)", path,
                           line[:60])
    return records


class RunLogger:
    """Appends records to RUN/metrics.jsonl and sends their numbers to `accelerator`'s trackers
    (those `init_trackers` started; none without an accelerator)."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, accelerator=None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / "metrics.jsonl"
        self._accelerator = accelerator if enabled else None

    def truncate_after(self, step: int, final: bool = False) -> None:
        """Drop records with a step beyond `step` (what a killed run logged after its checkpoint).
        `final`: `step` is the run's last, whose final evaluation is about to run again, so its
        records at `step` are dropped too. They are the ones without a loss: every training record
        has one, and periodic evaluations stop before the last step."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in _parse_records(self.path) if record.get("step", 0) <= step]
        if final:
            kept = [record for record in kept if record.get("step", 0) < step or "loss" in record]
        # Atomic: a kill during the rewrite leaves the old file or the new one, never a half of one.
        write_text_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with naming_full_disk(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.send_to_trackers(record)

    def send_to_trackers(self, record: dict) -> None:
        """The record's numbers to the trackers, at its step (a record without one has no place on a
        curve)."""
        if self._accelerator is None or not self._accelerator.trackers or "step" not in record:
            return
        numbers = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        if numbers:
            self._accelerator.log(numbers, step=record["step"])

    def close(self) -> None:
        """Finish the trackers (flush and close their files or runs). Not
        `accelerator.end_training()`: that also destroys the process group, which the recipe still
        waits on after this."""
        if self._accelerator is not None:
            for tracker in self._accelerator.trackers:
                tracker.finish()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return _parse_records(path)


_PANEL = (4.5, 3.4)  # inches, one metric's


def _margins(panels: int, title: bool) -> dict:
    """Fixed margins, in inches, as `subplots_adjust` fractions: room for the tick labels, the
    "step" label and the titles. `tight_layout` measured every text of a drawn figure first: a
    second whole draw, 45% of a run's closing plot."""
    width, height = _PANEL[0] * panels, _PANEL[1]
    left, right, bottom, top, gap = 0.75, 0.25, 0.5, 0.6 if title else 0.35, 0.85
    axes_width = (width - left - right - (panels - 1) * gap) / panels
    return {"left": left / width, "right": 1 - right / width, "bottom": bottom / height,
            "top": 1 - top / height, "wspace": gap / axes_width}


def curves_figure(records: list[dict], keys: tuple[str, ...], title: str = ""):
    """One panel per metric in `keys` against step, as a matplotlib Figure (no pyplot state: the
    caller draws or saves it); None if no record has any of them."""
    from matplotlib.figure import Figure

    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        return None
    fig = Figure(figsize=(_PANEL[0] * len(present), _PANEL[1]))
    fig.subplots_adjust(**_margins(len(present), bool(title)))
    for ax, key in zip(fig.subplots(1, len(present), squeeze=False)[0], present):
        points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        ax.plot([p[0] for p in points], [p[1] for p in points],
                marker="." if len(points) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def plot_curves(records: list[dict], out_png: str | Path, keys: tuple[str, ...],
                title: str = "") -> Path | None:
    """`curves_figure` saved as a PNG; returns its path (None if nothing to plot)."""
    fig = curves_figure(records, keys, title)
    if fig is None:
        return None
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)  # Agg: a Figure made without pyplot draws with it
    return out_png
