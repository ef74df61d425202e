"""The `lit-softmoe` command: a few lines per subcommand, each calling one plain function.

A user's mistake raises UserError anywhere below; it is printed here as one line (exit code 2).
"""
from __future__ import annotations

import argparse
import sys

from lit_softmoe.errors import UserError


def _cmd_data(args) -> None:
    if args.dataset == "fashion-mnist":
        from lit_softmoe.data.sources import write_fashion_mnist_shards
        summary = write_fashion_mnist_shards(args.out, source=args.source, limit=args.limit)
        print(summary_line(summary))


def summary_line(summary: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in summary.items())


def _cmd_pretrain(args) -> None:
    from lit_softmoe.config import PretrainConfig, load_config
    from lit_softmoe.train.pretrain import pretrain
    cfg = load_config(PretrainConfig, args.config, args.overrides)
    results = pretrain(cfg)
    if "test_top1" in results:
        print(f"test top-1 {results['test_top1']:.4f}" +
              (f", {cfg.fewshot_shots}-shot linear probe {results[f'fewshot{cfg.fewshot_shots}_top1']:.4f}"
               if cfg.fewshot_shots else "") + f"; tower saved to {cfg.run_dir}/tower")


def _cmd_models(args) -> None:
    from lit_softmoe.models.vit import image_tower_config, list_image_towers
    for name in list_image_towers():
        cfg = image_tower_config(name)
        kind = f"soft moe {cfg.num_experts}e in blocks {cfg.moe_layers[0]}-{cfg.moe_layers[-1]}" \
            if cfg.moe_layers else "dense"
        print(f"{name:18s} {cfg.image_size}px/{cfg.patch_size} width {cfg.width} depth {cfg.depth} {kind}")


def _cmd_demo(args) -> None:
    from lit_softmoe.demo import run_demo
    run_demo(data_dir=args.data, runs_dir=args.runs, fast=args.fast)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-softmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="turn a real dataset into webdataset shards")
    data.add_argument("dataset", choices=["fashion-mnist"])
    data.add_argument("--out", required=True, help="output folder (gets train/, test/, classnames.txt)")
    data.add_argument("--source", default=None, help="folder with the raw files (default: search the usual places)")
    data.add_argument("--limit", type=int, default=None, help="keep the first N images of each split")
    data.set_defaults(func=_cmd_data)

    pre = sub.add_parser("pretrain", help="pretrain an image tower on class shards")
    pre.add_argument("--config", required=True, help="YAML file, e.g. configs/pretrain/fmnist-soft-tiny.yaml")
    pre.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4")
    pre.set_defaults(func=_cmd_pretrain)

    models = sub.add_parser("models", help="list the registered image towers")
    models.set_defaults(func=_cmd_models)

    demo = sub.add_parser("demo", help="run the main job on Fashion-MNIST end to end")
    demo.add_argument("--data", default="data", help="where datasets and shards go")
    demo.add_argument("--runs", default="runs", help="where run folders go")
    demo.add_argument("--fast", action="store_true", help="a small subset, for a quick check")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as err:
        print(f"lit-softmoe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lit-softmoe {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
