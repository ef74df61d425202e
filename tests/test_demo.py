"""`lit-softmoe demo --fast`: the main job on a real Fashion-MNIST subset, end to end, as a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _demo(tmp_path):
    return subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "demo", "--fast", "--data", str(tmp_path / "data"),
                           "--runs", str(tmp_path / "runs")], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_demo_fast_runs_the_whole_pipeline(tmp_path):
    result = _demo(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for stage in ("== 1/4", "== 2/4", "== 3/4", "== 4/4", "== results"):
        assert stage in out
    runs = tmp_path / "runs" / "demo-fast"
    tower = json.loads((runs / "pretrain" / "results.json").read_text())
    lit = json.loads((runs / "lit" / "results.json").read_text())
    # 10,000 real training images: the tower and the text tower trained against it are far above
    # chance (10%); measured 0.733 (tower) and 0.747 (zero-shot, prompts unseen in training).
    assert tower["test_top1"] > 0.65
    assert lit["zeroshot_top1"] > 0.65
    assert lit["cached_features"] is True
    assert f"{lit['zeroshot_top1']:.4f}" in out and f"{tower['test_top1']:.4f}" in out
    assert (runs / "lit" / "model" / "model.safetensors").is_file()
    # A second run finds every stage done: nothing is rewritten or retrained, only re-evaluated.
    again = _demo(tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("already there") == 3  # the shards and both feature splits
    assert "(step 156 of 156)" in again.stdout and "(step 160 of 160)" in again.stdout
