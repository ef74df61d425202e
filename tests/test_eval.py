"""The zero-shot suite: readers give every image with its right label, the suite's numbers equal a
direct computation, the image-feature cache is hit only when it should be, absent data is skipped,
results are never overwritten, and templates say where they came from."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig, load_config
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, retrieval_metrics, zeroshot_metrics
from lit_softmoe.evals.features import encode_images
from lit_softmoe.evals.prompts import resolve_prompts
from lit_softmoe.evals.readers import EvalData, read_benchmark
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info, imagenet_wnids

from evalkit import FOOLBOX_DATA, _suite, _tar_samples, foolbox_images, tiny_pair, write_wds_benchmark

pytestmark = pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")

SUITES = Path(__file__).parent.parent / "eval"


def test_suite_equals_a_direct_computation(fmnist, tmp_path):
    bundle = tiny_pair()
    model, preprocess, tokenizer = bundle
    report = run_suite("tiny", _suite(fmnist, tmp_path / "cache"), out=tmp_path / "r.json", model_bundle=bundle)
    entry = report["results"][0]
    samples = _tar_samples(fmnist / "test")
    with torch.no_grad():
        images = model.encode_image(torch.stack([preprocess(im) for im, _ in samples]))
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer,
                                               (fmnist / "classnames.txt").read_text().split("\n")[:10],
                                               (fmnist / "zeroshot_classification_templates.txt").read_text().split("\n")[:-1])
    expected = zeroshot_metrics(images, torch.tensor([label for _, label in samples]), classifier)
    assert entry["num_samples"] == len(samples) == 300
    for key, value in expected.items():
        assert entry["metrics"][key] == pytest.approx(value, abs=1e-6), key
    assert entry["templates"] == {"from": "fashion-mnist (dataset files)", "borrowed": False, "count": 6}
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["results"][0]["metrics"] == entry["metrics"] and on_disk["suite"] == "t"
    assert "| fashion-mnist |" in (tmp_path / "r.md").read_text()
    assert PIL.Image.open(tmp_path / "r.png").size[0] > 100


def test_two_workers_give_the_same_features_in_the_same_order(fmnist):
    model, preprocess, _ = tiny_pair()
    data = read_benchmark("fashion-mnist", fmnist, "test", preprocess)
    one, labels_one, _ = encode_images(model, data, 50, 0, torch.device("cpu"))
    two, labels_two, _ = encode_images(model, data, 50, 2, torch.device("cpu"))
    assert labels_one == labels_two == [label for _, label in _tar_samples(fmnist / "test")]
    torch.testing.assert_close(one, two)


def test_image_cache_reencodes_only_text(fmnist, tmp_path, monkeypatch):
    cfg = _suite(fmnist, tmp_path / "cache")
    first = tiny_pair(seed=0)
    cold = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=first)["results"][0]
    # A new text tower against the same locked image tower: images come from the cache.
    second = tiny_pair(seed=1)
    second[0].image_tower.load_state_dict(first[0].image_tower.state_dict())
    calls = []
    forward = second[0].image_tower.forward_features
    monkeypatch.setattr(second[0].image_tower, "forward_features", lambda x: calls.append(len(x)) or forward(x))
    warm = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=second)["results"][0]
    assert (cold["image_cache"], warm["image_cache"]) == ("miss", "hit") and calls == []
    fresh = run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=second, use_cache=False)["results"][0]
    assert calls and fresh["image_cache"] == "off"
    assert warm["metrics"] == pytest.approx(fresh["metrics"], abs=1e-6)
    assert warm["metrics"] != cold["metrics"]  # the text tower did change the answers


def test_cache_misses_when_the_tower_or_preprocessing_changes(fmnist, tmp_path):
    cfg = _suite(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    with torch.no_grad():
        model.image_tower.patch_embed.weight[0, 0, 0, 0] += 1.0
    changed = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=(model, preprocess, tokenizer))
    assert changed["results"][0]["image_cache"] == "miss"
    model.pretrained_info = {"image_tower_sha256": "abc", "preprocess": {"mean": [0.5]}}
    run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=(model, preprocess, tokenizer))
    model.pretrained_info = {"image_tower_sha256": "abc", "preprocess": {"mean": [0.4]}}
    other = run_suite("m", cfg, out=tmp_path / "d.json", model_bundle=(model, preprocess, tokenizer))
    assert other["results"][0]["image_cache"] == "miss"


def test_absent_benchmark_is_skipped_with_its_path_and_the_rest_run(fmnist, tmp_path):
    cfg = _suite(fmnist, tmp_path / "cache")
    cfg.benchmarks.insert(0, BenchmarkConfig(name="cifar100", root=str(tmp_path / "nowhere")))
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    skipped, ran = report["results"]
    assert skipped["status"] == "skipped" and skipped["path"] == str(tmp_path / "nowhere")
    assert ran["status"] == "ok" and ran["num_samples"] == 300
    # The table gives the reason (what was looked for and what puts it there), as the console does.
    assert str(tmp_path / "nowhere") in skipped["reason"]
    assert f"skipped: {skipped['reason']}" in (tmp_path / "r.md").read_text()


def test_results_are_never_overwritten_silently(fmnist, tmp_path):
    cfg = _suite(fmnist, tmp_path / "cache")
    out = tmp_path / "r.json"
    out.write_text("{}")
    with pytest.raises(UserError, match="exists; choose another --out or pass --overwrite"):
        run_suite("m", cfg, out=out, model_bundle=tiny_pair())
    assert out.read_text() == "{}"
    run_suite("m", cfg, out=out, overwrite=True, model_bundle=tiny_pair())
    assert json.loads(out.read_text())["results"][0]["status"] == "ok"
    with pytest.raises(UserError, match="not in suite t"):
        run_suite("m", cfg, benchmarks=["cifar10"], out=tmp_path / "x.json", model_bundle=tiny_pair())


def test_templates_say_where_they_came_from():
    data = EvalData("classification", [], "cifar")
    names, templates, source = resolve_prompts(BenchmarkConfig(name="cifar10"), data)
    assert names == list(benchmark_info("cifar10").classnames) and source == {"from": "cifar10", "borrowed": False,
                                                                               "count": len(templates)}
    _, templates, source = resolve_prompts(BenchmarkConfig(name="imagenet-r"), EvalData("classification", [], "imagefolder"))
    assert source == {"from": "imagenet1k", "borrowed": True, "count": 80} and len(templates) == 80
    _, _, source = resolve_prompts(BenchmarkConfig(name="cifar10", templates="imagenet1k"), data)
    assert source["borrowed"] is True and source["count"] == 80
    with pytest.raises(UserError, match="no templates"):
        resolve_prompts(BenchmarkConfig(name="my-own"), EvalData("classification", [], "wds", classnames=["a", "b"]))


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


# ---- readers on real images ----------------------------------------------------------------------

def test_image_folder_with_wnid_folders_maps_to_imagenet_labels(tmp_path):
    wnids = imagenet_wnids()
    for path, label in foolbox_images("imagenet"):
        (tmp_path / "val" / wnids[label]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "val" / wnids[label] / path.name).write_bytes(path.read_bytes())
    info = benchmark_info("imagenet1k")
    data = read_benchmark("imagenet1k", tmp_path, "val", lambda im: torch.zeros(1), classnames=list(info.classnames),
                          wnids=list(info.wnids))
    targets = sorted(data.dataset[i][2] for i in range(len(data.dataset)))
    assert data.format == "imagefolder" and targets == sorted(label for _, label in foolbox_images("imagenet"))


def test_cifar_pickles_are_read_and_only_numpy_is_unpickled(tmp_path):
    images = foolbox_images("cifar10")
    pixels = np.stack([np.asarray(PIL.Image.open(p).convert("RGB")) for p, _ in images])  # (N, 32, 32, 3)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batch = {b"data": pixels.transpose(0, 3, 1, 2).reshape(len(images), -1), b"labels": [l for _, l in images]}
    (folder / "test_batch").write_bytes(pickle.dumps(batch))
    data = read_benchmark("cifar10", tmp_path, "test", lambda im: torch.from_numpy(np.asarray(im).copy()))
    assert data.format == "cifar" and len(data.dataset) == 20
    for i in (0, 7, 19):
        index, image, label = data.dataset[i]
        assert index == i and label == images[i][1] and torch.equal(image, torch.from_numpy(pixels[i]))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(UserError, match="refusing to load builtins.print"):
        read_benchmark("cifar10", tmp_path, "test", lambda im: im)


def test_retrieval_from_a_karpathy_json_and_from_wds_agree(tmp_path):
    images = foolbox_images("imagenet")[:8]
    names = benchmark_info("imagenet1k").classnames
    captions = [[f"a photo of a {names[l]}.", f"{names[l]}, seen up close."] for _, l in images]
    (tmp_path / "k" / "images").mkdir(parents=True)
    entries = []
    for (path, _), caps in zip(images, captions):
        (tmp_path / "k" / "images" / path.name).write_bytes(path.read_bytes())
        entries.append({"filename": path.name, "split": "test", "sentences": [{"raw": c} for c in caps]})
    entries.append({"filename": "not-in-test.jpg", "split": "train", "sentences": [{"raw": "x"}]})
    (tmp_path / "k" / "dataset_flickr30k.json").write_text(json.dumps({"images": entries}))
    write_wds_benchmark(tmp_path / "w", [(p.read_bytes(), "jpg", "\n".join(c)) for (p, _), c in zip(images, captions)],
                        retrieval=True)
    bundle = tiny_pair(in_channels=3, image_size=32)
    cfg = EvalSuiteConfig(name="r", workers=0, cache_dir=str(tmp_path / "cache"), benchmarks=[
        BenchmarkConfig(name="flickr30k", root=str(tmp_path / "k")), BenchmarkConfig(name="coco", root=str(tmp_path / "w"))])
    karpathy, webdataset = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=bundle)["results"]
    assert (karpathy["format"], webdataset["format"]) == ("karpathy", "wds")
    assert karpathy["num_samples"] == webdataset["num_samples"] == 8 and karpathy["num_captions"] == 16
    assert karpathy["metrics"] == webdataset["metrics"]
    model, preprocess, tokenizer = bundle
    with torch.no_grad():
        zimg = model.encode_image(torch.stack([preprocess(PIL.Image.open(p).convert("RGB")) for p, _ in images]))
        ztxt = model.encode_text(tokenizer([c for caps in captions for c in caps]))
    expected = retrieval_metrics(zimg, ztxt, torch.arange(8).repeat_interleave(2))
    assert karpathy["metrics"] == pytest.approx(expected, abs=1e-6)


def test_unreadable_images_are_skipped_and_counted(tmp_path):
    images = foolbox_images("cifar10")[:5]
    samples = [(p.read_bytes(), "png", l) for p, l in images]
    samples[2] = (samples[2][0][:60], "png", samples[2][2])  # truncated PNG
    root = write_wds_benchmark(tmp_path / "c10", samples, classnames=list(benchmark_info("cifar10").classnames))
    report = run_suite("m", _suite(root, tmp_path / "cache", name="cifar10"), out=tmp_path / "r.json",
                       model_bundle=tiny_pair(in_channels=3, image_size=32))
    entry = report["results"][0]
    assert entry["num_samples"] == 4 and entry["bad_samples"] == 1
    assert entry["templates"]["from"] == "cifar10" and entry["templates"]["borrowed"] is False


def test_a_cls_that_is_no_class_index_is_skipped_and_counted(tmp_path):
    # As the training pipeline's bad_cls: a .cls of "dog" or "-1" loses that sample, not the suite.
    images = foolbox_images("cifar10")[:5]
    samples = [(p.read_bytes(), "png", l) for p, l in images]
    samples[1] = (samples[1][0], "png", "dog")
    samples[3] = (samples[3][0], "png", -1)
    root = write_wds_benchmark(tmp_path / "c10", samples, classnames=list(benchmark_info("cifar10").classnames))
    report = run_suite("m", _suite(root, tmp_path / "cache", name="cifar10"), out=tmp_path / "r.json",
                       model_bundle=tiny_pair(in_channels=3, image_size=32))
    entry = report["results"][0]
    assert entry["status"] == "ok" and entry["num_samples"] == 3 and entry["bad_samples"] == 2


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


# ---- suite files and the command line -------------------------------------------------------------

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


def test_bf16_is_cached_apart_and_stays_close(fmnist, tmp_path):
    bundle = tiny_pair()
    fp32 = run_suite("m", _suite(fmnist, tmp_path / "cache"), out=tmp_path / "a.json", model_bundle=bundle)
    cfg = _suite(fmnist, tmp_path / "cache")
    cfg.precision = "bf16"
    bf16 = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)
    assert bf16["results"][0]["image_cache"] == "miss"  # other numbers, other cache entry
    assert abs(bf16["results"][0]["metrics"]["top1"] - fp32["results"][0]["metrics"]["top1"]) < 0.05


# ---- layouts that must not be misread ---------------------------------------------------------------

def test_numeric_class_folders_are_their_labels(tmp_path):
    # ImageNetV2's layout: folders 0 … 999. String order would put "10" before "2".
    images = foolbox_images("cifar10")
    for label in (0, 1, 2, 10, 11):
        (tmp_path / "test" / str(label)).mkdir(parents=True)
        (tmp_path / "test" / str(label) / "x.png").write_bytes(images[label % 20][0].read_bytes())
    data = read_benchmark("mine", tmp_path, "test", lambda im: torch.zeros(1))
    by_folder = {data.dataset.items[i][1] for i in range(len(data.dataset))}
    assert data.format == "imagefolder" and by_folder == {0, 1, 2, 10, 11}


def test_torchvision_roots_are_not_taken_for_class_folders(tmp_path):
    from lit_softmoe.evals.readers import MissingData, detect_format
    (tmp_path / "oxford-iiit-pet" / "images").mkdir(parents=True)  # torchvision's layout, files absent
    assert detect_format(tmp_path, "test", "pets") == "torchvision"
    with pytest.raises(MissingData):
        read_benchmark("pets", tmp_path, "test", lambda im: im)
    single = tmp_path / "single"
    (single / "test" / "the-one-class").mkdir(parents=True)
    with pytest.raises(MissingData, match="found only"):  # one class folder is not a classification set
        read_benchmark("mine", single, "test", lambda im: im, format="imagefolder")


def test_a_missing_class_folder_does_not_shift_the_names(tmp_path):
    # CIFAR-10 without its first class: labels follow the 9 folders, and so must the names.
    images = foolbox_images("cifar10")
    names = list(benchmark_info("cifar10").classnames)
    for name in names[1:]:
        (tmp_path / "test" / name).mkdir(parents=True)
        (tmp_path / "test" / name / "x.png").write_bytes(images[0][0].read_bytes())
    data = read_benchmark("cifar10", tmp_path, "test", lambda im: im, classnames=names)
    classnames, _, _ = resolve_prompts(BenchmarkConfig(name="cifar10"), data)
    for i in range(len(data.dataset)):
        folder = data.dataset.items[i][0].__defaults__[0].parent.name  # the loader's bound path
        assert classnames[data.dataset.items[i][1]] == folder


def test_class_folders_named_after_the_classes_get_their_own_names(tmp_path):
    # fashion-mnist's order is not alphabetical: "ankle boot" sorts first but is class 9. Folders spelled
    # the way folders are (case, "_" for " ") still match; folders with other names keep their own.
    image = foolbox_images("cifar10")[0][0].read_bytes()
    names = list(benchmark_info("fashion-mnist").classnames)
    for i, name in enumerate(names):
        folder = tmp_path / "named" / "test" / (name.replace(" ", "_").upper() if i % 2 else name)
        folder.mkdir(parents=True)
        (folder / "x.png").write_bytes(image)
        (tmp_path / "other" / "test" / f"kind{i}").mkdir(parents=True)
        (tmp_path / "other" / "test" / f"kind{i}" / "x.png").write_bytes(image)
    data = read_benchmark("fashion-mnist", tmp_path / "named", "test", lambda im: im, classnames=names)
    classnames, _, _ = resolve_prompts(BenchmarkConfig(name="fashion-mnist"), data)
    assert classnames == names
    for load, label in data.dataset.items:
        assert classnames[label].replace(" ", "_").upper() == load.__defaults__[0].parent.name.upper()
    data = read_benchmark("fashion-mnist", tmp_path / "other", "test", lambda im: im, classnames=names)
    classnames, _, _ = resolve_prompts(BenchmarkConfig(name="fashion-mnist"), data)
    assert [classnames[label] for _, label in data.dataset.items] == [f"kind{i}" for i in range(10)]


def test_torchvision_reader_on_real_fashion_mnist_files(tmp_path, fmnist):
    import gzip
    from lit_softmoe.data.fashion_mnist import find_fashion_mnist
    source = find_fashion_mnist(None, allow_download=False)
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):  # torchvision checks that all four are there
        (raw / stem).write_bytes(gzip.decompress((source / f"{stem}.gz").read_bytes()))
    data = read_benchmark("fashion-mnist", tmp_path, "test", lambda im: torch.from_numpy(np.asarray(im).copy()),
                          format="torchvision")
    assert data.format == "torchvision" and len(data.dataset) == 10_000
    first = [label for _, label in _tar_samples(fmnist / "test")][:300]
    assert [data.dataset.items[i][1] for i in range(300)] == first  # same labels, same order as our shards


def test_suite_task_overrides_a_missing_dataset_type(tmp_path):
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", f"caption {i}\nother {i}")
                                                for i, (p, _) in enumerate(images)], retrieval=True)
    (root / "dataset_type.txt").unlink()
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="my-captions", root=str(root), task="retrieval")])
    entry = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["task"] == "retrieval" and entry["num_captions"] == 8


def test_a_handed_in_model_is_keyed_by_its_weights_not_its_recorded_hash(fmnist, tmp_path):
    cfg = _suite(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    model.pretrained_info = {"image_tower_sha256": "recorded", "preprocess": {}}
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    with torch.no_grad():
        model.image_tower.patch_embed.weight.mul_(2)  # changed in memory; the recorded hash is now stale
    again = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=(model, preprocess, tokenizer))
    assert again["results"][0]["image_cache"] == "miss"


def test_the_cache_is_keyed_by_task(fmnist, tmp_path):
    # The cache holds the targets too: the same shards read as classification (class indices) and as
    # retrieval (captions) must not share an entry, in either order.
    bundle = tiny_pair()
    for first, second in (("classification", "retrieval"), ("retrieval", "classification")):
        cache = tmp_path / f"cache-{first}"
        a = run_suite("m", _suite(fmnist, cache, task=first), out=tmp_path / f"{first}-a.json", model_bundle=bundle)
        b = run_suite("m", _suite(fmnist, cache, task=second), out=tmp_path / f"{first}-b.json", model_bundle=bundle)
        assert [e["task"] for e in (a["results"][0], b["results"][0])] == [first, second]
        assert b["results"][0]["status"] == "ok" and b["results"][0]["image_cache"] == "miss"


def test_the_cache_is_keyed_by_the_transform_of_a_handed_in_model(fmnist, tmp_path):
    # No pretrained_info, so no recorded preprocessing: the transform the images went through decides.
    cfg = _suite(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    same = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=(model, eval_transform(28, 1, 0.5, 0.25), tokenizer))
    other = run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=(model, eval_transform(28, 1, 0.4, 0.25), tokenizer))
    assert same["results"][0]["image_cache"] == "hit" and other["results"][0]["image_cache"] == "miss"


def test_default_results_go_to_the_run_and_survive_checkpoint_pruning(fmnist, tmp_path):
    # A checkpoint folder is deleted by pruning and model/ is replaced when a run finishes: results
    # written inside either would be lost, so the default --out is RUN/eval/, the step in the name.
    from evalkit import save_pair
    from lit_softmoe.config import LiTConfig, to_yaml
    from lit_softmoe.train.checkpoint import prune_checkpoints, save_training_state
    run = save_pair(tmp_path / "pair")
    (run / "config.yaml").write_text(to_yaml(load_config(LiTConfig, None, [  # as the recipe writes it
        f"run_dir={run}", f"image_tower={tmp_path / 'pair' / 'pretrain' / 'tower'}", "text.width=32",
        "text.layers=1", "text.heads=2", "text.context_length=16"])))
    model, _, _ = tiny_pair()
    optimizer = torch.optim.AdamW([p for p in model.text_tower.parameters()])
    step = save_training_state(run / "checkpoints" / "step_00000006", 6, model, optimizer,
                               skip_prefixes=("image_tower.",))
    cfg = _suite(fmnist, tmp_path / "cache")
    from_step = run_suite(step, cfg)["paths"]["json"]
    from_model = run_suite(run / "model", cfg)["paths"]["json"]
    assert Path(from_step).parent == Path(from_model).parent == run / "eval"
    assert Path(from_step).name.startswith("t-step_00000006-") and Path(from_model).name.startswith("t-2")
    for s in (8, 10):  # training goes on and keeps 2 checkpoints: step 6 goes
        save_training_state(run / "checkpoints" / f"step_{s:08d}", s, model, optimizer, skip_prefixes=("image_tower.",))
    prune_checkpoints(run / "checkpoints", 2)
    assert not step.exists() and Path(from_step).is_file() and Path(from_model).is_file()


# ---- where the shipped suites look, and a suite in which nothing ran -------------------------------

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


def test_a_suite_in_which_nothing_ran_says_so_and_writes_nothing(tmp_path):
    from lit_softmoe.evals.reports import markdown_table
    from lit_softmoe.evals.suite import nothing_evaluated
    cfg = EvalSuiteConfig(name="s", workers=0, benchmarks=[
        BenchmarkConfig(name="imagenet1k", root=str(tmp_path / "imagenet1k"), split="val"),
        BenchmarkConfig(name="cifar100", root=str(tmp_path / "cifar100"))])
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 0 and [e["status"] for e in report["results"]] == ["skipped", "skipped"]
    assert list(tmp_path.iterdir()) == [] and report["paths"] == {}
    line = nothing_evaluated(report)
    assert line.startswith("nothing evaluated, so no results were written: all 2 benchmarks were skipped "
                           f"(imagenet1k: imagenet1k data folder not found at {tmp_path / 'imagenet1k'}; put") and \
        "\n" not in line
    one = {**report, "results": report["results"][1:]}
    assert nothing_evaluated(one) == ("nothing evaluated, so no results were written: cifar100: "
                                      f"{report['results'][1]['reason']}")
    assert "set LIT_SOFTMOE_BENCHMARKS=DIR to read DIR/cifar100" in nothing_evaluated(one)
    # The table of such a report: every row has as many cells as the header (no phantom column).
    rows = [l for l in markdown_table(report).splitlines() if l.startswith("|")]
    assert len(rows) == 4
    assert {row.count("|") for row in rows} == {6}, rows  # benchmark, task, samples, templates, seconds


def test_markdown_rows_line_up_with_metrics_and_skips(fmnist, tmp_path):
    from lit_softmoe.evals.reports import markdown_table
    from lit_softmoe.evals.suite import nothing_evaluated
    cfg = _suite(fmnist, tmp_path / "cache")
    cfg.benchmarks.append(BenchmarkConfig(name="cifar100", root=str(tmp_path / "nowhere")))
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 1 and nothing_evaluated(report) is None
    rows = [l for l in (tmp_path / "r.md").read_text().splitlines() if l.startswith("|")]
    assert len({row.count("|") for row in rows}) == 1, rows
    assert rows[1] == "|---|---|---:|---:|---:|---:|---|---:|"
