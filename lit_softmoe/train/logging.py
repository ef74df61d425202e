"""Run metrics: one JSON line per record in `metrics.jsonl`, the same scalars in TensorBoard, PNG curves.

Only the main process writes. On resume, records past the resumed step are dropped first, so the
file tells one consistent story even when a killed run had logged beyond its last checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path


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

    def truncate_after(self, step: int) -> None:
        """Drop records with a step beyond `step` (what a killed run logged after its checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

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
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
