"""`lit-softmoe demo`: the main job on real data, end to end, with a headline per stage.

Fashion-MNIST → shards → pretrain the tiny Soft MoE tower → cache its features (embed) → LiT-train a
text tower against the locked tower → zero-shot top-1 with prompts no training caption uses, beside
the tower's own test top-1 and linear-probe ceiling. Export joins this pipeline when it lands.
Every stage skips work that is already done, so a second run only re-evaluates.
"""
from __future__ import annotations

import time
from pathlib import Path

from lit_softmoe.config import LiTConfig, PretrainConfig, load_config
from lit_softmoe.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# --fast: 10k train / 10k test images, fewer epochs: the whole pipeline in about two minutes.
FAST_LIMIT = 10_000
FAST_PRETRAIN = ["epochs=2", "optim.warmup_steps=50", "log_every=10", "checkpoint_every=1000"]
FAST_LIT = ["epochs=4", "optim.warmup_steps=20", "eval.every=0", "log_every=10"]


def _headline(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _config_file(*parts: str) -> Path:
    path = CONFIGS.joinpath(*parts)
    if not path.is_file():
        raise UserError(f"{path} is missing; run the demo from a source checkout (pip install -e .)")
    return path


def run_demo(data_dir: str = "data", runs_dir: str = "runs", fast: bool = False) -> dict:
    from lit_softmoe.data.sources import write_fashion_mnist_shards
    from lit_softmoe.train.embed import embed_shards
    from lit_softmoe.train.lit import train_lit
    from lit_softmoe.train.pretrain import pretrain

    timings = {}
    name = "fashion-mnist-10k" if fast else "fashion-mnist"
    shards = Path(data_dir) / name
    features = Path(data_dir) / f"{name}-features"
    run_root = Path(runs_dir) / ("demo-fast" if fast else "demo")

    _headline("1/4 Fashion-MNIST → webdataset shards")
    tic = time.perf_counter()
    summary = write_fashion_mnist_shards(shards, limit=FAST_LIMIT if fast else None)
    counts = ", ".join(f"{n} {split}" for split, n in summary["samples"].items())
    print(f"{counts} images {'already there' if summary['skipped'] else 'written'} in {shards}")
    timings["shards"] = time.perf_counter() - tic

    _headline("2/4 pretrain the tiny Soft MoE tower on the class labels")
    tic = time.perf_counter()
    pretrain_cfg = load_config(PretrainConfig, _config_file("pretrain", "fmnist-soft-tiny.yaml"),
                               (FAST_PRETRAIN if fast else []) + [
                                   f"data.train={shards / 'train'}", f"data.test={shards / 'test'}",
                                   f"run_dir={run_root / 'pretrain'}"])
    tower_results = pretrain(pretrain_cfg)
    tower_dir = run_root / "pretrain" / "tower"
    timings["pretrain"] = time.perf_counter() - tic

    _headline("3/4 run the locked tower once over every image (feature cache)")
    tic = time.perf_counter()
    for split in ("train", "test"):
        cached = embed_shards(tower_dir, str(shards / split), features, split=split)
        print(f"{split}: {cached['num_samples']} embeddings of width {cached['dim']} "
              f"{'already there' if cached['skipped'] else 'written'} in {features / split}")
    timings["embed"] = time.perf_counter() - tic

    _headline("4/4 LiT: train a text tower against the locked tower, evaluate zero-shot")
    tic = time.perf_counter()
    lit_cfg = load_config(LiTConfig, _config_file("lit", "fmnist-tiny.yaml"), (FAST_LIT if fast else []) + [
        f"image_tower={tower_dir}", f"data.train={features / 'train'}", f"eval.shards={features / 'test'}",
        f"eval.probe_train={features / 'train'}", f"run_dir={run_root / 'lit'}"])
    lit_results = train_lit(lit_cfg)
    timings["lit"] = time.perf_counter() - tic

    _headline("results")
    shots = pretrain_cfg.fewshot_shots
    rows = [("image tower", f"{pretrain_cfg.tower.name} ({tower_results['params'] / 1e6:.2f}M params)"),
            ("tower test top-1 (classifier head)", f"{tower_results['test_top1']:.4f}"),
            (f"tower {shots}-shot linear probe", f"{tower_results[f'fewshot{shots}_top1']:.4f}"),
            ("tower linear probe, all train images", f"{lit_results['linear_probe_top1']:.4f}"),
            ("LiT zero-shot top-1 (unseen prompts)", f"{lit_results['zeroshot_top1']:.4f}"),
            *[(f"time: {stage}", f"{seconds:.0f} s") for stage, seconds in timings.items()]]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\nartifacts:\n  shards          {shards}\n  tower           {tower_dir}\n"
          f"  feature cache   {features}\n  LiT model       {run_root / 'lit' / 'model'}\n"
          f"  metrics, curves {run_root / 'pretrain'}, {run_root / 'lit'} (metrics.jsonl, curves.png)")
    return {"pretrain": tower_results, "lit": lit_results, "timings": timings}
