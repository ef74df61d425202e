"""The memory plan (`train.memory_plan`, `train.activation_count`): the meta-device count of what backward keeps
equals a real forward's, byte for byte but for what the GPU's attention kernel keeps beyond the CPU's; states are
16 bytes a parameter, divided under FSDP; the levers change the plan as they should; the paper's B/16 config does
not fit one 80 GB GPU and the verdict names the levers; `--plan` prints and exits 0. A GPU check compares the count
with what CUDA holds (skipped without one)."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from cli_errors import one_line_error
from lit_softmoe.cli import main
from lit_softmoe.config import LiTConfig, PretrainConfig, load_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.train.activation_count import count_pair_bytes, count_saved_bytes
from lit_softmoe.train.loss import contrastive_loss
from lit_softmoe.train.memory_plan import (
    GPU_FILL,
    Levers,
    count_config,
    count_lit,
    count_pretrain,
    levers_that_fit,
    plan_memory,
    plan_report,
)
from towers import count_params, tiny

GIB = 1 << 30


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


def test_lit_plans_the_text_side_the_locked_tower_and_the_logits(tmp_path):
    tower = tiny("soft-tiny-p7-16e")
    save_tower(tmp_path / "tower", tower, extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    cfg = load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={tmp_path / 'tower'}", "precision=bf16"])
    count = count_lit(cfg)
    plan = plan_memory(count, 1024, 4, Levers())
    assert count.frozen_bytes == 2 * count_params(tower)  # locked: held in bf16, no gradient, no moments
    assert plan.loss_logits == count.loss.at(256, 1024) and count.loss.per_pair > 0
    assert plan.activations == max(count.saved.kept(256), count.frozen_forward * 256)
    unlocked = count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={tmp_path / 'tower'}",
                                                                    "unlocked_blocks=2"]))
    last_two = sum(p.numel() for block in tower.blocks[-2:] for p in block.parameters())
    assert unlocked.trainable == count.trainable + last_two + sum(p.numel() for p in tower.norm.parameters())
    assert len(unlocked.saved.blocks) == len(count.saved.blocks) + 2


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
    refusal = (r"^this run needs about 110\.\d GiB per GPU, more than 90% of this GPU's 80\.0 GiB: set sharding=fsdp "
               r"\(44\.\d GiB per GPU\); or grad_checkpointing=true accum_steps=4 \(71\.\d GiB per GPU\) "
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
    assert out.splitlines()[-2].split() == ["fits", "yes"]


def test_train_plan_prints_and_exits_0(tmp_path, capsys):
    save_tower(tmp_path / "tower", tiny("soft-tiny-p7-16e"),
               extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    assert main(["train", "--config", "lit/fmnist-tiny", "--plan", f"image_tower={tmp_path / 'tower'}"]) == 0
    out = capsys.readouterr().out
    assert "loss logits" in out and "batch 256 on 1 GPU: micro-batch 256 per GPU" in out
    assert not (tmp_path / "runs").exists()


def test_plan_flags_without_plan_are_refused(capsys):
    line = one_line_error(capsys, ["pretrain", "--config", "pretrain/fmnist-soft-tiny", "--plan-gpus", "8"])
    assert "--plan-gpus and --plan-gpu go with --plan" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["soft-s16-128e", "vit-b16"])
def test_the_count_matches_what_cuda_holds(name):
    # What the graph holds after a bf16 forward (memory_allocated) against the count, and a whole step's peak
    # (max_memory_allocated) against the plan's total, which must not be below it.
    batch = 32
    torch.manual_seed(0)
    tower = create_image_tower(name, num_classes=1000).cuda()
    optimizer = torch.optim.AdamW(tower.parameters())
    count = count_pretrain(name, {}, 1000, "bf16")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = _classify(tower, batch)
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    optimizer.step()
    peak = torch.cuda.max_memory_allocated()
    counted, planned = count.saved.kept(batch), plan_memory(count, batch, 1, Levers()).total
    print(f"{name}: activations counted {counted / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB "
          f"({(counted - held) / held:+.1%}); step peak {peak / GIB:.2f} GiB, plan {planned / GIB:.2f} GiB "
          f"({(planned - peak) / peak:+.1%})")
    assert abs(counted - held) < 0.05 * held
    assert planned >= peak


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
    assert not fits and "sharding=fsdp" in report.splitlines()[-2], report
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
