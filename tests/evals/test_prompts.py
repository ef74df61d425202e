"""lit_softmoe.evals.prompts: class names and templates for a benchmark, and where they came from."""
from __future__ import annotations

import pytest

from evalkit import foolbox_images, needs_foolbox, tiny_pair, write_wds_benchmark
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.errors import UserError
from lit_softmoe.evals.eval_data import EvalData
from lit_softmoe.evals.prompts import resolve_prompts
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info

pytestmark = needs_foolbox


def test_templates_say_where_they_came_from():
    data = EvalData("classification", [], "cifar")
    names, templates, source = resolve_prompts(BenchmarkConfig(name="cifar10"), data)
    assert names == list(benchmark_info("cifar10").classnames) and source == {"from": "cifar10", "borrowed": False,
                                                                               "count": len(templates)}
    data = EvalData("classification", [], "imagefolder")
    _, templates, source = resolve_prompts(BenchmarkConfig(name="imagenet-r"), data)
    assert source == {"from": "imagenet1k", "borrowed": True, "count": 80} and len(templates) == 80
    _, _, source = resolve_prompts(BenchmarkConfig(name="cifar10", templates="imagenet1k"), data)
    assert source["borrowed"] is True and source["count"] == 80
    with pytest.raises(UserError, match="no templates"):
        resolve_prompts(BenchmarkConfig(name="my-own"), EvalData("classification", [], "wds", classnames=["a", "b"]))


def test_a_caption_set_without_dataset_type_names_task_retrieval(tmp_path):
    images = foolbox_images("imagenet")[:3]
    root = write_wds_benchmark(tmp_path / "caps", [(p.read_bytes(), "jpg", f"caption {i}")
                                                   for i, (p, _) in enumerate(images)], retrieval=True)
    (root / "dataset_type.txt").unlink()  # what `lit-softmoe data from-folder` writes for captions
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="my-captions", root=str(root))])
    report = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))
    entry = report["results"][0]
    assert entry["status"] == "failed" and "set task: retrieval" in entry["reason"], entry
    assert report["evaluated"] == 0 and not (tmp_path / "o.json").exists()
