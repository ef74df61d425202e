"""Time one zero-shot evaluation, ours (`lit-softmoe eval`) against CLIP_benchmark, same model and data.

Both tools run in this process, one after the other, on the same model folder and the same
CLIP_benchmark-layout webdataset shards (default: Fashion-MNIST's 10k test images):

1. `clip_benchmark`: its own `clip_benchmark eval` (`lit_softmoe.integrations.clip_benchmark.run_clip_benchmark`),
   our model registered in its TYPE2FUNC loader dict; it loads the model from the path itself and
   encodes every image (it has no feature cache);
2. `ours cold`: `run_suite` with a fresh, empty image-feature cache folder: loads the model from the
   path, encodes every image, writes the cache;
3. `ours warm`: the same again on that cache: the image features are read back (image_cache "hit");
4. `ours warm, new text tower`: the LiT use case — the model is loaded and its text tower's weights
   are perturbed (a different text tower against the same locked image tower), then passed to
   `run_suite` as `model_bundle`: the cache must still hit, and only text is encoded;
5. `ours --no-cache` (unless --skip-no-cache): `run_suite(use_cache=False)`.

Wall seconds per row include loading the model from disk (rows 1, 2, 3, 5: inside the tool; row 4:
`load_pretrained` + perturbing the text tower, timed here), reading the data, encoding, scoring and
writing the results (ours: JSON + Markdown + PNG report; CLIP_benchmark: its JSON). Python imports of
both tools are done before any timing, and the shards are read and the model loaded once (page cache)
before the first row. Both run in fp32 (CLIP_benchmark with --no_amp, ours with precision fp32, as
`lit-softmoe eval --peer`), on a GPU too. Images/s is images / wall seconds. "peer / ours" is the peer's
wall time over ours, measured in the same run (> 1: ours is faster). Top-1 of ours and of CLIP_benchmark
must agree within 0.1 point.

Workers: ours decodes with --workers DataLoader workers whatever the shard count; CLIP_benchmark's
webdataset reader fails with more workers than shards, so it gets min(workers, shards) (0 when that
is 1, as `run_clip_benchmark` does). When that differs from ours, an extra row `ours cold, peer's
workers` runs ours cold with the peer's worker count too. Examples:

    python scripts/bench_eval.py                                   # runs/demo/lit on data/fashion-mnist
    python scripts/bench_eval.py --limit 2000 --json bench_eval.json
    python scripts/bench_eval.py --model runs/other/lit --data data/cifar10 --benchmark cifar10
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from benchlib import cpu_name  # scripts/benchlib.py, beside this script

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available, in_our_names, run_clip_benchmark

PEER = "clip_benchmark"
AGREE_POINTS = 0.1  # top-1 of ours and the peer must agree within this many points
PRECISION = "fp32"  # both tools: CLIP_benchmark runs with --no_amp (`run_clip_benchmark`)


# ---------------------------------------------------------------------------------- data

def _shards(split_dir: Path) -> list[Path]:
    nshards = split_dir / "nshards.txt"
    if nshards.is_file():
        return [split_dir / f"{i}.tar" for i in range(int(nshards.read_text().strip()))]
    return sorted(split_dir.glob("*.tar"), key=lambda p: (len(p.name), p.name))


def limited_copy(root: Path, split: str, limit: int, out: Path) -> Path:
    """The first `limit` samples of `root/split` as one shard in `out` (the same layout and files)."""
    (out / split).mkdir(parents=True)
    for name in ("classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt"):
        if (root / name).is_file():
            (out / name).write_bytes((root / name).read_bytes())
    keys: list[str] = []
    with tarfile.open(out / split / "0.tar", "w") as sink:
        for shard in _shards(root / split):
            with tarfile.open(shard) as source:
                for member in source:
                    if not member.isfile():
                        continue
                    key = member.name.split(".", 1)[0]
                    if key not in keys:
                        if len(keys) == limit:
                            break
                        keys.append(key)
                    sink.addfile(member, source.extractfile(member))
            if len(keys) == limit:
                break
    (out / split / "nshards.txt").write_text("1\n")
    return out


def count_samples(root: Path, split: str) -> int:
    sizes = root / split / "sizes.json"
    if sizes.is_file():
        return sum(json.loads(sizes.read_text()).values())
    keys = set()
    for shard in _shards(root / split):
        with tarfile.open(shard) as source:
            keys.update(m.name.split(".", 1)[0] for m in source if m.isfile())
    return len(keys)


def peer_workers(root: Path, split: str, workers: int) -> int:
    """The worker count `run_clip_benchmark` gives CLIP_benchmark (its wds reader's limit)."""
    nshards = root / split / "nshards.txt"
    if nshards.is_file():
        workers = min(workers, int(nshards.read_text().strip()))
        workers = workers if workers > 1 else 0
    return workers


# ---------------------------------------------------------------------------------- the rows

def perturbed_bundle(model_path: Path, seed: int = 0):
    """load_pretrained(model_path), its text tower's weights moved by noise (10% of each tensor's std):
    a different text tower against the same locked image tower."""
    from lit_softmoe.hub import load_pretrained
    model, preprocess, tokenizer = load_pretrained(model_path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.text_tower.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.float().std())
    return model, preprocess, tokenizer


def run_ours(model_path: Path, cfg: EvalSuiteConfig, out_dir: Path, name: str, use_cache: bool = True,
             new_text: bool = False) -> dict:
    tic = time.perf_counter()
    bundle = perturbed_bundle(model_path) if new_text else None
    report = run_suite(model_path, cfg, out=out_dir / f"{name}.json", overwrite=True, use_cache=use_cache,
                       model_bundle=bundle)
    seconds = time.perf_counter() - tic
    entry = report["results"][0]
    if entry["status"] != "ok":
        raise SystemExit(f"our suite skipped {entry['benchmark']}: {entry['reason']}")
    return {"seconds": seconds, "eval_seconds": entry["seconds"], "top1": entry["metrics"]["top1"],
            "num_samples": entry["num_samples"], "image_cache": entry["image_cache"]}


def run_peer(model_path: Path, root: Path, benchmark: str, split: str, batch_size: int, workers: int) -> dict:
    tic = time.perf_counter()
    result = run_clip_benchmark(model_path, root, benchmark, split, batch_size=batch_size, workers=workers)
    seconds = time.perf_counter() - tic
    return {"seconds": seconds, "top1": in_our_names(result["metrics"])["top1"]}


def run_benchmark(args) -> dict:
    model_path, root = Path(args.model), Path(args.data)
    with tempfile.TemporaryDirectory(prefix="bench_eval-") as tmp:
        return _run_benchmark(args, model_path, root, Path(tmp))


def _run_benchmark(args, model_path: Path, root: Path, work: Path) -> dict:
    if args.limit:
        root = limited_copy(root, args.split, args.limit, work / "data")
    images = count_samples(root, args.split)
    for shard in _shards(root / args.split):  # page cache: the first row must not pay for the disk
        shard.read_bytes()
    # The same for the model: both tools load it with `load_pretrained`, and the first row (the peer's)
    # would otherwise read its files from disk and pay the first load's one-time costs alone.
    from lit_softmoe.hub import load_pretrained
    load_pretrained(model_path)
    ours_workers, theirs_workers = args.workers, peer_workers(root, args.split, args.workers)

    def suite(cache: str, workers: int = ours_workers) -> EvalSuiteConfig:
        # fp32, as `run_clip_benchmark` runs the peer (--no_amp) and as `lit-softmoe eval --peer` runs
        # ours: "auto" would be bf16 autocast on a GPU, timing bf16 against fp32.
        return EvalSuiteConfig(name="bench", batch_size=args.batch_size, workers=workers, cache_dir=cache,
                               precision=PRECISION,
                               benchmarks=[BenchmarkConfig(name=args.benchmark, root=str(root), split=args.split)])

    rows = [PEER, "ours cold", "ours warm", "ours warm, new text tower"]
    if theirs_workers != ours_workers:
        rows.insert(2, "ours cold, peer's workers")
    if not args.skip_no_cache:
        rows.append("ours --no-cache")
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    for repeat in range(args.repeats):
        cache = str(work / f"cache-{repeat}")  # fresh and empty for this repeat's cold row
        for row in rows:
            if row == PEER:
                result = run_peer(model_path, root, args.benchmark, args.split, args.batch_size, ours_workers)
            elif row == "ours cold":
                result = run_ours(model_path, suite(cache), work, f"cold-{repeat}")
            elif row == "ours cold, peer's workers":
                result = run_ours(model_path, suite(str(work / f"cache-{repeat}-peer-workers"), theirs_workers),
                                  work, f"cold-peer-workers-{repeat}")
            elif row == "ours warm":
                result = run_ours(model_path, suite(cache), work, f"warm-{repeat}")
            elif row == "ours warm, new text tower":
                result = run_ours(model_path, suite(cache), work, f"new-text-{repeat}", new_text=True)
            else:
                result = run_ours(model_path, suite(""), work, f"no-cache-{repeat}", use_cache=False)
            runs[row].append(result)
            print(f"  [{repeat + 1}/{args.repeats}] {row:28s} {result['seconds']:8.2f} s  top-1 "
                  f"{100 * result['top1']:.2f}" + (f"  image cache {result['image_cache']}"
                                                  if "image_cache" in result else ""), flush=True)

    results = []
    for row in rows:
        seconds = statistics.median(r["seconds"] for r in runs[row])
        last = runs[row][-1]
        results.append({"row": row, "seconds": seconds, "images_per_s": images / seconds,
                        "eval_seconds": statistics.median(r["eval_seconds"] for r in runs[row])
                        if "eval_seconds" in last else None,
                        "top1": last["top1"], "image_cache": last.get("image_cache"),
                        "num_samples": last.get("num_samples", images),
                        "workers": theirs_workers if row in (PEER, "ours cold, peer's workers") else ours_workers,
                        "repeats": len(runs[row])})
    for r in results:
        if r["num_samples"] != images:
            print(f"warning: {r['row']} scored {r['num_samples']} of the {images} images", file=sys.stderr)
    peer = results[0]
    for r in results[1:]:
        r["peer_over_ours"] = peer["seconds"] / r["seconds"]
    ours_top1 = {r["row"]: r["top1"] for r in results if r["row"] != PEER}
    gap = max(abs(ours_top1[row] - peer["top1"]) * 100 for row in ours_top1 if row != "ours warm, new text tower")
    return {"model": str(model_path), "data": str(Path(args.data)), "benchmark": args.benchmark, "split": args.split,
            "images": images, "limit": args.limit, "batch_size": args.batch_size, "precision": PRECISION,
            "workers": ours_workers, "peer_workers": theirs_workers, "threads": torch.get_num_threads(),
            "cpu": cpu_name(),
            "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "clip_benchmark": _version("clip_benchmark"), "repeats": args.repeats, "rows": results,
            "top1_gap_points": gap, "agree": gap <= AGREE_POINTS + 1e-6,
            "new_text_cache_hit": results[[r["row"] for r in results].index("ours warm, new text tower")]
            ["image_cache"] == "hit", "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    for name in (package, package.replace("_", "-")):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


# ---------------------------------------------------------------------------------- output

def markdown_table(report: dict) -> str:
    lines = ["| run | workers | wall s | images/s | peer / ours | eval s (ours) | image cache | top-1 |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in report["rows"]:
        ratio = f"{r['peer_over_ours']:.2f}x" if "peer_over_ours" in r else "1.00x"
        lines.append(f"| {r['row']} | {r['workers']} | {r['seconds']:.2f} | {r['images_per_s']:,.0f} | {ratio} | "
                     + (f"{r['eval_seconds']:.2f}" if r["eval_seconds"] is not None else "–")
                     + f" | {r['image_cache'] or '–'} | {100 * r['top1']:.2f} |")
    return "\n".join(lines)


def print_report(report: dict) -> None:
    print()
    print(f"Zero-shot eval of `{report['model']}` on {report['benchmark']} ({report['split']}, {report['images']:,} "
          f"images) on {report['cpu'] if report['device'] == 'cpu' else report['device']}, torch {report['torch']} "
          f"({report['threads']} threads), clip_benchmark {report['clip_benchmark']}, batch {report['batch_size']}")
    print()
    print(markdown_table(report))
    runs = "one run" if report["repeats"] == 1 else f"median of {report['repeats']} runs"
    print(f"- wall s: {runs} per row, model loading from disk, data reading, encoding, scoring and result writing "
          "included (imports excluded, shards in the page cache); eval s: our suite's own per-benchmark time (no "
          "model loading, no report writing)")
    print("- peer / ours: clip_benchmark's wall s over the row's (> 1: ours faster), same process, same run")
    print(f"- workers: ours {report['workers']} DataLoader workers; clip_benchmark "
          f"{report['peer_workers']} (its webdataset reader takes at most one worker per shard; "
          "a single shard runs in the main process)")
    print("- new text tower: the model's text-tower weights perturbed (10% of each tensor's std), passed to "
          "run_suite as model_bundle; its load and perturbation are timed; its top-1 differs by design")
    verdict = "agree" if report["agree"] else "DISAGREE"
    print(f"- top-1 ours vs clip_benchmark: largest gap {report['top1_gap_points']:.3f} points "
          f"({verdict}, bar {AGREE_POINTS} point); new text tower image cache: "
          f"{'hit' if report['new_text_cache_hit'] else 'MISS'}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/demo/lit", help="a LiT run or export folder (default: runs/demo/lit)")
    p.add_argument("--data", default="data/fashion-mnist",
                   help="the benchmark's folder in the CLIP_benchmark webdataset layout")
    p.add_argument("--benchmark", default="fashion-mnist", help="its name (class names and templates)")
    p.add_argument("--split", default="test")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward, both tools")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (clip_benchmark: at most one a shard)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every row (median reported)")
    p.add_argument("--limit", type=int, default=None, help="time on the first N samples only (copied to a temp dir)")
    p.add_argument("--skip-no-cache", action="store_true", help="leave out the `ours --no-cache` row")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 (default): torch's choice")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.batch_size < 1 or args.workers < 0 or (args.limit is not None and args.limit < 1):
        p.error("--repeats and --batch-size must be >= 1, --workers >= 0, --limit >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not Path(args.model).exists():
        sys.exit(f"error: model {args.model} does not exist; train the demo pair with `make demo` "
                 "(writes runs/demo/lit) or pass --model PATH")
    if not (Path(args.data) / args.split).is_dir():
        sys.exit(f"error: no {args.split}/ shards under {args.data}; write them with "
                 "`lit-softmoe data fashion-mnist --out data/fashion-mnist` or pass --data PATH")
    if not clip_benchmark_available():
        sys.exit("error: clip-benchmark is not installed (pip install clip-benchmark)")
    if args.threads:
        torch.set_num_threads(args.threads)
    for module in ("clip_benchmark.cli", "matplotlib.pyplot", "lit_softmoe.hub"):  # imports before timing
        importlib.import_module(module)
    report = run_benchmark(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
