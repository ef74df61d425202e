"""scripts/reproduce_routing.py at CPU size: five test towers, one seed, three steps each on a slice of
real Fashion-MNIST. Checks the table and the plot are written and the FLOP counts obey what the
layers' shapes fix (the accuracies of a 3-step run mean nothing and are not checked)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from launch import forked_python
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards

ROOT = Path(__file__).resolve().parents[2]
TOWERS = ["vit-test", "soft-test-4e", "ec-test-4e", "tc-test-4e-k1", "tc-test-4e-k2"]


def load_script():
    spec = importlib.util.spec_from_file_location("reproduce_routing", ROOT / "scripts" / "reproduce_routing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reproduction_writes_table_plot_and_orders_flops(tmp_path, monkeypatch):
    shards = tmp_path / "fmnist"
    write_fashion_mnist_shards(shards, limit=400, allow_download=False)
    out = tmp_path / "routing"
    script = load_script()
    monkeypatch.setattr(sys, "executable", forked_python())  # its runs start without importing torch again
    report = script.main(["--towers", *TOWERS, "--seeds", "0", "--steps", "3", "--jobs", "2",
                          "--train", str(shards / "train"), "--test", str(shards / "test"),
                          "--test-subset", "100", "--out", str(out), "--set", "batch_size=32",
                          "optim.warmup=2", "log_every=1"])

    table = (out / "routing.md").read_text()
    for tower in TOWERS:
        assert f"| {tower} |" in table
    assert "--steps 3" in table  # the command that made it
    assert (out / "routing.png").stat().st_size > 10_000
    saved = json.loads((out / "routing.json").read_text())
    assert [r["tower"] for r in saved["rows"]] == TOWERS

    runs = {r["tower"]: r for r in report["runs"]}
    for r in runs.values():
        assert r["steps"] == 3 and r["train_flops"] == 3 * r["step_flops"]
        assert 0 <= r["test_top1"] <= 1 and r["wall_seconds"] > 0
    flops = {t: runs[t]["step_flops"] for t in TOWERS}
    # 16 tokens, MoE in block 1 of 2, 4 experts. Expert-MLP passes per image in that block:
    # dense 16 tokens; Soft MoE 4 slots; EC C = round(16/4) = 4 per expert → 16; TC K=1:
    # ceil(16/4) = 4 → 16 buffer places; TC K=2: ceil(32/4) = 8 → 32 (full buffers are computed).
    # EC and TC K=1 have the same router and buffers, so the same FLOPs; each extra pass of the
    # width-32 / hidden-64 expert costs 3 × 2 × 2 × 32 × 64 (forward + two backward matmuls).
    assert flops["ec-test-4e"] == flops["tc-test-4e-k1"]
    assert flops["tc-test-4e-k2"] - flops["tc-test-4e-k1"] == 32 * 16 * 3 * 2 * 2 * 32 * 64
    assert flops["soft-test-4e"] < flops["vit-test"] < flops["ec-test-4e"]
    # EC over dense: the router x @ W (16·32·4 multiply-adds per image, forward + 2 backward), as
    # the expert passes are the same 16 (bias adds are not counted, fused or not).
    assert flops["ec-test-4e"] - flops["vit-test"] == 32 * 3 * 2 * 16 * 32 * 4
    # The sparse towers report dropped tokens, the others none.
    rows = {r["tower"]: r for r in report["rows"]}
    assert rows["vit-test"]["dropped_fraction_test"][0] == 0 == rows["soft-test-4e"]["dropped_fraction_test"][0]
    assert 0 <= rows["ec-test-4e"]["dropped_fraction_test"][0] <= 1

    # A second call with the same settings reuses the finished runs instead of training again...
    same = ["--towers", "vit-test", "--seeds", "0", "--steps", "3", "--out", str(out), "--train",
            str(shards / "train"), "--test", str(shards / "test"), "--test-subset", "100", "--set",
            "batch_size=32", "optim.warmup=2", "log_every=1"]
    again = script.main(same)
    assert again["runs"][0]["test_top1"] == runs["vit-test"]["test_top1"]
    # ... and one with other settings refuses to pass those runs off as its own.
    with pytest.raises(SystemExit, match="holds a run with other settings"):
        script.main(same[:-3] + ["batch_size=64"])
