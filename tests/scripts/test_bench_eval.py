"""scripts/bench_eval.py at CPU size: a tiny pair on 300 Fashion-MNIST test images in two shards, timed on
the first 200 (--limit): every row runs, the warm rows hit the image cache (the new text tower too),
and our top-1 agrees with CLIP_benchmark's."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from evalkit import save_pair
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available

pytestmark = pytest.mark.skipif(not clip_benchmark_available(), reason="clip-benchmark is not installed")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_eval():
    sys.path.insert(0, str(ROOT / "scripts"))  # for its `from benchlib import ...`
    try:
        spec = importlib.util.spec_from_file_location("bench_eval", ROOT / "scripts" / "bench_eval.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


def test_bench_eval_rows_cache_and_agreement(bench_eval, tmp_path, capsys):
    model = save_pair(tmp_path / "pair", in_channels=1, image_size=28)
    data = tmp_path / "fashion-mnist"
    write_fashion_mnist_shards(data, samples_per_shard=150, limit=300)
    out = tmp_path / "bench.json"
    report = bench_eval.main(["--model", str(model), "--data", str(data), "--limit", "200", "--batch-size", "64",
                              "--workers", "2", "--json", str(out)])
    rows = {r["row"]: r for r in report["rows"]}
    # --limit copies 200 samples into one shard: clip_benchmark gets 0 workers there, ours 2 (and 0 again).
    assert list(rows) == ["clip_benchmark", "ours cold", "ours cold, peer's workers", "ours warm",
                          "ours warm, new text tower", "ours --no-cache"]
    assert report["images"] == 200 and report["peer_workers"] == 0 and rows["ours cold"]["workers"] == 2
    assert [rows[r]["image_cache"] for r in list(rows)[1:]] == ["miss", "miss", "hit", "hit", "off"]
    assert report["new_text_cache_hit"] and report["agree"] and report["top1_gap_points"] <= 0.1 + 1e-6
    for row in ("ours cold", "ours cold, peer's workers", "ours warm", "ours --no-cache"):
        assert rows[row]["top1"] == rows["ours cold"]["top1"]
        assert rows[row]["peer_over_ours"] == pytest.approx(rows["clip_benchmark"]["seconds"] / rows[row]["seconds"])
    assert all(r["num_samples"] == 200 for r in rows.values())
    assert all(r["seconds"] > 0 and r["images_per_s"] == pytest.approx(200 / r["seconds"]) for r in rows.values())
    printed = capsys.readouterr().out
    assert "| run | workers | wall s | images/s | peer / ours |" in printed
    assert all(f"| {row} |" in printed for row in rows) and "(agree, bar 0.1 point)" in printed
    assert json.loads(out.read_text())["rows"][0]["row"] == "clip_benchmark"


def test_bench_eval_missing_model_says_make_demo(bench_eval, tmp_path):
    with pytest.raises(SystemExit, match="make demo"):
        bench_eval.main(["--model", str(tmp_path / "absent")])


def _fake_rows(bench_eval, monkeypatch, calls):
    """run_peer / run_ours replaced by recorders: the rows' settings without running either tool."""
    def run_peer(model_path, root, benchmark, split, batch_size, workers):
        calls.append(("peer", None))
        return {"seconds": 1.0, "top1": 0.5}

    def run_ours(model_path, cfg, out_dir, name, use_cache=True, new_text=False):
        calls.append(("ours", cfg))
        return {"seconds": 1.0, "eval_seconds": 0.5, "top1": 0.5, "num_samples": 300,
                "image_cache": ("hit" if "warm" in name or "text" in name else "miss") if use_cache else "off"}

    monkeypatch.setattr(bench_eval, "run_peer", run_peer)
    monkeypatch.setattr(bench_eval, "run_ours", run_ours)


def _run_with_fake_rows(bench_eval, tmp_path, monkeypatch) -> tuple[list, dict]:
    """run_benchmark on 300 images with both tools and the model load replaced by recorders."""
    data = tmp_path / "fashion-mnist"
    write_fashion_mnist_shards(data, samples_per_shard=150, limit=300)
    calls = []
    _fake_rows(bench_eval, monkeypatch, calls)
    import lit_softmoe.hub
    monkeypatch.setattr(lit_softmoe.hub, "load_pretrained", lambda *a, **k: calls.append(("load", None)))
    report = bench_eval.run_benchmark(bench_eval.parse_args(["--model", str(tmp_path), "--data", str(data)]))
    return calls, report


def test_bench_eval_ours_runs_fp32_like_the_peer(bench_eval, tmp_path, monkeypatch):
    # CLIP_benchmark runs with --no_amp; ours on "auto" would be bf16 autocast on a GPU.
    calls, report = _run_with_fake_rows(bench_eval, tmp_path, monkeypatch)
    configs = [cfg for who, cfg in calls if who == "ours"]
    assert configs and all(cfg.precision == "fp32" for cfg in configs)
    assert report["precision"] == "fp32"


def test_bench_eval_loads_the_model_once_before_the_first_row(bench_eval, tmp_path, monkeypatch):
    # The peer's row goes first: without an untimed load it alone reads the model from disk.
    calls, _ = _run_with_fake_rows(bench_eval, tmp_path, monkeypatch)
    assert calls[0][0] == "load" and calls[1][0] == "peer"
