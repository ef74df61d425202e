"""Shard writing: `lit-softmoe data from-folder` against img2dataset on the same photos.

A folder of captioned photo-like JPEGs (`benchlib.photo_jpegs`: foolbox's 20 ImageNet photos cropped and
resized to 500-1,200 px, quality 90, a same-stem .txt caption beside each) is written as webdataset shards
of 256 px JPEGs by both, as a user types the commands, each with its defaults but for what makes the work
the same:

    lit-softmoe data from-folder PHOTOS --out OURS --max-size 256 --image-format jpg   (every core)
    img2dataset --url_list photos.csv --input_format csv --url_col url --caption_col caption
        --output_format webdataset --image_size 256 --resize_mode keep_ratio_largest
        --resize_only_if_bigger True --encode_format jpg --processes_count P --thread_count 16

(img2dataset reads `file://` URLs; P is the number of cores, as our default.) The two alternate for
--repeats rounds, each into a fresh folder, and the median wall time is reported with the ratio, plus
ours with `--workers 1`. img2dataset is found on PATH or given with --img2dataset (it pins old
packages: install it in a venv of its own, `python -m venv /tmp/i2d && /tmp/i2d/bin/pip install
img2dataset`). Example:

    python scripts/bench_writers.py --photos 2000 --img2dataset /tmp/i2d/bin/img2dataset
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import cpu_name, photo_jpegs


def write_photos(folder: Path, count: int) -> Path:
    """`count` captioned JPEGs in `folder`, and the CSV img2dataset reads them from."""
    folder.mkdir(parents=True, exist_ok=True)
    table = folder.parent / "photos.csv"
    with open(table, "w", newline="") as file:
        rows = csv.writer(file)
        rows.writerow(["url", "caption"])
        for index, jpeg in enumerate(photo_jpegs(count)):
            path = folder / f"{index:06d}.jpg"
            path.write_bytes(jpeg)
            caption = f"a photo, number {index}"
            (folder / f"{index:06d}.txt").write_text(caption)
            rows.writerow([path.resolve().as_uri(), caption])
    return table


def _timed(command: list[str], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} … failed:\n{result.stderr[-3000:]}")
    return seconds


def _written(out: Path) -> tuple[int, int]:
    """(JPEGs, their bytes) in the tars under `out`."""
    import tarfile

    count = size = 0
    for tar in out.rglob("*.tar"):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                if member.name.endswith(".jpg"):
                    count, size = count + 1, size + member.size
    return count, size


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--img2dataset", default=shutil.which("img2dataset"), help="its executable")
    args = parser.parse_args(argv)
    if not args.img2dataset:
        raise SystemExit("img2dataset not found: pip install img2dataset (in a venv of its own), or --img2dataset")
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        table = write_photos(tmp / "photos", args.photos)
        ours = [sys.executable, "-m", "lit_softmoe.cli", "data", "from-folder", str(tmp / "photos"),
                "--out", str(tmp / "ours"), "--max-size", "256", "--image-format", "jpg"]
        runs = {
            "lit-softmoe data from-folder": (ours, tmp / "ours"),
            "lit-softmoe data from-folder --workers 1": (ours + ["--workers", "1"], tmp / "ours"),
            f"img2dataset --processes_count {cores}": (
                [args.img2dataset, "--url_list", str(table), "--input_format", "csv", "--url_col", "url",
                 "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(tmp / "i2d"),
                 "--image_size", "256", "--resize_mode", "keep_ratio_largest", "--resize_only_if_bigger", "True",
                 "--encode_format", "jpg", "--processes_count", str(cores), "--thread_count", "16",
                 "--enable_wandb", "False"], tmp / "i2d"),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (command, out) in runs.items():
                times[name].append(_timed(command, out))
        written = {name: _written(out) for name, (_, out) in runs.items()}
    peer = statistics.median(times[f"img2dataset --processes_count {cores}"])
    print(f"# {args.photos} captioned JPEGs of 500-1,200 px → 256 px JPEG shards; {cpu_name()}, {cores} cores; "
          f"median of {args.repeats}, alternating")
    print("| command | seconds | images/s | vs img2dataset | JPEGs written (MB) |")
    print("|---|---|---|---|---|")
    result = {}
    for name in runs:
        seconds = statistics.median(times[name])
        count, size = written[name]
        result[name] = {"seconds": seconds, "all": times[name], "written": count, "bytes": size}
        print(f"| `{name}` | {seconds:.1f} | {args.photos / seconds:.0f} | {peer / seconds:.2f}x | "
              f"{count} ({size / 1e6:.1f}) |")
    return result


if __name__ == "__main__":
    main()
