"""What every recipe sets up first: threads, precision and the accelerate object."""
from __future__ import annotations

import torch
from accelerate import Accelerator


def create_accelerator(precision: str = "auto", threads: int = 0) -> Accelerator:
    """`precision`: auto (bf16 on GPUs that support it, else fp32) | fp32 | bf16."""
    if threads > 0:
        torch.set_num_threads(threads)
    if precision == "auto":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        mixed_precision = "bf16" if bf16 else "no"
    else:
        mixed_precision = "bf16" if precision == "bf16" else "no"
    # cpu=True on GPU-less machines: accelerate only forms a multi-process (gloo) group on the CPU
    # when told so, e.g. under `torchrun --nproc_per_node 2`.
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
