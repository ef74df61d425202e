"""The memory plan (`train.memory_plan`, `train.activation_count`): the meta-device count of what backward keeps
equals a real forward's, byte for byte but for what the GPU's attention kernel keeps beyond the CPU's; states are
16 bytes a parameter, divided under FSDP; the levers change the plan as they should; the paper's B/16 config does
not fit one 80 GB GPU and the verdict names the levers; `--plan` prints and exits 0. Against real training steps
built as the recipes build them: the weights, gradients, optimizer and inputs rows are their bytes exactly; the
count is what the forward leaves for backward and the total is the step's peak, within 15%, on a GPU by CUDA's
counts (`-k cuda`, skipped without one) and on the CPU in fp32 by `LiveBytes`."""
from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from cli_errors import one_line_error
from lit_softmoe.cli import main
from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.nn import qk_norm
from lit_softmoe.train import lit as lit_recipe
from lit_softmoe.train.accumulation import contrastive_accumulation, split_batch
from lit_softmoe.train.activation_count import LiveBytes, count_pair_bytes, count_peak_bytes, count_saved_bytes
from lit_softmoe.train.loss import contrastive_loss
from lit_softmoe.train.memory_plan import (
    GPU_FILL,
    Levers,
    MemoryPlan,
    levers_that_fit,
    plan_memory,
    plan_report,
)
from lit_softmoe.train.model_count import (
    ModelCount,
    _pooled_step,
    count_config,
    count_lit,
    count_pretrain,
)
from lit_softmoe.train.optim import create_optimizer
from lit_softmoe.train.pretrain import _loss_fn as pretrain_loss
from lit_softmoe.utils.device import autocast_dtype, inference_dtype
from towers import count_params, tiny

GIB = 1 << 30
MIB = 1 << 20


def _classify(tower, batch: int, device: str = "cuda") -> torch.Tensor:
    cfg = tower.cfg
    logits = tower(torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device=device))
    return F.cross_entropy(logits, torch.zeros(batch, dtype=torch.long, device=device))


def _real_saved_bytes(run) -> int:
    """Bytes of the storages a real CPU forward saves for backward, each once (by address), weights left out."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model, loss = run()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in weights)


def _gpu_attention_extra(tower, batch: int) -> int:
    """What the GPU's memory-efficient attention (fp32) keeps beyond the CPU's flash attention, per block: its
    log-sum-exp is padded to 32 queries (b, h, 32⌈m/32⌉ fp32 instead of b, h, m), plus its two 8-byte RNG
    tensors (seed and offset)."""
    cfg = tower.cfg
    m = cfg.num_patches
    return cfg.depth * (batch * cfg.num_heads * (32 * math.ceil(m / 32) - m) * 4 + 16)


@pytest.mark.parametrize("name", ["soft-tiny-p4-16e", "vit-tiny-p4", "soft-test-4e"])
def test_the_meta_count_equals_a_real_forwards_saved_tensors(name):
    # fp32 on both sides: CPU autocast has other rules than CUDA's. The real count runs on real tensors with
    # real addresses; the meta count was fitted at batches 8 and 16 and is checked at 3. (Not the sparse routers: their
    # capacity rounds up to a multiple of 4, so their bytes are linear in the batch only up to that.)
    batch = 3
    torch.manual_seed(0)
    real = _real_saved_bytes(lambda: (tower := create_image_tower(name, num_classes=10),
                                      _classify(tower, batch, device="cpu")))
    meta = count_saved_bytes(create_image_tower(name, num_classes=10, device="meta"), _classify, None)
    assert meta.kept(batch) == real + _gpu_attention_extra(create_image_tower(name, device="meta"), batch)


@pytest.mark.parametrize("name", ["soft-tiny-p4-16e", "vit-tiny-p4"])
def test_a_locked_towers_forward_peak_is_counted_as_a_real_forward_holds_it(name):
    # What a forward without a graph holds at once (a locked tower's in LiT), counted on fake CUDA tensors at
    # batches 8 and 16, against a real fp32 CPU forward's tensors alive (`LiveBytes`) at batch 3. Rounding
    # to the allocator's 512-byte blocks is all that may differ.
    batch = 3
    counted = count_peak_bytes(create_image_tower(name, device="meta"), _pooled_step, None).at(batch)
    torch.manual_seed(0)
    tower = create_image_tower(name).eval()
    live = LiveBytes(*tower.parameters(), *tower.buffers())
    weights = live.held
    with live, torch.no_grad():
        tower.forward_pooled(torch.randn(batch, 1, 28, 28))
    assert abs(counted - (live.peak - weights)) <= 512 * 8


def test_the_parts_add_up_and_checkpointing_keeps_the_block_inputs_and_one_block():
    saved = count_saved_bytes(create_image_tower("soft-tiny-p4-16e", num_classes=10, device="meta"), _classify, None)
    cfg = create_image_tower("soft-tiny-p4-16e", device="meta").cfg
    b = 8
    assert saved.kept(b) == saved.stem.at(b) + sum(x.at(b) for x in saved.blocks) + saved.head.at(b)
    # Each block's input is the fp32 residual stream (b, m, d).
    assert all(x.at(b) == b * cfg.num_patches * cfg.width * 4 for x in saved.block_inputs)
    assert saved.kept(b, grad_checkpointing=True) == (saved.stem.at(b) + sum(x.at(b) for x in saved.block_inputs)
                                                      + max(x.at(b) for x in saved.blocks) + saved.head.at(b))
    assert saved.kept(b, grad_checkpointing=True) < saved.kept(b) / 2


def test_under_bf16_the_fixed_part_is_the_weights_cast_for_the_matmuls():
    # Soft MoE casts its experts' weights to bf16 for the batched matmuls, and backward keeps the casts:
    # 2 bytes a parameter of w1 and w2, whatever the batch.
    tower = create_image_tower("soft-tiny-p4-16e", device="meta")
    saved = count_saved_bytes(create_image_tower("soft-tiny-p4-16e", device="meta"), _classify_pooled, torch.bfloat16)
    experts = [block.mlp.experts for block in tower.blocks if hasattr(block.mlp, "experts")]
    expert_kernels = sum(e.w1.numel() + e.w2.numel() for e in experts)
    moe_blocks = [saved.blocks[i] for i in tower.cfg.moe_layers]
    assert all(block.fixed >= 2 * expert_kernels // len(experts) for block in moe_blocks)


def _classify_pooled(tower, batch):
    cfg = tower.cfg
    return tower(torch.empty(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device="cuda")).sum()


def test_the_contrastive_loss_is_counted_per_pair():
    # Counted at n = 1, 2, 4 (fake), checked against a real fp32 loss at n = 5: two (n, n) fp32 log-softmaxes
    # are 8 bytes a pair.
    pairs = count_pair_bytes(lambda a, b: contrastive_loss(a, b, a.new_tensor(10.0, requires_grad=True),
                                                           gather=False), 16, None)
    assert pairs.per_pair == 8
    n = 5

    def run():
        module = torch.nn.Linear(1, 1)  # no weight of the loss's own: the embeddings are the leaves
        zimg, ztxt = (torch.randn(n, 16, requires_grad=True) for _ in range(2))
        return module, contrastive_loss(zimg, ztxt, torch.tensor(10.0, requires_grad=True), gather=False)
    assert pairs.at(n, n) == _real_saved_bytes(run)


def test_states_are_16_bytes_a_parameter_divided_under_fsdp():
    count = count_pretrain("soft-test-4e", {}, 10, "fp32")
    params = count_params(create_image_tower("soft-test-4e", num_classes=10, device="meta"))
    assert count.trainable == params

    def states(gpus, sharding):
        plan = plan_memory(count, 64, gpus, Levers(sharding=sharding))
        return plan.weights + plan.gradients + plan.optimizer
    assert states(1, "none") == 16 * params
    assert states(4, "fsdp") == 16 * params // 4
    assert states(4, "none") == 20 * params  # DDP's all-reduce buckets: a second copy of the gradients


def test_accumulation_plans_the_micro_batch_and_fsdp_gathers_two_blocks():
    count = count_pretrain("soft-tiny-p4-16e", {}, 10, "bf16")
    whole, accumulated = (plan_memory(count, 256, 2, Levers(accum_steps=a)) for a in (1, 4))
    assert (whole.micro_batch, accumulated.micro_batch) == (128, 32)
    assert whole.activations == count.saved.kept(128) and accumulated.activations == count.saved.kept(32)
    sharded = plan_memory(count, 256, 2, Levers(sharding="fsdp"))
    # The casts kept per block give way to two gathered blocks in bf16.
    assert sharded.activations == count.saved.kept(128, blocks_fixed=False) + 2 * count.largest_block * 2


def test_lit_plans_the_text_side_the_locked_tower_and_the_logits(tmp_path, monkeypatch):
    tower = tiny("soft-tiny-p7-16e")
    save_tower(tmp_path / "tower", tower, extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    cfg = load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={tmp_path / 'tower'}", "precision=bf16"])
    monkeypatch.setattr(qk_norm, "_kernel_error", None)
    count = count_lit(cfg)
    # The locked tower's forward ran on fake CUDA tensors without trying the Triton qk-norm kernel on them:
    # a failed try would turn the kernel off for the run whose plan this is.
    assert qk_norm._kernel_error is None
    plan = plan_memory(count, 1024, 4, Levers())
    assert count.frozen_bytes == 2 * count_params(tower)  # locked: held in bf16, no gradient, no moments
    assert count.frozen_forward > 0  # data.train is not found here: planned on images, the tower runs
    assert plan.loss_logits == count.loss.at(256, 1024) and count.loss.per_pair > 0
    assert plan.activations == max(count.saved.kept(256), count.frozen_forward * 256)
    unlocked = count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={tmp_path / 'tower'}",
                                                                    "unlocked_blocks=2"]))
    last_two = [sum(p.numel() for p in block.parameters()) for block in tower.blocks[-2:]]
    # The final norm is part of the last block, as timm's group_matcher numbers layers (MATCH_PREV_GROUP).
    last_two[-1] += sum(p.numel() for p in tower.norm.parameters())
    assert unlocked.trainable == count.trainable + sum(last_two)
    assert len(unlocked.saved.blocks) == len(count.saved.blocks) + 2
    # The tower runs first: its unlocked blocks come first in the order backward walks back through.
    assert unlocked.block_params == (*last_two, *count.block_params)
    assert len(count.block_params) == len(count.saved.blocks) and all(count.block_params)


def test_the_paper_b16_config_does_not_fit_one_80gb_gpu_and_the_verdict_names_the_levers():
    cfg = load_config(PretrainConfig, "pretrain/soft-b16-128e-imagenet1k")
    tic = time.perf_counter()
    report, fits = plan_report(cfg, 1, 80 * GIB)
    assert time.perf_counter() - tic < 60  # the 3.7B-parameter tower counts in seconds on the meta device
    assert not fits
    verdict = next(line for line in report.splitlines() if line.startswith("does not fit: set "))
    assert "accum_steps=" in verdict and "grad_checkpointing=true" in verdict


def test_on_8_gpus_the_b16_config_fits_with_fsdp():
    cfg = load_config(PretrainConfig, "pretrain/soft-b16-128e-imagenet1k")
    count = count_pretrain(cfg.tower.name, {}, 1000, cfg.precision)
    assert not plan_memory(count, cfg.batch_size, 8, Levers()).fits(80 * GIB)  # as shipped: DDP, 55 GiB of states
    fitting = levers_that_fit(count, cfg.batch_size, 8, 80 * GIB, Levers())
    assert fitting[0] == Levers(sharding="fsdp")
    assert plan_memory(count, cfg.batch_size, 8, fitting[0]).total < GPU_FILL * 80 * GIB


def test_a_run_whose_plan_does_not_fit_this_gpu_is_refused_in_one_line(monkeypatch):
    import lit_softmoe.train.memory_plan as memory_plan
    cfg = load_config(PretrainConfig, "pretrain/soft-b16-128e-imagenet1k", ["sharding=none"])  # shipped: fsdp
    if not torch.cuda.is_available():
        memory_plan.check_plan_fits(cfg)  # no GPU here: nothing to check against
    monkeypatch.setattr(memory_plan, "visible_gpu_bytes", lambda: 80 * GIB)  # as on an 80 GB GPU
    monkeypatch.setenv("WORLD_SIZE", "8")
    refusal = (r"^this run needs about 99\.\d GiB per GPU, more than 90% of this GPU's 80\.0 GiB: set sharding=fsdp "
               r"\(42\.\d GiB per GPU\); or grad_checkpointing=true accum_steps=4 \(71\.\d GiB per GPU\) "
               r"\(`lit-softmoe pretrain --plan` shows the plan; LIT_SOFTMOE_IGNORE_PLAN=1 runs it anyway\)$")
    with pytest.raises(UserError, match=refusal):
        memory_plan.check_plan_fits(cfg)
    memory_plan.check_plan_fits(load_config(PretrainConfig, "pretrain/soft-b16-128e-imagenet1k", ["sharding=fsdp"]))
    monkeypatch.setenv("LIT_SOFTMOE_IGNORE_PLAN", "1")
    memory_plan.check_plan_fits(cfg)


def test_plan_prints_and_exits_0(capsys):
    assert main(["pretrain", "--config", "pretrain/soft-s16-128e-imagenet1k", "--plan", "--plan-gpus", "8",
                 "--plan-gpu", "80GB"]) == 0
    out = capsys.readouterr().out
    for row in ("weights", "gradients", "optimizer (AdamW)", "activations", "total", "GPU memory"):
        assert f"\n  {row}" in out or f"\n{row}" in out, row
    assert "batch 4,096 on 8 GPUs: micro-batch 512 per GPU, bf16" in out
    assert next(line for line in out.splitlines() if line.startswith("fits")).split() == ["fits", "yes"]


def test_train_plan_prints_and_exits_0(tmp_path, capsys):
    save_tower(tmp_path / "tower", tiny("soft-tiny-p7-16e"),
               extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    assert main(["train", "--config", "lit/fmnist-tiny", "--plan", f"image_tower={tmp_path / 'tower'}"]) == 0
    out = capsys.readouterr().out
    assert "loss logits" in out and "batch 256 on 1 GPU: micro-batch 256 per GPU" in out
    assert not (tmp_path / "runs").exists()


def test_a_gpu_size_without_its_unit_is_refused(capsys):
    # `--plan-gpu 80` was read as 80 bytes, and every run planned not to fit.
    with pytest.raises(SystemExit) as exited:  # argparse's refusal: its usage line, then the error's
        main(["pretrain", "--config", "pretrain/fmnist-soft-tiny", "--plan", "--plan-gpu", "80"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and error.endswith("argument --plan-gpu: give the unit: 80GB (a bare 80 is bytes)")
    assert main(["pretrain", "--config", "pretrain/fmnist-soft-tiny", "--plan", "--plan-gpu", "80GB"]) == 0


def test_plan_flags_without_plan_are_refused(capsys):
    line = one_line_error(capsys, ["pretrain", "--config", "pretrain/fmnist-soft-tiny", "--plan-gpus", "8"])
    assert "--plan-gpus and --plan-gpu go with --plan" in line


# ---- the plan against a real training step -------------------------------------------------------------------
# A step built as the recipes build it (the product's tower, text tower, LiT model, optimizer, loss and clipping),
# eager, measured on its second run (the first makes AdamW's moments and CUDA's cuBLAS workspaces, which a run
# holds from then on): what its forward and loss leave for backward against the count, and the most it holds
# at once over forward, backward and the optimizer step against the plan's total. On a GPU these are CUDA's
# caching allocator's counts (`torch.cuda.memory_allocated`, `max_memory_allocated`); on the CPU `LiveBytes`
# counts the tensors alive the same way, so the same code runs (in fp32, at small shapes) without a GPU.
# Outside both: the CUDA context and the allocator's fragmentation (reserved but not allocated), which the plan
# leaves to GPU_FILL; inside the GPU's peak and not the plan's: cuBLAS's workspaces and backward's transients.


class _CudaMemory(contextlib.nullcontext):
    """CUDA's caching allocator's counts, with `LiveBytes`'s interface, from what it holds when made (what an
    earlier test left is no part of the step)."""

    def __init__(self):
        super().__init__()
        gc.collect()
        self.base = torch.cuda.memory_allocated()

    @property
    def held(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.base

    @property
    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


@dataclass
class _Step:
    """One training step as the recipe runs it, and what the plan says of it."""
    run: Callable[[Callable[[torch.Tensor], None]], None]  # runs the step, backward through the callable given
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, ...]  # on the device, as the loop holds it through the step
    count: ModelCount
    plan: MemoryPlan
    kept: int  # what the count says the forward and loss leave for backward


def _autocast(precision: str, device: torch.device):
    """`accelerator.autocast()` of the recipes: torch's, to the precision's dtype (none for fp32)."""
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _pretrain_step(config: str, overrides: list[str], device: torch.device, tmp_path) -> _Step:
    """`lit-softmoe pretrain`'s step (pretrain.py's loop without mixup), on 1,000 classes: the plan assumes as
    many for a data.train it cannot read."""
    cfg = load_config(PretrainConfig, config, [*overrides, f"data.train={tmp_path / 'absent'}"])
    count, what = count_config(cfg)
    assert "1,000 classes" in what
    tower = create_image_tower(cfg.tower.name, num_classes=1000, device=device, **cfg.tower.options)
    tower.set_grad_checkpointing(cfg.grad_checkpointing)
    optimizer = create_optimizer(tower, cfg.optim)
    shape = tower.cfg
    pixels = torch.randn(cfg.batch_size, shape.in_channels, shape.image_size, shape.image_size, device=device)
    labels = torch.randint(0, 1000, (cfg.batch_size,), device=device)

    def run(backward):
        for micro_pixels, micro_labels in split_batch((pixels, labels), cfg.accum_steps):
            with _autocast(cfg.precision, device):
                loss = pretrain_loss(cfg, tower(micro_pixels), micro_labels)
                loss = (loss + cfg.aux_loss_weight * tower.moe_aux_loss()) / cfg.accum_steps
            backward(loss)
        torch.nn.utils.clip_grad_norm_(tower.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    plan = plan_memory(count, cfg.batch_size, 1, Levers.of(cfg))
    return _Step(run, tower, optimizer, (pixels, labels), count, plan, _kept_after_forward(count, plan))


def _lit_step(tower_dir, overrides: list[str], device: torch.device, tmp_path) -> _Step:
    """`lit-softmoe train`'s step on images (lit.py's model, optimizer and loop body): the locked tower held in
    the dtype it runs in, the text tower trained, the contrastive loss over the batch."""
    cfg = load_config(LiTConfig, None, [f"image_tower={tower_dir}", f"data.train={tmp_path / 'images'}", *overrides])
    count, what = count_config(cfg)
    assert "on images" in what
    tower_dtype = inference_dtype(cfg.precision, device)
    model, _ = lit_recipe._setup_model(cfg, device, tower_dtype)
    model.hold_locked_image_in(tower_dtype)
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    optimizer = lit_recipe._setup_optimizer(cfg, model)
    model.to(device).train()
    shape = model.image_tower.cfg
    images = torch.randn(cfg.batch_size, shape.in_channels, shape.image_size, shape.image_size, device=device)
    text = torch.randint(0, cfg.text.vocab_size, (cfg.batch_size, cfg.text.context_length), device=device)

    def embed(micro_batch):
        with _autocast(cfg.precision, device):
            return model(*micro_batch)

    def loss_fn(*outputs):
        with _autocast(cfg.precision, device):
            return contrastive_loss(*outputs)

    def run(backward):
        contrastive_accumulation(embed, loss_fn, split_batch((images, text), cfg.accum_steps), backward=backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        model.clamp_logit_scale_()
        optimizer.zero_grad(set_to_none=True)

    plan = plan_memory(count, cfg.batch_size, 1, Levers.of(cfg))
    return _Step(run, model, optimizer, (images, text), count, plan, _kept_after_forward(count, plan))


def _kept_after_forward(count: ModelCount, plan: MemoryPlan) -> int:
    """What the count says one micro-batch's forward and loss leave for backward: with checkpointing, each
    block's input (none is recomputed yet)."""
    saved, micro = count.saved, plan.micro_batch
    if plan.levers.grad_checkpointing:
        return saved.stem.at(micro) + sum(i.at(micro) for i in saved.block_inputs) + saved.head.at(micro)
    return saved.kept(micro) + plan.loss_logits


def _measure(step: _Step, memory) -> tuple[int, int]:
    """(bytes the first micro-batch's forward and loss leave for backward, the most held at once over the step),
    on the step's second run; `memory`: `_CudaMemory()` or a `LiveBytes` tracking what exists before the step."""
    at = {}

    def backward(loss):
        at.setdefault("forward", memory.held)
        loss.backward()

    with memory:
        step.run(backward)
        at = {"start": memory.held}
        memory.reset_peak()
        step.run(backward)
        peak = memory.peak
    return at["forward"] - at["start"], peak


def _measured_ratios(name: str, step: _Step, memory) -> tuple[float, float]:
    """(counted / held after the forward, the plan's total / the step's peak), printed on one line first: the
    measurement, whatever the checks that follow say."""
    held, peak = _measure(step, memory)
    kept, total = step.kept, step.plan.total
    print(f"{name}: activations counted {kept / MIB:,.1f} MiB, held {held / MIB:,.1f} MiB (counted/held "
          f"{kept / held:.3f}); step peak {peak / MIB:,.1f} MiB, plan {total / MIB:,.1f} MiB "
          f"(plan/peak {total / peak:.3f})")
    return kept / held, total / peak


_CUDA_CASES = {  # bf16, the shapes of a GPU run
    "pretrain-soft-s16-128e-b32": ("pretrain", ["batch_size=32"]),
    "pretrain-soft-s16-128e-b128": ("pretrain", ["batch_size=128"]),
    "pretrain-vit-b16-b32": ("pretrain", ["tower.name=vit-b16", "batch_size=32"]),
    "pretrain-vit-b16-b128": ("pretrain", ["tower.name=vit-b16", "batch_size=128"]),
    # LiT's 16 tokens (the locked tower's forward is the larger part) and CLIP's 77 (the text tower's is)
    "lit-vit-b16-text512-16tokens-b256": ("lit", ["batch_size=256", "text.context_length=16"]),
    "lit-vit-b16-text512-77tokens-b64": ("lit", ["batch_size=64", "text.context_length=77"]),
}


@pytest.fixture(scope="module")
def vit_b16_tower_dir(tmp_path_factory):
    """A random vit-b16 tower folder on the GPU's side of the run (LiT loads it as `lit-softmoe train` does)."""
    tower_dir = tmp_path_factory.mktemp("lit-tower") / "tower"
    torch.manual_seed(0)
    save_tower(tower_dir, create_image_tower("vit-b16", device="cuda"),
               extra={"preprocess": {"image_size": 224, "mean": [0.5] * 3, "std": [0.5] * 3}})
    return tower_dir


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(_CUDA_CASES))
def test_the_plan_matches_what_cuda_holds(case, request, tmp_path):
    recipe, overrides = _CUDA_CASES[case]
    tower_dir = request.getfixturevalue("vit_b16_tower_dir") if recipe == "lit" else None
    torch.manual_seed(0)
    device = torch.device("cuda")
    memory = _CudaMemory()  # before the step is built: its weights are part of what it holds
    if recipe == "pretrain":
        step = _pretrain_step("pretrain/soft-s16-128e-imagenet1k", [*overrides, "precision=bf16"], device, tmp_path)
    else:
        text = ["text.width=512", "text.layers=12", "text.heads=8", "precision=bf16"]
        step = _lit_step(tower_dir, [*text, *overrides], device, tmp_path)
    counted, planned = _measured_ratios(case, step, memory)
    _check_states(step)
    assert 0.85 <= counted <= 1.15
    assert 0.85 <= planned <= 1.15


_CPU_CASES = {  # fp32 (the count is CUDA autocast's, which a CPU cannot run), small shapes
    "pretrain-soft-tiny-p4-16e-b8": ("pretrain", ["tower.name=soft-tiny-p4-16e", "batch_size=8"]),
    "pretrain-soft-tiny-p4-16e-b64": ("pretrain", ["tower.name=soft-tiny-p4-16e", "batch_size=64"]),
    "pretrain-vit-tiny-p4-b64-checkpointing": ("pretrain", ["tower.name=vit-tiny-p4", "batch_size=64",
                                                           "grad_checkpointing=true"]),
    "pretrain-vit-tiny-p4-b64-accum2": ("pretrain", ["tower.name=vit-tiny-p4", "batch_size=64", "accum_steps=2"]),
    # the locked tower's forward holds the most (16 tokens), the text tower's does (77 tokens)
    "lit-soft-tiny-p4-16e-16tokens-b512": ("lit", ["batch_size=512", "text.context_length=16"]),
    "lit-soft-tiny-p4-16e-77tokens-b256": ("lit", ["batch_size=256", "text.context_length=77"]),
    "lit-soft-tiny-p4-16e-77tokens-b256-accum2": ("lit", ["batch_size=256", "text.context_length=77",
                                                          "accum_steps=2"]),
}


@pytest.mark.parametrize("case", list(_CPU_CASES))
def test_the_plan_matches_what_a_cpu_step_holds(case, tmp_path):
    """The GPU check's code, run on the CPU: the same steps, counts and bars, in fp32 at small shapes."""
    recipe, overrides = _CPU_CASES[case]
    torch.manual_seed(0)
    device = torch.device("cpu")
    if recipe == "pretrain":
        step = _pretrain_step("pretrain/fmnist-soft-tiny", [*overrides, "precision=fp32"], device, tmp_path)
    else:
        save_tower(tmp_path / "tower", tiny("soft-tiny-p4-16e"),
                   extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
        text = ["text.width=64", "text.layers=2", "text.heads=2", "precision=fp32"]
        step = _lit_step(tmp_path / "tower", [*text, *overrides], device, tmp_path)
    # LiveBytes sees what the steps make (AdamW's moments too) and what is given it: the weights and the batch.
    memory = LiveBytes(*step.model.parameters(), *step.model.buffers(), *step.batch)
    counted, planned = _measured_ratios(case, step, memory)
    _check_states(step)
    plan = step.plan  # the total is the peak, no more than the rows held at once
    assert plan.total == plan.weights + plan.optimizer + plan.inputs + plan.peak
    assert plan.peak <= plan.gradients + plan.activations + plan.loss_logits
    assert 0.85 <= counted <= 1.15
    assert 0.85 <= planned <= 1.15


@pytest.mark.parametrize("overrides", [[], ["unlocked_blocks=1"], ["text.locked=true", "text.unlocked_layers=1"],
                                       ["image_head=true"]],
                         ids=["locked-tower", "unlocked-block", "locked-text", "image-head"])
def test_the_lit_plans_states_are_the_lit_models_own(overrides, tmp_path):
    """LiT's model as `lit-softmoe train` builds it under bf16 (the locked tower, or its locked part, held in
    bf16, unlocked blocks in fp32; a locked text tower's layers held in fp32, not trained; an image head
    trained): the plan's weights, gradients and optimizer rows are its bytes exactly."""
    save_tower(tmp_path / "tower", tiny("soft-tiny-p4-16e"),
               extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    text = ["text.width=64", "text.layers=2", "text.heads=2", "batch_size=4", "precision=bf16"]
    step = _lit_step(tmp_path / "tower", [*text, *overrides], torch.device("cpu"), tmp_path)
    held_in_bf16 = [p for p in step.model.parameters() if p.dtype == torch.bfloat16]
    assert held_in_bf16 and all(not p.requires_grad for p in held_in_bf16)
    _check_states(step)


def _check_states(step: _Step) -> None:
    """The plan's weights, gradients, optimizer and inputs rows are the real model's and batch's, byte for byte
    (parameters: the buffers, a few KiB, are not planned). Runs a step: AdamW makes its moments at its first."""
    params = list(step.model.parameters())
    trained = [p for p in params if p.requires_grad]
    assert step.plan.weights == sum(p.nbytes for p in params)
    assert step.plan.gradients == sum(p.numel() * 4 for p in trained)  # fp32, as AccumulateGrad makes them
    assert all(p.dtype == torch.float32 for p in trained)
    assert step.plan.inputs == sum(t.nbytes for t in step.batch)
    step.run(lambda loss: loss.backward())  # AdamW makes its moments at its first step
    moments = [t for state in step.optimizer.state.values() for name, t in state.items() if name != "step"]
    assert step.plan.optimizer == sum(t.nbytes for t in moments)
    assert len(moments) == 2 * len(trained)


def test_the_lit_paper_scale_config_plans_to_fit_8_80gb_gpus(tmp_path):
    """lit/soft-b16-128e-cc12m as shipped, against a soft-b16-128e tower: the plan reads the tower folder's
    config.json only, so a folder with its config and no weights stands in for the pretrained one."""
    tower_dir = tmp_path / "tower"
    tower_dir.mkdir()
    tower = create_image_tower("soft-b16-128e", device="meta")
    (tower_dir / "config.json").write_text(json.dumps({"tower": tower.cfg.to_dict()}))
    (tower_dir / "model.safetensors").touch()
    cfg = load_config(LiTConfig, "lit/soft-b16-128e-cc12m", [f"image_tower={tower_dir}"])
    assert (cfg.batch_size, cfg.text.width, cfg.text.layers, cfg.steps) == (16384, 768, 12, 12000)
    report, fits = plan_report(cfg, 8, 80 << 30)
    assert fits, report
    assert not plan_report(cfg, 1, 80 << 30)[1]  # the same run on one GPU does not fit


def test_lit_with_unlocked_blocks_needs_sharding_and_fits_with_it(tmp_path):
    """Four of soft-b16-128e's blocks unlocked on images: their fp32 states and the gradients DDP buckets
    do not fit 8 × 80 GB; sharding them (the locked blocks stay whole) does, and the verdict names it."""
    tower_dir = tmp_path / "tower"
    tower_dir.mkdir()
    tower = create_image_tower("soft-b16-128e", device="meta")
    (tower_dir / "config.json").write_text(json.dumps({"tower": tower.cfg.to_dict()}))
    (tower_dir / "model.safetensors").touch()
    overrides = [f"image_tower={tower_dir}", "unlocked_blocks=4", f"data.train={tmp_path / 'images'}"]
    report, fits = plan_report(load_config(LiTConfig, "lit/soft-b16-128e-cc12m", overrides), 8, 80 << 30)
    verdict = next(line for line in report.splitlines() if line.startswith("does not fit: "))
    assert not fits and "sharding=fsdp" in verdict, report
    sharded = load_config(LiTConfig, "lit/soft-b16-128e-cc12m", [*overrides, "sharding=fsdp"])
    report, fits = plan_report(sharded, 8, 80 << 30)
    assert fits, report
    count, _ = count_config(sharded)
    plan = plan_memory(count, sharded.batch_size, 8, Levers.of(sharded))
    # Only the trained part is divided: the locked blocks' weights are held whole on each GPU.
    assert plan.weights == count.trainable * 4 // 8 + count.frozen_bytes
    assert count.frozen_bytes > 0 and plan.optimizer == count.trainable * 8 // 8


def test_a_locked_text_tower_is_planned_as_held_not_trained(tmp_path):
    """text.locked: the text tower's weights are held (fp32) but have no gradients or moments; with
    text.unlocked_layers its last blocks (and what follows them) train again."""
    tower_dir = tmp_path / "tower"
    tower_dir.mkdir()
    tower = create_image_tower("soft-test-4e", device="meta")
    (tower_dir / "config.json").write_text(json.dumps({"tower": tower.cfg.to_dict()}))
    (tower_dir / "model.safetensors").touch()
    common = [f"image_tower={tower_dir}", f"data.train={tmp_path / 'features'}", "text.width=64", "text.layers=2",
              "text.heads=2", "precision=bf16"]
    free = count_lit(load_config(LiTConfig, None, common))
    locked = count_lit(load_config(LiTConfig, None, [*common, "text.locked=true"]))
    partly = count_lit(load_config(LiTConfig, None, [*common, "text.locked=true", "text.unlocked_layers=1"]))
    text_params = free.trainable - 1  # all but the logit scale
    assert locked.trainable == 1  # the logit scale alone
    assert locked.frozen_bytes - free.frozen_bytes == text_params * 4
    assert locked.trainable < partly.trainable < free.trainable
    assert partly.frozen_bytes - free.frozen_bytes == (free.trainable - partly.trainable) * 4
