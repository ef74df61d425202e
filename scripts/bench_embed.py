"""`lit-softmoe embed` images/s on JPEG shards against the tower alone on pre-decoded tensors.

The ceiling is the locked tower's forward over tensors already on the device (bf16 weights on GPUs, as
embed holds it; inference mode, the same batch): what embedding would reach if decoding were free.
`embed` reads the same images as 500-1,200 px JPEG shards (foolbox's 20 ImageNet photos cropped and resized,
`benchlib.photo_jpegs`), decodes them in --workers DataLoader workers (the tower's preprocess says
decode=reduced: JPEGs at a DCT scale) and writes feature shards. The ratio embed / ceiling says how
much of the GPU the host keeps fed; on a GPU run, a ratio well under 1 with the workers' cores busy
means more cores (or GPU JPEG decoding) would pay.

`--baseline` first runs embed's loop as it was before its workers sent uint8 pixels (float32 batches, each
waited for before the next was queued, np.save per sample: `_loop_before`) over the same shards, then
checks that the two wrote the same feature shards, byte for byte. Every run checks that the normalization
on the device gives bitwise the pixels of the tower's transform on the CPU.

    python scripts/bench_embed.py                          # CUDA: soft-b16-128e, 8,192 images, a worker per core
    python scripts/bench_embed.py --cpu                    # tiny shapes in seconds (the test suite runs this)
    python scripts/bench_embed.py --tower soft-s16-128e --images 4096 --workers 8 --json embed.json
    python scripts/bench_embed.py --images 16384 --baseline     # before/after in one run
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this
from benchlib import photo_jpegs, setup_device, time_step  # noqa: E402

from lit_softmoe.data.feature_cache import feature_sample  # noqa: E402
from lit_softmoe.data.samples import npy_bytes  # noqa: E402
from lit_softmoe.data.shard_batches import ShardBatches  # noqa: E402
from lit_softmoe.data.shards import is_safe_key, shard_urls, write_split  # noqa: E402
from lit_softmoe.data.tar_reading import listed_sizes
from lit_softmoe.data.transforms import BatchNormalize, image_transform, pixel_transform  # noqa: E402
from lit_softmoe.models.inference import prepare_for_inference  # noqa: E402
from lit_softmoe.models.preprocess import Preprocess  # noqa: E402
from lit_softmoe.models.registry import create_image_tower  # noqa: E402
from lit_softmoe.models.tower_folder import save_tower  # noqa: E402
from lit_softmoe.train.embed import embed_shards  # noqa: E402
from lit_softmoe.train.embed_job import write_feature_shard  # noqa: E402
from lit_softmoe.utils.device import autocast_dtype, inference_dtype  # noqa: E402


def _ceiling(tower, device: torch.device, batch: int, image_size: int, channels: int) -> float:
    """Images/s of the tower alone: one batch of pre-decoded pixels on the device, forward after forward, the
    tower held as embed holds it (bf16 weights on GPUs)."""
    dtype = inference_dtype("auto", device)
    tower = prepare_for_inference(copy.deepcopy(tower), dtype=dtype)
    pixels = torch.randn(batch, channels, image_size, image_size, device=device, dtype=dtype)

    def step():
        with torch.inference_mode():
            tower.forward_pooled(pixels)

    milliseconds, _ = time_step(step, device, warmup=3, iters=10 if device.type == "cuda" else 3)
    return batch / (milliseconds / 1000)


def _normalization_matches(jpegs: list[bytes], preprocess: dict, channels: int, device: torch.device) -> bool:
    """Whether embed's uint8 batches normalized on `device` are bitwise the tower's whole transform on the CPU."""
    described = Preprocess.from_settings(preprocess, channels, "the benchmark's tower")
    transform, pixels, normalize = (image_transform(described), pixel_transform(described),
                                    BatchNormalize(described))
    expected = torch.stack([transform(PIL.Image.open(io.BytesIO(data))) for data in jpegs])
    with torch.inference_mode():
        got = normalize(torch.stack([pixels(PIL.Image.open(io.BytesIO(data))) for data in jpegs]).to(device))
    return torch.equal(got.cpu(), expected)


def _loop_before(tower, device: torch.device, shards: str, out: Path, batch: int, workers: int, preprocess: dict,
                 channels: int) -> float:
    """Steady images/s (after the first batch) of embed's main loop as it was before uint8 batches (commit
    2cfbcf0): the workers ran the whole transform and sent float32 batches (pinned, then copied to the
    device), `.cpu()` waited for each batch before the next was queued, and each sample's .npy was np.save'd
    alone. Same shards, tower, workers, DataLoader and shard writing as embed; its shards go to `out`."""
    urls = shard_urls(shards)
    todo = list(enumerate(urls))
    transform = image_transform(Preprocess.from_settings(preprocess, channels, "the benchmark's tower"))
    dataset = ShardBatches(todo, "image-caption", transform, batch,
                           listed_sizes(urls) or {}, with_cls=False)
    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=min(workers, len(todo)),
                        pin_memory=device.type == "cuda")
    autocast = autocast_dtype("auto", device)
    out.mkdir(parents=True)
    pending: dict[int, list[dict]] = {}
    first, later = None, 0
    for item in loader:
        if "done" in item:
            write_feature_shard(out, item["shard"], pending.pop(item["shard"], []), item["done"])
            continue
        with torch.inference_mode(), torch.autocast(device.type, dtype=autocast or torch.float32,
                                                    enabled=autocast is not None):
            features = tower.forward_pooled(item["image"].to(device, non_blocking=True))
        embeddings = features.float().to(torch.float16).cpu().numpy()
        samples = pending.setdefault(item["shard"], [])
        for key, caption, embedding in zip(item["key"], item["caption"], embeddings):
            if np.isfinite(embedding).all() and is_safe_key(key):
                samples.append(feature_sample(key, npy_bytes(embedding), caption, None))
        if first is None:
            first = time.perf_counter()
        else:
            later += len(item["key"])
    seconds = time.perf_counter() - first if first is not None else 0.0
    return later / seconds if later and seconds > 0 else 0.0


def _same_shards(first: Path, second: Path) -> bool:
    names = sorted(path.name for path in first.glob("*.tar"))
    return bool(names) and names == sorted(path.name for path in second.glob("*.tar")) and all(
        (first / name).read_bytes() == (second / name).read_bytes() for name in names)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    parser.add_argument("--tower", default=None, help="registered tower (default soft-b16-128e; --cpu: soft-test-4e)")
    parser.add_argument("--images", type=int, default=None, help="JPEGs embedded (default 8192; --cpu: 64)")
    parser.add_argument("--unique", type=int, default=512, help="distinct JPEGs made, repeated to --images")
    parser.add_argument("--batch", type=int, default=256, help="images per forward (default 256)")
    parser.add_argument("--workers", type=int, default=None, help="decoding workers (default: one per core)")
    parser.add_argument("--decode", choices=("reduced", "full"), default="reduced",
                        help="the tower's preprocess decode: reduced (DCT scaling, the default) or full")
    parser.add_argument("--baseline", action="store_true",
                        help="also time embed's loop as it was before uint8 batches, and compare their shards")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    device_name = setup_device(device)
    name = args.tower or ("soft-test-4e" if cpu else "soft-b16-128e")
    count = args.images or (64 if cpu else 8192)
    batch = min(args.batch, 16) if cpu else args.batch
    workers = args.workers if args.workers is not None else (0 if cpu else os.cpu_count() or 1)
    options = {} if cpu else {"image_size": 224}

    torch.manual_seed(0)
    tower = create_image_tower(name, **options).eval()
    image_size, channels = tower.cfg.image_size, tower.cfg.in_channels
    preprocess = {"image_size": image_size, "mean": 0.5, "std": 0.5, "decode": args.decode}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tic = time.perf_counter()
        jpegs = photo_jpegs(min(args.unique, count))
        per_shard = max(1, count // max(1, 4 * max(workers, 1)))  # several shards per worker
        write_split(({"jpg": jpegs[i % len(jpegs)], "txt": b"a photo"} for i in range(count)), tmp / "data",
                    "train", samples_per_shard=per_shard)
        save_tower(tmp / "tower", tower, extra={"preprocess": preprocess})
        setup_seconds = time.perf_counter() - tic
        ceiling = _ceiling(tower.to(device), device, batch, image_size, channels)
        print(f"ceiling {ceiling:,.0f} images/s; setup {setup_seconds:.0f} s", flush=True)
        normalization = _normalization_matches(jpegs[:8], preprocess, channels, device)
        before = None
        if args.baseline:
            before = _loop_before(tower, device, str(tmp / "data" / "train"), tmp / "before", batch, workers,
                                  preprocess, channels)
            print(f"before: {before:,.0f} images/s", flush=True)
        del tower
        torch.cuda.empty_cache() if device.type == "cuda" else None
        summary = embed_shards(tmp / "tower", str(tmp / "data" / "train"), tmp / "features", batch_size=batch,
                               workers=workers, device=device)
        same = _same_shards(tmp / "before", tmp / "features" / "train") if args.baseline else None
    # Steady: after the first batch. Overall: start-up included (hashing and loading the tower folder, 15 GB
    # in fp32 for soft-b16-128e, and starting the workers), what a user waits on a short run.
    steady = summary["steady_images_per_second"] or 0.0
    overall = summary["num_samples"] / summary["seconds"]
    result = {"device": device_name, "tower": name, "image_size": image_size, "images": count, "batch": batch,
              "workers": workers, "cpus": os.cpu_count(), "decode": args.decode,
              "ceiling_images_per_s": round(ceiling, 1), "embed_images_per_s": round(steady, 1),
              "ratio": round(steady / ceiling, 3), "embed_overall_images_per_s": round(overall, 1),
              "startup_seconds": summary["startup_seconds"], "setup_seconds": round(setup_seconds, 1),
              "normalization_on_device_bitwise": normalization,
              "before_images_per_s": round(before, 1) if before is not None else None,
              "same_shards_as_before": same}
    print(f"embed on {device_name}: {name} at {image_size} px, {count} JPEGs of 500-1,200 px, batch {batch}, "
          f"{workers} workers ({os.cpu_count()} CPUs), decode {args.decode}\n")
    print("| path | images/s | / ceiling |\n|---|---:|---:|")
    print(f"| tower alone, pre-decoded tensors on the device (ceiling) | {ceiling:,.0f} | 1.00 |")
    if before is not None:
        print(f"| `embed` before uint8 batches (float32 from the workers, a sync per batch), after its first batch | "
              f"{before:,.0f} | {before / ceiling:.2f} |")
    print(f"| `embed` on the JPEG shards (decode + tower + write), after its first batch | {steady:,.0f} | "
          f"{result['ratio']:.2f} |")
    print(f"| `embed`, start-up included ({summary['startup_seconds']:.1f} s to its first batch) | {overall:,.0f} | "
          f"{overall / ceiling:.2f} |")
    print(f"\nnormalization on the device bitwise the transform's on the CPU: {normalization}" +
          (f"; feature shards byte-identical to the loop before: {same}" if same is not None else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
