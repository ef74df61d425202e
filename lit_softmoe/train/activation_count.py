"""What a training step keeps for backward, counted per block without a GPU and without memory.

The memory plan (`train.memory_plan`) needs the bytes autograd saves for backward at the run's batch
and precision. They are counted, not guessed: the model runs one forward (and loss) on tensors
without data, and `torch.autograd.graph.saved_tensors_hooks` sums the storages the backward would
keep, each once (views share one); a parameter saved for backward is a weight, not an activation,
and is left out. Counted at two batches, each part is `fixed + per_sample · batch`: the fixed part
is the weights cast to the compute dtype for the matmuls (autocast's casts, Soft MoE's explicit
ones), which backward keeps too.

Three things make the count a GPU's:
- The tensors are FakeTensors that say they are on CUDA (`FakeTensorMode`: meta storage, CUDA
  dispatch keys), not plain meta tensors: autocast has no rules for the meta device (a meta forward
  under autocast runs in fp32), while CUDA's autocast casts fake CUDA tensors as it casts real ones.
  `torch.autocast` itself refuses to switch on without a GPU, so `_cuda_autocast` sets the
  thread-local switches it would set.
- Attention runs as on a GPU of compute capability 8.0 or more. Without a GPU, SDPA can only choose
  its math path, which keeps the (b, h, m, m) attention matrix; the GPU chooses a fused kernel that
  keeps q, k, v, the output and one log-sum-exp per query: flash attention for fp16/bf16 without a
  mask, the memory-efficient kernel otherwise. `_GpuAttention` calls those kernels' ops
  (their meta implementations) instead.
- Each saved tensor is charged to the block running when it was first saved (a block: an entry of
  the model's largest ModuleList, the unit `set_grad_checkpointing` recomputes), and each block's
  input is measured, so the plan can say what gradient checkpointing keeps: the block inputs, plus
  one block recomputed in backward.

A forward without a graph (a locked tower's) keeps nothing for backward; what it needs is the most
its tensors hold at once, counted by `count_peak_bytes` with `LiveBytes`: the bytes of the tensors
alive after each op, as CUDA's caching allocator counts them (`torch.cuda.memory_allocated`), here
on fake CUDA tensors.

torch.compile fuses elementwise chains and recomputes cheap ones in backward: a compiled step
usually keeps less than this eager count.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# A step: (model, batch) → a scalar whose graph holds what backward needs; it makes its inputs on
# "cuda".
Step = Callable[[nn.Module, int], torch.Tensor]
_FIT_BATCH = 8


@dataclass(frozen=True)
class Bytes:
    """Bytes that grow with the batch: `fixed + per_sample · batch`."""
    fixed: int
    per_sample: int

    def at(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch

    @classmethod
    def fit(cls, at_b: int, at_2b: int, b: int) -> "Bytes":
        """The line through the counts at batches b and 2b."""
        per_sample = (at_2b - at_b) // b
        return cls(fixed=at_b - per_sample * b, per_sample=per_sample)


@dataclass(frozen=True)
class SavedBytes:
    """What one forward (+ loss) keeps for backward, by part of the model."""
    stem: Bytes  # before the first block (patch or token embedding)
    blocks: tuple[Bytes, ...]  # inside each block
    # each block's input: what checkpointing keeps in the block's place
    block_inputs: tuple[Bytes, ...]
    head: Bytes  # after the last block (final norm, pooling, head, loss)

    def kept(self, batch: int, grad_checkpointing: bool = False, blocks_fixed: bool = True) -> int:
        """Bytes kept at `batch` samples. With checkpointing, each block keeps its input only, and
        backward recomputes one block at a time (the largest one's bytes). `blocks_fixed=False`
        leaves the blocks' fixed parts out (sharded weights arrive in the compute dtype: nothing is
        cast, see `memory_plan`)."""
        blocks = [block.at(batch) if blocks_fixed else block.per_sample * batch
                  for block in self.blocks]
        if grad_checkpointing:
            inside = sum(i.at(batch) for i in self.block_inputs) + max(blocks, default=0)
        else:
            inside = sum(blocks)
        return self.stem.at(batch) + inside + self.head.at(batch)


@dataclass(frozen=True)
class PairBytes:
    """Bytes a contrastive loss keeps: `fixed + per_row · N + per_pair · B · N` for B local rows
    against N."""
    fixed: int
    per_row: int
    per_pair: int

    def at(self, rows: int, columns: int) -> int:
        return self.fixed + self.per_row * columns + self.per_pair * rows * columns


def largest_module_list(model: nn.Module) -> nn.ModuleList:
    """The blocks: the ModuleList (or a timm ViT's Sequential) holding most of the model's
    parameters (a ViT's `blocks`, open_clip's `resblocks`, a Hugging Face encoder's `layer`), what
    `set_grad_checkpointing` wraps one by one."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=nn.ModuleList())


def count_saved_bytes(model: nn.Module, step: Step, dtype: torch.dtype | None,
                      blocks: list[list[nn.Module]] | None = None) -> SavedBytes:
    """What `step(model, batch)` keeps for backward, by part, under CUDA autocast to `dtype`
    (None: fp32).

    `model`: built on the meta device (no weights allocated, no init), its trainable parameters with
    requires_grad and the rest without; it moves to the fake GPU here, so it is spent after the
    count. `blocks`: the modules of each block, in the order they run (a timm tower's layers,
    `models.tower_layers`); None: each entry of the model's largest ModuleList."""
    blocks = blocks if blocks is not None else [[block] for block in largest_module_list(model)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        # At 8 and 16 rather than 1 and 2 (shapes cost nothing): the sparse routers round their
        # capacity up to a multiple of 4, which a larger batch makes a smaller part of the slope.
        at_8, at_16 = (_count(model, step, batch, dtype, blocks)
                       for batch in (_FIT_BATCH, 2 * _FIT_BATCH))
    (stem_8, blocks_8, inputs_8, head_8), (stem_16, blocks_16, inputs_16, head_16) = at_8, at_16
    return SavedBytes(stem=Bytes.fit(stem_8, stem_16, _FIT_BATCH),
                      blocks=tuple(Bytes.fit(a, b, _FIT_BATCH)
                                   for a, b in zip(blocks_8, blocks_16)),
                      block_inputs=tuple(Bytes.fit(a, b, _FIT_BATCH)
                                         for a, b in zip(inputs_8, inputs_16)),
                      head=Bytes.fit(head_8, head_16, _FIT_BATCH))


def count_peak_bytes(model: nn.Module, step: Step, dtype: torch.dtype | None) -> Bytes:
    """The most bytes `step(model, batch)` holds at once beyond the model's weights, run without a
    graph (`torch.no_grad`: a locked tower's forward) under CUDA autocast to `dtype`, its inputs
    included; fitted at batches 8 and 16 as `count_saved_bytes` is. `model`: on the meta device,
    spent after the count."""
    peaks = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        for batch in (_FIT_BATCH, 2 * _FIT_BATCH):
            live = LiveBytes(*model.parameters(), *model.buffers())
            weights = live.held
            with live, torch.no_grad(), _cuda_autocast(dtype), _GpuAttention():
                step(model, batch)
            peaks.append(live.peak - weights)
    return Bytes.fit(peaks[0], peaks[1], _FIT_BATCH)


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors alive, as CUDA's caching allocator counts them (each storage once,
    rounded up to its 512-byte blocks), and the most of them at once (`peak`): on any device, fake
    tensors too, for what `torch.cuda.memory_allocated` and `max_memory_allocated` say on a GPU.

    It sees the tensors the ops it runs make (within `with live:`), and those given to `track`: a
    view of a tensor made before (a weight's transpose in a matmul) would otherwise be counted as
    new memory."""

    def __init__(self, *tensors: torch.Tensor):
        super().__init__()
        self._storages: dict[StorageWeakRef, int] = {}
        self.track(*tensors)
        self.peak = self.held

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            self._storages.setdefault(StorageWeakRef(storage), -(-storage.nbytes() // 512) * 512)

    @property
    def held(self) -> int:
        """Bytes alive now (a freed storage drops out)."""
        for key in [key for key in self._storages if key.expired()]:
            del self._storages[key]
        return sum(self._storages.values())

    def reset_peak(self) -> None:
        self.peak = self.held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        self.peak = max(self.peak, self.held)
        return out


def count_pair_bytes(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dim: int,
                     dtype: torch.dtype | None) -> PairBytes:
    """What a contrastive `loss(zimg (n, dim), ztxt (n, dim))` keeps for backward, counted at n =
    1, 2, 4 (n × n logits) and solved for its fixed, per-row and per-pair parts."""
    def step(_, n: int) -> torch.Tensor:
        zimg, ztxt = (torch.empty(n, dim, device="cuda", requires_grad=True) for _ in range(2))
        return loss(zimg, ztxt)

    with FakeTensorMode():
        # no blocks: all in the stem
        c1, c2, c4 = (_count(nn.Module(), step, n, dtype)[0] for n in (1, 2, 4))
    # c(n) = fixed + per_row·n + per_pair·n²:
    # c2 - c1 = per_row + 3·per_pair, c4 - c2 = 2·per_row + 12·per_pair
    per_pair = (c4 - 3 * c2 + 2 * c1) // 6
    per_row = c2 - c1 - 3 * per_pair
    return PairBytes(fixed=c1 - per_row - per_pair, per_row=per_row, per_pair=per_pair)


def _count(model: nn.Module, step: Step, batch: int, dtype: torch.dtype | None,
           blocks: list[list[nn.Module]] = ()):
    """(stem, [block], [block input], head) bytes kept by one `step` at `batch`; a block runs its
    modules in turn, and its input is its first module's."""
    weights = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    seen: set[StorageWeakRef] = set()
    where = ["stem"]  # the part running now: "stem", a block index, then "head"
    saved = {"stem": 0, "head": 0, **{i: 0 for i in range(len(blocks))}}
    inputs = [0] * len(blocks)

    def enter(i):
        def hook(_, args):
            if not inputs[i]:  # the block's first module
                inputs[i] = args[0].untyped_storage().nbytes()
            where[0] = i
        return hook

    def leave(*_):
        where[0] = "head"

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in weights and key not in seen:
            seen.add(key)
            saved[where[0]] += storage.nbytes()
        # kept alive by the graph until the count ends: no storage is freed and its id reused
        return t

    handles = [h for i, modules in enumerate(blocks) for module in modules
               for h in (module.register_forward_pre_hook(enter(i)),
                         module.register_forward_hook(leave))]
    try:
        with (_cuda_autocast(dtype), _GpuAttention(),
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            loss = step(model, batch)
        del loss
    finally:
        for handle in handles:
            handle.remove()
    return saved["stem"], [saved[i] for i in range(len(blocks))], inputs, saved["head"]


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype | None):
    """CUDA autocast to `dtype` (None: off), also without a GPU: the switches `torch.autocast` sets
    on entry."""
    if dtype is None:
        yield
        return
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


class _GpuAttention(TorchFunctionMode):
    """SDPA (and nn.MultiheadAttention's forward, which calls it out of this mode's reach) through
    the fused kernel a GPU would choose, so that what attention keeps for backward is the GPU's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        if func is F.multi_head_attention_forward and _is_plain_self_attention(*args, **kwargs):
            return _multi_head_self_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """SDPA as flash attention (fp16/bf16, no mask, head_dim ≤ 256) or the memory-efficient kernel
    (otherwise), on q, k, v cast as autocast casts SDPA's inputs."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if attn_mask is None and dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
                                                                  scale=scale)[0]
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # SDPA's own conversion: -inf where attention is masked
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype,
                                    device=q.device).masked_fill(~attn_mask, -torch.inf)
        bias = attn_mask.to(dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    needs_grad = any(t.requires_grad for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, needs_grad,
                                                                  dropout_p, is_causal,
                                                                  scale=scale)[0]


def _is_plain_self_attention(query, key, value, *args, need_weights=True, key_padding_mask=None,
                             use_separate_proj_weight=False, bias_k=None, add_zero_attn=False,
                             **kwargs) -> bool:
    """The call open_clip's text blocks make: self-attention, one packed projection, no padding
    mask, no weights returned; other calls keep torch's own path (its math attention: more bytes,
    not fewer)."""
    positional = dict(zip(("embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
                           "bias_k", "bias_v", "add_zero_attn"), args))
    return (query is key is value and not need_weights and key_padding_mask is None
            and not use_separate_proj_weight and positional.get("bias_k", bias_k) is None
            and not positional.get("add_zero_attn", add_zero_attn))


def _multi_head_self_attention(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                               in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p,
                               out_proj_weight, out_proj_bias, training=True, key_padding_mask=None,
                               need_weights=True, attn_mask=None, is_causal=False, **_):
    """`F.multi_head_attention_forward`'s SDPA path for plain self-attention, step by step as torch
    takes it (the same projections, copies and views), with the fused attention above. query
    (L, B, E)."""
    length, batch, width = query.shape
    head_dim = width // num_heads
    qkv = F.linear(query, in_proj_weight, in_proj_bias)  # (L, B, 3E)
    # (3, L, B, E)
    qkv = qkv.unflatten(-1, (3, width)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = (t.view(length, batch * num_heads, head_dim).transpose(0, 1)
               .view(batch, num_heads, length, head_dim)
               for t in qkv)  # each (B, h, L, hd)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.view(1, 1, length, length)
    # (B, h, L, hd)
    x = _fused_attention(q, k, v, attn_mask, dropout_p if training else 0.0, is_causal)
    x = x.permute(2, 0, 1, 3).contiguous().view(batch * length, width)  # (L·B, E)
    return F.linear(x, out_proj_weight, out_proj_bias).view(length, batch, width), None
