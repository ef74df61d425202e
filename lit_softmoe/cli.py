"""The `lit-softmoe` command: a few lines per subcommand, each calling one plain function.

A user's mistake raises UserError anywhere below; it is printed here as one line (exit code 2).
"""
from __future__ import annotations

import argparse
import os
import sys

from lit_softmoe.cli_memory import add_plan_arguments, byte_size, recipe_config, run_size_on_out_of_memory
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
    with naming_full_disk(args.out):  # the shard writer's stream names no path when the disk fills
        _write_data(args)


def _write_data(args) -> None:
    if args.dataset == "fashion-mnist":
        from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
        summary = write_fashion_mnist_shards(args.out, source=args.source, limit=args.limit,
                                             overwrite=args.overwrite, setting_names=_DATA_FLAGS)
        counts = " + ".join(f"{n} {split}" for split, n in summary["samples"].items())
        verb = "already there, nothing written" if summary["skipped"] else f"written in {summary['seconds']:.0f} s"
        print(f"Fashion-MNIST {counts} samples in {sum(summary['shards'].values())} shards at {args.out}: {verb}")
        return
    from lit_softmoe.data.write_options import WriteOptions, check_split_name
    from lit_softmoe.data.writers import write_folder_shards, write_table_shards
    check_split_name(args.split, _DATA_FLAGS)  # WriteOptions checks it too, naming it "split"
    options = WriteOptions(split=args.split, image_format=args.image_format, max_size=args.max_size,
                           samples_per_shard=args.samples_per_shard, max_shard_bytes=args.max_shard_bytes)
    progress = sys.stderr.isatty()
    from lit_softmoe.utils.device import available_cpus  # here: `--help` imports no torch
    workers = args.workers if args.workers is not None else available_cpus()
    if args.dataset == "from-folder":
        from lit_softmoe.data.captions import load_caption_templates
        templates = load_caption_templates(args.caption_templates) if args.caption_templates is not None else None
        summary = write_folder_shards(args.src, args.out, options, layout=args.layout, progress=progress,
                                      overwrite=args.overwrite, caption_templates=templates,
                                      class_names=args.class_names, workers=workers,
                                      setting_names=_DATA_FLAGS)
    else:
        summary = write_table_shards(args.table, args.out, args.image_col, args.caption_col, options,
                                     key_col=args.key_col, progress=progress, overwrite=args.overwrite, root=args.root,
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
    with run_size_on_out_of_memory(args, f"tower {cfg.tower.name}{options}, batch {cfg.batch_size}"):
        results = pretrain(cfg)
    if "test_top1" in results and is_main_process():
        fewshot_key = f"fewshot{cfg.fewshot_shots}_top1"
        print(f"test top-1 {results['test_top1']:.4f}" +
              (f", {cfg.fewshot_shots}-shot linear probe {results[fewshot_key]:.4f}" if fewshot_key in results else "")
              + (f", {cfg.fewshot_shots}-shot linear probe skipped (see above)" if "fewshot_skipped" in results else "")
              + f"; tower saved to {cfg.run_dir}/tower")


def _cmd_train(args) -> None:
    from lit_softmoe.config import LiTConfig
    cfg = recipe_config(args, LiTConfig)
    if cfg is None:
        return
    from lit_softmoe.train.lit import train_lit
    text = cfg.text.path if cfg.text.kind == "hf" else f"{cfg.text.width} wide × {cfg.text.layers} layers"
    with run_size_on_out_of_memory(args, f"text tower {text} against {cfg.image_tower}, batch {cfg.batch_size}"):
        results = train_lit(cfg)
    scores = ""
    if "zeroshot_top1" in results:
        probe = f", linear-probe ceiling {results['linear_probe_top1']:.4f}" if "linear_probe_top1" in results else ""
        scores = f"zero-shot top-1 {results['zeroshot_top1']:.4f}{probe}; "
    if is_main_process():
        print(f"{scores}model saved to {cfg.run_dir}/model")


def _cmd_embed(args) -> None:
    from lit_softmoe.train.embed import embed_shards
    check_writable(args.out, "--out", folder=True)
    summary = embed_shards(args.tower, args.shards, args.out, split=args.split, batch_size=args.batch_size,
                           workers=args.workers, device=args.device, precision=args.precision,
                           compile=args.compile, jpeg_decoder=args.jpeg_decoder, gpu_jpeg_share=args.gpu_jpeg_share,
                           progress=sys.stderr.isatty())
    if summary["rank"] != 0:  # rank 0 puts the split together and says so
        return
    resumed = f", {summary['resumed_shards']} shards kept from an interrupted run" if summary["resumed_shards"] else ""
    processes = f" by {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    on_rank_0 = " on rank 0" if summary["world_size"] > 1 else ""
    done = "already there, nothing written" if summary["skipped"] else \
        f"written{processes} in {summary['seconds']:.1f} s " \
        f"({_rate(summary['images_per_second'])} images/s{on_rank_0}{resumed})"
    bad = ", ".join(f"{reason}: {count}" for reason, count in summary["bad"].items())
    print(f"{summary['num_samples']} embeddings (dim {summary['dim']}, float16) of {args.shards} at "
          f"{summary['split_dir']}: {done}" + (f"; bad samples skipped ({bad})" if bad else ""))


def _rate(per_second: float) -> str:
    """3,273 or 0.04: whole numbers down to 10 a second, two digits below (a large tower on a CPU)."""
    return f"{per_second:,.0f}" if per_second >= 10 else f"{per_second:.2g}"


def _cmd_upcycle(args) -> None:
    from lit_softmoe.models.upcycle import upcycle_checkpoint
    info = upcycle_checkpoint(args.source, args.to, args.out, seed=args.seed, overwrite=args.overwrite,
                              source_setting="--from", out_setting="--out", seed_setting="--seed",
                              overwrite_setting="--overwrite")
    print(f"{args.source} upcycled into {args.to} (Soft MoE blocks {info['moe_blocks']}) at {args.out}; "
          f"fresh: {', '.join(info['fresh'])}" + (f"; notes: {'; '.join(info['notes'])}" if info["notes"] else ""))


def _cmd_convert(args) -> None:
    from lit_softmoe.models.convert import convert_vmoe_checkpoint
    tower = convert_vmoe_checkpoint(args.from_vmoe, args.to, args.out, overwrite=args.overwrite,
                                    tower_setting="--to", out_setting="--out", overwrite_setting="--overwrite")
    params = sum(p.numel() for p in tower.parameters())
    print(f"{args.from_vmoe} loaded as {args.to} ({params:,} parameters, every key used) and saved to {args.out}")


def _cmd_inspect_routing(args) -> None:
    from lit_softmoe.evals.routing import inspect_routing, stats_table
    report = inspect_routing(args.tower, args.image, args.out, layer=args.layer, num_slots=args.slots)
    print(stats_table(report["layers"]))
    plotted = report["plotted"]
    print(f"entropies in nats (max in brackets); dispatch weights of block {plotted['block']}, slots "
          f"{plotted['slots'][0]}-{plotted['slots'][-1]} drawn in {args.out}; statistics in "
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
        print(f"{name:18s} {cfg.image_size}px/{cfg.patch_size} width {cfg.width} depth {cfg.depth} {kind}")


def _cmd_clip_benchmark(args) -> None:
    from lit_softmoe.integrations.clip_benchmark import clip_benchmark_cli
    clip_benchmark_cli(args.clip_benchmark_args)


def _cmd_eval(args) -> None:
    from lit_softmoe.config import EvalSuiteConfig, load_config
    from lit_softmoe.evals.reports import markdown_table, summary_line
    from lit_softmoe.evals.suite import failed_benchmarks, nothing_evaluated, run_suite
    from lit_softmoe.utils.device import parse_device
    cfg = load_config(EvalSuiteConfig, args.suite, args.overrides)
    benchmarks = None  # the whole suite
    if args.benchmarks is not None:
        benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        if not benchmarks:  # an empty subset silently ran the whole suite
            raise UserError(f"--benchmarks {args.benchmarks!r} names no benchmark; give a comma-separated list "
                            "such as fashion-mnist,cifar10, or leave it out for the whole suite")
    parse_device(args.device, "--device")  # run_suite checks it too, but its message names the parameter
    report = run_suite(args.model, cfg, benchmarks, out=args.out, overwrite=args.overwrite, device=args.device,
                       use_cache=not args.no_cache, peer=args.peer, progress=sys.stderr.isatty())
    nothing = nothing_evaluated(report)  # every benchmark skipped: no results were written
    if nothing is None:
        print(markdown_table(report))
    for entry in report["results"]:
        peer = entry.get("peer") or {}
        if peer.get("status") == "ok":
            print(f"{entry['benchmark']}: clip_benchmark differs by at most {peer['max_abs_diff_points']:.3f} points")
        elif entry["status"] != "ok":
            print(summary_line(entry))
        elif peer:  # asked for, but it did not run (another layout) or failed: say so
            print(f"{entry['benchmark']}: clip_benchmark {peer.get('status')}: {peer.get('reason', '')}")
    if nothing is not None:
        raise UserError(nothing)
    print(f"results: {report['paths']['json']} (+ .md, .png)")
    failed = failed_benchmarks(report)  # written with the rest, and still a mistake to fix: exit 2
    if failed is not None:
        raise UserError(failed)


def _cmd_export(args) -> None:
    import json

    from lit_softmoe.export import export_pair
    out = export_pair(args.run, args.out, dtype=args.dtype, onnx=args.onnx, overwrite=args.overwrite,
                      open_clip=args.open_clip)
    config = json.loads((out / "config.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".onnx"))
    onnx = config.get("onnx") or {}
    check = "; ONNX vs PyTorch max abs difference " + ", ".join(
        f"{side} {onnx[side]['max_abs_diff']:.1e}" for side in ("image", "text") if side in onnx) if onnx else ""
    open_clip = config.get("open_clip") or {}
    extra = ", open_clip_config.json" if "config" in open_clip else ""
    skipped = (f"\nopen_clip files left out: {open_clip['skipped']}"
               if "skipped" in open_clip and config["kind"] != "image" and args.open_clip else "")
    print(f"{'image tower' if config['kind'] == 'image' else 'LiT pair'} of {args.run} exported ({args.dtype}) to "
          f"{out}: {', '.join(files)}, config.json{extra}, README.md{check}{skipped}")


def _cmd_push(args) -> None:
    from lit_softmoe.export.push import push_export
    summary = push_export(args.export, args.repo_id, private=args.private, revision=args.revision, dry_run=args.dry_run)
    where = f"{args.repo_id}" + (f" (revision {args.revision})" if args.revision else "")
    if args.dry_run:
        front = summary["front_matter"]
        print(f"dry run: {len(summary['files'])} files of {args.export} would go to {where}:")
        for name in summary["files"]:
            print(f"  {name}")
        results = len((front.get("model-index") or [{}])[0].get("results", []))
        shown = ", ".join(f"{k}: {v}" for k, v in front.items() if k != "model-index")
        print(f"model card front matter (the card written for the Hub): {shown}; model-index: {results} result(s)")
        return
    print(f"{len(summary['files'])} files of {args.export} pushed to {where}: {summary['url']}")


def _cmd_demo(args) -> None:
    from lit_softmoe.demo import run_demo
    run_demo(data_dir=args.data, runs_dir=args.runs, fast=args.fast)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-softmoe", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)  # options every command takes
    common.add_argument("--verbose", action="store_true",
                        help="also show other libraries' warnings (hidden by default: they are not yours to act on)")

    def command(subparsers, name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, parents=[common], help=help)

    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="write webdataset shards: Fashion-MNIST, a folder of images, or a table")
    sources = data.add_subparsers(dest="dataset", required=True)
    fmnist = command(sources, "fashion-mnist", "Fashion-MNIST train and test → class + caption shards")
    fmnist.add_argument("--out", required=True, help="output folder (gets train/, test/, classnames.txt)")
    fmnist.add_argument("--source", default=None,
                        help="folder with the raw files (default: search the usual places)")
    fmnist.add_argument("--limit", type=int, default=None, help="keep the first N images of each split")
    fmnist.add_argument("--overwrite", action="store_true",
                        help="replace OUT/train and OUT/test if they hold other data (another source's shards)")

    folder = command(sources, "from-folder", "a folder of images with same-stem .txt captions, "
                                             "or of class subfolders → shards")
    folder.add_argument("src", metavar="SRC", help="the folder (searched recursively; hidden files left out)")
    folder.add_argument("--layout", choices=["auto", "captions", "classes"], default="auto",
                        help="captions: x.jpg + x.txt; classes: SRC/CLASS/x.jpg (writes .cls and "
                             "classnames.txt); auto: captions if any image has a .txt beside it (default)")
    folder.add_argument("--caption-templates", default=None, metavar="FILE|NAME",
                        help="classes layout: also write a .txt caption per image from its class folder's name, "
                             "one {c} template per line of FILE, or NAME: default (CLIP's 80 ImageNet templates) "
                             "or a benchmark's, e.g. cifar10; they also become the zero-shot prompts")
    folder.add_argument("--class-names", choices=["auto", "folders"], default="auto",
                        help="classes layout: auto (default) names ImageNet wnid folders (n01440764/ …) by ImageNet's "
                             "class names, .cls then the standard ImageNet index for all 1000; folders keeps every "
                             "folder's name")
    table = command(sources, "from-table", "a CSV / TSV / JSONL / Parquet table of image paths and "
                                           "captions or classes → shards")
    table.add_argument("table", metavar="FILE", help="the table; image paths in it are relative to its folder")
    table.add_argument("--image-col", required=True, help="column of image paths (or embedded image bytes)")
    table.add_argument("--caption-col", default=None, help="column of captions (required without --class-col)")
    table.add_argument("--class-col", default=None, help="column of class names (or, with --classnames, of class "
                       "indices): writes .cls and classnames.txt, classes numbered in sorted name order")
    table.add_argument("--classnames", default=None, metavar="FILE",
                       help="with --class-col: the classes, one name per line in label order; a column of whole "
                            "numbers is then read as indices into it")
    table.add_argument("--key-col", default=None, help="column of sample keys (default: the image path without "
                       "extension; give one to keep several captions of one image)")
    table.add_argument("--root", default=None, metavar="DIR",
                       help="read images inside DIR only: a path leading elsewhere (../, absolute, a link) is "
                            "skipped and counted (default: any file you can read)")
    for writer in (folder, table):
        writer.add_argument("--out", required=True, help="dataset folder; shards go to OUT/SPLIT/")
        writer.add_argument("--split", default="train", help="split folder name (default: train)")
        writer.add_argument("--workers", type=int, default=None,
                            help="processes that decode, resize and encode the images (default: one per core); "
                                 "the shards are the same bytes for any number")
        writer.add_argument("--image-format", choices=["keep", "jpg", "png", "webp"], default="keep",
                            help="store images as they are where possible (keep, default) or all in one format")
        writer.add_argument("--max-size", type=int, default=None, metavar="PIXELS",
                            help="shrink images whose longer side is larger than this")
        writer.add_argument("--samples-per-shard", type=int, default=10_000, help="default: 10000")
        writer.add_argument("--max-shard-bytes", type=byte_size, default=1 << 30, metavar="SIZE",
                            help="start a new shard past this size, e.g. 500M (default: 1G)")
        writer.add_argument("--overwrite", action="store_true",
                            help="replace OUT/SPLIT if it holds other data (another source's shards)")
    data.set_defaults(func=_cmd_data)

    pre = command(sub, "pretrain", "pretrain an image tower on class shards")
    pre.add_argument("--config", required=True,
                     help="a YAML file, or a shipped config by name, e.g. pretrain/fmnist-soft-tiny")
    pre.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4")
    add_plan_arguments(pre)
    pre.set_defaults(func=_cmd_pretrain)

    train = command(sub, "train", "LiT: train a text tower against a locked image tower")
    train.add_argument("--config", required=True, help="a YAML file, or a shipped config by name, e.g. lit/fmnist-tiny")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. text.layers=4")
    add_plan_arguments(train)
    train.set_defaults(func=_cmd_train)

    embed = command(sub, "embed", "run a locked image tower once over image shards → feature shards "
                                  "(resumes where a killed run stopped; one process per GPU under torchrun)")
    embed.add_argument("--tower", required=True, help="tower folder of a pretraining run (RUN/tower), or a timm "
                       "model: timm:NAME, timm:hf-hub:ORG/NAME, timm:NAME?file=CHECKPOINT")
    embed.add_argument("--shards", required=True, help="image + caption shards: a split folder, DIR/{0..9}.tar, "
                       "or several joined with '::'")
    embed.add_argument("--out", required=True, help="feature dataset folder; shards go to OUT/SPLIT/")
    embed.add_argument("--split", default=None, help="feature split name (default: the source split folder's name)")
    embed.add_argument("--batch-size", type=int, default=256, help="images per tower forward (default: 256)")
    embed.add_argument("--workers", type=int, default=None,
                       help="shard-reading (and image-decoding) worker processes (default: one per available core, "
                            "at most one per shard)")
    embed.add_argument("--device", default=None, help="where the tower runs: cpu, cuda, cuda:1 … (default: this "
                       "process's GPU under torchrun, else cuda when present)")
    embed.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                       help="the tower's weights: auto (default) = bf16 on GPUs that support it, else fp32")
    embed.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                       help="torch.compile the tower (default auto: on a GPU, for runs long enough to earn the "
                            "compile time back)")
    embed.add_argument("--jpeg-decoder", choices=["auto", "gpu", "cpu"], default="auto",
                       help="where JPEGs are decoded (default auto: on the GPU with nvJPEG when the tower runs on one; "
                            "other formats always on the host)")
    embed.add_argument("--gpu-jpeg-share", type=float, default=1.0, metavar="F",
                       help="with the GPU decoder, the fraction of the JPEGs it decodes (default 1); below 1 the "
                            "workers decode the rest, so both decoders work")
    embed.set_defaults(func=_cmd_embed)

    upcycle = command(sub, "upcycle", "dense ViT (tower folder or timm vit_* weights) → Soft MoE tower, "
                                      "every expert a copy of the dense MLP")
    upcycle.add_argument("--from", dest="source", required=True, metavar="CKPT",
                         help="a dense tower folder, or a timm ViT state dict (.safetensors, .pth, .bin)")
    upcycle.add_argument("--to", required=True, metavar="NAME", help="registered Soft MoE tower, e.g. soft-s16-128e")
    upcycle.add_argument("--out", required=True, help="output tower folder (written atomically)")
    upcycle.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    upcycle.add_argument("--seed", type=int, default=0, help="seed of the fresh routers (default: 0)")
    upcycle.set_defaults(func=_cmd_upcycle)

    convert = command(sub, "convert", "a vmoe (JAX) Soft MoE ViT parameter tree (.npz) → tower folder")
    convert.add_argument("--from-vmoe", required=True, metavar="FILE.npz",
                         help="the flattened parameter tree, names joined with '/' (np.savez(f, **flat))")
    convert.add_argument("--to", required=True, metavar="NAME", help="the registered tower it was trained as")
    convert.add_argument("--out", required=True, help="output tower folder (written atomically)")
    convert.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    convert.set_defaults(func=_cmd_convert)

    routing = command(sub, "inspect-routing", "one image through a Soft MoE tower: slot heatmaps (PNG) and "
                                              "dispatch/combine statistics (table + JSON)")
    routing.add_argument("--tower", required=True, help="a tower folder (RUN/tower)")
    routing.add_argument("--image", required=True, help="an image file (PNG, JPEG, ...)")
    routing.add_argument("--layer", type=int, default=None, metavar="L",
                         help="block whose slots are drawn (default: the last Soft MoE block)")
    routing.add_argument("--slots", type=int, default=8, help="draw the first N slots (default: 8)")
    routing.add_argument("--out", default="routing.png", help="PNG to write; the statistics go beside it as .json")
    routing.set_defaults(func=_cmd_inspect_routing)

    models = command(sub, "models", "list the registered image towers")
    models.set_defaults(func=_cmd_models)

    ev = command(sub, "eval", "zero-shot classification and retrieval over the benchmarks of a suite")
    ev.add_argument("--model", required=True, help="a LiT run folder, its model/ or a checkpoint folder, or an export")
    ev.add_argument("--suite", required=True,
                    help="a suite YAML file, or a shipped suite by name: fashion-mnist, lit-paper, clip-27")
    ev.add_argument("--benchmarks", default=None, help="comma-separated subset of the suite's benchmarks")
    ev.add_argument("--out", default=None, help="results JSON (default: RUN/eval/SUITE[-step_N]-TIME.json for a run, "
                    "its model/ or a checkpoint; EXPORT/eval/SUITE-TIME.json for an export); .md and .png go beside it")
    ev.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda when present)")
    ev.add_argument("--no-cache", action="store_true", help="encode every image again instead of reusing "
                    "cached image features")
    ev.add_argument("--peer", action="store_true", help="also run clip_benchmark on each webdataset benchmark "
                    "and report the largest gap")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides of the suite, e.g. batch_size=64")
    ev.set_defaults(func=_cmd_eval)

    bench = command(sub, "clip-benchmark", "CLIP_benchmark's own command line with lit-softmoe's towers and "
                    "loader registered (and its NumPy-2 accuracy fix for this run): clip-benchmark -- eval ...")
    bench.add_argument("clip_benchmark_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                       help="clip_benchmark's arguments, after --")
    bench.set_defaults(func=_cmd_clip_benchmark)

    export = command(sub, "export", "a LiT run's paired encoders (or a pretrained tower alone) → one folder")
    export.add_argument("run", metavar="RUN", help="a finished LiT run folder (or its model/), or a pretraining "
                        "run / tower folder for an image-only export")
    export.add_argument("--out", required=True, help="export folder (written atomically)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="weights on disk (default: fp32); ONNX graphs are always fp32")
    export.add_argument("--no-open-clip", dest="open_clip", action="store_false",
                        help="store the weights under lit-softmoe's names (image/text_encoder.safetensors) in place "
                             "of open_clip's (open_clip_model.safetensors + open_clip_config.json): open_clip's "
                             "create_model_and_transforms then cannot load the export")
    export.add_argument("--onnx", action="store_true", help="also write image/text_encoder.onnx and check them "
                        "against PyTorch with onnxruntime")
    export.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    export.set_defaults(func=_cmd_export)

    push = command(sub, "push", "upload an export to a Hugging Face Hub model repository")
    push.add_argument("export", metavar="EXPORT", help="an export folder (checked complete before anything is sent)")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub repository, ORG/NAME (created if absent)")
    push.add_argument("--private", action="store_true", help="create the repository private (an existing one "
                      "keeps its visibility)")
    push.add_argument("--revision", default=None, help="the branch to push to (created if absent; default: main)")
    push.add_argument("--dry-run", action="store_true", help="check the export, list the files and the model "
                      "card's front matter; nothing is sent")
    push.set_defaults(func=_cmd_push)

    demo = command(sub, "demo", "run the main job on Fashion-MNIST end to end")
    demo.add_argument("--data", default="data", help="where datasets and shards go")
    demo.add_argument("--runs", default="runs", help="where run folders go")
    demo.add_argument("--fast", action="store_true", help="10k training images and fewer epochs, for a quick check "
                      "(about 2 min); shards in DATA/fashion-mnist-10k, run folders in RUNS/demo-fast")
    demo.set_defaults(func=_cmd_demo)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; key=value overrides may also follow a flag (`run_dir=r --plan sharding=fsdp`), which
    argparse leaves over once the overrides before the flag filled their argument. They keep their order."""
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
        print(f"\nlit-softmoe {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lit-softmoe models | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
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
