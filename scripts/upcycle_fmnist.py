"""Sparse upcycling end to end on real Fashion-MNIST, on the CPU: dense → upcycle → continue.

    python scripts/upcycle_fmnist.py --data data/fashion-mnist --out runs/upcycle-fmnist

1. the dense `vit-tiny-p7` is pretrained by configs/pretrain/fmnist-dense-tiny.yaml, shortened to
   --dense-epochs (its schedule, warmup included, shrinks with it);
2. `upcycle` turns it into `soft-tiny-p7-16e` (every expert a copy of its block's MLP, fresh routers);
3. configs/pretrain/upcycle-fmnist-tiny.yaml trains the upcycled tower for --epochs from that folder
   (`init_from`).

A control row trains the dense tower on for the same epochs with the same recipe (`init_from` the
dense folder), so that the upcycled tower's gain is not only that of more training. Prints a table of
test top-1 (10,000 test images) and minutes per stage.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.models.upcycle import upcycle_checkpoint
from lit_softmoe.train.pretrain import pretrain


@torch.inference_mode()
def test_top1(tower_dir: Path, test_split: str) -> float:
    """Test top-1 of a tower folder, its images normalized with its own preprocess (eval mode)."""
    tower, meta = load_tower(tower_dir)
    tower.eval()
    images, labels, _ = load_class_split(test_split)
    mean = torch.tensor(meta["preprocess"]["mean"])[:, None, None]
    std = torch.tensor(meta["preprocess"]["std"])[:, None, None]
    correct = 0
    for start in range(0, len(images), 1000):
        pixels = (images[start:start + 1000].float() / 255 - mean) / std
        correct += int((tower(pixels).argmax(1) == labels[start:start + 1000]).sum())
    return correct / len(images)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/fashion-mnist", help="from `lit-softmoe data fashion-mnist --out`")
    parser.add_argument("--out", default="runs/upcycle-fmnist")
    parser.add_argument("--dense-epochs", type=float, default=2.0)
    parser.add_argument("--epochs", type=float, default=1.0, help="training of the upcycled tower (and the control)")
    parser.add_argument("--no-control", action="store_true", help="skip the dense-trained-on control row")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    common = [f"data.train={data / 'train'}", f"data.test={data / 'test'}", "log_with=[]", "fewshot_shots=0",
              f"threads={args.threads}"]
    minutes = {}

    tic = time.perf_counter()
    dense = pretrain(load_config(PretrainConfig, "pretrain/fmnist-dense-tiny", [
        *common, f"run_dir={out / 'dense'}", f"epochs={args.dense_epochs}"]))
    minutes["dense"] = (time.perf_counter() - tic) / 60

    tic = time.perf_counter()
    upcycle_checkpoint(out / "dense" / "tower", "soft-tiny-p7-16e", out / "upcycled", overwrite=True)
    before = test_top1(out / "upcycled", str(data / "test"))
    minutes["upcycle"] = (time.perf_counter() - tic) / 60

    tic = time.perf_counter()
    after = pretrain(load_config(PretrainConfig, "pretrain/upcycle-fmnist-tiny", [
        *common, f"run_dir={out / 'upcycled-run'}", f"init_from={out / 'upcycled'}", f"epochs={args.epochs}"]))
    minutes["upcycled-run"] = (time.perf_counter() - tic) / 60

    control = None
    if not args.no_control:
        tic = time.perf_counter()
        control = pretrain(load_config(PretrainConfig, "pretrain/upcycle-fmnist-tiny", [
            *common, f"run_dir={out / 'dense-run'}", f"init_from={out / 'dense' / 'tower'}",
            "tower.name=vit-tiny-p7", f"epochs={args.epochs}"]))
        minutes["dense-run"] = (time.perf_counter() - tic) / 60

    print(f"\nmachine: {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); data: {data}")
    print("\n| tower | training | test top-1 | minutes |\n|---|---|---|---|")
    print(f"| dense vit-tiny-p7 | {args.dense_epochs:g} epochs (fmnist-dense-tiny, shortened) | "
          f"{dense['test_top1']:.4f} | {minutes['dense']:.1f} |")
    print(f"| upcycled soft-tiny-p7-16e, before training | none (upcycle only) | {before:.4f} | "
          f"{minutes['upcycle']:.1f} |")
    print(f"| upcycled soft-tiny-p7-16e | + {args.epochs:g} epoch (upcycle-fmnist-tiny) | {after['test_top1']:.4f} | "
          f"{minutes['upcycled-run']:.1f} |")
    if control is not None:
        print(f"| dense vit-tiny-p7, trained on (control) | + {args.epochs:g} epoch (upcycle-fmnist-tiny) | "
              f"{control['test_top1']:.4f} | {minutes['dense-run']:.1f} |")
    print(f"\ntotal: {sum(minutes.values()):.1f} minutes")


if __name__ == "__main__":
    main()
