"""lit_softmoe.integrations.clip_benchmark: the --peer cross-check. The same model on the same files
through our suite and through CLIP_benchmark (our model registered in its loader dict, loaded from disk by
it) gives the same top-1, top-5, mean per-class recall and retrieval recall@k, to within 0.1 point.

Data: the real ImageNet / CIFAR-10 / CIFAR-100 test images foolbox ships (20 each) in the
CLIP_benchmark webdataset layout, the same ImageNet images as a retrieval set, and Fashion-MNIST test
shards as `lit-softmoe data fashion-mnist` writes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalkit import (
    foolbox_benchmark,
    foolbox_images,
    needs_clip_benchmark,
    needs_foolbox,
    save_pair,
    write_wds_benchmark,
)
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.integrations import clip_benchmark as peer
from lit_softmoe.integrations.clip_benchmark import in_our_names, run_clip_benchmark
from lit_softmoe.metadata import benchmark_info
from shared_builds import built_once


def _agree(model_dir, root, name, tmp_path) -> tuple[dict, dict]:
    cfg = EvalSuiteConfig(name="peer", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name=name, root=str(root))])
    ours = run_suite(model_dir, cfg, out=tmp_path / f"{name}.json")["results"][0]
    theirs = in_our_names(run_clip_benchmark(model_dir, root, name)["metrics"])
    assert ours["status"] == "ok" and set(ours["metrics"]) == set(theirs), (ours["metrics"], theirs)
    for key, value in ours["metrics"].items():
        assert abs(value - theirs[key]) * 100 <= 0.1 + 1e-6, (name, key, value, theirs[key])  # float32 slack
    return ours, theirs


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory):
    return built_once(tmp_path_factory, "rgb-pair", lambda root: save_pair(root, in_channels=3, image_size=32)) / "lit"


@needs_clip_benchmark
@needs_foolbox
@pytest.mark.parametrize("dataset, name, templates", [
    ("imagenet", "imagenet1k", 8), ("cifar10", "cifar10", None), ("cifar100", "cifar100", None)])
def test_classification_agrees_on_real_images(rgb_model, tmp_path, dataset, name, templates):
    info = benchmark_info(name)
    root = foolbox_benchmark(tmp_path / name, dataset, info.classnames, info.templates[:templates])
    ours, _ = _agree(rgb_model, root, name, tmp_path)
    assert ours["num_samples"] == 20 and ours["num_classes"] == len(info.classnames)
    assert "top5" in ours["metrics"]


@needs_clip_benchmark
@needs_foolbox
def test_retrieval_agrees_on_real_images(rgb_model, tmp_path):
    names = benchmark_info("imagenet1k").classnames
    # Captions unique over the set (two of the images share a class): identical captions tie exactly,
    # and the suites break ties differently (ours toward the lower index, CLIP_benchmark as topk does).
    samples = [(path.read_bytes(), "jpg", f"a photo of a {names[label]}, number {i}.\n{names[label]}, up close, "
                f"take {i}.\nimage {i}.")
               for i, (path, label) in enumerate(foolbox_images("imagenet"))]
    root = write_wds_benchmark(tmp_path / "ret", samples, retrieval=True)
    ours, _ = _agree(rgb_model, root, "mscoco_captions", tmp_path)
    assert set(ours["metrics"]) == {f"{d}_R@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    assert ours["num_captions"] == 60


@pytest.fixture(scope="module")
def fashion_mnist_5000(tmp_path_factory) -> Path:
    """5,000 Fashion-MNIST test images as `lit-softmoe data fashion-mnist` writes them."""
    return built_once(tmp_path_factory, "fmnist-5000",
                      lambda root: write_fashion_mnist_shards(root / "fashion-mnist", limit=5000)) / "fashion-mnist"


@needs_clip_benchmark
@needs_foolbox
def test_fashion_mnist_agrees(tmp_path, fashion_mnist_5000):
    model_dir = save_pair(tmp_path / "gray", in_channels=1, image_size=28)
    ours, theirs = _agree(model_dir, fashion_mnist_5000, "fashion-mnist", tmp_path)
    assert ours["num_samples"] == 5000 and 0.0 < ours["metrics"]["top1"] < 1.0


@needs_clip_benchmark
@pytest.mark.slow
def test_stock_clip_benchmark_scores_the_open_clip_export_as_our_eval(tmp_path, fashion_mnist_5000):
    """CLIP_benchmark's own open_clip loader (`--model_type open_clip --model local-dir:EXPORT`) on the
    export's open_clip files, against our eval of the same export, on 5,000 Fashion-MNIST test images.
    The gray tower: open_clip's RGB pixels reach it through the luma-widened patch embedding."""
    pytest.importorskip("timm")
    from lit_runs import make_run
    from lit_softmoe.export import export_pair
    export = export_pair(make_run(tmp_path / "run"), tmp_path / "export")
    root = fashion_mnist_5000
    cfg = EvalSuiteConfig(name="peer", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="fashion-mnist", root=str(root))])
    ours = run_suite(export, cfg, out=tmp_path / "ours.json")["results"][0]
    theirs = in_our_names(run_clip_benchmark(export, root, "fashion-mnist", model_type="open_clip")["metrics"])
    assert ours["status"] == "ok" and ours["num_samples"] == 5000 and set(ours["metrics"]) == set(theirs)
    assert 0.0 < ours["metrics"]["top1"] < 1.0
    for key, value in ours["metrics"].items():
        assert abs(value - theirs[key]) * 100 <= 0.1, (key, value, theirs[key])
    print(f"ours {ours['metrics']}, CLIP_benchmark on open_clip {theirs}")


def _peer_entry(model, tmp_path, **spec) -> dict:
    cfg = EvalSuiteConfig(name="s", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(**spec)])
    report = run_suite(model, cfg, out=tmp_path / "r.json", peer=True)
    entry = report["results"][0]
    assert entry["status"] == "ok" and json.loads((tmp_path / "r.json").read_text())["results"][0]["peer"]
    return entry


@needs_clip_benchmark
@needs_foolbox
def test_peer_on_a_caption_set_of_the_users_own_name(rgb_model, tmp_path):
    # CLIP_benchmark picks the task by the dataset's name: "my-captions" was run as classification and
    # failed with an AssertionError traceback, after our own results were computed and before any was written.
    samples = [(path.read_bytes(), "jpg", f"a photo number {i}.\nimage {i}, up close.")
               for i, (path, _) in enumerate(foolbox_images("imagenet"))]
    root = write_wds_benchmark(tmp_path / "caps", samples, retrieval=True)
    entry = _peer_entry(rgb_model, tmp_path, name="my-captions", root=str(root))
    assert entry["peer"]["status"] == "ok", entry["peer"]
    assert set(entry["peer"]["metrics"]) == set(entry["metrics"]) and entry["peer"]["max_abs_diff_points"] <= 0.1


@needs_clip_benchmark
@needs_foolbox
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


@needs_clip_benchmark
@needs_foolbox
def test_a_failing_peer_is_recorded_and_the_results_are_written(rgb_model, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("Classes not specified for wds/x")

    monkeypatch.setattr(peer, "run_clip_benchmark", broken)
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label)
                                                      for p, label in foolbox_images("cifar10")[:4]])
    entry = _peer_entry(rgb_model, tmp_path, name="cifar10", root=str(root))
    assert entry["peer"]["status"] == "failed" and "Classes not specified" in entry["peer"]["reason"]


@needs_clip_benchmark
@needs_foolbox
def test_peer_on_a_layout_it_cannot_read_says_so(rgb_model, tmp_path):
    # --peer on class folders: no cross-check could run, and the result said nothing about it.
    image = foolbox_images("cifar10")[0][0].read_bytes()
    for name in ("kind a", "kind b"):
        (tmp_path / "mine" / "test" / name).mkdir(parents=True)
        (tmp_path / "mine" / "test" / name / "x.png").write_bytes(image)
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n")
    entry = _peer_entry(rgb_model, tmp_path, name="mine", root=str(tmp_path / "mine"),
                        templates=str(tmp_path / "t.txt"))
    assert entry["format"] == "imagefolder"
    assert entry["peer"]["status"] == "skipped" and "webdataset" in entry["peer"]["reason"]


@needs_clip_benchmark
@needs_foolbox
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


def test_peer_result_explains_a_gap_from_blank_caption_lines(monkeypatch):
    from lit_softmoe.integrations import clip_benchmark as peer
    monkeypatch.setattr(peer, "clip_benchmark_available", lambda: True)
    monkeypatch.setattr(peer, "run_clip_benchmark", lambda *a, **k: {"metrics": {"text_retrieval_recall@1": 0.5}})
    spec = BenchmarkConfig(name="r", root="x")
    entry = {"task": "retrieval", "metrics": {"image_to_text_R@1": 0.75}, "empty_captions": 3}
    result = peer.compare_with_clip_benchmark("m", spec, entry)
    assert result["max_abs_diff_points"] == pytest.approx(25.0) and "3 blank caption line(s)" in result["note"]
    assert "note" not in peer.compare_with_clip_benchmark("m", spec, {**entry, "empty_captions": 0})


def test_the_numpy2_accuracy_fix_is_patched_for_one_run_only(tmp_path, monkeypatch):
    """CLIP_benchmark's `accuracy` is replaced while our cross-check runs it, and restored after: the
    rest of the process (a user's own CLIP_benchmark runs) keeps the library as installed."""
    pytest.importorskip("clip_benchmark.cli")
    import sys

    import clip_benchmark.cli as cli
    import clip_benchmark.metrics.zeroshot_classification as zeroshot
    original, seen = zeroshot.accuracy, []

    def fake_main():  # records what `accuracy` is during the run, writes an empty result
        seen.append(zeroshot.accuracy)
        Path(sys.argv[sys.argv.index("--output") + 1]).write_text('{"metrics": {}}')

    monkeypatch.setattr(cli, "main", fake_main)
    assert run_clip_benchmark(tmp_path / "model", tmp_path, "mine") == {"metrics": {}}
    assert seen == [peer._accuracy_numpy2] and zeroshot.accuracy is original


@needs_clip_benchmark
def test_lit_softmoe_clip_benchmark_without_arguments_is_one_line(capsys):
    from cli_errors import one_line_error
    for argv in (["clip-benchmark"], ["clip-benchmark", "--"]):
        line = one_line_error(capsys, argv)
        assert "give clip_benchmark's own arguments after --" in line and "--model local-dir:EXPORT" in line


@needs_clip_benchmark
def test_lit_softmoe_clip_benchmark_leaves_the_library_as_installed(capsys, monkeypatch):
    """Its NumPy-2 fix is for its own run: CLIP_benchmark's `accuracy` is the installed one again after it, and
    its own argument errors are its own (argparse's exit 2)."""
    import clip_benchmark.metrics.zeroshot_classification as zeroshot

    from lit_softmoe import cli
    installed = zeroshot.accuracy
    with pytest.raises(SystemExit) as exited:
        cli.main(["clip-benchmark", "--", "eval", "--no-such-flag"])
    assert exited.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert zeroshot.accuracy is installed
