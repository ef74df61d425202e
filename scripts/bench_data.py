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
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.models.tokenizers import create_tokenizer


def _time_epoch(batches) -> tuple[int, float]:
    start = time.perf_counter()
    images = 0
    for batch in batches:
        images += len(batch["image"] if isinstance(batch, dict) else batch[0])
    return images, time.perf_counter() - start


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
    args = parser.parse_args(argv)

    if args.shards is None:
        # 2,500 samples a shard: 24 shards for the 60k training images, enough for any worker count here.
        write_fashion_mnist_shards(args.out, samples_per_shard=2500, progress=True)
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
            timings: dict[str, list[float]] = {name: [] for name in epochs}
            counts: dict[str, int] = {}
            for repeat in range(args.repeats + 1):
                names = list(epochs) if repeat % 2 == 0 else list(reversed(epochs))  # alternate who goes first
                for name in names:
                    images, seconds = epochs[name](repeat)
                    if repeat > 0:  # epoch 0 starts the workers and fills the shuffle buffer
                        timings[name].append(images / seconds / workers)
                        counts[name] = images
            row = {"image_size": size, "workers": workers, "images_per_epoch": counts,
                   **{f"{name}_images_per_s_per_worker": statistics.median(values) for name, values in timings.items()}}
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
