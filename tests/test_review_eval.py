"""Review of `lit-softmoe eval` as a user meets it: suite entries that name no data, class folders
taken for torchvision's files, torchvision splits, results of two runs landing on one path, --out
pointing at the Markdown, and --peer on a caption set CLIP_benchmark does not know by name."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.errors import UserError
from lit_softmoe.evals import suite
from lit_softmoe.evals.readers import detect_format, read_benchmark
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info

from evalkit import FOOLBOX_DATA, _class_folders, _wds_set, foolbox_images, save_pair, tiny_pair, write_wds_benchmark

pytestmark = pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")


def test_a_benchmark_without_root_or_name_is_refused(tmp_path, monkeypatch):
    # Path("") is the working directory: without the check, its subfolders were read as a class set.
    _class_folders(tmp_path, ["a", "b"])
    monkeypatch.chdir(tmp_path)
    for spec, words in ((BenchmarkConfig(name="cifar100"), "cifar100 has no root"),
                        (BenchmarkConfig(root=str(tmp_path)), "benchmark 1 has no name")):
        cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"), benchmarks=[spec])
        with pytest.raises(UserError, match=words):
            run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))
    assert not (tmp_path / "o.json").exists()


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


def test_the_torchvision_reader_reads_the_split_asked_for(torchvision_fmnist):
    # split: train used to give the 10k test images, reported as split train (CLIP_benchmark's #13).
    train = read_benchmark("fashion-mnist", torchvision_fmnist, "train", lambda im: im, format="torchvision")
    test = read_benchmark("fashion-mnist", torchvision_fmnist, "test", lambda im: im, format="torchvision")
    assert len(train.dataset) == 60_000 and len(test.dataset) == 10_000
    assert train.signature != test.signature
    with pytest.raises(UserError, match="train and test, not 'val'"):
        read_benchmark("fashion-mnist", torchvision_fmnist, "val", lambda im: im, format="torchvision")


def test_a_split_torchvision_does_not_know_is_one_line(tmp_path):
    # A split torchvision validates itself (ValueError) is a UserError, not a traceback.
    (tmp_path / "dtd" / "dtd").mkdir(parents=True)
    with pytest.raises(UserError, match="tset"):
        read_benchmark("dtd", tmp_path, "tset", lambda im: im, format="torchvision")


def test_two_runs_finishing_on_one_default_path_keep_both_results(tmp_path, monkeypatch):
    # Two evals of one suite started in the same second (e.g. --benchmarks a and b on two GPUs) got the
    # same default name; both passed the check at the start and the second overwrote the first.
    root = _wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    taken = [tmp_path / "eval" / "s-20260101-000000.json"]  # the path the other run writes
    monkeypatch.setattr(suite, "_default_out", lambda model_path, name: taken[0])
    evaluate = suite.evaluate_benchmark

    def other_run_finishes_first(*args, **kwargs):
        taken[0].parent.mkdir(exist_ok=True)
        taken[0].write_text('{"other": "run"}')
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(suite, "evaluate_benchmark", other_run_finishes_first)
    report = run_suite(tmp_path / "m", cfg, model_bundle=tiny_pair(3, 32))
    assert json.loads(taken[0].read_text()) == {"other": "run"}
    mine = report["paths"]["json"]
    assert mine == str(taken[0].with_name("s-20260101-000000-2.json"))
    assert json.loads(open(mine).read())["results"][0]["status"] == "ok"
    # An explicit --out that appeared during the run is not replaced either (without --overwrite).
    taken[0] = tmp_path / "mine.json"
    report = run_suite(tmp_path / "m", cfg, out=taken[0], model_bundle=tiny_pair(3, 32))
    assert json.loads(taken[0].read_text()) == {"other": "run"} and report["paths"]["json"] != str(taken[0])
    report = run_suite(tmp_path / "m", cfg, out=taken[0], overwrite=True, model_bundle=tiny_pair(3, 32))
    assert report["paths"]["json"] == str(taken[0]) and "results" in json.loads(taken[0].read_text())


def test_out_naming_the_markdown_or_png_is_refused(tmp_path):
    # The Markdown and PNG go beside --out with its suffix swapped: --out r.md wrote the JSON, then
    # replaced it with the table.
    root = _wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    for name in ("r.md", "r.PNG"):
        with pytest.raises(UserError, match="give a .json path"):
            run_suite("m", cfg, out=tmp_path / name, model_bundle=tiny_pair(3, 32))
    assert not list(tmp_path.glob("r.*"))


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


def test_a_failing_benchmark_loses_none_of_the_others_results(tmp_path, capsys):
    # A mistake in one entry (here a caption set read as classes) ended the suite with the results of
    # the benchmarks before it, already computed, unwritten.
    from lit_softmoe import cli
    images = foolbox_images("imagenet")[:3]
    captions = write_wds_benchmark(tmp_path / "caps", [(p.read_bytes(), "jpg", f"caption {i}")
                                                       for i, (p, _) in enumerate(images)], retrieval=True)
    (captions / "dataset_type.txt").unlink()
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(_wds_set(tmp_path / "cifar10"))),
                                      BenchmarkConfig(name="my-captions", root=str(captions))])
    report = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))
    written = json.loads((tmp_path / "o.json").read_text())["results"]
    assert [(e["benchmark"], e["status"]) for e in written] == [("cifar10", "ok"), ("my-captions", "failed")]
    assert written[0]["metrics"]["top1"] == report["results"][0]["metrics"]["top1"]
    table = (tmp_path / "o.md").read_text()
    assert "failed: my-captions" in table and "set task: retrieval" in table

    # The CLI writes them too, then ends in one line naming the failure and where the rest went: exit 2.
    model = save_pair(tmp_path / "pair", in_channels=3, image_size=32)
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: s\nworkers: 0\ncache_dir: {tmp_path / 'c2'}\nbenchmarks:\n"
                     f"  - {{name: cifar10, root: {tmp_path / 'cifar10'}}}\n"
                     f"  - {{name: my-captions, root: {captions}}}\n")
    code = cli.main(["eval", "--model", str(model), "--suite", str(suite), "--out", str(tmp_path / "cli.json")])
    captured = capsys.readouterr()
    assert code == 2 and (tmp_path / "cli.json").is_file()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-softmoe eval: error: my-captions: ") and str(tmp_path / "cli.json") in lines[0]


def test_a_webdataset_export_under_another_split_name_says_which(tmp_path):
    # The shipped suites read imagenet1k's split val (ImageFolder's name); CLIP_benchmark's export
    # (clip-benchmark/wds_imagenet1k) calls the same images test. The skip said "class folders (found
    # only test/ …)"; it now names the split to set.
    from lit_softmoe.evals.readers import MissingData
    root = _wds_set(tmp_path / "imagenet1k")
    for format in ("auto", "wds"):
        with pytest.raises(MissingData, match="webdataset split here: test; set split: test"):
            read_benchmark("imagenet1k", root, "val", lambda im: im, format=format)


def test_a_cache_that_cannot_be_written_does_not_end_the_suite(tmp_path, caplog):
    # A read-only ~/.cache (containers) or a cache_dir that is a file raised after every image was encoded.
    root = _wds_set(tmp_path / "cifar10")
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(blocker),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and entry["image_cache"] == "off"
    assert "not cached" in caplog.text and str(blocker) in caplog.text


@pytest.mark.parametrize("ks", [[0], [-1, 5], []])
def test_recall_k_below_one_is_refused(tmp_path, ks):
    # recall_k=[0] scored R@0 = 0 and [-1] ranked "all but the last" (a slice), both silently.
    root = _wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"), recall_k=ks,
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    with pytest.raises(UserError, match="recall_k"):
        run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))


def _cifar100_pickles(root):
    images = foolbox_images("cifar100")
    pixels = np.stack([np.asarray(__import__("PIL.Image").Image.open(p).convert("RGB")) for p, _ in images])
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    batch = {b"data": pixels.transpose(0, 3, 1, 2).reshape(len(images), -1), b"fine_labels": [l for _, l in images]}
    (folder / "test").write_bytes(__import__("pickle").dumps(batch))
    return folder


def test_cifar100_pickles_under_a_name_of_the_users_own(tmp_path):
    # The variant came from the benchmark's name alone: "my-cifar100" looked for CIFAR-10's test_batch.
    _cifar100_pickles(tmp_path)
    data = read_benchmark("my-cifar100", tmp_path, "test", lambda im: im)
    assert data.format == "cifar" and len(data.dataset) == 20


def test_a_broken_cifar_pickle_is_one_line(tmp_path):
    # A truncated download raised EOFError / UnpicklingError from deep in pickle.
    folder = _cifar100_pickles(tmp_path)
    (folder / "test").write_bytes((folder / "test").read_bytes()[:1000])
    with pytest.raises(UserError, match="cifar-100-python/test"):
        read_benchmark("cifar100", tmp_path, "test", lambda im: im)
