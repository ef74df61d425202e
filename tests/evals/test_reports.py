"""lit_softmoe.evals.reports: the Markdown table of a suite's results."""
from __future__ import annotations

import pytest

from evalkit import FOOLBOX_DATA, suite_config, tiny_pair
from lit_softmoe.config import BenchmarkConfig
from lit_softmoe.evals.suite import run_suite

pytestmark = pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")


def test_markdown_rows_line_up_with_metrics_and_skips(fmnist, tmp_path):
    from lit_softmoe.evals.suite import nothing_evaluated
    cfg = suite_config(fmnist, tmp_path / "cache")
    cfg.benchmarks.append(BenchmarkConfig(name="cifar100", root=str(tmp_path / "nowhere")))
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 1 and nothing_evaluated(report) is None
    rows = [line for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("|")]
    assert len({row.count("|") for row in rows}) == 1, rows
    assert rows[1] == "|---|---|---:|---:|---:|---:|---|---:|"
