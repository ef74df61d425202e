"""`lit-softmoe demo --fast`: the main job on a real Fashion-MNIST subset, end to end, as a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_fast_runs_the_main_job(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "demo", "--fast", "--data", str(tmp_path / "data"),
                             "--runs", str(tmp_path / "runs")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "== 1/2" in out and "== 2/2" in out and "test top-1" in out
    results = json.loads((tmp_path / "runs" / "demo-fast" / "pretrain" / "results.json").read_text())
    # 12,000 real training images, two epochs: well above chance (10%), and the printed table says so.
    assert results["test_top1"] > 0.7  # 0.789 measured
    assert f"{results['test_top1']:.4f}" in out
    assert (tmp_path / "runs" / "demo-fast" / "pretrain" / "tower" / "model.safetensors").is_file()
    # A second run finds the shards written and the run finished: it neither rewrites nor retrains.
    again = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "demo", "--fast", "--data", str(tmp_path / "data"),
                            "--runs", str(tmp_path / "runs")], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already there" in again.stdout
    assert "resuming from" in again.stdout and "(step 186 of 186)" in again.stdout
