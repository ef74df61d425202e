"""A small Table 9: dense vs Soft MoE vs Experts Choice vs Tokens Choice towers of the same width.

Puigcerver et al., "From Sparse to Soft Mixtures of Experts" (ICLR 2024), Table 9 and App. B compare
Soft MoE against the sparse routers of Riquelme et al. 2021 (Tokens Choice, V-MoE, with BPR) and Zhou
et al. 2022 (Experts Choice) at equal steps, reporting JFT precision@1, ImageNet 10-shot accuracy
and training FLOPs. This script does the same on class shards (Fashion-MNIST by default) with the
tiny CPU towers, several seeds each:

- every run is the pretraining recipe (`lit-softmoe pretrain`, configs/pretrain/fmnist-soft-tiny.yaml)
  with only the tower name and seed changed, so all towers get the same steps, batch and schedule;
- test top-1 and the 10-shot linear probe come from the recipe's results.json, the dropped-token
  fractions too (training: noisy routing; test: eval routing);
- training FLOPs = the FLOPs of one training step (forward + loss + backward at the recipe's batch,
  counted by `torch.utils.flop_counter.FlopCounterMode`) × steps. The counter counts matmul-like ops
  only: gathers, scatters, top-k and softmaxes are free, as in the paper's FLOP counts; a sparse layer
  costs its full expert buffers (n·C places) whether they are filled or not, as in vmoe.

Writes `routing.md` (mean ± std over seeds), `routing.json` (every run), `routing.png` (test top-1
and 10-shot accuracy against training FLOPs: one point per run, a large marker per tower mean).

    python scripts/reproduce_routing.py --seeds 0 1 2 --epochs 2 --train-subset 20000 --jobs 2
    python scripts/reproduce_routing.py --towers vit-tiny-p7 tc-tiny-p7-16e-k2 --steps 50 --out runs/r
    python scripts/reproduce_routing.py --train data/mnist/train --test data/mnist/test --set optim.lr=1e-3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lit_softmoe.config import PretrainConfig, to_yaml
from lit_softmoe.config_loading import load_config
from lit_softmoe.models.registry import image_tower_config
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOWERS = ["vit-tiny-p7", "soft-tiny-p7-16e", "ec-tiny-p7-16e", "tc-tiny-p7-16e-k1", "tc-tiny-p7-16e-k2"]
DEFAULT_CONFIG = ROOT / "configs" / "pretrain" / "fmnist-soft-tiny.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--towers", nargs="+", default=DEFAULT_TOWERS, help="registered tower names")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=None, help="over the config's epochs")
    p.add_argument("--steps", type=int, default=None, help="over --epochs when given")
    p.add_argument("--train-subset", type=int, default=0, help="first N training images (0: all)")
    p.add_argument("--test-subset", type=int, default=0, help="first N test images (0: all)")
    p.add_argument("--train", default=None, help="a split folder of class shards (default: the config's)")
    p.add_argument("--test", default=None)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the pretraining config every run starts from")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more config overrides for every run, e.g. optim.warmup=100")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each with --threads threads)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default="runs/routing")
    return p.parse_args(argv)


def run_overrides(args, tower: str, seed: int, run_dir: Path) -> list[str]:
    """The `key=value` overrides of one run: what differs between runs is the tower and the seed."""
    overrides = [f"tower.name={tower}", f"seed={seed}", f"run_dir={run_dir}", f"threads={args.threads}",
                 f"data.max_train_samples={args.train_subset}", f"data.max_test_samples={args.test_subset}"]
    if args.epochs is not None:
        overrides.append(f"epochs={args.epochs}")
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.train:
        overrides.append(f"data.train={args.train}")
    if args.test:
        overrides.append(f"data.test={args.test}")
    return overrides + list(args.set)


def train_all(args, out: Path) -> list[dict]:
    """Run every (tower, seed) through `lit-softmoe pretrain`, `--jobs` at a time; a run whose
    results.json exists is reused (so an interrupted reproduction picks up where it stopped)."""
    todo = [(tower, seed) for seed in args.seeds for tower in args.towers]
    pending, running, runs = list(todo), {}, {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    while pending or running:
        while pending and len(running) < args.jobs:
            tower, seed = pending.pop(0)
            run_dir = out / "runs" / f"{tower}-seed{seed}"
            if (run_dir / "config.yaml").exists():
                # Reuse (or resume) only a run made with these very settings, never silently another.
                wanted = to_yaml(load_config(PretrainConfig, args.config, run_overrides(args, tower, seed, run_dir)))
                if (run_dir / "config.yaml").read_text() != wanted:
                    raise SystemExit(f"{run_dir} holds a run with other settings (its config.yaml differs); "
                                     "pass another --out or delete that folder")
            if (run_dir / "results.json").exists():
                runs[(tower, seed)] = {"wall_seconds": json.loads((run_dir / "wall.json").read_text())["wall_seconds"]
                                       if (run_dir / "wall.json").exists() else None}
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "log.txt", "w")
            cmd = [sys.executable, "-m", "lit_softmoe.cli", "pretrain", "--config", args.config,
                   *run_overrides(args, tower, seed, run_dir)]
            print(f"start {tower} seed {seed}", flush=True)
            running[(tower, seed)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                                      time.perf_counter(), log, run_dir)
        time.sleep(0.2)
        for key, (proc, tic, log, run_dir) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            if proc.returncode != 0:
                tail = (run_dir / "log.txt").read_text()[-2000:]
                raise SystemExit(f"{key[0]} seed {key[1]} failed (exit {proc.returncode}):\n{tail}")
            wall = time.perf_counter() - tic
            (run_dir / "wall.json").write_text(json.dumps({"wall_seconds": wall}) + "\n")
            runs[key] = {"wall_seconds": wall}
            print(f"done  {key[0]} seed {key[1]} in {wall:.0f} s", flush=True)
    results = []
    for tower, seed in todo:
        run_dir = out / "runs" / f"{tower}-seed{seed}"
        results.append({"tower": tower, "seed": seed, **runs[(tower, seed)],
                        **json.loads((run_dir / "results.json").read_text())})
    return results


def training_step_flops(tower_cfg: ViTConfig, cfg: PretrainConfig) -> int:
    """FLOPs of one training step of the recipe: forward, loss (+ aux) and backward at its batch size."""
    torch.manual_seed(0)
    tower = VisionTransformer(tower_cfg).train()
    size = tower_cfg.image_size
    pixels = torch.randn(cfg.batch_size, tower_cfg.in_channels, size, size)
    labels = torch.randint(0, tower_cfg.num_classes, (cfg.batch_size,))
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(tower(pixels), labels) + cfg.aux_loss_weight * tower.moe_aux_loss()
        loss.backward()
    return counter.get_total_flops()


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(results: list[dict], towers: list[str]) -> list[dict]:
    rows = []
    for tower in towers:
        runs = [r for r in results if r["tower"] == tower]
        cfg = image_tower_config(tower)
        row = {"tower": tower, "moe": cfg.moe_type if cfg.moe_layers else "dense", "seeds": len(runs),
               "params": runs[0]["params"], "steps": runs[0]["steps"], "train_flops": runs[0]["train_flops"]}
        for key in ("test_top1", "fewshot10_top1", "train_seconds", "wall_seconds", "dropped_fraction_train",
                    "dropped_fraction_test"):
            row[key] = _mean_std([r.get(key, 0.0 if key.startswith("dropped") else None) for r in runs])
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    def pm(pair, scale=100.0, digits=2):
        mean, std = pair
        return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"

    lines = ["| tower | MoE | params | test top-1 (%) | 10-shot (%) | train TFLOP | train time (s) | "
             "dropped, train (%) | dropped, test (%) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tower']} | {r['moe']} | {r['params'] / 1e6:.2f}M | {pm(r['test_top1'])} | "
                     f"{pm(r['fewshot10_top1'])} | {r['train_flops'] / 1e12:.3g} | {pm(r['train_seconds'], 1, 0)} | "
                     f"{pm(r['dropped_fraction_train'], 100, 1)} | {pm(r['dropped_fraction_test'], 100, 1)} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], rows: list[dict], out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = ((axes[0], "test_top1", "test top-1 (%)"), (axes[1], "fewshot10_top1", "10-shot linear probe (%)"))
    for ax, key, label in panels:
        for i, row in enumerate(rows):
            runs = [r for r in results if r["tower"] == row["tower"] and r.get(key) is not None]
            color = colors[i % len(colors)]
            ax.scatter([r["train_flops"] / 1e12 for r in runs], [100 * r[key] for r in runs], color=color,
                       alpha=0.45, s=18)
            ax.scatter([row["train_flops"] / 1e12], [100 * row[key][0]], color=color, s=110, marker="*",
                       edgecolor="black", linewidth=0.6, label=row["tower"])
        ax.set_xscale("log")
        ax.set_xlabel("training TFLOP (forward + backward)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("dense vs Soft MoE vs sparse routers: accuracy against training FLOPs (dots: runs, stars: means)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for tower in args.towers:
        image_tower_config(tower)  # an unknown name fails now, not after the first runs
    tic = time.perf_counter()
    results = train_all(args, out)
    wall = time.perf_counter() - tic

    # FLOPs per training step depend on the tower only (not on the seed); count each once.
    torch.set_num_threads(args.threads)
    step_flops = {}
    for tower in args.towers:
        run_dir = out / "runs" / f"{tower}-seed{args.seeds[0]}"
        cfg = load_config(PretrainConfig, run_dir / "config.yaml")
        tower_cfg = ViTConfig.from_dict(json.loads((run_dir / "tower" / "config.json").read_text())["tower"])
        step_flops[tower] = training_step_flops(tower_cfg, cfg)
    for r in results:
        r["step_flops"] = step_flops[r["tower"]]
        r["train_flops"] = step_flops[r["tower"]] * r["steps"]

    rows = summarize(results, args.towers)
    command = "python scripts/reproduce_routing.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Seeds {args.seeds}, {rows[0]['steps']} steps each; mean ± std over seeds; "
              f"wall time of the whole reproduction {wall / 60:.1f} min ({args.jobs} runs at a time).\n\n"
              f"    {command}\n\n")
    (out / "routing.md").write_text(header + markdown_table(rows))
    (out / "routing.json").write_text(json.dumps({"command": command, "wall_seconds": wall, "rows": rows,
                                                  "runs": results}, indent=2) + "\n")
    plot(results, rows, out / "routing.png")
    print(header + markdown_table(rows))
    print(f"wrote {out / 'routing.md'}, {out / 'routing.json'}, {out / 'routing.png'}")
    return {"rows": rows, "runs": results, "wall_seconds": wall}


if __name__ == "__main__":
    main()
