"""Time forward+backward of our Soft MoE layer against soft-moe-pytorch and the dense MLP.

The same tokens go through three (or, with --compile, five) implementations:
- `ours`: `lit_softmoe.nn.SoftMoE`, experts batched into one bmm per projection;
- `soft_moe_pytorch`: lucidrains' `soft_moe_pytorch.SoftMoE` (a different parametrization: an
  RMSNorm with gain in front, experts in a Python loop over an `nn.ModuleList`), built with the same
  width, number of experts, slots per expert and expert hidden width;
- `dense_mlp`: the dense block MLP of the same width (`lit_softmoe.models.vit.Mlp`), i.e. what the
  Soft MoE block replaces.

Paper shapes (S/16 and B/16 at 224 px: 196 tokens, 128 experts, 1 slot each, batch 256) are the
default on CUDA, under bf16 autocast; the CPU default is a small shape. Examples:

    python scripts/bench_softmoe.py                       # CUDA: s16,b16; CPU: cpu
    python scripts/bench_softmoe.py --shapes s16 --precision bf16 --compile --json bench.json
    python scripts/bench_softmoe.py --shapes 8:49:128:512:16:1 --iters 3
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
from benchlib import setup_device, time_step  # scripts/benchlib.py, beside this script

from lit_softmoe.models.vit import Mlp
from lit_softmoe.nn.soft_moe import SoftMoE


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    tokens: int
    dim: int
    mlp_dim: int
    experts: int
    slots: int = 1

    def __str__(self) -> str:
        return (f"{self.name} (b={self.batch}, m={self.tokens}, d={self.dim}, mlp={self.mlp_dim}, "
                f"n={self.experts}, p={self.slots})")


PRESETS = {
    "s16": Shape("s16", batch=256, tokens=196, dim=384, mlp_dim=1536, experts=128),
    "b16": Shape("b16", batch=256, tokens=196, dim=768, mlp_dim=3072, experts=128),
    "cpu": Shape("cpu", batch=8, tokens=49, dim=128, mlp_dim=512, experts=16),
}


def parse_shape(spec: str) -> Shape:
    """A preset name, or `batch:tokens:dim:mlp_dim:experts[:slots]`."""
    if spec in PRESETS:
        return PRESETS[spec]
    try:
        numbers = [int(v) for v in spec.split(":")]
        return Shape(spec, *numbers)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"shape {spec!r} is neither a preset ({', '.join(PRESETS)}) nor "
            "batch:tokens:dim:mlp_dim:experts[:slots]") from None


# ---- the implementations ------------------------------------------------------------------------

def build_ours(shape: Shape) -> torch.nn.Module:
    return SoftMoE(shape.dim, shape.experts, shape.mlp_dim, slots_per_expert=shape.slots)


def build_peer(shape: Shape) -> torch.nn.Module:
    from soft_moe_pytorch import SoftMoE as PeerSoftMoE  # optional dependency
    # expert_mult sets the expert hidden width, int(dim · mult); offloading would move experts
    # between devices on every call and distributed mode would all-gather, so both are off.
    mult = shape.mlp_dim / shape.dim
    if int(shape.dim * mult) != shape.mlp_dim:
        raise ValueError(f"soft_moe_pytorch cannot make hidden width {shape.mlp_dim} from dim {shape.dim}")
    return PeerSoftMoE(shape.dim, num_experts=shape.experts, num_slots=shape.slots, expert_mult=mult,
                       is_distributed=False, offload_unused_experts_to_cpu=False)


def build_dense(shape: Shape) -> torch.nn.Module:
    return Mlp(shape.dim, shape.mlp_dim)


# ---- timing -------------------------------------------------------------------------------------

@dataclass
class Result:
    impl: str
    shape: str
    ms: float | None = None  # median ms of one forward+backward
    ratio: float | None = None  # ms / ms of `ours` on the same shape
    params_m: float | None = None
    peak_mib: float | None = None  # CUDA only: peak allocated during the timed steps, params included
    iters: int = 0
    note: str = ""


def time_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast_dtype,
                 warmup: int, iters: int) -> tuple[float, float | None]:
    """Median milliseconds of forward + backward (input grads included), and peak CUDA MiB."""
    device = x.device

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            y = module(x)
        y.backward(grad.to(y.dtype))

    return time_step(step, device, warmup, iters)


def bench_shape(shape: Shape, args, device: torch.device) -> list[Result]:
    weight_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    autocast_dtype = torch.bfloat16 if args.precision == "autocast-bf16" else None
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(shape.batch, shape.tokens, shape.dim, generator=g).to(device, weight_dtype)
    x.requires_grad_(True)  # in a network the block's input needs its gradient too
    grad = torch.randn(x.shape, generator=g).to(device, weight_dtype)

    impls = [("ours", build_ours, False, args.iters),
             ("soft_moe_pytorch", build_peer, False, args.peer_iters),
             ("dense_mlp", build_dense, False, args.iters)]
    if args.compile:
        impls += [("ours+compile", build_ours, True, args.iters),
                  ("dense_mlp+compile", build_dense, True, args.iters)]

    results = []
    for name, build, compiled, iters in impls:
        result = Result(name, shape.name, iters=iters)
        try:
            torch.manual_seed(0)
            module = build(shape).to(device, weight_dtype)
            result.params_m = sum(p.numel() for p in module.parameters()) / 1e6
            if compiled:
                module = torch.compile(module)
            warmup = args.warmup + (2 if compiled else 0)
            result.ms, result.peak_mib = time_fwd_bwd(module, x, grad, autocast_dtype, warmup, iters)
        except ImportError as e:
            result.note = f"skipped: {e.name or 'soft_moe_pytorch'} is not installed"
        except Exception as e:  # one failing row (OOM, no compiler) must not end the benchmark
            result.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        finally:
            module = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results.append(result)
        print(f"  {name:18s} {shape.name}: " + (f"{result.ms:.3f} ms" if result.ms else result.note),
              flush=True)

    ours = next((r.ms for r in results if r.impl == "ours" and r.ms), None)
    for r in results:
        if r.ms and ours:
            r.ratio = r.ms / ours
    return results


def markdown_table(results: list[Result], cuda: bool) -> str:
    head = ["impl", "shape", "ms fwd+bwd", "ratio vs ours", "params (M)"]
    if cuda:
        head.append("peak MiB")
    head.append("note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [r.impl, r.shape,
               f"{r.ms:.3f}" if r.ms is not None else "–",
               f"{r.ratio:.2f}x" if r.ratio is not None else "–",
               f"{r.params_m:.2f}" if r.params_m is not None else "–"]
        if cuda:
            row.append(f"{r.peak_mib:.0f}" if r.peak_mib is not None else "–")
        row.append(r.note or (f"median of {r.iters}" if r.ms is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None,
                   help="comma-separated presets (s16, b16, cpu) or batch:tokens:dim:mlp_dim:experts[:slots]; "
                        "default: s16,b16 on CUDA, cpu on CPU")
    p.add_argument("--precision", choices=["auto", "fp32", "autocast-bf16", "bf16"], default="auto",
                   help="autocast-bf16: fp32 weights under bf16 autocast; bf16: bf16 weights and inputs; "
                        "auto: autocast-bf16 on CUDA, fp32 on CPU")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    p.add_argument("--peer-iters", type=int, default=None,
                   help="timed iterations for soft_moe_pytorch (slow on GPU); default min(iters, 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd ours and dense MLP")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch; 0 (default): torch's choice, or 1 when the machine is "
                        "already busy, where OpenMP threads waiting on each other inflate timings 10x+")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.precision == "auto":
        args.precision = "autocast-bf16" if args.device.startswith("cuda") else "fp32"
    if args.shapes is None:
        args.shapes = "s16,b16" if args.device.startswith("cuda") else "cpu"
    try:
        args.shapes = [parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.peer_iters is None:
        args.peer_iters = min(args.iters, 5)
    if args.iters < 1 or args.peer_iters < 1 or args.warmup < 0:
        p.error("--iters and --peer-iters must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> list[Result]:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    device_name = setup_device(device, args.threads)
    print(f"device: {device} ({device_name}), torch {torch.__version__}, precision {args.precision}, "
          f"threads {torch.get_num_threads()}")
    results = []
    for shape in args.shapes:
        print(f"shape {shape}", flush=True)
        results += bench_shape(shape, args, device)

    print()
    print(f"Soft MoE forward+backward on {device_name} ({args.precision}, torch {torch.__version__})")
    print()
    print(markdown_table(results, cuda))
    for shape in args.shapes:
        print(f"- {shape}")
    if args.json:
        payload = {"device": str(device), "device_name": device_name, "torch": torch.__version__,
                   "precision": args.precision, "compile": args.compile,
                   "shapes": [asdict(s) for s in args.shapes], "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
