"""`--peer` as a user meets it: a caption set under a name of the user's own, prompts the suite sets
itself, and a CLIP_benchmark that fails, none of which may end the suite or compare unlike things."""
from __future__ import annotations

import json

import pytest

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.integrations import clip_benchmark as peer
from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available
from lit_softmoe.metadata import benchmark_info

from evalkit import FOOLBOX_DATA, foolbox_images, save_pair, write_wds_benchmark

pytestmark = [pytest.mark.skipif(not clip_benchmark_available(), reason="clip-benchmark is not installed"),
              pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")]


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("rgb"), in_channels=3, image_size=32)


def _peer_entry(model, tmp_path, **spec) -> dict:
    cfg = EvalSuiteConfig(name="s", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(**spec)])
    report = run_suite(model, cfg, out=tmp_path / "r.json", peer=True)
    entry = report["results"][0]
    assert entry["status"] == "ok" and json.loads((tmp_path / "r.json").read_text())["results"][0]["peer"]
    return entry


def test_peer_on_a_caption_set_of_the_users_own_name(rgb_model, tmp_path):
    # CLIP_benchmark picks the task by the dataset's name: "my-captions" was run as classification and
    # failed with an AssertionError traceback, after our own results were computed and before any was written.
    samples = [(path.read_bytes(), "jpg", f"a photo number {i}.\nimage {i}, up close.")
               for i, (path, _) in enumerate(foolbox_images("imagenet"))]
    root = write_wds_benchmark(tmp_path / "caps", samples, retrieval=True)
    entry = _peer_entry(rgb_model, tmp_path, name="my-captions", root=str(root))
    assert entry["peer"]["status"] == "ok", entry["peer"]
    assert set(entry["peer"]["metrics"]) == set(entry["metrics"]) and entry["peer"]["max_abs_diff_points"] <= 0.1


def test_peer_uses_the_prompts_the_suite_used(rgb_model, tmp_path):
    # The suite's templates (and the shipped class names, the set having no classnames.txt) were not
    # passed on: CLIP_benchmark scored the dataset's own templates file, or failed for want of class names.
    names = list(benchmark_info("cifar10").classnames)
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label)
                                                      for p, label in foolbox_images("cifar10")],
                               templates=["{c}"])
    (tmp_path / "mine.txt").write_text("a blurry photo of a {c}.\na drawing of the {c}.\nitap of a {c}.\n")
    entry = _peer_entry(rgb_model, tmp_path, name="cifar10", root=str(root), templates=str(tmp_path / "mine.txt"))
    assert entry["templates"]["count"] == 3 and entry["num_classes"] == len(names)
    assert entry["peer"]["status"] == "ok", entry["peer"]
    assert entry["peer"]["max_abs_diff_points"] <= 0.1 and set(entry["peer"]["metrics"]) == set(entry["metrics"])


def test_a_failing_peer_is_recorded_and_the_results_are_written(rgb_model, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("Classes not specified for wds/x")

    monkeypatch.setattr(peer, "run_clip_benchmark", broken)
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label)
                                                      for p, label in foolbox_images("cifar10")[:4]])
    entry = _peer_entry(rgb_model, tmp_path, name="cifar10", root=str(root))
    assert entry["peer"]["status"] == "failed" and "Classes not specified" in entry["peer"]["reason"]


def test_peer_on_a_layout_it_cannot_read_says_so(rgb_model, tmp_path):
    # --peer on class folders: no cross-check could run, and the result said nothing about it.
    image = foolbox_images("cifar10")[0][0].read_bytes()
    for name in ("kind a", "kind b"):
        (tmp_path / "mine" / "test" / name).mkdir(parents=True)
        (tmp_path / "mine" / "test" / name / "x.png").write_bytes(image)
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n")
    entry = _peer_entry(rgb_model, tmp_path, name="mine", root=str(tmp_path / "mine"), templates=str(tmp_path / "t.txt"))
    assert entry["format"] == "imagefolder"
    assert entry["peer"]["status"] == "skipped" and "webdataset" in entry["peer"]["reason"]


def test_the_cli_names_the_peer_gap_and_a_peer_that_did_not_run(rgb_model, tmp_path, capsys):
    from lit_softmoe.cli import main
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label)
                                                      for p, label in foolbox_images("cifar10")])
    image = foolbox_images("cifar10")[0][0].read_bytes()
    for name in ("kind a", "kind b"):
        (tmp_path / "mine" / "test" / name).mkdir(parents=True)
        (tmp_path / "mine" / "test" / name / "x.png").write_bytes(image)
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n")
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: s\nworkers: 0\ncache_dir: {tmp_path / 'cache'}\nbenchmarks:\n"
                     f"  - {{name: cifar10, root: {root}}}\n"
                     f"  - {{name: mine, root: {tmp_path / 'mine'}, templates: {tmp_path / 't.txt'}}}\n")
    main(["eval", "--model", str(rgb_model), "--suite", str(suite), "--out", str(tmp_path / "r.json"), "--peer"])
    out = capsys.readouterr().out
    assert "cifar10: clip_benchmark differs by at most 0.000 points" in out
    assert "mine: clip_benchmark skipped: CLIP_benchmark is run on the webdataset layout only" in out
