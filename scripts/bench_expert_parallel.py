"""Time forward+backward of the Soft MoE layer on its expert-parallel path at E = 1 against the plain layer.

`expert_parallel=E` runs every MoE layer's experts through `lit_softmoe.nn.expert_parallel` (DTensor chunks,
two all-to-alls, a gradient share). On one process (E = 1) that path moves nothing and computes the same
values, so it must cost what the plain layer costs: this script measures the ratio (docs/benchmarks.md, issue
42's "no regression from the new path"). One process group of one (NCCL on CUDA, gloo on the CPU) is formed
here, without a launcher.

    python scripts/bench_expert_parallel.py                  # CUDA: B/16 at 224 px, bf16; CPU: a small shape
    python scripts/bench_expert_parallel.py --batch 32 --iters 5
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from benchlib import setup_device, time_step  # scripts/benchlib.py, beside this script
from torch.distributed.device_mesh import init_device_mesh

from lit_softmoe.nn.expert_parallel import place_experts
from lit_softmoe.nn.soft_moe import SoftMoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="images (default: 256 on CUDA, 8 on the CPU)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = setup_device(device)
    cuda = device.type == "cuda"
    # B/16 at 224 px: 196 tokens of 768, 128 experts of hidden 3072, 1 slot each; the CPU shape is small
    batch, tokens, dim, hidden, experts = ((args.batch or 256), 196, 768, 3072, 128) if cuda else \
        ((args.batch or 8), 49, 128, 512, 16)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    plain = SoftMoE(dim, experts, hidden, slots_per_expert=1, device=device)
    placed = copy.deepcopy(plain)
    place_experts(placed, init_device_mesh(device.type, (1,)))
    x = torch.randn(batch, tokens, dim, device=device, requires_grad=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step(layer):
        def run():
            with autocast:
                out = layer(x)
            out.float().square().mean().backward()
        return run

    rows = []
    for label, layer in (("plain layer", plain), ("expert-parallel path, E = 1", placed)):
        ms, peak = time_step(step(layer), device, args.warmup, args.iters)
        rows.append((label, ms, peak))
    print(f"Soft MoE layer forward+backward on {name}: batch {batch}, {tokens} tokens of {dim}, {experts} "
          f"experts (hidden {hidden}), {'bf16 autocast' if cuda else 'fp32'}, median of {args.iters}")
    print(f"{'':30} {'ms':>9} {'peak MiB':>9} {'/ plain':>8}")
    for label, ms, peak in rows:
        print(f"{label:30} {ms:9.2f} {peak if peak is not None else float('nan'):9.0f} {ms / rows[0][1]:8.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
