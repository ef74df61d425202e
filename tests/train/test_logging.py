"""lit_softmoe.train.logging: metrics.jsonl survives a torn last line and is truncated atomically."""
import json
from pathlib import Path

import pytest

from lit_softmoe.errors import UserError
from lit_softmoe.train.logging import RunLogger, read_metrics


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
