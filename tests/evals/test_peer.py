"""lit_softmoe.evals.peer: `--peer`'s CLIP_benchmark result is recorded under everything it depends on. A rerun of
the same suite on the same model and files reads it (the gap computed again against this run's metrics); a change of
the model's weights, the files or the prompts runs CLIP_benchmark again; a failed run is not recorded; without a cache
folder it always runs. Real images: the 20 CIFAR-10 test images foolbox ships."""
from __future__ import annotations

import pytest
import torch

from evalkit import foolbox_images, needs_clip_benchmark, needs_foolbox, save_pair, write_wds_benchmark
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.evals import peer
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.hub import load_pretrained
from shared_builds import built_once

pytestmark = [needs_clip_benchmark, needs_foolbox]


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory):
    return built_once(tmp_path_factory, "rgb-pair", lambda root: save_pair(root, in_channels=3, image_size=32)) / "lit"


@pytest.fixture
def cifar10(tmp_path):
    return write_wds_benchmark(tmp_path / "cifar10", [(path.read_bytes(), "png", label)
                                                      for path, label in foolbox_images("cifar10")])


@pytest.fixture
def peer_runs(monkeypatch):
    """The CLIP_benchmark runs made (each one real), in order."""
    runs = []
    real = peer.compare_with_clip_benchmark

    def counted(*args, **kwargs):
        runs.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(peer, "compare_with_clip_benchmark", counted)
    return runs


def _entry(bundle, root, tmp_path, use_cache=True, **benchmark) -> dict:
    cfg = EvalSuiteConfig(name="s", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root), **benchmark)])
    report = run_suite("model", cfg, out=tmp_path / "r.json", overwrite=True, peer=True, use_cache=use_cache,
                       model_bundle=bundle)
    (entry,) = report["results"]
    assert entry["status"] == "ok" and entry["peer"]["status"] == "ok", entry
    return entry


def test_a_rerun_reads_the_recorded_result_and_computes_the_gap_again(rgb_model, cifar10, tmp_path, peer_runs,
                                                                      monkeypatch):
    bundle = load_pretrained(rgb_model)
    first = _entry(bundle, cifar10, tmp_path)
    assert len(peer_runs) == 1 and first["peer"]["cache"] == "miss" and first["peer"]["max_abs_diff_points"] <= 0.1
    (recorded,) = (tmp_path / "cache" / peer.PEER_FOLDER).glob("*.json")

    again = _entry(bundle, cifar10, tmp_path)
    assert len(peer_runs) == 1 and again["peer"] == {**first["peer"], "cache": "hit"}
    # The gap is this run's metrics against the recorded ones: a recorded top-1 3 points off shows as 3 points.
    text = recorded.read_text()
    recorded.write_text(text.replace(f'"top1": {first["peer"]["metrics"]["top1"]}',
                                     f'"top1": {first["peer"]["metrics"]["top1"] + 0.03}'))
    shifted = _entry(bundle, cifar10, tmp_path)
    assert len(peer_runs) == 1 and shifted["peer"]["cache"] == "hit"
    assert shifted["peer"]["max_abs_diff_points"] == pytest.approx(3.0, abs=0.1 + 1e-6)
    # A recorded file that does not parse is run again, and recorded anew.
    recorded.write_text("{not json")
    assert _entry(bundle, cifar10, tmp_path)["peer"]["cache"] == "miss" and len(peer_runs) == 2
    assert _entry(bundle, cifar10, tmp_path)["peer"]["cache"] == "hit" and len(peer_runs) == 2


@pytest.mark.parametrize("change", ["text tower", "image tower", "files", "templates"])
def test_what_the_result_depends_on_runs_it_again(rgb_model, cifar10, tmp_path, peer_runs, change):
    bundle = load_pretrained(rgb_model)
    _entry(bundle, cifar10, tmp_path)
    benchmark = {}
    if change in ("text tower", "image tower"):
        tower = bundle[0].text_tower if change == "text tower" else bundle[0].image_tower
        with torch.no_grad():
            next(tower.parameters()).add_(1e-3)  # in memory: a model folder's records say nothing of it
    elif change == "files":
        samples = [(path.read_bytes(), "png", label) for path, label in foolbox_images("cifar10")[:12]]
        write_wds_benchmark(cifar10, samples)
    else:
        (tmp_path / "t.txt").write_text("a blurry photo of a {c}.\n")
        benchmark = {"templates": str(tmp_path / "t.txt")}
    entry = _entry(bundle, cifar10, tmp_path, **benchmark)
    assert len(peer_runs) == 2 and entry["peer"]["cache"] == "miss" and entry["peer"]["max_abs_diff_points"] <= 0.1
    if change == "files":
        assert entry["num_samples"] == 12 and entry["peer"]["metrics"]["top1"] == pytest.approx(
            entry["metrics"]["top1"], abs=1e-3)
    if change == "templates":
        assert peer_runs[1]["templates"] == ["a blurry photo of a {c}."]


def test_a_failed_run_is_not_recorded_and_no_cache_always_runs(rgb_model, cifar10, tmp_path, peer_runs,
                                                               monkeypatch):
    bundle = load_pretrained(rgb_model)
    real = peer.compare_with_clip_benchmark
    monkeypatch.setattr(peer, "compare_with_clip_benchmark",
                        lambda *a, **k: {"status": "failed", "reason": "clip_benchmark failed: boom"})
    cfg = EvalSuiteConfig(name="s", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(cifar10))])
    failed = run_suite("model", cfg, out=tmp_path / "r.json", peer=True, model_bundle=bundle)["results"][0]
    assert failed["peer"] == {"status": "failed", "reason": "clip_benchmark failed: boom"}
    assert not (tmp_path / "cache" / peer.PEER_FOLDER).exists()
    monkeypatch.setattr(peer, "compare_with_clip_benchmark", real)
    assert _entry(bundle, cifar10, tmp_path)["peer"]["cache"] == "miss"
    # --no-cache: CLIP_benchmark runs each time, and nothing says "cache".
    for _ in range(2):
        assert "cache" not in _entry(bundle, cifar10, tmp_path / "off", use_cache=False)["peer"]
    assert len(peer_runs) == 3
