"""scripts/bench_product.py in its CPU mode: every row of the GPU run runs (embed through its function with the
CLI's defaults, an older checkout's embed, the tower against timm, `train` through the CLI against open_clip,
`pretrain` through the CLI against its tower's training step),
each measured row has its rate and its ratio against the row it names, and the JSON and Markdown agree."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import forked_python

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("foolbox") is None,
                    reason="the photos are foolbox's data files (make install adds foolbox)")
def test_cpu_run_measures_every_row_against_its_peer(tmp_path, monkeypatch):
    baseline = tmp_path / "baseline"  # an "older checkout": this one, exported as a user would
    baseline.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD", "lit_softmoe"], cwd=ROOT, capture_output=True)
    if archive.returncode:
        pytest.skip("not a git checkout")
    subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive.stdout, check=True)
    spec = importlib.util.spec_from_file_location("bench_product", ROOT / "scripts" / "bench_product.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_product"] = module
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "executable", forked_python())  # the commands it runs start without importing torch
    result = module.main(["--cpu", "--images", "32", "--unique", "8", "--lit-steps", "4", "--baseline",
                          str(baseline), "--baseline-images", "16", "--work", str(tmp_path / "work"),
                          "--json", str(tmp_path / "p.json"), "--md", str(tmp_path / "p.md")])
    assert json.loads((tmp_path / "p.json").read_text()) == result
    rows = {row["name"]: row for row in result["rows"]}
    expected = ["tower alone, bf16 weights, eager", "`embed`, default flags", "`embed --gpu-jpeg-share 0.7`",
                "`embed` before (older checkout), default flags", "`embed --jpeg-decoder cpu`",
                "open_clip --lock-image ViT-B-16 step (its default: eager)",
                "`train` on cached features, default flags",
                "LiT step on the fly (vit-b16 locked), the recipe's defaults", "timm ViT-B/16, bf16, eager",
                "soft-test-4e, bf16 weights (now), eager", "timm ViT-B/16, bf16, compiled",
                "soft-test-4e, bf16 weights, compiled", "`embed --compile true`", "nvJPEG decode alone",
                "host decode (reduced) + resize + crop, 1 core",
                "`embed`, default flags, 256 px JPEGs (img2dataset keep_ratio)",
                "`embed --jpeg-decoder cpu`, 256 px JPEGs (img2dataset keep_ratio)", "nvJPEG decode alone (256 px)",
                "GPU resize + crop alone (`ResizeCrop`) (256 px)", "JpegBatchDecoder: decode + resize + crop (256 px)",
                "`pretrain --config pretrain/soft-s16-128e-imagenet1k`, batch 8"]
    for name in expected:
        assert rows[name]["value"] > 0, rows[name]
        if rows[name]["against"]:
            base = rows[rows[name]["against"]]["value"]
            assert rows[name]["ratio"] == pytest.approx(rows[name]["value"] / base, rel=2e-2, abs=1e-3)  # rounded
    assert rows["`embed`, default flags"]["note"].startswith("32 images")
    assert rows["`embed`, default flags, 256 px JPEGs (img2dataset keep_ratio)"]["note"].startswith("32 images")
    assert rows["`embed` before (older checkout), default flags"]["note"].startswith("16 images")
    table = (tmp_path / "p.md").read_text()
    assert all(f"| {name} |" in table for name in expected)
