"""The training commands' memory on the command line: `--plan` (and the GPUs it plans for), and
what a run that runs out of memory is told. `lit_softmoe.cli_parser` adds these options to
`pretrain` and `train`."""
from __future__ import annotations

import argparse
import contextlib
import shlex

from lit_softmoe.errors import UserError, out_of_memory
from lit_softmoe.utils.distributed import is_main_process


def byte_size(text: str) -> int:
    """A size with its unit (64MB, 1G) as an argparse type."""
    from lit_softmoe.data.write_options import parse_byte_size
    try:
        return parse_byte_size(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _gpu_memory(text: str) -> int:
    """--plan-gpu's size: with its unit (80GB); a bare number, which the byte sizes read as bytes,
    is refused."""
    if text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"give the unit: {text.strip()}GB (a bare {text.strip()} is bytes)")
    return byte_size(text)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plan", action="store_true",
        help="print the memory per GPU (weights, gradients, AdamW, activations counted at the "
             "configured batch) and whether it fits, naming the levers that would make it fit, "
             "and the bytes a step moves with FSDP and with expert parallelism; train nothing "
             "(`train --plan` also takes a registered tower name as image_tower)")
    parser.add_argument(
        "--plan-gpus", type=int, default=None, metavar="N",
        help="with --plan: the GPUs the run would use (default: the launcher's WORLD_SIZE, else 1)")
    parser.add_argument(
        "--plan-gpu", type=_gpu_memory, default=None, metavar="SIZE",
        help="with --plan: the memory of one GPU, e.g. 80GB or 24G (binary units: 80GB = 80 GiB; "
             "default: this machine's GPU, else 80GB)")


def _print_plan(args, cfg) -> None:
    """`--plan`: the memory per GPU of the run `cfg` describes, and whether it fits; no work."""
    from lit_softmoe.train.memory_plan import plan_report, visible_gpu_bytes
    from lit_softmoe.utils.distributed import rank_and_world_size
    gpus = args.plan_gpus if args.plan_gpus is not None else rank_and_world_size()[1]
    gpu_bytes = args.plan_gpu if args.plan_gpu is not None else visible_gpu_bytes() or 80 << 30
    if gpus < 1 or gpu_bytes < 1:
        raise UserError(f"--plan-gpus {gpus} and --plan-gpu {gpu_bytes}: give at least 1 GPU of "
                        "some memory")
    report, _ = plan_report(cfg, gpus, gpu_bytes)
    if is_main_process():
        print(report)


def recipe_config(args, config_class):
    """The training command's config; None once `--plan` has printed its memory plan (no work)."""
    from lit_softmoe.config_loading import load_config
    if not args.plan and (args.plan_gpus is not None or args.plan_gpu is not None):
        raise UserError("--plan-gpus and --plan-gpu go with --plan (which prints the memory plan "
                        "and trains nothing)")
    cfg = load_config(config_class, args.config, args.overrides)
    if args.plan:
        _print_plan(args, cfg)
        return None
    return cfg


@contextlib.contextmanager
def run_size_on_out_of_memory(args, size: str):
    """Memory running out in a training run is one line naming the run's `size`, the `--plan`
    command line of this very run and the memory levers."""
    try:
        yield
    except Exception as err:
        problem = out_of_memory(err)
        if problem is None:
            raise
        plan = shlex.join(["lit-softmoe", args.command, "--config", args.config, *args.overrides,
                           "--plan"])
        raise UserError(f"{problem} in this run ({size}); `{plan}` shows what it needs per device: "
                        "lower batch_size (raise accum_steps to keep it), or set "
                        "grad_checkpointing=true, precision=bf16 (on a GPU) or sharding=fsdp over "
                        "more GPUs") from None
