"""scripts/bench_gpu.py in its CPU mode: tiny shapes, every part, every row timed, every ratio finite and
positive, JSON and Markdown written; a missing peer gives a row that says so instead of a crash."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# --cpu runs every row the GPU run does (the CUDA-graphs rows compiled without graphs).
GRAPH_ROWS = {"ours compiled, CUDA graphs", "dense MLP compiled, CUDA graphs",
              "ours soft-b16-128e compiled reduce-overhead"}
LAYER_ROWS = {"ours", "ours compiled", "dense MLP", "dense MLP compiled", "soft-moe-pytorch",
              "ours step by step (reference_forward)", "ours compiled, CUDA graphs", "dense MLP compiled, CUDA graphs"}
TOWER_ROWS = {"timm vit_base_patch16_224", "ours soft-b16-128e", "timm vit_base_patch16_224 compiled",
              "ours soft-b16-128e compiled", "ours vit-b16", "ours soft-b16-128e, PyTorch qk-norm",
              "ours vit-b16, PyTorch qk-norm", "ours soft-b16-128e compiled reduce-overhead"}
LIT_ROWS = {"open_clip lock-image", "ours on-the-fly", "ours cached", "ours on-the-fly, tower compiled",
            "open_clip image features given", "ours cached, text compiled", "ours on-the-fly, PyTorch qk-norm"}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # puts scripts/ on sys.path for benchlib, bench_softmoe, bench_lit
    return module


@pytest.mark.skipif(not all(map(_installed, ("timm", "open_clip", "soft_moe_pytorch"))),
                    reason="the peers (timm, open_clip_torch, soft-moe-pytorch) are dev dependencies")
def test_cpu_mode_writes_every_row_and_ratio(bench_gpu, tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    bench_gpu.main(["--cpu", "--iters", "1", "--peer-iters", "1", "--json", str(out_json), "--md", str(out_md)])
    result = json.loads(out_json.read_text())
    assert result["mode"] == "cpu" and result["torch"] and result["device_name"]
    rows = result["rows"]
    by_part = {part: {r["name"] for r in rows if r["part"] == part} for part in ("layer", "tower", "lit")}
    assert by_part == {"layer": LAYER_ROWS, "tower": TOWER_ROWS, "lit": LIT_ROWS}
    layer_settings = {r["setting"] for r in rows if r["part"] == "layer"}
    assert layer_settings == {"tiny bf16 weights", "tiny bf16 autocast"}  # the GPU run's two precisions
    assert len([r for r in rows if r["part"] == "layer"]) == 2 * len(LAYER_ROWS)
    assert all("bfloat16 weights" in r["setting"] for r in rows if r["part"] == "tower")
    assert all("autocast-bf16" in r["setting"] for r in rows if r["part"] == "lit")
    for r in rows:
        assert r["ms"] is not None and r["ms"] > 0, r
        assert r["note"] == ("cpu: no CUDA graphs" if r["name"] in GRAPH_ROWS else ""), r
        if r["part"] != "layer":
            assert r["per_s"] > 0, r
    # FLOPs are counted for the rows the ratios and MFU use.
    assert all(r["gflop"] > 0 for r in rows if r["name"] in ("ours", "dense MLP", "ours soft-b16-128e",
                                                              "timm vit_base_patch16_224", "open_clip lock-image"))
    ratios = result["ratios"]
    assert len(ratios) == 2 * 7 + 2 + 2 + 5  # layer 7 per setting; tower 2 + the qk-norm pair; lit 5
    for q in ratios:
        assert q["value"] is not None and math.isfinite(q["value"]) and q["value"] > 0, q
        assert q["met"] in (True, False) or q["target"] is None
    md = out_md.read_text()
    for name in LAYER_ROWS | TOWER_ROWS | LIT_ROWS:
        assert f"| {name} |" in md
    assert md.count("| ratio | value | target | met |") == 3


def test_missing_peers_are_rows_not_crashes(bench_gpu, tmp_path, monkeypatch):
    for name in ("soft_moe_pytorch", "timm"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    out_json = tmp_path / "bench.json"
    bench_gpu.main(["--cpu", "--only", "layer,tower", "--iters", "1", "--json", str(out_json),
                    "--md", str(tmp_path / "bench.md")])
    result = json.loads(out_json.read_text())
    notes = {(r["part"], r["name"]): r["note"] for r in result["rows"]}
    assert notes[("layer", "soft-moe-pytorch")].startswith("not installed")
    assert notes[("tower", "timm vit_base_patch16_224")].startswith("not installed")
    assert notes[("layer", "ours")] == "" and notes[("tower", "ours soft-b16-128e")] == ""
    peer_ratios = [q for q in result["ratios"] if "soft-moe-pytorch" in q["name"]]
    assert peer_ratios and all(q["value"] is None and q["met"] is None for q in peer_ratios)


def test_budget_skips_rows_and_says_so(bench_gpu, tmp_path):
    out_json = tmp_path / "bench.json"
    bench_gpu.main(["--cpu", "--only", "layer", "--budget", "layer=0", "--json", str(out_json)])
    rows = json.loads(out_json.read_text())["rows"]
    assert rows and all(r["ms"] is None and "budget" in r["note"] for r in rows)


def test_rejects_unknown_parts(bench_gpu):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--only", "layer,towers"])


def test_a_kill_mid_part_keeps_the_rows_it_measured(bench_gpu, tmp_path, monkeypatch):
    # gpu_check.sh ends the run with `timeout`: the rows of the part it was in must already be on disk.
    import bench_softmoe

    def interrupted(shape):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_softmoe, "build_dense", interrupted)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    with pytest.raises(KeyboardInterrupt):
        bench_gpu.main(["--cpu", "--only", "layer", "--iters", "1", "--json", str(out_json), "--md", str(out_md)])
    result = json.loads(out_json.read_text())
    assert result["complete"] is False
    assert [r["name"] for r in result["rows"]] == ["ours", "ours compiled"] and all(r["ms"] for r in result["rows"])
    assert "| ours compiled |" in out_md.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]  # no temporary files left


def test_a_failing_part_does_not_cost_the_later_parts(bench_gpu, tmp_path, monkeypatch):
    def broken(bench, shapes):
        raise RuntimeError("CUDA out of memory outside any row")

    monkeypatch.setattr(bench_gpu, "bench_layer", broken)
    out_json = tmp_path / "bench.json"
    bench_gpu.main(["--cpu", "--only", "layer,tower", "--iters", "1", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    notes = {(r["part"], r["name"]): r["note"] for r in result["rows"]}
    assert notes[("layer", "(part)")] == "failed: RuntimeError: CUDA out of memory outside any row"
    assert any(r["part"] == "tower" and r["ms"] for r in result["rows"]) and result["complete"] is True


def test_mfu_peak_by_device_name(bench_gpu):
    # torch.cuda.get_device_name() of each part; the PCIe and NVL parts have lower peaks than the SXM ones.
    assert bench_gpu.peak_bf16("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert bench_gpu.peak_bf16("NVIDIA H200")[0] == 989.0
    assert bench_gpu.peak_bf16("NVIDIA H100 PCIe")[0] == 756.0
    assert bench_gpu.peak_bf16("NVIDIA H100 NVL")[0] == 835.0
    assert bench_gpu.peak_bf16("NVIDIA H200 NVL")[0] == 835.0
    assert bench_gpu.peak_bf16("NVIDIA A100-SXM4-80GB")[0] == 312.0
