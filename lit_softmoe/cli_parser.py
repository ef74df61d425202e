"""The `lit-softmoe` command line's subcommands and their flags (argparse); `lit_softmoe.cli` builds
its parser with them and runs the function each subcommand is given."""
from __future__ import annotations

import argparse
from typing import Callable, Mapping

from lit_softmoe.cli_memory import add_plan_arguments, byte_size


def add_commands(parser: argparse.ArgumentParser,
                 handlers: Mapping[str, Callable[[argparse.Namespace], None]]) -> None:
    """Every subcommand of `parser` with its flags; `handlers` maps each subcommand's name to the
    function that runs it (`args.func`)."""
    common = argparse.ArgumentParser(add_help=False)  # options every command takes
    common.add_argument("--verbose", action="store_true",
                        help="also show other libraries' warnings (hidden "
                             "by default: they are not yours to act on)")

    def command(subparsers, name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, parents=[common], help=help)

    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data",
                          help="write webdataset shards: Fashion-MNIST, "
                               "a folder of images, or a table")
    sources = data.add_subparsers(dest="dataset", required=True)
    fmnist = command(sources, "fashion-mnist",
                     "Fashion-MNIST train and test → class + caption shards")
    fmnist.add_argument("--out", required=True,
                        help="output folder (gets train/, test/, classnames.txt)")
    fmnist.add_argument("--source", default=None,
                        help="folder with the raw files (default: search the usual places)")
    fmnist.add_argument("--limit", type=int, default=None,
                        help="keep the first N images of each split")
    fmnist.add_argument("--overwrite", action="store_true",
                        help="replace OUT/train and OUT/test if they "
                             "hold other data (another source's shards)")

    folder = command(sources, "from-folder", "a folder of images with same-stem .txt "
                                             "captions, or of class subfolders → shards")
    folder.add_argument("src", metavar="SRC",
                        help="the folder (searched recursively; hidden files left out)")
    folder.add_argument("--layout", choices=["auto", "captions", "classes"], default="auto",
                        help="captions: x.jpg + x.txt; classes: SRC/CLASS/x.jpg "
                             "(writes .cls and classnames.txt); auto: captions "
                             "if any image has a .txt beside it (default)")
    folder.add_argument("--caption-templates", default=None, metavar="FILE|NAME",
                        help="classes layout: also write a .txt caption per image from its "
                             "class folder's name, one {c} template per line of FILE, or "
                             "NAME: default (CLIP's 80 ImageNet templates) or a benchmark's, "
                             "e.g. cifar10; they also become the zero-shot prompts")
    folder.add_argument("--class-names", choices=["auto", "folders"], default="auto",
                        help="classes layout: auto (default) names ImageNet wnid folders "
                             "(n01440764/ …) by ImageNet's class names, .cls then the standard "
                             "ImageNet index for all 1000; folders keeps every folder's name")
    table = command(sources, "from-table", "a CSV / TSV / JSONL / Parquet table of image "
                                           "paths and captions or classes → shards")
    table.add_argument("table", metavar="FILE",
                       help="the table; image paths in it are relative to its folder")
    table.add_argument("--image-col", required=True,
                       help="column of image paths (or embedded image bytes)")
    table.add_argument("--caption-col", default=None,
                       help="column of captions (required without --class-col)")
    table.add_argument("--class-col", default=None,
                       help="column of class names (or, with --classnames, of class indices): "
                            "writes .cls and classnames.txt, classes numbered in sorted name order")
    table.add_argument("--classnames", default=None, metavar="FILE",
                       help="with --class-col: the classes, one name per line in label order; "
                            "a column of whole numbers is then read as indices into it")
    table.add_argument("--key-col", default=None,
                       help="column of sample keys (default: the image path without "
                            "extension; give one to keep several captions of one image)")
    table.add_argument("--root", default=None, metavar="DIR",
                       help="read images inside DIR only: a path leading elsewhere (../, absolute, "
                            "a link) is skipped and counted (default: any file you can read)")
    for writer in (folder, table):
        writer.add_argument("--out", required=True, help="dataset folder; shards go to OUT/SPLIT/")
        writer.add_argument("--split", default="train", help="split folder name (default: train)")
        writer.add_argument("--workers", type=int, default=None,
                            help="processes that decode, resize and encode the images (default: "
                                 "one per core); the shards are the same bytes for any number")
        writer.add_argument("--image-format", choices=["keep", "jpg", "png", "webp"],
                            default="keep",
                            help="store images as they are where possible "
                                 "(keep, default) or all in one format")
        writer.add_argument("--max-size", type=int, default=None, metavar="PIXELS",
                            help="shrink images whose longer side is larger than this")
        writer.add_argument("--samples-per-shard", type=int, default=10_000, help="default: 10000")
        writer.add_argument("--max-shard-bytes", type=byte_size, default=1 << 30, metavar="SIZE",
                            help="start a new shard past this size, e.g. 500M (default: 1G)")
        writer.add_argument("--overwrite", action="store_true",
                            help="replace OUT/SPLIT if it holds other "
                                 "data (another source's shards)")
    data.set_defaults(func=handlers["data"])

    pre = command(sub, "pretrain", "pretrain an image tower on class shards")
    pre.add_argument("--config", required=True,
                     help="a YAML file, or a shipped config by "
                          "name, e.g. pretrain/fmnist-soft-tiny")
    pre.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4")
    add_plan_arguments(pre)
    pre.set_defaults(func=handlers["pretrain"])

    train = command(sub, "train", "LiT: train a text tower against a locked image tower")
    train.add_argument("--config", required=True,
                       help="a YAML file, or a shipped config by name, e.g. lit/fmnist-tiny")
    train.add_argument("overrides", nargs="*",
                       help="dotted key=value overrides, e.g. text.layers=4")
    add_plan_arguments(train)
    train.set_defaults(func=handlers["train"])

    embed = command(sub, "embed", "run a locked image tower once over image shards "
                                  "→ feature shards (resumes where a killed run "
                                  "stopped; one process per GPU under torchrun)")
    embed.add_argument("--tower", required=True,
                       help="tower folder of a pretraining run (RUN/tower), or a timm model: "
                            "timm:NAME, timm:hf-hub:ORG/NAME, timm:NAME?file=CHECKPOINT")
    embed.add_argument("--shards", required=True,
                       help="image + caption shards: a split folder, "
                            "DIR/{0..9}.tar, or several joined with '::'")
    embed.add_argument("--out", required=True,
                       help="feature dataset folder; shards go to OUT/SPLIT/")
    embed.add_argument("--split", default=None,
                       help="feature split name (default: the source split folder's name)")
    embed.add_argument("--batch-size", type=int, default=256,
                       help="images per tower forward (default: 256)")
    embed.add_argument("--workers", type=int, default=None,
                       help="shard-reading (and image-decoding) worker processes "
                            "(default: one per available core, at most one per shard)")
    embed.add_argument("--device", default=None,
                       help="where the tower runs: cpu, cuda, cuda:1 … (default: this "
                            "process's GPU under torchrun, else cuda when present)")
    embed.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                       help="the tower's weights: auto (default) = "
                            "bf16 on GPUs that support it, else fp32")
    embed.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                       help="torch.compile the tower (default auto: on a GPU, "
                            "for runs long enough to earn the compile time back)")
    embed.add_argument("--jpeg-decoder", choices=["auto", "gpu", "cpu"], default="auto",
                       help="where JPEGs are decoded (default auto: on the GPU with nvJPEG "
                            "when the tower runs on one; other formats always on the host)")
    embed.add_argument("--gpu-jpeg-share", type=float, default=1.0, metavar="F",
                       help="with the GPU decoder, the fraction of the JPEGs it decodes "
                            "(default 1); below 1 the workers decode the rest, so both "
                            "decoders work")
    embed.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                       help="split the tower's experts over each group of E processes of a "
                            "torchrun launch (E must divide the processes and the experts); a GPU "
                            "then holds its chunk of them, not the whole tower (default: 1, off)")
    embed.set_defaults(func=handlers["embed"])

    upcycle = command(sub, "upcycle", "dense ViT (tower folder or timm vit_* weights) → "
                                      "Soft MoE tower, every expert a copy of the dense MLP")
    upcycle.add_argument("--from", dest="source", required=True, metavar="CKPT",
                         help="a dense tower folder, or a timm ViT "
                              "state dict (.safetensors, .pth, .bin)")
    upcycle.add_argument("--to", required=True, metavar="NAME",
                         help="registered Soft MoE tower, e.g. soft-s16-128e")
    upcycle.add_argument("--out", required=True, help="output tower folder (written atomically)")
    upcycle.add_argument("--overwrite", action="store_true",
                         help="replace --out if it exists and is not empty")
    upcycle.add_argument("--seed", type=int, default=0,
                         help="seed of the fresh routers (default: 0)")
    upcycle.set_defaults(func=handlers["upcycle"])

    convert = command(sub, "convert",
                      "a vmoe (JAX) Soft MoE ViT parameter tree (.npz) → tower folder")
    convert.add_argument("--from-vmoe", required=True, metavar="FILE.npz",
                         help="the flattened parameter tree, names "
                              "joined with '/' (np.savez(f, **flat))")
    convert.add_argument("--to", required=True, metavar="NAME",
                         help="the registered tower it was trained as")
    convert.add_argument("--out", required=True, help="output tower folder (written atomically)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace --out if it exists and is not empty")
    convert.set_defaults(func=handlers["convert"])

    routing = command(sub, "inspect-routing",
                      "one image through a Soft MoE tower: slot heatmaps "
                      "(PNG) and dispatch/combine statistics (table + JSON)")
    routing.add_argument("--tower", required=True, help="a tower folder (RUN/tower)")
    routing.add_argument("--image", required=True, help="an image file (PNG, JPEG, ...)")
    routing.add_argument("--layer", type=int, default=None, metavar="L",
                         help="block whose slots are drawn (default: the last Soft MoE block)")
    routing.add_argument("--slots", type=int, default=8, help="draw the first N slots (default: 8)")
    routing.add_argument("--out", default="routing.png",
                         help="PNG to write; the statistics go beside it as .json")
    routing.set_defaults(func=handlers["inspect-routing"])

    models = command(sub, "models", "list the registered image towers")
    models.set_defaults(func=handlers["models"])

    ev = command(sub, "eval",
                 "zero-shot classification and retrieval over the benchmarks of a suite")
    ev.add_argument("--model", required=True,
                    help="a LiT run folder, its model/ or a checkpoint folder, or an export")
    ev.add_argument("--suite", required=True,
                    help="a suite YAML file, or a shipped suite by "
                         "name: fashion-mnist, lit-paper, clip-27")
    ev.add_argument("--benchmarks", default=None,
                    help="comma-separated subset of the suite's benchmarks")
    ev.add_argument("--out", default=None,
                    help="results JSON (default: RUN/eval/SUITE[-step_N]-TIME.json for a "
                         "run, its model/ or a checkpoint; EXPORT/eval/SUITE-TIME.json "
                         "for an export); .md and .png go beside it")
    ev.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ev.add_argument("--device", default=None,
                    help="cpu, cuda, cuda:1 … (default: cuda when present)")
    ev.add_argument("--no-cache", action="store_true",
                    help="encode every image again instead of reusing cached image features")
    ev.add_argument("--peer", action="store_true",
                    help="also run clip_benchmark on each webdataset "
                         "benchmark and report the largest gap")
    ev.add_argument("overrides", nargs="*",
                    help="dotted key=value overrides of the suite, e.g. batch_size=64")
    ev.set_defaults(func=handlers["eval"])

    bench = command(sub, "clip-benchmark", "CLIP_benchmark's own command line with "
                    "lit-softmoe's towers and loader registered (and its NumPy-2 "
                    "accuracy fix for this run): clip-benchmark -- eval ...")
    bench.add_argument("clip_benchmark_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                       help="clip_benchmark's arguments, after --")
    bench.set_defaults(func=handlers["clip-benchmark"])

    export = command(sub, "export",
                     "a LiT run's paired encoders (or a pretrained tower alone) → one folder")
    export.add_argument("run", metavar="RUN",
                        help="a finished LiT run folder (or its model/), or a "
                             "pretraining run / tower folder for an image-only export")
    export.add_argument("--out", required=True, help="export folder (written atomically)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="weights on disk (default: fp32); ONNX graphs are always fp32")
    export.add_argument("--no-open-clip", dest="open_clip", action="store_false",
                        help="store the weights under lit-softmoe's names "
                             "(image/text_encoder.safetensors) in place of open_clip's "
                             "(open_clip_model.safetensors + open_clip_config.json): open_clip's "
                             "create_model_and_transforms then cannot load the export")
    export.add_argument("--onnx", action="store_true",
                        help="also write image/text_encoder.onnx and "
                             "check them against PyTorch with onnxruntime")
    export.add_argument("--overwrite", action="store_true",
                        help="replace --out if it exists and is not empty")
    export.set_defaults(func=handlers["export"])

    push = command(sub, "push", "upload an export to a Hugging Face Hub model repository")
    push.add_argument("export", metavar="EXPORT",
                      help="an export folder (checked complete before anything is sent)")
    push.add_argument("repo_id", metavar="REPO_ID",
                      help="the Hub repository, ORG/NAME (created if absent)")
    push.add_argument("--private", action="store_true",
                      help="create the repository private (an existing one keeps its visibility)")
    push.add_argument("--revision", default=None,
                      help="the branch to push to (created if absent; default: main)")
    push.add_argument("--dry-run", action="store_true",
                      help="check the export, list the files and the "
                           "model card's front matter; nothing is sent")
    push.set_defaults(func=handlers["push"])

    demo = command(sub, "demo", "run the main job on Fashion-MNIST end to end")
    demo.add_argument("--data", default="data", help="where datasets and shards go")
    demo.add_argument("--runs", default="runs", help="where run folders go")
    demo.add_argument("--fast", action="store_true",
                      help="5k training and 5k test images, fewer steps, for a quick check (about "
                           "1 min); shards in DATA/fashion-mnist-5k, run folders in RUNS/demo-fast")
    demo.set_defaults(func=handlers["demo"])
