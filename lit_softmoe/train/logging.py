"""Run metrics: one JSON line per record in `metrics.jsonl`, the same scalars in TensorBoard, PNG curves.

Only the main process writes. On resume, records past the resumed step are dropped first, so the
file tells one consistent story even when a killed run had logged beyond its last checkpoint; a
finished run rerun (it resumes at its last step and evaluates again) also drops its final
evaluation's records, so the new ones replace them instead of repeating them. A run
killed mid-append (or a full disk) can leave a torn last line: readers drop it with a warning, and
the resume's rewrite goes through a temporary file, so a kill then cannot lose the log.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import write_text_atomic

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
            logger.warning("%s: dropping its torn last line %r (a run killed while logging)", path, line[:60])
    return records


class RunLogger:
    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / "metrics.jsonl"
        self._writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is a dependency, but a missing one must not stop training
                self._writer = None

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
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None and "step" in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, record["step"])
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return _parse_records(path)


def plot_curves(records: list[dict], out_png: str | Path, keys: tuple[str, ...], title: str = "") -> Path | None:
    """One panel per metric in `keys` against step; returns the PNG path (None if nothing to plot)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.4), squeeze=False)
    for ax, key in zip(axes[0], present):
        points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
