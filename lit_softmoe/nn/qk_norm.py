"""qk-norm for inference: the LayerNorms of queries and keys read straight from the fused qkv
projection, one Triton kernel launch each for q and k.

Why a kernel: the paper's ViTs put a LayerNorm on every head's queries and keys, i.e. on rows only
`head_dim` (64) wide, and PyTorch's LayerNorm kernel is slow on rows that narrow. q and k are also
strided views into qkv, so `F.layer_norm` first copies each of them: in eager inference the qk
LayerNorms take a large share of the forward (docs/benchmarks.md). The op only moves memory: one
read of q and k and one write of the result, which this kernel does, `BLOCK_ROWS` rows of `head_dim`
per program, statistics in fp32.

Where it runs: CUDA tensors outside autograd (`torch.inference_mode()` / `no_grad`, or locked
weights on an input that needs no grad) — the locked tower in LiT, `embed`, the eval suite, exports
run in PyTorch. Training and `torch.compile` (inductor fuses the LayerNorm on its own) keep the
PyTorch path, and so does everything on the CPU. `LIT_SOFTMOE_FUSED_QK_NORM=0` turns the kernel
off (for A/B benchmarks, or a GPU it misbehaves on). Where the kernel cannot be built or launched
(Triton needs a C compiler the first time), `fused_qk_norm` warns once and the process keeps
PyTorch's path.

    qkv (b, m, 3·d), d = heads · head_dim, per token laid out (3, heads, head_dim)
        → q, k: (b, m, heads, head_dim) contiguous, LayerNorm'd over head_dim with their own affine
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lit_softmoe.errors import first_line

try:  # Triton ships with torch's CUDA wheels; without it everything runs in PyTorch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENV_SWITCH = "LIT_SOFTMOE_FUSED_QK_NORM"
# Why the kernel could not run in this process, once it failed to: PyTorch's path from then on.
_kernel_error: str | None = None


def fused_qk_norm_enabled() -> bool:
    """True when Triton is importable, the kernel has not failed in this process, and
    `LIT_SOFTMOE_FUSED_QK_NORM` is not "0" (read on every call)."""
    return triton is not None and _kernel_error is None and os.environ.get(ENV_SWITCH, "1") != "0"


if triton is not None:
    @triton.jit
    def _head_layer_norm_kernel(qkv_ptr, out_ptr, weight_ptr, bias_ptr, rows, heads, head_dim,
                                part_offset, token_stride, eps, HAS_BIAS: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        # One program: BLOCK_ROWS rows, a row = one (token, head) pair of q (part 0) or k (part 1).
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, BLOCK_DIM)
        row_ok, col_ok = row < rows, col < head_dim
        mask = row_ok[:, None] & col_ok[None, :]
        row64 = row.to(tl.int64)  # offsets past 2**31 at large batches
        token, head = row64 // heads, row64 % heads
        src = token * token_stride + part_offset + head * head_dim  # start of the row inside qkv
        x = tl.load(qkv_ptr + src[:, None] + col[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / head_dim
        centred = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / head_dim + eps)
        weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
        y = centred * rstd[:, None] * weight[None, :]
        if HAS_BIAS:  # flax's qk LayerNorm, as our towers use it, has none
            y += tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dst = row64 * head_dim  # the output is (tokens, heads, head_dim), contiguous
        tl.store(out_ptr + dst[:, None] + col[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def head_layer_norm(qkv: torch.Tensor, part: int, heads: int, weight: torch.Tensor,
                    bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over head_dim of q (part 0) or k (part 1) inside `qkv`, with the Triton kernel.

    qkv: (b, m, 3·d), contiguous, any float dtype; weight, bias: (head_dim,), bias may be None.
    Returns (b, m, heads, head_dim) in qkv's dtype, statistics computed in fp32 (as PyTorch's kernel
    does). Runs wherever Triton does (a CUDA GPU, or the CPU under `TRITON_INTERPRET=1` for tests).
    """
    if triton is None:
        raise RuntimeError("head_layer_norm needs Triton; use F.layer_norm instead")
    b, m, three_d = qkv.shape
    width = three_d // 3
    head_dim = width // heads
    if three_d != 3 * heads * head_dim or not qkv.is_contiguous():
        raise ValueError("expected a contiguous (b, m, 3·heads·head_dim) qkv, "
                         f"got shape {tuple(qkv.shape)}")
    out = torch.empty(b, m, heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    rows = b * m * heads
    block_dim = triton.next_power_of_2(head_dim)
    block_rows = max(1, min(64, 4096 // block_dim))  # ~4k elements a program: 64 rows of 64
    grid = (triton.cdiv(rows, block_rows),)
    _head_layer_norm_kernel[grid](qkv, out, weight, weight if bias is None else bias, rows, heads,
                                  head_dim, part * width, three_d, eps, HAS_BIAS=bias is not None,
                                  BLOCK_ROWS=block_rows, BLOCK_DIM=block_dim)
    return out


def fused_qk_norm(qkv: torch.Tensor, heads: int, q_norm: nn.LayerNorm, k_norm: nn.LayerNorm):
    """(q, k), each (b, m, heads, head_dim), LayerNorm'd by the kernel; None when the kernel cannot
    run here (Triton found no C compiler, no driver, ...): warned once, and later calls take
    PyTorch's path."""
    global _kernel_error
    try:
        return (head_layer_norm(qkv, 0, heads, q_norm.weight, q_norm.bias, q_norm.eps),
                head_layer_norm(qkv, 1, heads, k_norm.weight, k_norm.bias, k_norm.eps))
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        # the kernel's build or launch, not the inputs (can_fuse_qk_norm checked those)
        _kernel_error = f"{type(err).__name__}: {first_line(err)}"
        warnings.warn(f"the Triton qk-norm kernel cannot run here ({_kernel_error}); using "
                      f"PyTorch's LayerNorm (set {ENV_SWITCH}=0 to skip the attempt)",
                      RuntimeWarning, stacklevel=2)
        return None


def can_fuse_qk_norm(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module) -> bool:
    """Whether `Attention` may take the kernel: a CUDA qkv outside autograd and outside
    torch.compile."""
    norms = (q_norm, k_norm)
    if not all(isinstance(n, nn.LayerNorm) and n.elementwise_affine for n in norms):
        return False
    if (not qkv.is_cuda or not qkv.is_contiguous() or torch.compiler.is_compiling()
            or not fused_qk_norm_enabled()):
        return False
    if is_fake(qkv):  # the memory plan's count (`train.activation_count`): no data to launch on
        return False
    if torch.is_grad_enabled() and (qkv.requires_grad or any(p.requires_grad for n in norms
                                                             for p in n.parameters())):
        return False  # training: the kernel has no backward
    return qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)
