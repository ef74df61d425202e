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
    for stage in [f"== {i}/7" for i in range(1, 8)] + ["== results"]:
        assert stage in out
    runs = tmp_path / "runs" / "demo-fast"
    tower = json.loads((runs / "pretrain" / "results.json").read_text())
    lit = json.loads((runs / "lit" / "results.json").read_text())
    # 10,000 real training images: the tower and the text tower trained against it are far above
    # chance (10%); measured 0.733 (tower) and 0.747 (zero-shot, prompts unseen in training).
    assert tower["test_top1"] > 0.65
    assert lit["zeroshot_top1"] > 0.65
    assert lit["cached_features"] is True
    assert f"{tower['test_top1']:.4f}" in out
    assert (runs / "lit" / "model" / "model.safetensors").is_file()
    # The eval suite's report agrees with the training run's own final zero-shot number (same model,
    # same test images, same prompts) and, where clip_benchmark is installed, with the peer.
    (report_file,) = (runs / "lit" / "eval").glob("fashion-mnist-*.json")
    entry = json.loads(report_file.read_text())["results"][0]
    assert entry["num_samples"] == 10_000 and abs(entry["metrics"]["top1"] - lit["zeroshot_top1"]) < 1e-3
    (row,) = [line for line in out.splitlines() if "LiT zero-shot top-1" in line]
    assert row.endswith(f"{entry['metrics']['top1']:.4f}")
    if "peer" in entry:
        assert entry["peer"]["status"] == "ok" and entry["peer"]["max_abs_diff_points"] <= 0.1 + 1e-6
    # The export holds both encoders as safetensors and checked ONNX graphs, and a model card.
    export = runs / "export"
    config = json.loads((export / "config.json").read_text())
    assert {"image_encoder.onnx", "text_encoder.onnx", "README.md", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    assert config["onnx"]["image"]["max_abs_diff"] < 1e-4 and config["onnx"]["text"]["max_abs_diff"] < 1e-4
    # Five test images classified by text prompts through the loaded export: mostly right at ~75% top-1.
    picks = [line for line in out.splitlines() if line.startswith("  test image ")]
    assert len(picks) == 5 and sum(line.endswith("[ok]") for line in picks) >= 3
    # A second run finds every stage done: nothing is rewritten or retrained, only re-evaluated.
    again = _demo(tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("already there") == 3  # the shards and both feature splits
    reports = sorted((runs / "lit" / "eval").glob("fashion-mnist-*.json"))  # a new file, the first one kept
    assert len(reports) == 2 and reports[0] == report_file
    rerun = json.loads(reports[1].read_text())["results"][0]
    assert rerun["image_cache"] == "hit" and rerun["metrics"] == entry["metrics"]
    assert "(step 156 of 156)" in again.stdout and "(step 160 of 160)" in again.stdout
