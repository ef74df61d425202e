"""The `lit-softmoe` command: a few lines per subcommand, each calling one plain function.

A user's mistake raises UserError anywhere below; it is printed here as one line (exit code 2).
"""
from __future__ import annotations

import argparse
import os
import sys

from lit_softmoe.cli_memory import recipe_config, run_size_on_out_of_memory
from lit_softmoe.cli_parser import add_commands
from lit_softmoe.errors import UserError, out_of_memory
from lit_softmoe.utils.atomic import full_disk_message, naming_full_disk
from lit_softmoe.utils.console import end_progress_bars, library_warnings_hidden
from lit_softmoe.utils.distributed import close_process_group, is_main_process
from lit_softmoe.utils.paths import check_writable

# What the data writers' messages call their parameters: the `data` commands' flags
# (`errors.setting`).
_DATA_FLAGS = {"out_dir": "--out", "split": "--split", "overwrite": "--overwrite",
               "limit": "--limit", "layout": "--layout", "caption_templates": "--caption-templates",
               "class_names": "--class-names", "image_col": "--image-col",
               "caption_col": "--caption-col", "key_col": "--key-col", "class_col": "--class-col",
               "classnames_file": "--classnames", "root": "--root"}


def _cmd_data(args) -> None:
    # the shard writer's stream names no path when the disk fills
    with naming_full_disk(args.out):
        _write_data(args)


def _write_data(args) -> None:
    if args.dataset == "fashion-mnist":
        from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
        summary = write_fashion_mnist_shards(args.out, source=args.source, limit=args.limit,
                                             overwrite=args.overwrite, setting_names=_DATA_FLAGS)
        counts = " + ".join(f"{n} {split}" for split, n in summary["samples"].items())
        verb = ("already there, nothing written" if summary["skipped"]
                else f"written in {summary['seconds']:.0f} s")
        print(f"Fashion-MNIST {counts} samples in {sum(summary['shards'].values())} shards at "
              f"{args.out}: {verb}")
        return
    from lit_softmoe.data.write_options import WriteOptions, check_split_name
    from lit_softmoe.data.writers import write_folder_shards, write_table_shards
    check_split_name(args.split, _DATA_FLAGS)  # WriteOptions checks it too, naming it "split"
    options = WriteOptions(split=args.split, image_format=args.image_format, max_size=args.max_size,
                           samples_per_shard=args.samples_per_shard,
                           max_shard_bytes=args.max_shard_bytes)
    progress = sys.stderr.isatty()
    from lit_softmoe.utils.device import available_cpus  # here: `--help` imports no torch
    workers = args.workers if args.workers is not None else available_cpus()
    if args.dataset == "from-folder":
        from lit_softmoe.data.captions import load_caption_templates
        templates = (load_caption_templates(args.caption_templates)
                     if args.caption_templates is not None else None)
        summary = write_folder_shards(args.src, args.out, options, layout=args.layout,
                                      progress=progress, overwrite=args.overwrite,
                                      caption_templates=templates, class_names=args.class_names,
                                      workers=workers, setting_names=_DATA_FLAGS)
    else:
        summary = write_table_shards(args.table, args.out, args.image_col, args.caption_col,
                                     options, key_col=args.key_col, progress=progress,
                                     overwrite=args.overwrite, root=args.root,
                                     class_col=args.class_col, classnames_file=args.classnames,
                                     workers=workers, setting_names=_DATA_FLAGS)
    if summary.classnames_note:
        print(summary.classnames_note)
    print(summary.line())


def _cmd_pretrain(args) -> None:
    from lit_softmoe.config import PretrainConfig
    cfg = recipe_config(args, PretrainConfig)
    if cfg is None:
        return
    from lit_softmoe.train.pretrain import pretrain
    options = "".join(f", {key}={value}" for key, value in cfg.tower.options.items())
    with run_size_on_out_of_memory(args, f"tower {cfg.tower.name}{options}, "
                                         f"batch {cfg.batch_size}"):
        results = pretrain(cfg)
    if "test_top1" in results and is_main_process():
        fewshot_key = f"fewshot{cfg.fewshot_shots}_top1"
        print(f"test top-1 {results['test_top1']:.4f}" +
              (f", {cfg.fewshot_shots}-shot linear probe {results[fewshot_key]:.4f}"
               if fewshot_key in results else "")
              + (f", {cfg.fewshot_shots}-shot linear probe skipped (see above)"
                 if "fewshot_skipped" in results else "")
              + f"; tower saved to {cfg.run_dir}/tower")


def _cmd_train(args) -> None:
    from lit_softmoe.config import LiTConfig
    cfg = recipe_config(args, LiTConfig)
    if cfg is None:
        return
    from lit_softmoe.train.lit import train_lit
    text = (cfg.text.path if cfg.text.kind == "hf"
            else f"{cfg.text.width} wide × {cfg.text.layers} layers")
    with run_size_on_out_of_memory(args, f"text tower {text} against {cfg.image_tower}, "
                                         f"batch {cfg.batch_size}"):
        results = train_lit(cfg)
    scores = ""
    if "zeroshot_top1" in results:
        probe = (f", linear-probe ceiling {results['linear_probe_top1']:.4f}"
                 if "linear_probe_top1" in results else "")
        scores = f"zero-shot top-1 {results['zeroshot_top1']:.4f}{probe}; "
    if is_main_process():
        print(f"{scores}model saved to {cfg.run_dir}/model")


def _cmd_embed(args) -> None:
    from lit_softmoe.train.embed import embed_shards
    check_writable(args.out, "--out", folder=True)
    summary = embed_shards(args.tower, args.shards, args.out, split=args.split,
                           batch_size=args.batch_size, workers=args.workers, device=args.device,
                           precision=args.precision, compile=args.compile,
                           jpeg_decoder=args.jpeg_decoder, gpu_jpeg_share=args.gpu_jpeg_share,
                           progress=sys.stderr.isatty(), expert_parallel=args.expert_parallel)
    if summary["rank"] != 0:  # rank 0 puts the split together and says so
        return
    resumed = (f", {summary['resumed_shards']} shards kept from an interrupted run"
               if summary["resumed_shards"] else "")
    processes = f" by {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    on_rank_0 = " on rank 0" if summary["world_size"] > 1 else ""
    done = "already there, nothing written" if summary["skipped"] else \
        f"written{processes} in {summary['seconds']:.1f} s " \
        f"({_rate(summary['images_per_second'])} images/s{on_rank_0}{resumed})"
    bad = ", ".join(f"{reason}: {count}" for reason, count in summary["bad"].items())
    print(f"{summary['num_samples']} embeddings (dim {summary['dim']}, float16) of {args.shards} "
          f"at {summary['split_dir']}: {done}" + (f"; bad samples skipped ({bad})" if bad else ""))


def _rate(per_second: float) -> str:
    """3,273 or 0.04: whole numbers down to 10 a second, two digits below (a large tower on a
    CPU)."""
    return f"{per_second:,.0f}" if per_second >= 10 else f"{per_second:.2g}"


def _cmd_upcycle(args) -> None:
    from lit_softmoe.models.upcycle import upcycle_checkpoint
    info = upcycle_checkpoint(args.source, args.to, args.out, seed=args.seed,
                              overwrite=args.overwrite,
                              source_setting="--from", out_setting="--out", seed_setting="--seed",
                              overwrite_setting="--overwrite")
    print(f"{args.source} upcycled into {args.to} (Soft MoE blocks {info['moe_blocks']}) at "
          f"{args.out}; fresh: {', '.join(info['fresh'])}"
          + (f"; notes: {'; '.join(info['notes'])}" if info["notes"] else ""))


def _cmd_convert(args) -> None:
    from lit_softmoe.models.convert import convert_vmoe_checkpoint
    tower = convert_vmoe_checkpoint(args.from_vmoe, args.to, args.out, overwrite=args.overwrite,
                                    tower_setting="--to", out_setting="--out",
                                    overwrite_setting="--overwrite")
    params = sum(p.numel() for p in tower.parameters())
    print(f"{args.from_vmoe} loaded as {args.to} ({params:,} parameters, every key used) and saved "
          f"to {args.out}")


def _cmd_inspect_routing(args) -> None:
    from lit_softmoe.evals.routing import inspect_routing, stats_table
    report = inspect_routing(args.tower, args.image, args.out, layer=args.layer,
                             num_slots=args.slots)
    print(stats_table(report["layers"]))
    plotted = report["plotted"]
    print(f"entropies in nats (max in brackets); dispatch weights of block {plotted['block']}, "
          f"slots {plotted['slots'][0]}-{plotted['slots'][-1]} drawn in {args.out}; statistics in "
          f"{plotted['png'].rsplit('.', 1)[0]}.json"
          + (f"; predicted: {report['prediction']}" if report["prediction"] else "")
          + (f"; {report['resolution_change']}" if report["resolution_change"] else ""))


def _cmd_models(args) -> None:
    from lit_softmoe.models.registry import image_tower_config, list_image_towers
    for name in list_image_towers():
        cfg = image_tower_config(name)
        moe = {"soft": "soft moe", "tokens_choice": f"tokens choice k={cfg.num_selected_experts}",
               "experts_choice": "experts choice"}[cfg.moe_type]
        kind = f"{moe} {cfg.num_experts}e in blocks {cfg.moe_layers[0]}-{cfg.moe_layers[-1]}" \
            if cfg.moe_layers else "dense"
        print(f"{name:18s} {cfg.image_size}px/{cfg.patch_size} width {cfg.width} "
              f"depth {cfg.depth} {kind}")


def _cmd_clip_benchmark(args) -> None:
    from lit_softmoe.integrations.clip_benchmark import clip_benchmark_cli
    clip_benchmark_cli(args.clip_benchmark_args)


def _cmd_eval(args) -> None:
    from lit_softmoe.config import EvalSuiteConfig
    from lit_softmoe.config_loading import load_config
    from lit_softmoe.evals.reports import markdown_table, summary_line
    from lit_softmoe.evals.suite import failed_benchmarks, nothing_evaluated, run_suite
    from lit_softmoe.utils.device import parse_device
    cfg = load_config(EvalSuiteConfig, args.suite, args.overrides)
    benchmarks = None  # the whole suite
    if args.benchmarks is not None:
        benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        if not benchmarks:  # an empty subset silently ran the whole suite
            raise UserError(f"--benchmarks {args.benchmarks!r} names no benchmark; give a "
                            "comma-separated list such as fashion-mnist,cifar10, or leave it out "
                            "for the whole suite")
    # run_suite checks it too, but its message names the parameter
    parse_device(args.device, "--device")
    report = run_suite(args.model, cfg, benchmarks, out=args.out, overwrite=args.overwrite,
                       device=args.device, use_cache=not args.no_cache, peer=args.peer,
                       progress=sys.stderr.isatty())
    nothing = nothing_evaluated(report)  # every benchmark skipped: no results were written
    if nothing is None:
        print(markdown_table(report))
    for entry in report["results"]:
        peer = entry.get("peer") or {}
        if peer.get("status") == "ok":
            print(f"{entry['benchmark']}: clip_benchmark differs by at most "
                  f"{peer['max_abs_diff_points']:.3f} points"
                  + (" (its result recorded on the unchanged model and files)"
                     if peer.get("cache") == "hit" else ""))
        elif entry["status"] != "ok":
            print(summary_line(entry))
        elif peer:  # asked for, but it did not run (another layout) or failed: say so
            print(f"{entry['benchmark']}: clip_benchmark {peer.get('status')}: "
                  f"{peer.get('reason', '')}")
    if nothing is not None:
        raise UserError(nothing)
    print(f"results: {report['paths']['json']} (+ .md, .png)")
    failed = failed_benchmarks(report)  # written with the rest, and still a mistake to fix: exit 2
    if failed is not None:
        raise UserError(failed)


def _cmd_export(args) -> None:
    import json

    from lit_softmoe.export import export_pair
    from lit_softmoe.export.onnx import onnx_summary
    out = export_pair(args.run, args.out, dtype=args.dtype, onnx=args.onnx,
                      overwrite=args.overwrite, open_clip=args.open_clip)
    config = json.loads((out / "config.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".onnx"))
    onnx = onnx_summary(config.get("onnx") or {})
    check = f"; {onnx}" if onnx else ""
    open_clip = config.get("open_clip") or {}
    extra = ", open_clip_config.json" if "config" in open_clip else ""
    skipped = (f"\nopen_clip files left out: {open_clip['skipped']}"
               if "skipped" in open_clip and config["kind"] != "image" and args.open_clip else "")
    print(f"{'image tower' if config['kind'] == 'image' else 'LiT pair'} of {args.run} exported "
          f"({args.dtype}) to {out}: {', '.join(files)}, config.json{extra}, "
          f"README.md{check}{skipped}")


def _cmd_push(args) -> None:
    from lit_softmoe.export.push import push_export
    summary = push_export(args.export, args.repo_id, private=args.private, revision=args.revision,
                          dry_run=args.dry_run)
    where = f"{args.repo_id}" + (f" (revision {args.revision})" if args.revision else "")
    if args.dry_run:
        front = summary["front_matter"]
        print(f"dry run: {len(summary['files'])} files of {args.export} would go to {where}:")
        for name in summary["files"]:
            print(f"  {name}")
        results = len((front.get("model-index") or [{}])[0].get("results", []))
        shown = ", ".join(f"{k}: {v}" for k, v in front.items() if k != "model-index")
        print(f"model card front matter (the card written for the Hub): {shown}; "
              f"model-index: {results} result(s)")
        return
    print(f"{len(summary['files'])} files of {args.export} pushed to {where}: {summary['url']}")


def _cmd_demo(args) -> None:
    from lit_softmoe.demo import run_demo
    run_demo(data_dir=args.data, runs_dir=args.runs, fast=args.fast)


# The function each subcommand runs (`add_commands` sets it as `args.func`).
_COMMANDS = {"data": _cmd_data, "pretrain": _cmd_pretrain, "train": _cmd_train,
             "embed": _cmd_embed, "upcycle": _cmd_upcycle, "convert": _cmd_convert,
             "inspect-routing": _cmd_inspect_routing, "models": _cmd_models, "eval": _cmd_eval,
             "clip-benchmark": _cmd_clip_benchmark, "export": _cmd_export, "push": _cmd_push,
             "demo": _cmd_demo}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-softmoe", description=__doc__.splitlines()[0])
    add_commands(parser, _COMMANDS)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; key=value overrides may also follow a flag
    (`run_dir=r --plan sharding=fsdp`), which argparse leaves over once the overrides before the
    flag filled their argument. They keep their order."""
    parser = build_parser()
    args, left = parser.parse_known_args(argv)
    if left and isinstance(getattr(args, "overrides", None), list) and \
            all("=" in word and not word.startswith("-") for word in left):
        args.overrides += left
    elif left:
        parser.error(f"unrecognized arguments: {' '.join(left)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        with library_warnings_hidden(not args.verbose):
            args.func(args)
        close_process_group()  # once it ended well: see its docstring
    except UserError as err:
        end_progress_bars()
        print(f"lit-softmoe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # On a line of its own: a progress bar may have left the cursor at the end of its line.
        print(f"\nlit-softmoe {args.command}: interrupted; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lit-softmoe models | head`: the reader has what it wanted
        # no second error at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        problem = full_disk_message(err)
        if problem is None and (memory := out_of_memory(err)) is not None:
            where = {"embed": " (--batch-size)", "eval": " (batch_size=N)"}.get(args.command, "")
            problem = f"{memory}; lower the batch size{where}, or run on a machine with more memory"
        if problem is None:
            raise
        end_progress_bars()
        print(f"lit-softmoe {args.command}: error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
