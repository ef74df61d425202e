"""Agreement with the peer: the same model on the same files through our suite and through
CLIP_benchmark (our model registered in its TYPE2FUNC loader dict, loaded from disk by it) gives the
same top-1, top-5, mean per-class recall and retrieval recall@k, to within 0.1 point.

Data: the real ImageNet / CIFAR-10 / CIFAR-100 test images foolbox ships (20 each) in the
CLIP_benchmark webdataset layout, the same ImageNet images as a retrieval set, and Fashion-MNIST test
shards as `lit-softmoe data fashion-mnist` writes them.
"""
from __future__ import annotations

import pytest

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available, in_our_names, run_clip_benchmark
from lit_softmoe.metadata import benchmark_info

from evalkit import FOOLBOX_DATA, foolbox_benchmark, foolbox_images, save_pair, write_wds_benchmark

pytestmark = [pytest.mark.skipif(not clip_benchmark_available(), reason="clip-benchmark is not installed"),
              pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")]


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
    return save_pair(tmp_path_factory.mktemp("rgb"), in_channels=3, image_size=32)


@pytest.mark.parametrize("dataset, name, templates", [
    ("imagenet", "imagenet1k", 8), ("cifar10", "cifar10", None), ("cifar100", "cifar100", None)])
def test_classification_agrees_on_real_images(rgb_model, tmp_path, dataset, name, templates):
    info = benchmark_info(name)
    root = foolbox_benchmark(tmp_path / name, dataset, info.classnames, info.templates[:templates])
    ours, _ = _agree(rgb_model, root, name, tmp_path)
    assert ours["num_samples"] == 20 and ours["num_classes"] == len(info.classnames)
    assert "top5" in ours["metrics"]


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


def test_fashion_mnist_agrees(tmp_path):
    model_dir = save_pair(tmp_path / "gray", in_channels=1, image_size=28)
    root = tmp_path / "fashion-mnist"
    write_fashion_mnist_shards(root, limit=5000)
    ours, theirs = _agree(model_dir, root, "fashion-mnist", tmp_path)
    assert ours["num_samples"] == 5000 and 0.0 < ours["metrics"]["top1"] < 1.0
