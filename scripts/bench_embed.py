"""`lit-softmoe embed` images/s on JPEG shards against the tower alone on pre-decoded tensors.

The ceiling is the locked tower's forward over tensors already on the device (bf16 autocast, inference
mode, the same batch): what embedding would reach if decoding were free. `embed` reads the same
images as 500-1,200 px JPEG shards (foolbox's 20 ImageNet photos cropped and resized,
`benchlib.photo_jpegs`), decodes them in --workers DataLoader workers (the tower's preprocess says
decode=reduced: JPEGs at a DCT scale) and writes feature shards. The ratio embed / ceiling says how
much of the GPU the host keeps fed; on a GPU run, a ratio well under 1 with the workers' cores busy
means more cores (or GPU JPEG decoding) would pay.

    python scripts/bench_embed.py                          # CUDA: soft-b16-128e, 8,192 images, a worker per core
    python scripts/bench_embed.py --cpu                    # tiny shapes in seconds (the test suite runs this)
    python scripts/bench_embed.py --tower soft-s16-128e --images 4096 --workers 8 --json embed.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this
from benchlib import photo_jpegs, setup_device, time_step  # noqa: E402

from lit_softmoe.data.shards import write_split  # noqa: E402
from lit_softmoe.models.registry import create_image_tower  # noqa: E402
from lit_softmoe.models.tower_folder import save_tower  # noqa: E402
from lit_softmoe.train.embed import embed_shards  # noqa: E402
from lit_softmoe.utils.device import autocast_dtype  # noqa: E402


def _ceiling(tower, device: torch.device, batch: int, image_size: int, channels: int) -> float:
    """Images/s of the tower alone: one batch of pre-decoded pixels on the device, forward after forward."""
    pixels = torch.randn(batch, channels, image_size, image_size, device=device)
    dtype = autocast_dtype("auto", device)

    def step():
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype or torch.float32,
                                                    enabled=dtype is not None):
            tower.forward_pooled(pixels)

    milliseconds, _ = time_step(step, device, warmup=3, iters=10 if device.type == "cuda" else 3)
    return batch / (milliseconds / 1000)


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
        del tower
        torch.cuda.empty_cache() if device.type == "cuda" else None
        summary = embed_shards(tmp / "tower", str(tmp / "data" / "train"), tmp / "features", batch_size=batch,
                               workers=workers, device=device)
    # Steady: after the first batch. Overall: start-up included (hashing and loading the tower folder, 15 GB
    # in fp32 for soft-b16-128e, and starting the workers), what a user waits on a short run.
    steady = summary["steady_images_per_second"] or 0.0
    overall = summary["num_samples"] / summary["seconds"]
    result = {"device": device_name, "tower": name, "image_size": image_size, "images": count, "batch": batch,
              "workers": workers, "cpus": os.cpu_count(), "decode": args.decode,
              "ceiling_images_per_s": round(ceiling, 1), "embed_images_per_s": round(steady, 1),
              "ratio": round(steady / ceiling, 3), "embed_overall_images_per_s": round(overall, 1),
              "startup_seconds": summary["startup_seconds"], "setup_seconds": round(setup_seconds, 1)}
    print(f"embed on {device_name}: {name} at {image_size} px, {count} JPEGs of 500-1,200 px, batch {batch}, "
          f"{workers} workers ({os.cpu_count()} CPUs), decode {args.decode}\n")
    print("| path | images/s | / ceiling |\n|---|---:|---:|")
    print(f"| tower alone, pre-decoded tensors on the device (ceiling) | {ceiling:,.0f} | 1.00 |")
    print(f"| `embed` on the JPEG shards (decode + tower + write), after its first batch | {steady:,.0f} | "
          f"{result['ratio']:.2f} |")
    print(f"| `embed`, start-up included ({summary['startup_seconds']:.1f} s to its first batch) | {overall:,.0f} | "
          f"{overall / ceiling:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
