"""The zero-shot suite: readers give every image with its right label, the suite's numbers equal a
direct computation, the image-feature cache is hit only when it should be, absent data is skipped,
results are never overwritten, and templates say where they came from."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lit_softmoe.config import EvalSuiteConfig, load_config
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info

from evalkit import FOOLBOX_DATA, tiny_pair

pytestmark = pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")

SUITES = Path(__file__).parent.parent / "eval"


def test_every_shipped_suite_loads():
    from pathlib import Path
    suites = sorted(Path(__file__).parent.parent.glob("eval/*.yaml"))
    assert {s.stem for s in suites} >= {"fashion-mnist", "lit-paper", "clip-27"}
    for path in suites:
        cfg = load_config(EvalSuiteConfig, path)
        assert cfg.benchmarks and all(b.root for b in cfg.benchmarks), path
        for b in cfg.benchmarks:
            benchmark_info(b.name)  # every benchmark has shipped metadata
    assert len(load_config(EvalSuiteConfig, "eval/clip-27.yaml").benchmarks) >= 27


def test_cli_mistakes_end_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbenchmarks:\n  - name: cifar10\n    root: /x\n    fromat: wds\n")
    run = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "eval", "--model", "m", "--suite", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "unknown config key" in run.stderr and "fromat" in run.stderr and "format" in run.stderr
    bad.write_text("name: x\nbenchmarks:\n  - name: cifar10\n    root: /x\n    format: zip\n")
    run = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "eval", "--model", "m", "--suite", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "'benchmarks[0].format' is 'zip'" in run.stderr


def test_shipped_suites_read_the_shards_lit_softmoe_data_writes(fmnist, tmp_path, monkeypatch):
    """LIT_SOFTMOE_DATA names the raw *-ubyte.gz downloads (README Quickstart); the suites read the
    converted shards: data/NAME, or $LIT_SOFTMOE_BENCHMARKS/NAME."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "t10k-images-idx3-ubyte.gz").write_bytes(b"")
    monkeypatch.setenv("LIT_SOFTMOE_DATA", str(raw))
    monkeypatch.delenv("LIT_SOFTMOE_BENCHMARKS", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fashion-mnist").symlink_to(fmnist)  # where `lit-softmoe data fashion-mnist` writes
    cfg = load_config(EvalSuiteConfig, SUITES / "fashion-mnist.yaml", ["workers=0", f"cache_dir={tmp_path / 'c'}"])
    assert cfg.benchmarks[0].root == "data/fashion-mnist"
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 1 and report["results"][0]["num_samples"] == 300
    monkeypatch.setenv("LIT_SOFTMOE_BENCHMARKS", "/bench")
    for suite in SUITES.glob("*.yaml"):
        for b in load_config(EvalSuiteConfig, suite).benchmarks:
            assert b.root == f"/bench/{b.name}", (suite, b.root)
