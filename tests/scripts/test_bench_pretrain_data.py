"""scripts/make_class_folders.py and scripts/bench_pretrain_data.py at toy size: JPEG class folders at the
sizes asked for, the throughput race's rows and ratio, and the --memory harness around a real (in-memory)
pretraining run."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))  # for their `from benchlib import ...`
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # the pool's workers find `_write_chunk` by its module's name
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


@pytest.fixture(scope="module")
def make_class_folders():
    return _load("make_class_folders")


@pytest.fixture(scope="module")
def bench():
    return _load("bench_pretrain_data")


def test_class_folders_are_jpegs_at_the_sizes_asked(make_class_folders, tmp_path):
    out = tmp_path / "folders"
    summary = make_class_folders.main(["--out", str(out), "--train", "30", "--test", "10", "--min-size", "40",
                                       "--max-size", "90", "--rgb", "--seed", "3"])
    assert summary["images"] == 40 and summary["counts"] == {"train": 30, "test": 10} and not summary["skipped"]
    for split, count in (("train", 30), ("test", 10)):
        assert sorted(p.name for p in (out / split).iterdir()) == sorted(FASHION_MNIST_CLASSNAMES)  # ≥ 10: all
        files = sorted((out / split).glob("*/*"))
        assert len(files) == count and {p.stem for p in files} == {str(i) for i in range(count)}
        for path in files:
            with PIL.Image.open(path) as image:
                assert image.format == "JPEG" and image.mode == "RGB"
                assert all(40 <= side <= 90 for side in image.size)
                assert image.size == make_class_folders.image_size(3, split, int(path.stem), 40, 90)
    # Classes in turn: image i is of class i mod 10 (Fashion-MNIST's 10 classes have equal counts).
    assert all(FASHION_MNIST_CLASSNAMES.index(p.parent.name) == int(p.stem) % 10 for p in out.glob("*/*/*.jpg"))
    assert summary["bytes"] == sum(p.stat().st_size for p in out.glob("*/*/*.jpg"))
    assert len({PIL.Image.open(p).size for p in out.glob("train/*/*.jpg")}) > 5  # sizes do vary
    assert make_class_folders.main(["--out", str(out), "--train", "30", "--test", "10", "--min-size", "40",
                                    "--max-size", "90", "--rgb", "--seed", "3"])["skipped"]


def test_items_keep_their_shape_centered_on_a_black_canvas(make_class_folders, tmp_path):
    # Stretched to a canvas up to 1.67:1, an item would lose up to 40% of itself to a classifier's center crop.
    out = tmp_path / "folders"
    make_class_folders.make_class_folders(out, train=0, test=30, min_size=40, max_size=120, processes=1)
    originals, _ = make_class_folders._arrays("test", None)
    non_square = 0
    for path in out.glob("test/*/*.jpg"):
        index = int(path.stem)
        width, height = make_class_folders.image_size(0, "test", index, 40, 120)
        side = min(width, height)
        top, left = (height - side) // 2, (width - side) // 2
        with PIL.Image.open(path) as image:
            pixels = np.asarray(image, dtype=np.float64)  # (H, W)
        item = PIL.Image.fromarray(originals[index]).resize((side, side), PIL.Image.Resampling.BICUBIC)
        assert pixels.shape == (height, width)
        assert np.abs(pixels[top:top + side, left:left + side] - np.asarray(item)).mean() < 3  # JPEG's error only
        canvas = np.ones(pixels.shape, dtype=bool)
        canvas[top:top + side, left:left + side] = False
        if canvas.any():
            non_square += 1
            assert pixels[canvas].mean() < 3  # black, as Fashion-MNIST's background
    assert non_square >= 20


def test_more_images_than_fashion_mnist_repeat_it_and_shards_follow(make_class_folders, tmp_path, monkeypatch):
    # A test split of 5 images written as 12: the 5 originals, then repeats under new indices.
    images, labels = make_class_folders._arrays("test", None)
    monkeypatch.setitem(make_class_folders._ARRAYS, "test", (images[:5], labels[:5]))
    out = tmp_path / "folders"
    make_class_folders.make_class_folders(out, train=0, test=12, min_size=28, max_size=28, processes=1, shards=True,
                                          samples_per_shard=5)
    files = sorted(out.glob("test/*/*.jpg"), key=lambda p: int(p.stem))
    assert [int(p.stem) for p in files] == list(range(12)) and not (out / "train").exists()
    assert [p.parent.name for p in files[5:10]] == [p.parent.name for p in files[:5]]
    with PIL.Image.open(files[0]) as image:
        assert image.mode == "L" and image.size == (28, 28)
    assert (out / "shards" / "test" / "nshards.txt").read_text().strip() == "3"
    assert (out / "shards" / "classnames.txt").read_text().splitlines() == sorted({p.parent.name for p in files})


def test_throughput_race_has_both_rows_and_a_ratio(bench, tmp_path, capsys):
    result = bench.main(["--data", str(tmp_path / "data"), "--images", "64", "--batch", "16", "--repeats", "1",
                         "--workers", "1", "--json", str(tmp_path / "bench.json")])
    assert json.loads((tmp_path / "bench.json").read_text()) == result
    rows = {row["loader"]: row for row in result["rows"]}
    assert {"timm", "ours"} <= set(rows) and rows["timm"]["ratio"] == 1.0
    assert all(row["images_per_epoch"] == 64 and row["images_per_s_per_worker"] > 0 for row in rows.values())
    assert result["ratio"] == pytest.approx(rows["ours"]["ratio"]) and result["ratio"] > 0
    printed = capsys.readouterr()
    assert "| loader | images/epoch | images/s | images/s per worker | / timm |" in printed.out
    # The same crop on both sides: timm's, and ours (the random box on the PIL image, then the resize).
    assert "RandomResizedCropAndInterpolation(size=(224, 224), scale=(0.08, 1.0), ratio=(0.75, 1.3333)" in printed.err
    assert "_RandomAreaCropFlip(scale=(0.08, 1.0), ratio=(3/4, 4/3), hflip=True)" in printed.err
    assert "Resize(size=[224, 224], interpolation=bilinear, antialias=True)" in printed.err


# A stand-in for `lit-softmoe pretrain`: a process holding 30 MB that starts a worker holding 60 MB.
_TREE = """
import subprocess, sys, time
held = bytearray(30 * 2**20)
worker = subprocess.Popen([sys.executable, "-c", "import time; held = bytearray(60 * 2**20); time.sleep(1.5)"])
time.sleep(1.5)
worker.wait()
"""


def test_memory_harness_samples_the_whole_process_tree(bench, tmp_path, monkeypatch, capsys):
    # The real command runs `pretrain` for --steps (tested by hand: the docstring's command); here the
    # stand-in shows what the sampler adds up. Its data sets are still written, with their shards.
    commands = []
    monkeypatch.setattr(bench, "pretrain_command", lambda dataset, run_dir, args: commands.append(
        (dataset, args.steps)) or [sys.executable, "-c", _TREE])
    result = bench.main(["--memory", "--data", str(tmp_path / "data"), "--memory-sizes", "20,30", "--memory-test",
                         "10", "--min-size", "28", "--max-size", "32", "--steps", "7",
                         "--json", str(tmp_path / "memory.json")])
    assert commands == [(tmp_path / "data" / "20", 7), (tmp_path / "data" / "30", 7)]
    assert (tmp_path / "data" / "30" / "shards" / "train" / "nshards.txt").is_file()
    assert [row["train_images"] for row in result["rows"]] == [20, 30]
    for row in result["rows"]:
        assert row["peak_main_bytes"] > 30 * 2**20 and row["peak_tree_bytes"] > row["peak_main_bytes"] + 50 * 2**20
    assert result["pass"] == (result["relative_difference"] < 0.10)
    assert json.loads((tmp_path / "memory.json").read_text()) == result
    printed = capsys.readouterr().out
    assert "| train images | peak RSS, main + workers (MB) | peak RSS, main (MB) | run s |" in printed
    assert ("PASS" if result["pass"] else "FAIL") in printed


def test_pretrain_command_holds_only_keys_pretrain_knows(bench, tmp_path):
    from lit_softmoe.config import PretrainConfig
    from lit_softmoe.config_loading import load_config

    args = argparse.Namespace(steps=5, loader_keys="", extra=["batch_size=8"])
    command = bench.pretrain_command(tmp_path, tmp_path / "run", args)
    config = command[command.index("--config") + 1]
    cfg = load_config(PretrainConfig, config, command[command.index("--config") + 2:])
    assert cfg.steps == 5 and cfg.fewshot_shots == 0 and cfg.log_with == [] and cfg.batch_size == 8
    assert cfg.data.train == str(tmp_path / "shards" / "train")


def test_memory_mode_says_when_pretrain_lacks_the_streaming_keys(bench, tmp_path):
    with pytest.raises(SystemExit, match="does not know data.bogus_loader yet"):
        bench.main(["--memory", "--data", str(tmp_path / "data"), "--memory-sizes", "20", "--memory-test", "10",
                    "--min-size", "28", "--max-size", "28", "--steps", "1", "--loader-keys", "data.bogus_loader=1"])
