"""Training batches per second per DataLoader worker: our streaming class loader against timm's (issue 17).

Bar: "on the same 224-px class folders, training-batch images/s per worker of our streaming loader
≥ 1.0x timm's loader, measured side by side in one run, ratio printed". The data are Fashion-MNIST's
images as 224×224 RGB JPEGs in class folders (`make_class_folders.py`, written on the first run,
or a folder given with --data), and the same files as class shards (`data from-folder --layout
classes`, 256 samples a shard so every worker has shards). Each loader runs the same training
transform — RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3, bilinear) + horizontal flip (p 0.5)
+ to float + normalize — and batches of --batch, with persistent workers:

- `timm`: `timm.data.create_dataset("", root=FOLDER/train, split="train", is_training=True)` (its
  ImageFolder reader: one file per image) + `timm.data.create_loader(..., use_prefetcher=False)`
  with colour jitter, auto-augment and random erasing off;
- `ours`: `create_shard_loader(ShardDataConfig(...), "image-class", transform=train_transform(...))`
  on the shards (tar streams, shard shuffle + a --shuffle-buffer sample shuffle);
- `ours (uint8, normalize on device)`: the same with `train_transform(..., normalize=False)`, as
  `pretrain` streams: the workers send uint8 images and training normalizes them on the device
  (timed here on the CPU, in the reading process: `normalize_batch`);
- `timm (uint8, its prefetcher normalizes)`: `create_loader(..., use_prefetcher=True)`, timm's default
  for training: its workers send uint8 and its PrefetchLoader normalizes (here on the CPU).

The bar compares the uint8 pair, what each library trains with; the float pair is printed too.

The first epoch of each is a warm-up (worker start, shuffle-buffer fill) and is not timed; then they
alternate for --repeats epochs and the median is reported. Images/s per worker is images / seconds /
workers. Both drop the last partial batch, so an epoch's image count can differ by a batch or so.

    python scripts/bench_pretrain_data.py                        # 4,000 images, batch 64, 2 workers, 3 repeats
    python scripts/bench_pretrain_data.py --workers 1 --images 2000 --json bench.json

`--memory`: the bar "peak RSS of a pretraining run on 20k and on 100k class images (mixed sizes
64-640 px, JPEG) differs by < 10%". It writes (or reuses, under --data) class folders of each size
in --memory-sizes with their shards, runs `lit-softmoe pretrain` on each in a subprocess with the
streaming loader (--loader-keys, default `data.loader=stream data.workers=2 data.shuffle_buffer=1000`)
for the same --steps, samples the RSS of the process tree (main + DataLoader workers) every 0.2 s,
and prints both peaks, their relative difference and PASS/FAIL:

    python scripts/bench_pretrain_data.py --memory --data /tmp/lit-softmoe-bench/pretrain-memory
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib and make_class_folders beside this
from benchlib import cpu_name  # noqa: E402
from make_class_folders import make_class_folders  # noqa: E402

from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader  # noqa: E402
from lit_softmoe.data.transforms import normalize_batch, train_transform  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SIZE = 224
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # RandomResizedCrop's, on both sides (ours has ratio 3/4-4/3 built in)
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
SAMPLES_PER_SHARD = 256
UINT8_ROW = "ours (uint8, normalize on device)"
TIMM_UINT8_ROW = "timm (uint8, its prefetcher normalizes)"


# ---------------------------------------------------------------------------------- throughput

def _time_epoch(batches) -> tuple[int, float]:
    """(images, wall seconds) of one pass over `batches` (dicts with "image", or timm's (images, labels))."""
    start, images = time.perf_counter(), 0
    for batch in batches:
        images += len(batch["image"] if isinstance(batch, dict) else batch[0])
    return images, time.perf_counter() - start


def _normalized(batches):
    """What training does with a uint8 batch on the device, here on the CPU in this process (timm's
    prefetcher does the same there): the multiply-add to normalized float."""
    for batch in batches:
        yield {"image": normalize_batch(batch["image"], MEAN, STD)}


def _ours(shards: Path, args, normalize: bool):
    options = {} if normalize else {"normalize": False}
    transform = train_transform(IMAGE_SIZE, 3, MEAN, STD, random_resized_crop=True, scale=SCALE, hflip=True,
                                decode="full", **options)
    cfg = ShardDataConfig(urls=str(shards), batch_size=args.batch, workers=args.workers, shuffle=True,
                          shuffle_buffer=args.shuffle_buffer, seed=0)
    loader = create_shard_loader(cfg, "image-class", transform=transform)

    def epoch(index: int):
        loader.set_epoch(index)
        return _time_epoch(loader if normalize else _normalized(loader))

    return epoch, transform


def _timm(folder: Path, args, prefetcher: bool = False):
    """timm's loader; `prefetcher`: its default for training, whose workers send uint8 and whose
    PrefetchLoader normalizes each batch in this process (on the CPU here: `device`)."""
    import timm.data

    # timm's ImageFolder numbers the classes in sorted folder order; `data from-folder` sorts them too,
    # but the labels do not matter here: only the speed is compared.
    dataset = timm.data.create_dataset("", root=str(folder), split="train", is_training=True)
    loader = timm.data.create_loader(
        dataset, input_size=(3, IMAGE_SIZE, IMAGE_SIZE), batch_size=args.batch, is_training=True,
        use_prefetcher=prefetcher, device=torch.device("cpu"), num_workers=args.workers, scale=SCALE, ratio=RATIO,
        hflip=0.5, vflip=0.0,
        color_jitter=None, auto_augment=None, re_prob=0.0, interpolation="bilinear", mean=MEAN, std=STD,
        persistent_workers=args.workers > 0)

    def epoch(index: int):
        return _time_epoch(loader)

    return epoch, dataset.transform


def _race(epochs: dict, repeats: int, workers: int) -> tuple[dict[str, float], dict[str, int]]:
    """({loader: median images/s per worker}, {loader: images per epoch}) over `repeats` timed epochs
    each after an untimed one, the loaders alternating who goes first."""
    timings: dict[str, list[float]] = {name: [] for name in epochs}
    counts: dict[str, int] = {}
    for repeat in range(repeats + 1):
        names = list(epochs) if repeat % 2 == 0 else list(reversed(epochs))
        for name in names:
            images, seconds = epochs[name](repeat)
            if repeat > 0:  # epoch 0 starts the workers and fills the shuffle buffer
                timings[name].append(images / seconds / max(workers, 1))
                counts[name] = images
    return {name: statistics.median(values) for name, values in timings.items()}, counts


def _class_data(args) -> tuple[Path, Path]:
    """(class folder of the train split, its shards), written by make_class_folders unless there."""
    out = args.data or Path(tempfile.gettempdir(), "lit-softmoe-bench", f"class-folders-224-{args.images}")
    summary = make_class_folders(out, train=args.images, test=0, min_size=IMAGE_SIZE, max_size=IMAGE_SIZE, rgb=True,
                                 shards=True, samples_per_shard=SAMPLES_PER_SHARD)
    verb = "reused" if summary["skipped"] else f"written in {summary['seconds']:.0f} s"
    print(f"# {summary['images']:,} RGB 224×224 JPEGs ({summary['bytes'] / 1e6:.0f} MB) at {out}: {verb}",
          file=sys.stderr)
    return out / "train", out / "shards" / "train"


def throughput_main(args) -> dict:
    import timm

    folder, shards = _class_data(args)
    with_uint8 = "normalize" in inspect.signature(train_transform).parameters
    epochs, transforms = {}, {}
    epochs["timm"], transforms["timm"] = _timm(folder, args)
    epochs["ours"], transforms["ours"] = _ours(shards, args, normalize=True)
    if with_uint8:
        epochs[TIMM_UINT8_ROW], transforms[TIMM_UINT8_ROW] = _timm(folder, args, prefetcher=True)
        epochs[UINT8_ROW], transforms[UINT8_ROW] = _ours(shards, args, normalize=False)
    for name, transform in transforms.items():
        print(f"# {name} transform:\n{transform}", file=sys.stderr)
    if not with_uint8:
        print(f"# train_transform has no `normalize` argument yet: no {UINT8_ROW!r} row", file=sys.stderr)
    threads = torch.get_num_threads()
    if args.workers == 0:  # reading in this process: one torch thread, as in a DataLoader worker (several
        torch.set_num_threads(1)  # spin-waiting OpenMP threads make the tensor transforms 10x slower on a busy machine)
    speeds, counts = _race(epochs, args.repeats, args.workers)
    torch.set_num_threads(threads)
    del epochs
    gc.collect()  # stops the persistent workers
    workers = max(args.workers, 1)
    rows = [{"loader": name, "images_per_epoch": counts[name], "images_per_s": speed * workers,
             "images_per_s_per_worker": speed, "ratio": speed / speeds["timm"]} for name, speed in speeds.items()]
    result = {"image_size": IMAGE_SIZE, "images": args.images, "batch": args.batch, "workers": args.workers,
              "repeats": args.repeats, "shuffle_buffer": args.shuffle_buffer, "cpu": cpu_name(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
              "timm": timm.__version__, "rows": rows, "ratio": speeds["ours"] / speeds["timm"]}
    if with_uint8:  # what `pretrain` streams: uint8 batches, normalized on the device
        result["ratio_uint8"] = speeds[UINT8_ROW] / speeds[TIMM_UINT8_ROW]

    print(f"\n{cpu_name()} ({os.cpu_count()} CPUs), torch {torch.__version__}, timm {timm.__version__}; "
          f"{IMAGE_SIZE}-px RGB JPEG class folders, batch {args.batch}, workers: {args.workers}, "
          f"median of {args.repeats} epochs")
    print("| loader | images/epoch | images/s | images/s per worker | / timm |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['loader']} | {row['images_per_epoch']:,} | {row['images_per_s']:,.0f} | "
              f"{row['images_per_s_per_worker']:,.0f} | {row['ratio']:.2f}x |")
    print(f"ours / timm, float batches: {result['ratio']:.2f}x")
    if with_uint8:
        ratio = result["ratio_uint8"]
        print(f"ours / timm, uint8 batches (what pretrain streams; timm's training default): {ratio:.2f}x "
              f"(bar ≥ 1.0x: {'PASS' if ratio >= 1.0 else 'FAIL'})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---------------------------------------------------------------------------------- --memory

def _tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of the process and all its descendants, RSS of the process) in bytes; (0, 0) once it is gone."""
    import psutil

    try:
        main = psutil.Process(pid)
        processes = [main, *main.children(recursive=True)]
        main_rss = main.memory_info().rss
    except psutil.NoSuchProcess:
        return 0, 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:  # a worker that ended between the listing and the reading
            pass
    return total, main_rss


def run_sampled(command: list[str], interval: float = 0.2, env: dict | None = None) -> dict:
    """Run `command`, sampling its process tree's RSS every `interval` s: {rc, seconds, peak_*_bytes, output}."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)
        peak_tree = peak_main = 0
        while process.poll() is None:
            tree, main = _tree_rss(process.pid)
            peak_tree, peak_main = max(peak_tree, tree), max(peak_main, main)
            time.sleep(interval)
        output.seek(0)
        text = output.read()
    return {"rc": process.returncode, "seconds": time.perf_counter() - start, "peak_tree_bytes": peak_tree,
            "peak_main_bytes": peak_main, "output": text}


def pretrain_command(dataset: Path, run_dir: Path, args) -> list[str]:
    """`lit-softmoe pretrain` of the tiny Fashion-MNIST config on `dataset`'s shards, streamed."""
    return [sys.executable, "-m", "lit_softmoe.cli", "pretrain", "--config",
            str(ROOT / "configs" / "pretrain" / "fmnist-soft-tiny.yaml"),
            f"run_dir={run_dir}", f"data.train={dataset / 'shards' / 'train'}",
            f"data.test={dataset / 'shards' / 'test'}", f"steps={args.steps}", "fewshot_shots=0", "log_with=[]",
            "eval_every=0", f"checkpoint_every={args.steps + 1}", *args.loader_keys.split(), *args.extra]


def _unknown_loader_keys(output: str, loader_keys: str) -> list[str]:
    """The --loader-keys that `pretrain` rejected as unknown (before streaming pretraining lands)."""
    keys = [item.split("=", 1)[0] for item in loader_keys.split()]
    unknown_lines = [line for line in output.splitlines() if "unknown" in line.lower()]  # "unknown config key 'x'"
    return [key for key in keys if any(f"'{key}'" in line for line in unknown_lines)]


def memory_main(args) -> dict:
    data = args.data or Path(tempfile.gettempdir(), "lit-softmoe-bench", "pretrain-memory")
    sizes = [int(n) for n in args.memory_sizes.split(",")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-pretrain-memory-") as runs:
        for count in sizes:
            dataset = data / f"{count}"
            summary = make_class_folders(dataset, train=count, test=args.memory_test, min_size=args.min_size,
                                         max_size=args.max_size, rgb=False, shards=True, samples_per_shard=1000)
            verb = "reused" if summary["skipped"] else f"written in {summary['seconds']:.0f} s"
            print(f"# {count:,} train images ({args.min_size}-{args.max_size} px JPEGs, "
                  f"{summary['bytes'] / 1e6:,.0f} MB with the test split) at {dataset}: {verb}", file=sys.stderr)
            command = pretrain_command(dataset, Path(runs, f"run-{count}"), args)
            print("# " + " ".join(command[1:]), file=sys.stderr)
            run = run_sampled(command, env=env)
            if run["rc"] != 0:
                tail = "\n".join(run["output"].strip().splitlines()[-15:])
                unknown = _unknown_loader_keys(run["output"], args.loader_keys)
                if unknown:
                    raise SystemExit(f"{tail}\n\nlit-softmoe pretrain does not know {', '.join(unknown)} yet: the "
                                     "streaming loader for pretraining has not landed in this checkout, so the "
                                     "memory bar cannot be measured (no result)")
                raise SystemExit(f"{tail}\n\nthe pretraining run on {count:,} images failed (exit {run['rc']}); "
                                 "its last lines are above")
            rows.append({"train_images": count, "seconds": run["seconds"], "peak_tree_bytes": run["peak_tree_bytes"],
                         "peak_main_bytes": run["peak_main_bytes"]})
    smallest, largest = rows[0], rows[-1]
    difference = abs(largest["peak_tree_bytes"] - smallest["peak_tree_bytes"]) / smallest["peak_tree_bytes"]
    result = {"rows": rows, "relative_difference": difference, "pass": difference < args.memory_bar,
              "steps": args.steps, "loader_keys": args.loader_keys, "extra": args.extra, "cpu": cpu_name(),
              "torch": torch.__version__}

    print(f"\n`lit-softmoe pretrain` for {args.steps} steps ({args.loader_keys or 'the default loader'}), "
          f"{args.min_size}-{args.max_size} px grayscale JPEGs; RSS sampled every 0.2 s")
    print("| train images | peak RSS, main + workers (MB) | peak RSS, main (MB) | run s |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['train_images']:,} | {row['peak_tree_bytes'] / 2**20:,.0f} | "
              f"{row['peak_main_bytes'] / 2**20:,.0f} | {row['seconds']:.0f} |")
    print(f"peak RSS of the tree, {largest['train_images']:,} vs {smallest['train_images']:,} images: "
          f"{difference:+.1%} (bar < {args.memory_bar:.0%}: {'PASS' if result['pass'] else 'FAIL'})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path,
                        help="where the class folders and shards are written or reused (default: under the temp dir)")
    parser.add_argument("--images", type=int, default=4000, help="training images of the 224-px folders")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of each loader")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loader (median reported)")
    parser.add_argument("--shuffle-buffer", type=int, default=1000, help="our loader's sample shuffle buffer")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--memory", action="store_true",
                        help="measure the peak RSS of streaming pretraining runs on two data sizes instead")
    parser.add_argument("--memory-sizes", default="20000,100000", help="--memory: train images of each run")
    parser.add_argument("--memory-test", type=int, default=500, help="--memory: test images of each data set")
    parser.add_argument("--min-size", type=int, default=64, help="--memory: smallest image side")
    parser.add_argument("--max-size", type=int, default=640, help="--memory: largest image side")
    parser.add_argument("--steps", type=int, default=200, help="--memory: training steps of each run")
    parser.add_argument("--loader-keys", default="data.loader=stream data.workers=2 data.shuffle_buffer=1000",
                        help="--memory: the overrides that select streaming (\"\": pretrain's default loader)")
    parser.add_argument("--extra", nargs="*", default=[], help="--memory: more key=value overrides for pretrain")
    parser.add_argument("--memory-bar", type=float, default=0.10, help="--memory: the largest relative difference")
    args = parser.parse_args(argv)
    return memory_main(args) if args.memory else throughput_main(args)


if __name__ == "__main__":
    main()
