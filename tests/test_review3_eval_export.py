"""Review 3 of zero-shot evaluation: the class order of torchvision-read benchmarks against the shipped
(CLIP_benchmark) class lists, CIFAR splits, damaged webdataset shards and samples without a class."""
from __future__ import annotations

import csv

import PIL.Image
import pytest

from lit_softmoe.errors import UserError
from lit_softmoe.evals.readers import read_benchmark
from lit_softmoe.metadata import benchmark_info


def _names_of(data, benchmark: str) -> list[str]:
    """The shipped class name each sample of `data` is scored against, in dataset order."""
    classnames = benchmark_info(benchmark).classnames
    return [classnames[target] for _, _, target in (data.dataset[i] for i in range(len(data.dataset)))]


def test_caltech101_labels_line_up_with_the_shipped_names_background_included(tmp_path):
    # torchvision's Caltech101 drops BACKGROUND_Google, so its label 0 is Faces; the shipped list
    # (CLIP_benchmark's) starts with "background": every image was scored against the previous
    # class's name, and the background images were never read.
    base = tmp_path / "caltech101" / "101_ObjectCategories"
    folders = ["BACKGROUND_Google", "Faces", "Faces_easy", "Leopards", "Motorbikes", "accordion"]
    for folder in folders:
        (base / folder).mkdir(parents=True)
        PIL.Image.new("RGB", (8, 8), "gray").save(base / folder / "image_0001.jpg")
    data = read_benchmark("caltech101", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "caltech101") == ["background", "off-center face", "centered face", "leopard",
                                             "motorbike", "accordion"]


def _fer_csv(path, usage: str, with_labels: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["emotion", "pixels", "Usage"] if with_labels else ["pixels"])
        for emotion in range(7):  # FER's ids: angry, disgust, fear, happy, sad, surprise, neutral
            pixels = " ".join([str(30 * emotion)] * 48 * 48)
            writer.writerow([emotion, pixels, usage] if with_labels else [pixels])


def test_fer2013_emotion_ids_are_mapped_onto_the_shipped_alphabetical_names(tmp_path, monkeypatch):
    # torchvision reads FER's emotion ids (4 sad, 5 surprise, 6 neutral); the shipped names are
    # CLIP_benchmark's alphabetical folders (4 neutral, 5 sad, 6 surprised): three classes were
    # scored against another emotion's prompt.
    import torchvision.datasets.fer2013 as fer
    monkeypatch.setattr(fer, "check_integrity", lambda *args, **kwargs: True)  # our CSV is not FER's md5
    _fer_csv(tmp_path / "fer2013" / "fer2013.csv", "PublicTest")
    data = read_benchmark("fer2013", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "fer2013") == ["angry", "disgusted", "fearful", "happy", "sad", "surprised", "neutral"]


def test_fer2013_without_test_labels_is_one_line(tmp_path, monkeypatch):
    # Kaggle's test.csv has no labels; torchvision then gives None, which ended in int(None).
    import torchvision.datasets.fer2013 as fer
    monkeypatch.setattr(fer, "check_integrity", lambda *args, **kwargs: True)
    _fer_csv(tmp_path / "fer2013" / "test.csv", "", with_labels=False)
    with pytest.raises(UserError, match="fer2013.csv or icml_face_data.csv"):
        read_benchmark("fer2013", tmp_path, "test", lambda image: image, format="torchvision")


def test_a_cifar10_split_other_than_train_or_test_is_refused_not_read_as_train(tmp_path):
    # Any split but "test" read the five training batches: split: val scored CIFAR-10's training
    # images under the name val (CLIP_benchmark's #13, a split silently ignored).
    import pickle

    import numpy as np
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate(["test_batch", *[f"data_batch_{n}" for n in range(1, 6)]]):
        batch = {b"data": np.full((2, 3 * 32 * 32), i, np.uint8), b"labels": [i % 10, (i + 1) % 10]}
        (folder / name).write_bytes(pickle.dumps(batch))
    assert len(read_benchmark("cifar10", tmp_path, "train", lambda image: image).dataset) == 10
    assert len(read_benchmark("cifar10", tmp_path, "test", lambda image: image).dataset) == 2
    with pytest.raises(UserError, match="split: train or split: test"):
        read_benchmark("cifar10", tmp_path, "val", lambda image: image)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_truncated_shard_keeps_its_readable_samples_and_the_suite_runs(tmp_path, workers):
    # A tar cut short ended the whole suite in tarfile's ReadError traceback (the results of the
    # benchmarks before it lost); the training pipeline keeps the samples before the damage.
    from evalkit import foolbox_images, tiny_pair, write_wds_benchmark

    from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
    from lit_softmoe.evals.suite import run_suite
    samples = [(path.read_bytes(), "png", label) for path, label in foolbox_images("cifar10")]
    root = write_wds_benchmark(tmp_path / "c10", samples, list(benchmark_info("cifar10").classnames), per_shard=10)
    second = root / "test" / "1.tar"
    second.write_bytes(second.read_bytes()[:len(second.read_bytes()) // 2])
    cfg = EvalSuiteConfig(name="s", workers=workers, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and 10 < entry["num_samples"] < 20, entry


def test_a_sample_without_cls_in_a_class_set_is_skipped_and_counted(tmp_path):
    # A sample with an image but no .cls got label -1, and the benchmark failed on "labels run from
    # -1 …": one bad sample lost the whole benchmark, where the docstring (and training's
    # missing_cls) skip and count it.
    import webdataset as wds
    from evalkit import foolbox_images, tiny_pair, write_wds_benchmark

    from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
    from lit_softmoe.evals.suite import run_suite
    samples = [(path.read_bytes(), "png", label) for path, label in foolbox_images("cifar10")[:5]]
    root = write_wds_benchmark(tmp_path / "c10", samples, list(benchmark_info("cifar10").classnames))
    with wds.TarWriter(str(root / "test" / "0.tar")) as sink:  # the same samples, the third without .cls
        for i, (image, ext, label) in enumerate(samples):
            sink.write({"__key__": f"s{i:07d}", ext: image, **({} if i == 2 else {"cls": str(label)})})
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "cache"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and entry["num_samples"] == 4 and entry["bad_samples"] == 1, entry


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


def test_a_multilabel_webdataset_is_refused_in_one_line(tmp_path):
    # CLIP_benchmark's multi-label sets (voc2007_multilabel: dataset_type.txt "multilabel", labels in
    # .npy) were read as single-label classes whose samples all lack a .cls.
    from evalkit import foolbox_images, write_wds_benchmark
    samples = [(path.read_bytes(), "png", 0) for path, _ in foolbox_images("cifar10")[:2]]
    root = write_wds_benchmark(tmp_path / "voc", samples, classnames=["cat", "dog"])
    (root / "dataset_type.txt").write_text("multilabel\n")
    with pytest.raises(UserError, match="multi-label"):
        read_benchmark("voc2007_multilabel", root, "test", lambda image: image)
    with pytest.raises(UserError, match="multi-label"):  # as the suite calls it: the shipped task given
        read_benchmark("voc2007_multilabel", root, "test", lambda image: image, task="classification")
