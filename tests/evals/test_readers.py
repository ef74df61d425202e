"""lit_softmoe.evals.readers: every benchmark reader gives each image with its right label: image folders,
CIFAR pickles, webdataset and Karpathy sets, and torchvision's own files whose label i must be the shipped
class name i."""
from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from evalkit import (
    _class_folders,
    foolbox_images,
    needs_foolbox,
    raw_tar_samples,
    suite_config,
    tiny_pair,
    wds_set,
    write_wds_benchmark,
)
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.errors import UserError
from lit_softmoe.evals import retrieval_metrics
from lit_softmoe.evals.prompts import resolve_prompts
from lit_softmoe.evals.readers import detect_format, read_benchmark
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info, imagenet_wnids
from sun397 import _SUN397_CLASSES

# Country211's class folders (ISO 3166 codes); torchvision reads them as an ImageFolder, sorted.
_COUNTRY211_CODES = """
AD AE AF AG AI AL AM AO AQ AR AT AU AW AX AZ BA BB BD BE BF BG BH BJ BM BN BO BQ BR BS BT BW BY BZ CA CD CF CH
CI CK CL CM CN CO CR CU CV CW CY CZ DE DK DM DO DZ EC EE EG ES ET FI FJ FK FO FR GA GB GD GE GF GG GH GI GL GM
GP GR GS GT GU GY HK HN HR HT HU ID IE IL IM IN IQ IR IS IT JE JM JO JP KE KG KH KN KP KR KW KY KZ LA LB LC LI
LK LR LT LU LV LY MA MC MD ME MF MG MK ML MM MN MO MQ MR MT MU MV MW MX MY MZ NA NC NG NI NL NO NP NZ OM PA PE
PF PG PH PK PL PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SS SV SX SY SZ TG TH
TJ TL TM TN TO TR TT TW TZ UA UG US UY UZ VA VE VG VI VN VU WS XK YE ZA ZM ZW
""".split()


@needs_foolbox
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


@needs_foolbox
def test_cifar_pickles_are_read_and_only_numpy_is_unpickled(tmp_path):
    images = foolbox_images("cifar10")
    pixels = np.stack([np.asarray(PIL.Image.open(p).convert("RGB")) for p, _ in images])  # (N, 32, 32, 3)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batch = {b"data": pixels.transpose(0, 3, 1, 2).reshape(len(images), -1), b"labels": [label for _, label in images]}
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


@needs_foolbox
def test_retrieval_from_a_karpathy_json_and_from_wds_agree(tmp_path):
    images = foolbox_images("imagenet")[:8]
    names = benchmark_info("imagenet1k").classnames
    captions = [[f"a photo of a {names[label]}.", f"{names[label]}, seen up close."] for _, label in images]
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
        BenchmarkConfig(name="flickr30k", root=str(tmp_path / "k")),
        BenchmarkConfig(name="coco", root=str(tmp_path / "w"))])
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


@needs_foolbox
def test_a_cls_that_is_no_class_index_is_skipped_and_counted(tmp_path):
    # As the training pipeline's bad_cls: a .cls of "dog" or "-1" loses that sample, not the suite.
    images = foolbox_images("cifar10")[:5]
    samples = [(p.read_bytes(), "png", label) for p, label in images]
    samples[1] = (samples[1][0], "png", "dog")
    samples[3] = (samples[3][0], "png", -1)
    root = write_wds_benchmark(tmp_path / "c10", samples, classnames=list(benchmark_info("cifar10").classnames))
    report = run_suite("m", suite_config(root, tmp_path / "cache", name="cifar10"), out=tmp_path / "r.json",
                       model_bundle=tiny_pair(in_channels=3, image_size=32))
    entry = report["results"][0]
    assert entry["status"] == "ok" and entry["num_samples"] == 3 and entry["bad_samples"] == 2


@needs_foolbox
def test_numeric_class_folders_are_their_labels(tmp_path):
    # ImageNetV2's layout: folders 0 … 999. String order would put "10" before "2".
    images = foolbox_images("cifar10")
    for label in (0, 1, 2, 10, 11):
        (tmp_path / "test" / str(label)).mkdir(parents=True)
        (tmp_path / "test" / str(label) / "x.png").write_bytes(images[label % 20][0].read_bytes())
    data = read_benchmark("mine", tmp_path, "test", lambda im: torch.zeros(1))
    by_folder = {data.dataset.items[i][1] for i in range(len(data.dataset))}
    assert data.format == "imagefolder" and by_folder == {0, 1, 2, 10, 11}


@needs_foolbox
def test_torchvision_roots_are_not_taken_for_class_folders(tmp_path):
    from lit_softmoe.evals.eval_data import MissingData
    from lit_softmoe.evals.readers import detect_format
    (tmp_path / "oxford-iiit-pet" / "images").mkdir(parents=True)  # torchvision's layout, files absent
    assert detect_format(tmp_path, "test", "pets") == "torchvision"
    with pytest.raises(MissingData):
        read_benchmark("pets", tmp_path, "test", lambda im: im)
    single = tmp_path / "single"
    (single / "test" / "the-one-class").mkdir(parents=True)
    with pytest.raises(MissingData, match="found only"):  # one class folder is not a classification set
        read_benchmark("mine", single, "test", lambda im: im, format="imagefolder")


@needs_foolbox
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


@needs_foolbox
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


@needs_foolbox
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
    first = [label for _, label in raw_tar_samples(fmnist / "test")][:300]
    assert [data.dataset.items[i][1] for i in range(300)] == first  # same labels, same order as our shards


@needs_foolbox
def test_suite_task_overrides_a_missing_dataset_type(tmp_path):
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", f"caption {i}\nother {i}")
                                                for i, (p, _) in enumerate(images)], retrieval=True)
    (root / "dataset_type.txt").unlink()
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="my-captions", root=str(root), task="retrieval")])
    entry = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["task"] == "retrieval" and entry["num_captions"] == 8


@needs_foolbox
def test_class_folders_without_a_split_folder_are_read_for_torchvision_names(tmp_path):
    # ROOT/CLASS/*.png is a layout the README lists; for a name torchvision knows it was taken for
    # torchvision's own files and skipped as "not found".
    names = list(benchmark_info("fashion-mnist").classnames)
    root = _class_folders(tmp_path / "fm", names)
    assert detect_format(root, "test", "fashion-mnist") == "imagefolder"
    data = read_benchmark("fashion-mnist", root, "test", lambda im: im, classnames=names)
    assert data.format == "imagefolder" and len(data.dataset) == 10
    (tmp_path / "pet" / "oxford-iiit-pet" / "images").mkdir(parents=True)  # torchvision's own layout
    assert detect_format(tmp_path / "pet", "test", "pets") == "torchvision"


@pytest.fixture(scope="module")
def torchvision_fmnist(tmp_path_factory):
    from lit_softmoe.data.fashion_mnist import find_fashion_mnist
    try:
        source = find_fashion_mnist(None, allow_download=False)
    except Exception:
        pytest.skip("Fashion-MNIST's raw files are not installed")
    root = tmp_path_factory.mktemp("tv")
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (raw / stem).write_bytes(gzip.decompress((source / f"{stem}.gz").read_bytes()))
    return root


@needs_foolbox
def test_the_torchvision_reader_reads_the_split_asked_for(torchvision_fmnist):
    # split: train used to give the 10k test images, reported as split train (CLIP_benchmark's #13).
    train = read_benchmark("fashion-mnist", torchvision_fmnist, "train", lambda im: im, format="torchvision")
    test = read_benchmark("fashion-mnist", torchvision_fmnist, "test", lambda im: im, format="torchvision")
    assert len(train.dataset) == 60_000 and len(test.dataset) == 10_000
    assert train.signature != test.signature
    with pytest.raises(UserError, match="train and test, not 'val'"):
        read_benchmark("fashion-mnist", torchvision_fmnist, "val", lambda im: im, format="torchvision")


@needs_foolbox
def test_a_split_torchvision_does_not_know_is_one_line(tmp_path):
    # A split torchvision validates itself (ValueError) is a UserError, not a traceback.
    (tmp_path / "dtd" / "dtd").mkdir(parents=True)
    with pytest.raises(UserError, match="tset"):
        read_benchmark("dtd", tmp_path, "tset", lambda im: im, format="torchvision")


@needs_foolbox
def test_a_webdataset_export_under_another_split_name_says_which(tmp_path):
    # The shipped suites read imagenet1k's split val (ImageFolder's name); CLIP_benchmark's export
    # (clip-benchmark/wds_imagenet1k) calls the same images test. The skip said "class folders (found
    # only test/ …)"; it now names the split to set.
    from lit_softmoe.evals.eval_data import MissingData
    root = wds_set(tmp_path / "imagenet1k")
    for format in ("auto", "wds"):
        with pytest.raises(MissingData, match="webdataset split here: test; set split: test"):
            read_benchmark("imagenet1k", root, "val", lambda im: im, format=format)


def _cifar100_pickles(root):
    images = foolbox_images("cifar100")
    pixels = np.stack([np.asarray(__import__("PIL.Image").Image.open(p).convert("RGB")) for p, _ in images])
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    batch = {b"data": pixels.transpose(0, 3, 1, 2).reshape(len(images), -1),
             b"fine_labels": [label for _, label in images]}
    (folder / "test").write_bytes(__import__("pickle").dumps(batch))
    return folder


@needs_foolbox
def test_cifar100_pickles_under_a_name_of_the_users_own(tmp_path):
    # The variant came from the benchmark's name alone: "my-cifar100" looked for CIFAR-10's test_batch.
    _cifar100_pickles(tmp_path)
    data = read_benchmark("my-cifar100", tmp_path, "test", lambda im: im)
    assert data.format == "cifar" and len(data.dataset) == 20


@needs_foolbox
def test_a_broken_cifar_pickle_is_one_line(tmp_path):
    # A truncated download raised EOFError / UnpicklingError from deep in pickle.
    folder = _cifar100_pickles(tmp_path)
    (folder / "test").write_bytes((folder / "test").read_bytes()[:1000])
    with pytest.raises(UserError, match="cifar-100-python/test"):
        read_benchmark("cifar100", tmp_path, "test", lambda im: im)


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


def _png(size: int = 8) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (size, size), (200, 30, 90)).save(buffer, "png")
    return buffer.getvalue()


@pytest.mark.parametrize("read", ["all", "one", "truncated"])
def test_reading_a_webdataset_split_closes_its_shard_files(tmp_path, read):
    """`eval` printed `ResourceWarning: unclosed file .../0.tar` per shard: webdataset's url_opener
    leaves the file open. Read to the end, abandoned after one sample, or cut short by a damaged tar."""
    import gc
    import warnings
    root = write_wds_benchmark(tmp_path / "b", [(_png(), "png", i % 2) for i in range(6)], ["a", "b"], per_shard=3)
    if read == "truncated":
        shard = root / "test" / "1.tar"
        shard.write_bytes(shard.read_bytes()[:1700])
    data = read_benchmark("b", root, "test", lambda image: torch.zeros(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        samples = iter(data.dataset)
        got = [next(samples)] if read == "one" else list(samples)
        del samples
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    read_back = [(index, target) for index, _, target in got]
    if read == "truncated":  # the first shard whole, the second up to its damage
        assert read_back[:3] == [(0, 0), (1, 1), (2, 0)] and len(read_back) < 6, read_back
    else:
        assert read_back == ([(i, i % 2) for i in range(6)] if read == "all" else [(0, 0)])


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


def _image_folders(root: Path, folders: list[str], per_folder: int = 2) -> None:
    import PIL.Image
    for f, folder in enumerate(folders):
        (root / folder).mkdir(parents=True)
        for i in range(per_folder):
            PIL.Image.new("L", (8, 8), color=10 * f + i).save(root / folder / f"{i}.png")


@pytest.mark.parametrize("name, folders", [
    ("fer2013", ["angry", "disgust", "fear", "happy", "neutral", "sad", "surprise"]),  # Kaggle msambare/fer2013
    ("eurosat", ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
                 "PermanentCrop", "Residential", "River", "SeaLake"]),  # the EuroSAT RGB zip's 2750/
])
def test_a_common_copys_class_folders_get_the_shipped_class_names(tmp_path, name, folders):
    from lit_softmoe.evals.benchmark import read_split as _read
    from lit_softmoe.evals.prompts import resolve_prompts
    from lit_softmoe.metadata import benchmark_info
    _image_folders(tmp_path / name / "test", folders)
    spec = BenchmarkConfig(name=name, root=str(tmp_path / name))
    data = _read(spec, lambda image: torch.tensor(image.getpixel((0, 0))))
    shipped = list(benchmark_info(name).classnames)
    assert data.format == "imagefolder"
    classnames, _, _ = resolve_prompts(spec, data)
    assert classnames == shipped  # the prompts say "disgusted", "lake or sea" …, in the shipped order
    # Each folder's images carry its class's index: the pixel value 10 * folder + i tells the folder.
    targets = {int(image) // 10: target for _, image, target in (data.dataset[i] for i in range(len(data.dataset)))}
    assert targets == dict(enumerate(range(len(folders))))
    if name == "fer2013":
        assert (shipped[targets[1]], shipped[targets[6]]) == ("disgusted", "surprised")


def test_sun397_labels_follow_classname_txt_jail_indoor_before_jail_cell(tmp_path):
    # torchvision numbers SUN397's classes by ClassName.txt, where /j/jail/indoor comes before
    # /j/jail_cell ("/" < "_"); the shipped list (CLIP's prompts.md, sorted after "_" and "/" became
    # spaces) had "jail cell" first, so both classes were scored against each other's prompt.
    assert len(_SUN397_CLASSES) == 397 and _SUN397_CLASSES == sorted(_SUN397_CLASSES)
    base = tmp_path / "SUN397"
    base.mkdir()
    (base / "ClassName.txt").write_text("".join(f"/{c[0]}/{c}\n" for c in _SUN397_CLASSES))
    picked = ["abbey", "jacuzzi/indoor", "jail/indoor", "jail_cell", "jewelry_shop", "youth_hostel"]
    for shade, cls in enumerate(picked):  # each folder's image has its own shade, to tell them apart
        path = base / cls[0] / cls / f"sun_{shade:04d}.jpg"
        path.parent.mkdir(parents=True)
        PIL.Image.new("L", (4, 4), 40 * shade).save(path, quality=100)
    data = read_benchmark("sun397", tmp_path, "test", lambda image: image, format="torchvision")
    classnames = benchmark_info("sun397").classnames
    got = {}
    for i in range(len(data.dataset)):
        _, image, target = data.dataset[i]
        got[picked[round(image.convert("L").getpixel((0, 0)) / 40)]] = classnames[target]
    assert got == {cls: cls.replace("_", " ").replace("/", " ") for cls in picked}


def _image(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.new("RGB", (8, 8), "gray").save(path)


def test_pets_class_ids_line_up_with_the_shipped_breeds(tmp_path):
    # annotations/test.txt: "IMAGE CLASS-ID SPECIES BREED-ID", CLASS-ID 1..37 (1-based).
    base = tmp_path / "oxford-iiit-pet"
    rows = [("Abyssinian_1", 1, 1), ("american_bulldog_10", 2, 2), ("Bengal_3", 6, 1), ("german_shorthaired_4", 15, 2),
            ("Maine_Coon_5", 21, 1), ("Sphynx_6", 34, 1), ("yorkshire_terrier_7", 37, 2)]
    (base / "annotations").mkdir(parents=True)
    (base / "annotations" / "test.txt").write_text("".join(f"{i} {c} {s} 1\n" for i, c, s in rows))
    for image_id, _, _ in rows:
        _image(base / "images" / f"{image_id}.jpg")
    data = read_benchmark("pets", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "pets") == ["Abyssinian", "American Bulldog", "Bengal", "German Shorthaired",
                                       "Maine Coon", "Sphynx", "Yorkshire Terrier"]


def test_eurosat_folders_line_up_with_the_shipped_names(tmp_path):
    folders = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
               "PermanentCrop", "Residential", "River", "SeaLake"]
    for folder in reversed(folders):
        _image(tmp_path / "eurosat" / "2750" / folder / f"{folder}_1.jpg")
    data = read_benchmark("eurosat", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "eurosat") == [
        "annual crop land", "forest", "brushland or shrubland", "highway or road",
        "industrial buildings or commercial buildings", "pasture land", "permanent crop land",
        "residential buildings or homes or apartments", "river", "lake or sea"]


def test_country211_iso_folders_line_up_with_the_shipped_countries(tmp_path):
    assert len(_COUNTRY211_CODES) == 211
    for code in _COUNTRY211_CODES:
        _image(tmp_path / "country211" / "test" / code / "1.jpg")
    data = read_benchmark("country211", tmp_path, "test", lambda image: image, format="torchvision")
    names = dict(zip(_COUNTRY211_CODES, _names_of(data, "country211")))
    assert {c: names[c] for c in ("AD", "AX", "CD", "CW", "DZ", "ES", "GB", "KP", "KR", "SZ", "US", "XK", "ZW")} == {
        "AD": "Andorra", "AX": "Aland Islands", "CD": "DR Congo", "CW": "Curacao", "DZ": "Algeria", "ES": "Spain",
        "GB": "United Kingdom", "KP": "North Korea", "KR": "South Korea", "SZ": "Eswatini", "US": "United States",
        "XK": "Kosovo", "ZW": "Zimbabwe"}


def test_stl10_one_based_label_file_lines_up_with_the_shipped_names(tmp_path, monkeypatch):
    import numpy as np
    import torchvision.datasets.stl10 as stl10
    monkeypatch.setattr(stl10, "check_integrity", lambda *args, **kwargs: True)  # our files are not STL's md5
    base = tmp_path / "stl10_binary"
    base.mkdir()
    labels = np.arange(1, 11, dtype=np.uint8)  # test_y.bin holds 1..10
    np.zeros((10, 3, 96, 96), dtype=np.uint8).tofile(base / "test_X.bin")
    labels.tofile(base / "test_y.bin")
    (base / "class_names.txt").write_text("airplane\nbird\ncar\ncat\ndeer\ndog\nhorse\nmonkey\nship\ntruck\n")
    data = read_benchmark("stl10", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "stl10") == (base / "class_names.txt").read_text().split()


def test_labels_kept_beside_the_images_are_read_without_decoding_them(tmp_path, monkeypatch):
    # Rendered SST2 (like GTSRB, FER2013 and Cars) keeps (path, label) pairs in `_samples`; listing the
    # labels through dataset[i] decoded every image first (about 8,000 JPEGs for Cars).
    import torchvision.datasets
    for name, count in (("negative", 2), ("positive", 3)):
        for i in range(count):
            _image(tmp_path / "rendered-sst2" / "test" / name / f"{name}_{i}.png")
    decoded = []
    original = torchvision.datasets.RenderedSST2.__getitem__
    monkeypatch.setattr(torchvision.datasets.RenderedSST2, "__getitem__",
                        lambda self, i: decoded.append(i) or original(self, i))
    data = read_benchmark("renderedsst2", tmp_path, "test", lambda image: image, format="torchvision")
    assert decoded == []  # nothing decoded until the images themselves are read
    assert _names_of(data, "renderedsst2") == ["negative"] * 2 + ["positive"] * 3
    assert sorted(decoded) == list(range(5))


@needs_foolbox
def test_a_fifo_among_class_folder_images_is_passed_over_never_opened(tmp_path):
    """Opening a FIFO blocks until a writer comes, so an image-folder eval with one among its images
    hung forever; only regular files are images."""
    import os
    import threading

    images = foolbox_images("cifar10")
    for label, name in enumerate(("cat", "dog")):
        (tmp_path / "test" / name).mkdir(parents=True)
        (tmp_path / "test" / name / "a.png").write_bytes(images[label][0].read_bytes())
    fifo = tmp_path / "test" / "dog" / "b.png"
    os.mkfifo(fifo)
    read = []

    def read_all():
        data = read_benchmark("mine", tmp_path, "test", lambda im: im.size)
        read.append([data.dataset[i][2] for i in range(len(data.dataset))])

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # unblock the reader (open a writer end, then close it) before failing
        open(fifo, "wb").close()
        reader.join(5)
        pytest.fail("the image-folder reader blocked on a FIFO for 20 s")
    assert read == [[0, 1]]


def _photo_jpegs(count: int) -> list[bytes]:
    """foolbox's ImageNet photos upscaled to 900-1,100 px JPEGs (q90): large enough for a reduced decode."""
    jpegs = []
    for i, (path, _) in enumerate(foolbox_images("imagenet")[:count]):
        size = (1100 - 60 * i, 900 + 40 * i)
        image = PIL.Image.open(path).convert("RGB").resize(size, PIL.Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    return jpegs


@needs_foolbox
@pytest.mark.parametrize("decode", ["reduced", "full", None])  # None: a tower folder written before the key
def test_pipeline_eval_readers_and_model_preprocess_decode_a_jpeg_alike(tmp_path, decode):
    """Embedding (the shard pipeline), eval (its webdataset and class-folder readers) and a loaded model's
    preprocess, given the file as PIL.Image.open returns it, see the very same tensor."""
    from lit_softmoe.data.images import open_image
    from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
    from lit_softmoe.data.transforms import eval_transform, image_transform
    from lit_softmoe.hub import make_preprocess, preprocess_spec
    from lit_softmoe.models.preprocess import Preprocess

    jpegs = _photo_jpegs(3)
    pre = {"image_size": 32, "mean": [0.4, 0.5, 0.6], "std": [0.2, 0.25, 0.3]}
    if decode:
        pre["decode"] = decode
    transform = image_transform(Preprocess.from_settings(pre, 3, "test"))
    min_side = 64 if decode == "reduced" else None
    expected = torch.stack([eval_transform(32, 3, pre["mean"], pre["std"])(open_image(d, min_side)) for d in jpegs])
    full = torch.stack([eval_transform(32, 3, pre["mean"], pre["std"])(open_image(d)) for d in jpegs])
    assert torch.equal(expected, full) == (decode != "reduced")  # the reduced decode is another decode

    write_wds_benchmark(tmp_path / "wds", [(d, "jpg", i) for i, d in enumerate(jpegs)])
    loader = create_shard_loader(ShardDataConfig(urls=str(tmp_path / "wds" / "test"), batch_size=8, workers=0,
                                                 shuffle=False, exact_epoch=True),
                                 "image-class", transform=transform)
    assert torch.equal(next(iter(loader))["image"], expected)

    wds_data = read_benchmark("x", tmp_path / "wds", "test", transform, format="wds")
    assert torch.equal(torch.stack([image for _, image, _ in wds_data.dataset]), expected)
    for i, data in enumerate(jpegs):
        (tmp_path / "folders" / f"class{i}").mkdir(parents=True)
        (tmp_path / "folders" / f"class{i}" / "photo.jpg").write_bytes(data)
    folder_data = read_benchmark("x", tmp_path / "folders", "test", transform, format="imagefolder")
    assert torch.equal(torch.stack([folder_data.dataset[i][1] for i in range(3)]), expected)

    # An export's description: torch-free readers redo the preprocessing from these.
    spec = preprocess_spec(Preprocess.from_settings(pre, 3, "test"))
    assert (spec["decode"], spec["jpeg_min_side"]) == (decode or "full", min_side)
    preprocess = make_preprocess(spec)
    opened = [PIL.Image.open(tmp_path / "folders" / f"class{i}" / "photo.jpg") for i in range(3)]
    assert torch.equal(torch.stack([preprocess(image) for image in opened]), expected)
