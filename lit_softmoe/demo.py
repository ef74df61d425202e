"""`lit-softmoe demo`: the main job on real data, end to end, with a headline per stage.

Today: Fashion-MNIST → shards → pretrain the tiny Soft MoE tower → test top-1 and 10-shot linear
probe. Later stages (embed, LiT, zero-shot, export) join this pipeline as they land.
"""
from __future__ import annotations

import time
from pathlib import Path

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAST_OVERRIDES = ["data.max_train_samples=12000", "data.max_test_samples=2000", "epochs=2",
                  "optim.warmup_steps=50", "log_every=10", "checkpoint_every=1000"]


def _headline(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(data_dir: str = "data", runs_dir: str = "runs", fast: bool = False) -> dict:
    from lit_softmoe.data.sources import write_fashion_mnist_shards
    from lit_softmoe.train.pretrain import pretrain

    config_file = CONFIGS / "pretrain" / "fmnist-soft-tiny.yaml"
    if not config_file.is_file():
        raise UserError(f"{config_file} is missing; run the demo from a source checkout (pip install -e .)")
    timings = {}

    _headline("1/2 Fashion-MNIST → webdataset shards")
    tic = time.perf_counter()
    shards = Path(data_dir) / "fashion-mnist"
    summary = write_fashion_mnist_shards(shards)
    counts = ", ".join(f"{n} {split}" for split, n in summary["samples"].items())
    print(f"{counts} images {'already there' if summary['skipped'] else 'written'} in {shards}")
    timings["shards"] = time.perf_counter() - tic

    _headline("2/2 pretrain the tiny Soft MoE tower" + (" (fast: 12k images, 2 epochs)" if fast else ""))
    run_dir = Path(runs_dir) / ("demo-fast" if fast else "demo") / "pretrain"
    overrides = [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}"]
    cfg = load_config(PretrainConfig, config_file, (FAST_OVERRIDES if fast else []) + overrides)
    tic = time.perf_counter()
    results = pretrain(cfg)
    timings["pretrain"] = time.perf_counter() - tic

    _headline("results")
    shots = cfg.fewshot_shots
    rows = [("tower", cfg.tower.name), ("params", f"{results['params'] / 1e6:.2f}M"),
            ("test top-1", f"{results['test_top1']:.4f}"),
            (f"{shots}-shot linear probe", f"{results[f'fewshot{shots}_top1']:.4f}"),
            ("shards time", f"{timings['shards']:.0f} s"), ("pretrain time", f"{timings['pretrain']:.0f} s")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\nartifacts:\n  shards   {shards}\n  tower    {run_dir / 'tower'}\n"
          f"  metrics  {run_dir / 'metrics.jsonl'}\n  curves   {run_dir / 'curves.png'}")
    return results
