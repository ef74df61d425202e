"""Fashion-MNIST's real images as ImageNet-style class folders of JPEGs at random sizes (issue 17).

Writes `OUT/train/<class name>/<index>.jpg` and `OUT/test/<class name>/<index>.jpg`, each at a random
size: a base side drawn uniformly in `--min-size..--max-size`, then each side drawn independently within
±25% of it and clipped to that range. The 28×28 original is resized (PIL bicubic) to a square of the
shorter side and centered on that canvas, the rest filled with Fashion-MNIST's black background, as a
photo framed wider: stretching the item to the canvas instead would distort it, and a classifier's
center crop would then cut up to 40% of it. Optionally converted to RGB (`--rgb`; default grayscale
"L"), saved as JPEG quality 90.
The originals are taken one class after the other (image i is of class i mod 10, in Fashion-MNIST's order
within each class), so a split of any size ≥ 10 has every class folder and about equal counts;
`--train N` above 60,000 repeats the originals, each repeat at a new size under a new index. Every
image's size depends only on (seed, split, index), so the same command writes the same files whatever
the number of processes. With `--shards`, `lit-softmoe data from-folder --layout classes` then writes
class shards of both splits to `OUT/shards/{train,test}` (and `OUT/shards/classnames.txt`).

    python scripts/make_class_folders.py --out /tmp/fmnist-folders                     # 60k + 10k, 28-256 px
    python scripts/make_class_folders.py --out /tmp/f224 --train 4000 --test 0 --min-size 224 --max-size 224 --rgb
    python scripts/make_class_folders.py --out /tmp/f100k --train 100000 --min-size 64 --max-size 640 --shards

A folder this script wrote before (its make_class_folders.json) is reused when the arguments match
and rewritten otherwise; a folder holding anything else is refused.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shutil
import time
from pathlib import Path

import numpy as np
import PIL.Image

from lit_softmoe import cli
from lit_softmoe.data.fashion_mnist import read_fashion_mnist
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES

MANIFEST = "make_class_folders.json"
SPLITS = ("train", "test")
ASPECT_SPREAD = 0.25  # each side within ±25% of the drawn base side
JPEG_QUALITY = 90
FRAMING = "centered"  # in the manifest: folders whose items were stretched to the canvas are rewritten
CHUNK = 500  # images per task of the pool

_ARRAYS: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # split → (images, labels), per process


def image_size(seed: int, split: str, index: int, min_size: int, max_size: int) -> tuple[int, int]:
    """(width, height) of image `index`: a function of its (seed, split, index) alone."""
    rng = random.Random(f"{seed}/{split}/{index}")
    base = rng.randint(min_size, max_size)

    def side() -> int:
        return min(max_size, max(min_size, round(base * rng.uniform(1 - ASPECT_SPREAD, 1 + ASPECT_SPREAD))))

    return side(), side()


def framed(item: np.ndarray, size: tuple[int, int]) -> PIL.Image.Image:
    """The item (H, W uint8) resized to a square of the shorter side of `size` = (width, height) and
    centered on a black canvas of that size."""
    side = min(size)
    canvas = PIL.Image.new("L", size, 0)  # Fashion-MNIST's background is 0
    canvas.paste(PIL.Image.fromarray(item).resize((side, side), PIL.Image.Resampling.BICUBIC),
                 ((size[0] - side) // 2, (size[1] - side) // 2))
    return canvas


def class_interleaved(labels: np.ndarray) -> np.ndarray:
    """An order of the originals taking one of each class in turn (the first of each, then the second…),
    so that any 10 consecutive images hold every class: small splits then have the same class folders,
    which `data from-folder` requires of the splits of one data set."""
    rank = np.zeros(len(labels), dtype=np.int64)  # each image's position among its class's
    for label in np.unique(labels):
        members = labels == label
        rank[members] = np.arange(members.sum())
    return np.lexsort((labels, rank))  # by rank, then label


def _arrays(split: str, source: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's `split` (images, labels) in `class_interleaved` order."""
    if split not in _ARRAYS:  # read once per process: the pool's workers read their own copy
        images, labels = read_fashion_mnist(split, source, allow_download=False)
        order = class_interleaved(labels)
        _ARRAYS[split] = images[order], labels[order]
    return _ARRAYS[split]


def _write_chunk(task: tuple) -> int:
    """Write images `start..stop` of `split`; returns the bytes written."""
    out, split, start, stop, options = task
    images, labels = _arrays(split, options["source"])
    written = 0
    for index in range(start, stop):
        original = index % len(images)  # past the originals: repeats, each at its own size
        size = image_size(options["seed"], split, index, options["min_size"], options["max_size"])
        image = framed(images[original], size)
        if options["rgb"]:
            image = image.convert("RGB")
        path = Path(out, split, FASHION_MNIST_CLASSNAMES[labels[original]], f"{index}.jpg")
        image.save(path, "JPEG", quality=JPEG_QUALITY)
        written += path.stat().st_size
    return written


def _prepare(out: Path, manifest: dict) -> bool:
    """True if `out` already holds these folders; else empties what this script wrote there before."""
    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        written = json.loads(manifest_path.read_text())
        if {key: value for key, value in written.items() if key != "summary"} == manifest:
            return True
        manifest_path.unlink()
        for split in SPLITS:
            shutil.rmtree(out / split, ignore_errors=True)
        shutil.rmtree(out / "shards", ignore_errors=True)
    elif out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty and was not written by this script ({MANIFEST} missing); "
                         "choose another --out")
    return False


def _write_shards(out: Path, samples_per_shard: int) -> None:
    """`lit-softmoe data from-folder --layout classes` for each split written."""
    for split in SPLITS:
        if (out / split).is_dir():
            argv = ["data", "from-folder", str(out / split), "--out", str(out / "shards"), "--split", split,
                    "--layout", "classes", "--samples-per-shard", str(samples_per_shard)]
            if cli.main(argv):
                raise SystemExit(f"lit-softmoe {' '.join(argv)} failed")


def make_class_folders(out: str | Path, train: int | None = None, test: int | None = None, min_size: int = 28,
                       max_size: int = 256, rgb: bool = False, seed: int = 0, processes: int = 2,
                       shards: bool = False, samples_per_shard: int = 1000, source: str | None = None) -> dict:
    """Write the class folders (see the module docstring); returns {"images", "bytes", "seconds", "skipped"}.

    `train` / `test`: images per split (None: all of Fashion-MNIST's, 60,000 and 10,000; 0: no such split).
    """
    if not 1 <= min_size <= max_size:
        raise SystemExit(f"--min-size {min_size} and --max-size {max_size}: need 1 ≤ min ≤ max")
    start, out = time.perf_counter(), Path(out)
    counts = {split: n if n is not None else len(_arrays(split, source)[1])
              for split, n in zip(SPLITS, (train, test))}
    manifest = {"counts": counts, "min_size": min_size, "max_size": max_size, "rgb": rgb, "seed": seed,
                "quality": JPEG_QUALITY, "framing": FRAMING, "shards": samples_per_shard if shards else None}
    if _prepare(out, manifest):
        summary = json.loads((out / MANIFEST).read_text())["summary"]
        return {**summary, "seconds": time.perf_counter() - start, "skipped": True}
    options = {"seed": seed, "min_size": min_size, "max_size": max_size, "rgb": rgb, "source": source}
    tasks = []
    for split, count in counts.items():
        labels = _arrays(split, source)[1] if count else []
        for label in np.unique(labels[:count]):  # only classes with images: `data from-folder` lists no others
            (out / split / FASHION_MNIST_CLASSNAMES[label]).mkdir(parents=True, exist_ok=True)
        tasks += [(str(out), split, first, min(count, first + CHUNK), options) for first in range(0, count, CHUNK)]
    if processes > 1 and len(tasks) > 1:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            written = sum(pool.imap_unordered(_write_chunk, tasks))
    else:
        written = sum(map(_write_chunk, tasks))
    if shards:
        _write_shards(out, samples_per_shard)
    summary = {"images": sum(counts.values()), "counts": counts, "bytes": written}
    (out / MANIFEST).write_text(json.dumps({**manifest, "summary": summary}, indent=1) + "\n")
    return {**summary, "seconds": time.perf_counter() - start, "skipped": False}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write train/ and test/ into")
    parser.add_argument("--train", type=int, help="train images (default: all 60,000; more repeat the originals)")
    parser.add_argument("--test", type=int, help="test images (default: all 10,000; 0: no test split)")
    parser.add_argument("--min-size", type=int, default=28, help="smallest side in pixels (default 28)")
    parser.add_argument("--max-size", type=int, default=256, help="largest side in pixels (default 256)")
    parser.add_argument("--rgb", action="store_true", help="write RGB JPEGs (default: grayscale)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2, help="processes encoding JPEGs (default 2)")
    parser.add_argument("--shards", action="store_true",
                        help="then write class shards of both splits to OUT/shards (data from-folder --layout classes)")
    parser.add_argument("--samples-per-shard", type=int, default=1000, help="--shards: samples per shard")
    parser.add_argument("--source", help="Fashion-MNIST's idx files' folder (default: where the library finds it)")
    args = parser.parse_args(argv)
    summary = make_class_folders(args.out, args.train, args.test, args.min_size, args.max_size, args.rgb, args.seed,
                                 args.processes, args.shards, args.samples_per_shard, args.source)
    verb = "already there" if summary["skipped"] else "written"
    print(f"{summary['images']:,} JPEGs ({' + '.join(f'{n:,} {s}' for s, n in summary['counts'].items())}), "
          f"{summary['bytes'] / 1e6:,.1f} MB, {verb} in {summary['seconds']:.1f} s at {args.out}")
    return summary


if __name__ == "__main__":
    main()
