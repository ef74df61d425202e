"""What a user gets on a GPU with the commands' default flags, each against its peer in the same run.

Rows (the command or recipe as users run it, with its defaults; the peer on the same device):
- `embed`: `lit-softmoe embed --tower T --shards S --out O` (its function, with the CLI's defaults) on
  --images JPEGs of 500-1,200 px (`benchlib.photo_jpegs`), and on as many of shorter side 256 (img2dataset's
  keep_ratio, as the shipped LiT config makes them), images/s after its first batch, against the tower alone
  on pixels already on the device in bf16 weights (the ceiling), eager and compiled. Also
  `--jpeg-decoder cpu` (the workers decode), and with --baseline CODE, the same command in an older
  checkout's code (its own defaults), on --baseline-images of the same JPEGs.
- `tower`: the locked tower as embed, eval and LiT hold it (bf16 weights) and as they held it before
  (fp32 weights under bf16 autocast), against timm's `vit_base_patch16_224` in bf16 weights; eager and
  compiled (`compile=true`; `auto` compiles it in LiT, and in embed for long runs).
- `pretrain`: `lit-softmoe pretrain --config pretrain/soft-s16-128e-imagenet1k` (streamed: its workers decode
  and augment ImageNet-sized photo JPEGs) for --pretrain-steps at the recipe's batch per GPU (512), against
  the same tower's forward + backward + AdamW on device tensors as the recipe sets it up (bf16, compiled).
- `lit`: `lit-softmoe train` on the features `embed` cached (--lit-steps steps of 256, a CLIP base text
  tower with open_clip ViT-B-16's 77 tokens), samples/s from its metrics.jsonl after the compile, and
  the LiT step on the fly as the recipe sets it up (locked dense vit-b16 in bf16, compile auto), both
  against open_clip's `--lock-image` ViT-B-16 step with its defaults (eager), on device tensors
  (`scripts/bench_lit.py`'s builder).

Each row is written to --json and --md as soon as it is measured; rows past --budget seconds are
skipped and say so, so the run ends in bounded time. --cpu runs tiny shapes in seconds (the test suite
does), through the same code.

    python scripts/bench_product.py --json product.json --md product.md
    python scripts/bench_product.py --baseline .baseline --images 16384 --budget 420
    python scripts/bench_product.py --cpu --json /tmp/p.json --md /tmp/p.md
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, bench_lit beside this
from benchlib import photo_jpegs, setup_device, time_step  # noqa: E402

from lit_softmoe.config import OptimConfig  # noqa: E402
from lit_softmoe.data.shards import write_split  # noqa: E402
from lit_softmoe.models.inference import prepare_for_inference  # noqa: E402
from lit_softmoe.models.registry import create_image_tower  # noqa: E402
from lit_softmoe.models.tower_folder import save_tower  # noqa: E402
from lit_softmoe.train.embed import embed_shards  # noqa: E402
from lit_softmoe.train.optim import create_optimizer  # noqa: E402
from lit_softmoe.utils.atomic import write_text_atomic  # noqa: E402
from lit_softmoe.utils.device import inference_dtype, resolve_compile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Report:
    """Rows {section, name, value, unit, ratio, against, note}, rewritten to JSON and Markdown after each."""

    def __init__(self, args, device_name: str):
        self.args, self.rows, self.start = args, [], time.perf_counter()
        self.meta = {"device": device_name, "torch": torch.__version__, "cpus": os.cpu_count(),
                     "images": args.images, "tower": args.tower}

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def add(self, section: str, name: str, value: float | None, unit: str, against: str | None = None,
            note: str = "") -> dict:
        base = next((row["value"] for row in self.rows if row["name"] == against), None) if against else None
        row = {"section": section, "name": name, "value": None if value is None else round(value, 1), "unit": unit,
               "against": against, "ratio": round(value / base, 3) if value and base else None, "note": note}
        self.rows.append(row)
        print(f"  [{section}] {name}: " + (f"{value:,.0f} {unit}" if value else note)
              + (f" = {row['ratio']:.2f}x {against}" if row["ratio"] else ""), flush=True)
        self.write()
        return row

    def skip(self, section: str, name: str, why: str) -> None:
        self.add(section, name, None, "", note=f"skipped: {why}")

    def write(self) -> None:
        if self.args.json:
            write_text_atomic(Path(self.args.json), json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))
        if self.args.md:
            meta = self.meta
            lines = [f"Product rows on {meta['device']} (torch {meta['torch']}, {meta['cpus']} CPUs)", "",
                     "| section | row | value | ratio | note |", "|---|---|---:|---:|---|"]
            for row in self.rows:
                value = f"{row['value']:,.0f} {row['unit']}" if row["value"] else ""
                ratio = f"{row['ratio']:.2f}x {row['against']}" if row["ratio"] else ""
                lines.append(f"| {row['section']} | {row['name']} | {value} | {ratio} | {row['note']} |")
            write_text_atomic(Path(self.args.md), "\n".join(lines) + "\n")


def guarded(report: Report, section: str, name: str, seconds_needed: float, fn) -> None:
    """Run one row unless the budget is spent (or --skip names it); a failing row (OOM, compiler) is a row,
    not the end."""
    if any(part and part in name for part in report.args.skip.split("|")):
        return
    if report.left() < seconds_needed:
        report.skip(section, name, f"{report.left():.0f} s of the budget left")
        return
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        # The whole error to stderr: a compiler's message is pages long, the table keeps its start.
        traceback.print_exc()
        # Two lines: a compiler's error says "backend='inductor' raised:" first and its cause on the next.
        said = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        report.add(section, name, None, "", note=f"failed: {type(err).__name__}: {said[:300]}")
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- data and tower --------------------------------------------------------------------------------------

def make_shards(folder: Path, count: int, per_shard: int, unique: int, shorter_side: int | None = None) -> Path:
    if (folder / "train" / "sizes.json").is_file():
        return folder / "train"
    jpegs = photo_jpegs(min(unique, count), shorter_side=shorter_side)
    write_split(({"jpg": jpegs[i % len(jpegs)], "txt": f"a photo number {i % 97}".encode()} for i in range(count)),
                folder, "train", samples_per_shard=per_shard)
    return folder / "train"


def make_tower(folder: Path, name: str, options: dict, device: torch.device) -> Path:
    """A random-init tower folder, built on `device` and saved in the dtype the product runs it in there:
    on a GPU, bf16 halves the bytes every command hashes and loads (7.4 GB for soft-b16-128e), which is
    start-up time only (the rows report steady rates)."""
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    tower = create_image_tower(name, num_classes=0, device=device, **options).to(inference_dtype("auto", device))
    save_tower(folder, tower, extra={"preprocess": {"image_size": tower.cfg.image_size, "mean": 0.5, "std": 0.5,
                                                    "decode": "reduced"}})
    del tower
    return folder


def images_per_second(model, device, batch: int, size: int, weights: torch.dtype, autocast: bool,
                      iters: int) -> float:
    pixels = torch.randn(batch, 3, size, size, device=device)

    def step():
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            (model.forward_pooled if hasattr(model, "forward_pooled") else model)(pixels.to(weights))

    warmup = 3 if device.type == "cuda" else 1
    milliseconds, _ = time_step(step, device, warmup=warmup, iters=iters)
    return batch / (milliseconds / 1000)


# ---- sections --------------------------------------------------------------------------------------------

def embed_row(report: Report, args, tower_dir: Path, shards: Path, work: Path, name: str, out: str,
              **flags) -> None:
    """`embed_shards` with the CLI's defaults but for `flags`, into work/out; its steady images/s."""
    needed = 120 if flags.get("compile") == "true" else 30

    def run():
        shutil.rmtree(work / out, ignore_errors=True)
        summary = embed_shards(tower_dir, str(shards), work / out, batch_size=args.batch, **flags)
        waits = ", ".join(f"{key.replace('_', ' ')} {share:.0%}"
                          for key, share in (summary["steady_waits"] or {}).items())
        report.add("embed", name, summary["steady_images_per_second"], "images/s", against=CEILING,
                   note=f"{summary['num_samples']} images, start-up {summary['startup_seconds']} s; of the steady "
                        f"time: {waits}")
    guarded(report, "embed", name, needed, run)


CEILING = "tower alone, bf16 weights, eager"


def decode_rows(report: Report, args, device, shorter_side: int | None = None) -> None:
    """What bounds `embed`: each decoder alone on a batch of the same JPEGs, of 500-1,200 px, or with
    `shorter_side` as img2dataset's keep_ratio mode writes them (rows named with "(256 px)")."""
    import io

    import PIL.Image

    from lit_softmoe.data.gpu_jpeg import EncodedJpeg, JpegBatchDecoder, pack
    from lit_softmoe.data.transforms import eval_transform
    jpegs = photo_jpegs(min(args.batch, args.unique), seed=1, shorter_side=shorter_side)
    size = args.tower_options.get("image_size", 224)
    suffix, described = (f" ({shorter_side} px)", f"JPEGs of shorter side {shorter_side} (img2dataset keep_ratio)") \
        if shorter_side else ("", "JPEGs of 500-1,200 px")

    def gpu():
        from torchvision.io import ImageReadMode
        decoder = JpegBatchDecoder(device, size, 3, host_decode=lambda data: None, min_side=2 * size)
        packed = pack([EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)) for data in jpegs])
        encoded = list(torch.split(packed["jpeg_bytes"], packed["jpeg_lengths"].tolist()))
        decoder(packed)  # warm-up: nvJPEG's state, the kernels
        timings = {"decode": [], "resize": [], "both": []}
        for _ in range(3):
            torch.cuda.synchronize() if device.type == "cuda" else None
            tic = time.perf_counter()
            decoded = decoder._decode(encoded, ImageReadMode.RGB)
            torch.cuda.synchronize() if device.type == "cuda" else None
            timings["decode"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            decoder.resize(decoded)
            torch.cuda.synchronize() if device.type == "cuda" else None
            timings["resize"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            decoder(packed)
            torch.cuda.synchronize() if device.type == "cuda" else None
            timings["both"].append(time.perf_counter() - tic)
        for key, name in (("decode", "nvJPEG decode alone"), ("resize", "GPU resize + crop alone (`ResizeCrop`)"),
                          ("both", "JpegBatchDecoder: decode + resize + crop")):
            report.add("decode", name + suffix, len(jpegs) / min(timings[key]), "images/s",
                       note=f"a batch of {len(jpegs)} {described}")
    guarded(report, "decode", "nvJPEG decode alone" + suffix, 20, gpu)  # --cpu: torchvision's decoder on the CPU

    def host():
        transform = eval_transform(size, 3, decode="reduced", normalize=False)
        sample = jpegs[:32]
        tic = time.perf_counter()
        for data in sample:
            transform(PIL.Image.open(io.BytesIO(data)))
        report.add("decode", "host decode (reduced) + resize + crop, 1 core" + suffix,
                   len(sample) / (time.perf_counter() - tic), "images/s", note=f"x {args.cpus} cores in the workers")
    guarded(report, "decode", "host decode" + suffix, 10, host)


def ceiling_row(report: Report, args, device) -> None:
    weights = inference_dtype("auto", device)
    tower = create_image_tower(args.tower, num_classes=0, device=device, **args.tower_options)
    prepare_for_inference(tower, dtype=weights)
    report.add("embed", CEILING, images_per_second(tower, device, args.batch, tower.cfg.image_size, weights, False,
                                                   args.iters), "images/s",
               note="the ceiling: pixels already on the device")


def baseline_embed(report: Report, args, tower_dir: Path, work: Path) -> None:
    """The same command with an older checkout's code and defaults, in its own process."""
    same = args.baseline_images == args.images  # the default: the rows compare like with like
    shards = make_shards(work / ("data" if same else "baseline-data"), args.baseline_images, args.per_shard,
                         args.unique)
    code = (f"import json, sys; from lit_softmoe.train.embed import embed_shards; "
            f"s = embed_shards({str(tower_dir)!r}, {str(shards)!r}, {str(work / 'baseline-features')!r}, "
            f"batch_size={args.batch}); print(json.dumps(s))")
    env = {**os.environ, "PYTHONPATH": f"{Path(args.baseline).resolve()}:{os.environ.get('PYTHONPATH', '')}"}
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(f"{ROOT}:", "")  # the older lit_softmoe, not this one
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=max(30, report.left()), cwd=Path(args.baseline).resolve())
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    report.add("embed", "`embed` before (older checkout), default flags", summary["steady_images_per_second"],
               "images/s", against=CEILING,
               note=f"{summary['num_samples']} images, start-up {summary['startup_seconds']} s")


def tower_rows(report: Report, args, device, compiled: bool) -> None:
    import timm
    weights = inference_dtype("auto", device)
    size = 224 if device.type == "cuda" else 32

    def row(name, make, dtype, autocast, compiled, against):
        def run():
            model = make().to(device)
            prepare_for_inference(model, dtype=dtype, compile=compiled, backend=args.backend)
            report.add("tower", name, images_per_second(model, device, args.batch, size, dtype, autocast,
                                                        args.iters), "images/s", against=against)
        guarded(report, "tower", name, 100 if compiled else 20, run)

    ours = lambda: create_image_tower(args.tower, num_classes=0, device=device, **args.tower_options)  # noqa: E731
    peer = lambda: timm.create_model("vit_base_patch16_224" if device.type == "cuda" else "vit_tiny_patch16_224",  # noqa: E731
                                     pretrained=False, num_classes=0, img_size=size)
    if not compiled:
        row("timm ViT-B/16, bf16, eager", peer, weights, False, False, None)
        row(f"{args.tower}, bf16 weights (now), eager", ours, weights, False, False, "timm ViT-B/16, bf16, eager")
        row(f"{args.tower}, fp32 weights + bf16 autocast (before), eager", ours, torch.float32, True, False,
            "timm ViT-B/16, bf16, eager")
    else:
        row("timm ViT-B/16, bf16, compiled", peer, weights, False, True, None)
        row(f"{args.tower}, bf16 weights, compiled", ours, weights, False, True, "timm ViT-B/16, bf16, compiled")


def lit_rows(report: Report, args, device, tower_dir: Path, features: Path | None, work: Path,
             on_the_fly: bool) -> None:
    import bench_lit as bl

    preset = bl.PRESETS["b16" if device.type == "cuda" else "cpu"]
    autocast = torch.bfloat16 if device.type == "cuda" else None
    inputs = bl.make_inputs(preset, device)
    options = argparse.Namespace(precision="autocast-bf16" if autocast else "fp32", fp32_tower=False, compile_mode=None)

    base = "open_clip --lock-image ViT-B-16 step (its default: eager)"

    def openclip():
        built = bl.build_openclip(preset, device, False, options)
        ms, _ = time_step(bl.openclip_step(*built, inputs, autocast, features_given=False), device, 3, args.iters)
        report.add("lit", base, preset.batch / ms * 1000, "samples/s", note="device tensors")
    if not on_the_fly:
        guarded(report, "lit", base, 30, openclip)

    def train_cached(workers: int | None = None):
        run_dir = work / "lit-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        text = ({"width": preset.text_width, "layers": preset.text_layers, "heads": preset.text_heads,
                 "context_length": preset.context_length})
        config = {"run_dir": str(run_dir), "image_tower": str(tower_dir), "batch_size": preset.batch,
                  "steps": args.lit_steps, "log_every": 10, "log_with": [], "checkpoint_every": 10**6,
                  "eval": {"shards": ""}, "data": {"train": str(features), **({"workers": workers} if workers else {})},
                  "text": text}
        (work / "lit.yaml").write_text(json.dumps(config))  # JSON is YAML
        done = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "train", "--config", str(work / "lit.yaml")],
                              capture_output=True, text=True, timeout=max(30, report.left()), cwd=ROOT)
        if done.returncode:
            raise RuntimeError((done.stderr.strip().splitlines() or ["failed"])[-1])
        rates = [record["samples_per_s"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())
                 if "samples_per_s" in record]
        steady = statistics.median(rates[2:]) if len(rates) > 2 else rates[-1]  # after the compile
        setup = next((line for line in done.stdout.splitlines() if line.startswith("LiT:")), "")
        name = f"`train` on cached features, data.workers={workers}" if workers else \
            "`train` on cached features, default flags"
        report.add("lit", name, steady, "samples/s", against=base,
                   note=f"median of {len(rates) - 2} windows of 10 steps; {setup.split('; ', 1)[-1]}")
    if on_the_fly:
        pass
    elif features is None:
        report.skip("lit", "`train` on cached features, default flags", "no feature cache (embed did not run)")
    else:
        guarded(report, "lit", "`train` on cached features, default flags", 90, train_cached)
        if args.lit_workers:
            guarded(report, "lit", f"`train` on cached features, data.workers={args.lit_workers}", 90,
                    lambda: train_cached(args.lit_workers))

    def on_the_fly_row():
        # As `train_lit` sets the model up: the locked tower held in the dtype it runs in, compile auto.
        model, optimizer = bl.build_ours(preset, device, False, options, "vit-b16")
        model.image_tower.to(inference_dtype("auto", device))
        if resolve_compile("auto", device):
            model.image_tower.forward_features = torch.compile(model.image_tower.forward_features)
            model.text_tower.compile()
        step = bl.ours_step(model, optimizer, inputs, autocast, cached=False)
        ms, _ = time_step(step, device, 5, args.iters)
        report.add("lit", "LiT step on the fly (vit-b16 locked), the recipe's defaults", preset.batch / ms * 1000,
                   "samples/s", against=base, note="device tensors; compile auto")
    if on_the_fly:
        guarded(report, "lit", "LiT step on the fly", 100, on_the_fly_row)


PRETRAIN_CONFIG = "pretrain/soft-s16-128e-imagenet1k"
IMAGENET_SIDE = 375  # ImageNet's photos: mostly 500 x 375 or 500 x 333 px


def make_class_shards(folder: Path, count: int, per_shard: int, unique: int, classes: int) -> Path:
    """train and test class splits (`.jpg` + `.cls`, classnames.txt beside them) of ImageNet-sized photo JPEGs."""
    if (folder / "classnames.txt").is_file():
        return folder
    jpegs = photo_jpegs(min(unique, count), seed=2, shorter_side=IMAGENET_SIDE)
    for split, size in (("train", count), ("test", max(classes, count // 16))):
        write_split(({"jpg": jpegs[i % len(jpegs)], "cls": str(i % classes).encode()} for i in range(size)),
                    folder, split, samples_per_shard=per_shard)
    (folder / "classnames.txt").write_text("".join(f"class {i}\n" for i in range(classes)))
    return folder


def pretrain_rows(report: Report, args, device, work: Path) -> None:
    """`lit-softmoe pretrain --config pretrain/soft-s16-128e-imagenet1k` streaming JPEG class shards (its workers
    decode and augment: inception crop, RandAugment, mixup) at the recipe's batch per GPU, against the same tower's
    forward + backward + AdamW on device tensors as the recipe sets it up (bf16 autocast, compiled)."""
    import torch.nn.functional as F

    classes = 1000 if device.type == "cuda" else 10
    tower_options = {} if device.type == "cuda" else {**args.tower_options, "num_experts": 4}
    name = f"`pretrain --config {PRETRAIN_CONFIG}`, batch {args.pretrain_batch}"
    peer = f"{args.pretrain_tower} forward + backward + AdamW, device tensors, the recipe's settings"

    def tower_alone():
        torch.manual_seed(0)
        tower = create_image_tower(args.pretrain_tower, num_classes=classes, device=device, **tower_options)
        optimizer = create_optimizer(tower, OptimConfig(lr=1e-4, weight_decay=0.03))  # the recipe's: fused
        size = tower.cfg.image_size
        pixels = torch.randn(args.pretrain_batch, 3, size, size, device=device)
        labels = torch.randint(0, classes, (args.pretrain_batch,), device=device)
        model = torch.compile(tower, backend=args.backend)  # the recipe: compile true, bf16 autocast on GPUs

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(pixels).float(), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ms, _ = time_step(step, device, warmup=3, iters=args.iters)
        report.add("pretrain", peer, args.pretrain_batch / ms * 1000, "images/s", note="the ceiling: no data")
    guarded(report, "pretrain", peer, 90, tower_alone)

    def pretrain_run():
        data = make_class_shards(work / "class-data", args.pretrain_steps * args.pretrain_batch, args.per_shard,
                                 args.unique, classes)
        run_dir = work / "pretrain-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [f"run_dir={run_dir}", f"data.train={data / 'train'}", f"data.test={data / 'test'}",
                     f"steps={args.pretrain_steps}", f"batch_size={args.pretrain_batch}", "log_every=10",
                     "checkpoint_every=1000000", "fewshot_shots=0", "log_with=[]"]
        if device.type != "cuda":  # the tiny tower at the CPU mode's size, one worker, no C++ build
            overrides += [f"tower.name={args.pretrain_tower}", "data.workers=1", "compile=false",
                          *(f"tower.options.{key}={value}" for key, value in tower_options.items())]
        done = subprocess.run([sys.executable, "-m", "lit_softmoe.cli", "pretrain", "--config", PRETRAIN_CONFIG,
                               *overrides], capture_output=True, text=True, timeout=max(30, report.left()), cwd=ROOT)
        if done.returncode:
            raise RuntimeError((done.stderr.strip().splitlines() or ["failed"])[-1])
        rates = [record["images_per_s"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())
                 if "images_per_s" in record]
        steady = rates[2:] or rates[-1:]  # after the first two windows (the compile, the workers' start)
        report.add("pretrain", name, statistics.median(steady), "images/s", against=peer,
                   note=f"median of {len(steady)} log window(s) of up to 10 steps, after the first two")
    guarded(report, "pretrain", name, 150, pretrain_run)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    parser.add_argument("--only", default="embed,tower,lit,pretrain", help="comma-separated sections")
    parser.add_argument("--tower", default=None, help="registered tower (default soft-b16-128e; --cpu soft-test-4e)")
    parser.add_argument("--images", type=int, default=None, help="JPEGs for embed (default 16384; --cpu 48)")
    parser.add_argument("--per-shard", type=int, default=None,
                        help="JPEGs per source shard (default 1024: webdataset shards hold thousands; --cpu 12)")
    parser.add_argument("--unique", type=int, default=512, help="distinct JPEGs made, repeated to --images")
    parser.add_argument("--batch", type=int, default=None, help="images per forward (default 256; --cpu 8)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per tower row (default 10; --cpu 2)")
    parser.add_argument("--lit-steps", type=int, default=None, help="`train` steps (default 200; --cpu 6)")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="`pretrain` steps (default 40; --cpu 3)")
    parser.add_argument("--pretrain-batch", type=int, default=None,
                        help="`pretrain` batch (default 512, the S/16 recipe's per GPU on its 8; --cpu 8)")
    parser.add_argument("--baseline", default=None, metavar="CODE",
                        help="a folder holding an older lit_softmoe/ (e.g. `git archive` of main): its embed too")
    parser.add_argument("--baseline-images", type=int, default=None,
                        help="JPEGs for the older embed (default --images: the same shards, the same worker count)")
    parser.add_argument("--budget", type=float, default=480, help="seconds; rows past it are skipped")
    parser.add_argument("--lit-workers", type=int, default=0, help="also `train` with this data.workers")
    parser.add_argument("--skip", default="", help="parts of row names to leave out, joined with '|'")
    parser.add_argument("--work", default=None, help="folder for shards, tower and runs (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args(argv)
    args.cpu = args.cpu or not torch.cuda.is_available()
    args.tower = args.tower or ("soft-test-4e" if args.cpu else "soft-b16-128e")
    args.tower_options = {"image_size": 35, "in_channels": 3} if args.cpu else {"image_size": 224}
    args.images = args.images or (48 if args.cpu else 16384)
    args.baseline_images = args.baseline_images or args.images
    args.batch = args.batch or (8 if args.cpu else 256)
    args.per_shard = args.per_shard or (12 if args.cpu else 1024)
    args.iters = args.iters or (2 if args.cpu else 10)
    args.lit_steps = args.lit_steps or (6 if args.cpu else 200)
    args.pretrain_steps = args.pretrain_steps or (3 if args.cpu else 40)
    args.pretrain_batch = args.pretrain_batch or (8 if args.cpu else 512)
    args.pretrain_tower = "soft-test-4e" if args.cpu else "soft-s16-128e"
    args.backend = "eager" if args.cpu else "inductor"
    args.cpus = os.cpu_count()  # --cpu: the compiled rows run, without a C++ build
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    report = Report(args, setup_device(device))
    sections = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tic = time.perf_counter()
        shards = make_shards(work / "data", args.images, args.per_shard, args.unique)
        tower_dir = make_tower(work / "tower", args.tower, args.tower_options, device)
        report.meta["setup_seconds"] = round(time.perf_counter() - tic, 1)
        print(f"data and tower ready in {report.meta['setup_seconds']} s", flush=True)
        features = work / "features" / "train"
        # The rows in the order of what they settle, the compiled ones last (each compile takes a minute).
        if "embed" in sections:
            ceiling_row(report, args, device)
            embed_row(report, args, tower_dir, shards, work, "`embed`, default flags", "features")
            # Fewer workers reading: whether the host's processes compete with the loop (`steady_waits` say more).
            embed_row(report, args, tower_dir, shards, work, "`embed --workers 4`", "features-4-workers", workers=4)
            for share in (0.85, 0.7):  # the GPU and the workers decoding together
                embed_row(report, args, tower_dir, shards, work, f"`embed --gpu-jpeg-share {share}`",
                          f"features-shared-{share}", gpu_jpeg_share=share)
            decode_rows(report, args, device)
            # The shipped LiT config's data: img2dataset --resize_mode keep_ratio --image_size 256
            small = make_shards(work / "data-256", args.images, args.per_shard, args.unique, shorter_side=256)
            embed_row(report, args, tower_dir, small, work, "`embed`, default flags, 256 px JPEGs (img2dataset "
                      "keep_ratio)", "features-256")
            embed_row(report, args, tower_dir, small, work, "`embed --jpeg-decoder cpu`, 256 px JPEGs (img2dataset "
                      "keep_ratio)", "features-256-cpu", jpeg_decoder="cpu")  # which decoder auto should pick there
            decode_rows(report, args, device, shorter_side=256)
            if args.baseline:
                guarded(report, "embed", "`embed` before (older checkout), default flags", 60,
                        lambda: baseline_embed(report, args, tower_dir, work))
        if "lit" in sections:
            lit_rows(report, args, device, tower_dir, features if (features / "embed.json").is_file() else None,
                     work, on_the_fly=False)
        if "tower" in sections:
            tower_rows(report, args, device, compiled=False)
        if "embed" in sections:
            embed_row(report, args, tower_dir, shards, work, "`embed --jpeg-decoder cpu`", "features-cpu",
                      jpeg_decoder="cpu")
        if "lit" in sections:
            lit_rows(report, args, device, tower_dir, None, work, on_the_fly=True)
        if "tower" in sections:
            tower_rows(report, args, device, compiled=True)
        if "embed" in sections:  # what `compile: auto` does for runs of a million images or more
            embed_row(report, args, tower_dir, shards, work, "`embed --compile true`", "features-compiled",
                      compile="true")
        if "pretrain" in sections:  # last: its compile and its data take the longest
            pretrain_rows(report, args, device, work)
    report.meta["seconds"] = round(time.perf_counter() - report.start, 1)
    report.write()
    return {"meta": report.meta, "rows": report.rows}


if __name__ == "__main__":
    main()
