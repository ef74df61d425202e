"""lit_softmoe.evals.benchmark: one benchmark evaluated: prompts checked before any image is encoded, a
skipped benchmark names its fix, caption shards read as classes fail naming the fix, and caption sets with
blank lines or uncaptioned images."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from evalkit import foolbox_images, needs_foolbox, save_pair, tiny_pair, write_wds_benchmark
from lit_softmoe.cli import main
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.errors import UserError
from lit_softmoe.evals import suite as suite_module
from lit_softmoe.evals.eval_data import EvalData
from lit_softmoe.evals.prompts import resolve_prompts
from lit_softmoe.evals.suite import run_suite
from shard_cuts import cut_before_sample

# Per image: CLIP_benchmark's str.splitlines gives ['', 'a dog', '', 'another dog', ''] (3 empty), ['a cat'],
# [' ', ' '] (2 blank, no caption left), ['a bird'] (a final newline is no line): 5 empty captions.
CAPTIONS = ["\na dog\n\nanother dog\n\n", "a cat", " \n ", "a bird\n"]


@needs_foolbox
def test_a_bad_template_is_refused_before_any_image_is_encoded(tmp_path, monkeypatch):
    from lit_softmoe.evals import benchmark
    bad = tmp_path / "templates.txt"
    bad.write_text("a photo of a {c}.\na photo of a {}.\n")
    data = EvalData("classification", [], "wds", classnames=["a", "b"])
    with pytest.raises(UserError, match=r"a photo of a \{\}"):
        resolve_prompts(BenchmarkConfig(name="my-own", templates=str(bad)), data)
    monkeypatch.setattr(benchmark, "read_benchmark", lambda *a, **k: data)
    monkeypatch.setattr(benchmark, "cached_image_features", lambda *a, **k: pytest.fail("images encoded"))
    with pytest.raises(UserError, match="templates.txt"):
        benchmark.evaluate_benchmark(None, None, None, BenchmarkConfig(name="my-own", templates=str(bad)), None,
                                 torch.device("cpu"))


@needs_foolbox
def test_retrieval_leaves_out_images_without_captions_and_skips_a_set_with_none(tmp_path):
    images = foolbox_images("imagenet")[:4]
    captions = ["a dog\n\nanother dog", "", "a cat", " \n "]  # blank lines are no captions
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", c) for (p, _), c in zip(images, captions)],
                               retrieval=True)
    same = write_wds_benchmark(tmp_path / "same", [(images[i][0].read_bytes(), "jpg", captions[i]) for i in (0, 2)],
                               retrieval=True)  # the same set without the two captionless images
    none = write_wds_benchmark(tmp_path / "none", [(p.read_bytes(), "jpg", "") for p, _ in images], retrieval=True)
    cfg = EvalSuiteConfig(name="r", workers=0, cache_dir=str(tmp_path / "cache"), benchmarks=[
        BenchmarkConfig(name="r", root=str(root)), BenchmarkConfig(name="same", root=str(same)),
        BenchmarkConfig(name="none", root=str(none))])
    partial, reference, empty = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"]
    assert (partial["num_samples"], partial["num_captions"], partial["images_without_captions"]) == (2, 3, 2)
    assert reference["images_without_captions"] == 0 and partial["metrics"] == reference["metrics"]
    assert empty["status"] == "skipped" and "no captions" in empty["reason"] and ".txt" in empty["reason"]


@needs_foolbox
def test_a_skipped_benchmark_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("LIT_SOFTMOE_DATA", raising=False)

    def reason(name, root):
        cfg = EvalSuiteConfig(name="s", benchmarks=[BenchmarkConfig(name=name, root=str(root))], workers=0)
        return run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())["results"][0]["reason"]

    assert reason("fashion-mnist", tmp_path / "data" / "fashion-mnist").endswith(
        f"write it with `lit-softmoe data fashion-mnist --out {tmp_path / 'data' / 'fashion-mnist'}`")
    assert "set LIT_SOFTMOE_BENCHMARKS=DIR to read DIR/cifar100" in reason("cifar100", tmp_path / "cifar100")
    # LIT_SOFTMOE_BENCHMARKS set to the raw downloads: they are not what the suite reads.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train-images-idx3-ubyte.gz").write_bytes(b"")
    assert f"convert them with `lit-softmoe data fashion-mnist --source {raw} --out data/fashion-mnist`" in \
        reason("fashion-mnist", raw / "fashion-mnist")
    # Benchmarks kept under LIT_SOFTMOE_DATA, as the suites once read it: the new variable is named.
    old = tmp_path / "benchmarks"
    (old / "cifar100").mkdir(parents=True)
    monkeypatch.setenv("LIT_SOFTMOE_DATA", str(old))
    assert reason("cifar100", tmp_path / "data" / "cifar100").endswith(f"set LIT_SOFTMOE_BENCHMARKS={old}")


def test_caption_shards_with_class_names_read_as_classes_fail_naming_task_retrieval(tmp_path):
    from evalkit import foolbox_images, tiny_pair, write_wds_benchmark
    from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
    from lit_softmoe.evals.suite import run_suite
    samples = [(path.read_bytes(), "png", f"a photo {i}") for i, (path, _) in enumerate(foolbox_images("cifar10")[:3])]
    root = write_wds_benchmark(tmp_path / "caps", samples, classnames=["cat", "dog"], templates=["a {c}."],
                               retrieval=True)
    (root / "dataset_type.txt").unlink()
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="my-captions", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "failed" and "set task: retrieval" in entry["reason"], entry


def _retrieval_suite(tmp_path: Path, *benchmarks: BenchmarkConfig) -> EvalSuiteConfig:
    return EvalSuiteConfig(name="r", workers=0, cache_dir=str(tmp_path / "cache"), benchmarks=list(benchmarks))


def test_blank_caption_lines_are_counted_as_clip_benchmark_reads_them(tmp_path, caplog):
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", c) for (p, _), c in zip(images, CAPTIONS)],
                               retrieval=True)
    cfg = _retrieval_suite(tmp_path, BenchmarkConfig(name="r", root=str(root)))
    bundle = tiny_pair(3, 32)
    with caplog.at_level("WARNING"):
        cold = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=bundle)["results"][0]
    warm = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)["results"][0]
    assert (cold["image_cache"], warm["image_cache"]) == ("miss", "hit")
    for entry in (cold, warm):  # the cache holds the raw text: a hit counts the same lines
        assert entry["empty_captions"] == 5
        assert (entry["num_samples"], entry["num_captions"], entry["images_without_captions"]) == (3, 4, 1)
    assert "5 blank caption line(s) left out" in caplog.text and "CLIP_benchmark" in caplog.text


def test_empty_captions_is_what_clip_benchmarks_own_reader_leaves_empty(tmp_path):
    builder = pytest.importorskip("clip_benchmark.datasets.builder")
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", c) for (p, _), c in zip(images, CAPTIONS)],
                               retrieval=True)
    theirs = [texts for _, texts in builder.build_wds_dataset("r", transform=lambda im: 0, split="test",
                                                              data_dir=str(root))]
    assert len(theirs) == 4
    empty = sum(not text.strip() for texts in theirs for text in texts)
    entry = run_suite("m", _retrieval_suite(tmp_path, BenchmarkConfig(name="r", root=str(root))),
                      out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["empty_captions"] == empty == 5
    assert entry["num_captions"] + entry["empty_captions"] == sum(map(len, theirs))


def test_karpathy_empty_sentences_are_counted_even_as_an_images_only_one(tmp_path):
    images = foolbox_images("imagenet")[:3]
    sentences = [["a dog", ""], [""], ["a cat"]]
    (tmp_path / "k" / "images").mkdir(parents=True)
    entries = []
    for (path, _), raws in zip(images, sentences):
        (tmp_path / "k" / "images" / path.name).write_bytes(path.read_bytes())
        entries.append({"filename": path.name, "split": "test", "sentences": [{"raw": r} for r in raws]})
    (tmp_path / "k" / "dataset_flickr30k.json").write_text(json.dumps({"images": entries}))
    entry = run_suite("m", _retrieval_suite(tmp_path, BenchmarkConfig(name="flickr30k", root=str(tmp_path / "k"))),
                      out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["format"] == "karpathy"
    assert (entry["empty_captions"], entry["num_captions"], entry["images_without_captions"]) == (2, 2, 1)


def test_a_split_truncated_at_a_sample_boundary_is_reported_partial_and_not_compared(fmnist, tmp_path, capsys,
                                                                                      monkeypatch):
    """A shard cut at a sample boundary reads as a complete, shorter tar: the eval reported its numbers on
    two thirds of the split as the split's, and --peer claimed agreement with CLIP_benchmark on them."""
    root = tmp_path / "fashion-mnist"
    shutil.copytree(fmnist, root)
    listed = sum(json.loads((root / "test" / "sizes.json").read_text()).values())
    kept = cut_before_sample(root / "test" / "1.tar", 28)
    read = listed - 128 + kept  # shard 1 held 128 samples
    monkeypatch.setattr(suite_module, "cross_check", lambda *a, **k: pytest.fail("compared"))
    (tmp_path / "suite.yaml").write_text(f"name: s\nworkers: 0\nbenchmarks:\n- name: fashion-mnist\n"
                                         f"  root: {root}\n")
    model = save_pair(tmp_path / "model")
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(model), "--suite", str(tmp_path / "suite.yaml"), "--out", str(out),
                 "--no-cache", "--peer"]) == 0
    partial = (f"{read} of the {listed} samples that the sizes.json of {root}/test lists were read: its shards "
               "are truncated, and the metrics cover the samples read only")
    [entry] = json.loads(out.read_text())["results"]
    assert entry["status"] == "ok" and entry["num_samples"] == read == 200 and entry["partial"] == partial
    assert entry["peer"] == {"status": "skipped", "reason": f"not compared on a partial split: {partial}"}
    [row] = [line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| fashion-mnist")]
    assert f"| {read} (partial) |" in row
    stdout = capsys.readouterr().out
    assert f"| {read} (partial) |" in stdout and "clip_benchmark skipped: not compared on a partial split" in stdout
