"""lit_softmoe.train.logging: metrics.jsonl survives a torn last line and is truncated atomically; the curves' panels
and their texts fit the figure."""
import json
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import list_image_towers
from lit_softmoe.train.logging import RunLogger, curves_figure, read_metrics


def _write_records(path: Path, steps) -> list[dict]:
    records = [{"step": step, "loss": 1.0 / step} for step in steps]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_a_torn_last_metrics_line_is_dropped(tmp_path):
    records = _write_records(tmp_path / "metrics.jsonl", [1, 2, 3])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.2')  # a run killed mid-append
    assert read_metrics(tmp_path / "metrics.jsonl") == records
    logger = RunLogger(tmp_path)
    logger.truncate_after(2)
    logger.log({"step": 3, "loss": 0.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [*records[:2], {"step": 3, "loss": 0.5}]


def test_a_bad_metrics_line_before_the_last_is_reported(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        RunLogger(tmp_path).truncate_after(1)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'


def test_truncating_the_metrics_is_atomic(tmp_path, monkeypatch):
    """A kill halfway through the rewrite leaves the old file whole."""
    records = _write_records(tmp_path / "metrics.jsonl", range(1, 50))
    write_text = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        write_text(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        RunLogger(tmp_path).truncate_after(10)
    monkeypatch.undo()
    assert read_metrics(tmp_path / "metrics.jsonl") == records


def test_a_full_disk_while_logging_a_record_names_the_metrics_file(tmp_path, monkeypatch):
    """The append's write() names no path: the CLI's one line could not say which file the disk refused."""
    import errno

    from lit_softmoe.train import logging as run_logging

    class FullFile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_logging, "open", lambda *args, **kwargs: FullFile(), raising=False)
    logger = RunLogger(tmp_path)
    with pytest.raises(OSError) as caught:
        logger.log({"step": 1, "loss": 0.5})
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "metrics.jsonl"))


@pytest.mark.parametrize("keys", [("loss",), ("loss", "lr"), ("loss", "lr", "test_top1")])
@pytest.mark.parametrize("title", ["", f"pretrain {max(list_image_towers(), key=len)}", "LiT transformer text tower"])
def test_every_text_of_the_curves_lies_inside_the_figure_and_off_the_other_panels(keys, title):
    # The widest labels a run logs: five-digit losses, a learning rate's 6-decimal ticks, 150,000 steps.
    records = [{"step": step, "loss": 12345.6 / (step + 1), "lr": 3e-4 * min(1.0, step / 10_000), "test_top1": 0.5}
               for step in range(0, 150_001, 5_000)]
    fig = curves_figure(records, keys, title)
    canvas = FigureCanvasAgg(fig)  # what savefig draws a PNG with
    canvas.draw()
    renderer = canvas.get_renderer()
    inside = fig.bbox.padded(-1)  # not cut at the edge
    panels = [ax.get_window_extent(renderer) for ax in fig.axes]
    assert len(panels) == len(keys)
    for i, ax in enumerate(fig.axes):
        (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
        ticks = [t for t in ax.get_xticklabels() if x0 <= t.get_position()[0] <= x1] + \
            [t for t in ax.get_yticklabels() if y0 <= t.get_position()[1] <= y1]  # those drawn
        texts = [ax.title, ax.xaxis.label, ax.yaxis.get_offset_text(), *ticks]
        for text in (t for t in texts if t.get_visible() and t.get_text()):
            box = text.get_window_extent(renderer)
            assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), (keys[i], text.get_text())
            assert not any(box.overlaps(other) for j, other in enumerate(panels) if j != i), (keys[i], text.get_text())
    if title:
        box = fig._suptitle.get_window_extent(renderer)
        assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
        assert all(box.y0 >= ax.title.get_window_extent(renderer).y1 for ax in fig.axes)  # above the panels' titles
