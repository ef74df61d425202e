"""The memory plan under expert parallelism (`expert_parallel`, issue 42): each GPU's expert chunk, trained or
locked, equals a hand count of the experts' parameters; the bytes a step moves (FSDP's all-gathers and
reduce-scatters, the all-to-alls of the slots) equal a hand count and docs/training.md's numbers; the lever
search names expert_parallel when it is what makes a run fit (soft-h14-256e under LiT on 8 × 80 GB); `train
--plan` takes a registered tower name, with no folder; an expert_parallel the run cannot take is one line."""
from __future__ import annotations

import json

import pytest

from cli_errors import one_line_error
from lit_softmoe.cli import main
from lit_softmoe.config import LiTConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower, image_tower_config
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train import memory_plan
from lit_softmoe.train.memory_plan import Levers, bytes_moved, levers_that_fit, plan_memory, plan_report
from lit_softmoe.train.model_count import count_config, count_lit, count_pretrain
from towers import count_params

GIB = 1 << 30
TINY = "soft-tiny-p4-16e"  # 16 experts in each of 3 Soft MoE layers, width 128, expert MLPs 256 wide


def _expert_params(name: str) -> int:
    """The Soft MoE experts' parameters of a registered tower, by hand: per expert w1 (d, h), b1 (h), w2 (h, d),
    b2 (d)."""
    cfg = image_tower_config(name)
    d, h = cfg.width, cfg.mlp_dim
    return len(cfg.moe_layers) * cfg.num_experts * (d * h + h + h * d + d)


@pytest.mark.parametrize("group", [2, 4])
def test_a_gpus_trained_expert_chunk_is_the_hand_count(group):
    """Pretraining on 8 GPUs: n/E experts a layer, fp32, sharded over the 8/E GPUs holding that chunk; the
    other weights over all 8; FSDP gathers a Soft MoE block with n/E of its experts."""
    count = count_pretrain(TINY, {}, 10, "bf16")
    experts = _expert_params(TINY)
    assert count.experts.trained == experts and count.experts.frozen_bytes == 0
    gpus = 8
    ep = plan_memory(count, 256, gpus, Levers(sharding="fsdp", expert_parallel=group))
    fsdp = plan_memory(count, 256, gpus, Levers(sharding="fsdp"))
    chunk = experts // group * 4 // (gpus // group)
    others = (count.trainable - experts) * 4 // gpus
    assert ep.experts == chunk and fsdp.experts == experts * 4 // gpus
    assert ep.weights == ep.gradients == others + chunk
    assert ep.optimizer == (count.trainable - experts) * 8 // gpus + experts // group * 8 // (gpus // group)
    # Two gathered blocks in bf16: the largest, a Soft MoE block with n/E experts, or a dense one.
    cfg = image_tower_config(TINY)
    tower = create_image_tower(TINY, device="meta", num_classes=10)
    moe_block = count_params(tower.blocks[cfg.moe_layers[0]])
    dense = max(count_params(b) for i, b in enumerate(tower.blocks) if i not in cfg.moe_layers)
    per_layer = experts // len(cfg.moe_layers)
    gathered = max(moe_block - per_layer + per_layer // group, dense)
    assert fsdp.activations - ep.activations == 2 * 2 * (moe_block - gathered) > 0


def test_a_locked_towers_expert_chunk_is_held_whole_and_a_registered_name_counts_as_its_folder(tmp_path,
                                                                                             monkeypatch):
    """LiT against a registered name (no folder of it here) counts what the same tower's folder counts; under
    expert parallelism each GPU holds 1/E of the locked experts, whole, in bf16, and the rest of the tower."""
    monkeypatch.chdir(tmp_path)
    common = ["precision=bf16", f"data.train={tmp_path / 'images'}"]
    registered = count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={TINY}", *common]))
    folder = tmp_path / "tower"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"tower": image_tower_config(TINY).to_dict()}))
    (folder / "model.safetensors").touch()  # the plan reads config.json only
    assert registered == count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={folder}", *common]))
    experts = _expert_params(TINY)
    assert registered.frozen_bytes == count_params(create_image_tower(TINY, device="meta")) * 2
    assert registered.experts.frozen_bytes == experts * 2 and registered.experts.trained == 0
    whole = plan_memory(registered, 256, 4, Levers(sharding="fsdp"))
    for group in (2, 4):
        ep = plan_memory(registered, 256, 4, Levers(sharding="fsdp", expert_parallel=group))
        assert ep.experts == experts * 2 // group
        assert whole.weights - ep.weights == experts * 2 - experts * 2 // group
        assert ep.gradients == whole.gradients and ep.optimizer == whole.optimizer  # the text side, as before
    # The locked forward's peak: beside a layer's slots, the slots received and their regrouped copy (n·p·d
    # values in bf16 each, per sample).
    assert memory_plan._exchange_buffers(registered, Levers(sharding="fsdp", expert_parallel=2)) == 2 * 16 * 128 * 2


def test_the_bytes_moved_are_the_hand_count(tmp_path):
    """Per GPU and step: FSDP gathers every sharded parameter twice and reduce-scatters its gradient once, in fp32
    (an expert chunk only over the GPUs / E that hold it); each Soft MoE layer all-to-alls its slots (b·n·p·d,
    bf16) out and back in its forward, both again in its backward, its forward's again when recomputed."""
    count = count_pretrain(TINY, {}, 10, "bf16")
    experts, layers, slots = _expert_params(TINY), 3, 16 * 1 * 128  # n · p · d
    batch, gpus = 256, 4  # micro-batch 64

    def moved(**levers):
        return bytes_moved(count, batch, gpus, Levers(sharding="fsdp", **levers))
    assert moved().fsdp == count.trainable * 4 * 3 and moved().all_to_alls == 0
    whole_groups = moved(expert_parallel=4)  # each chunk on one GPU: the experts are never gathered
    assert whole_groups.fsdp == (count.trainable - experts) * 4 * 3
    assert moved(expert_parallel=2).fsdp == (count.trainable - experts + experts // 2) * 4 * 3
    assert (whole_groups.all_to_alls, whole_groups.all_to_all) == (4 * layers, 64 * slots * 2)
    assert moved(expert_parallel=4, grad_checkpointing=True).all_to_alls == 6 * layers
    accumulated = moved(expert_parallel=4, accum_steps=2)  # micro-batches of 32, twice: the same bytes
    assert (accumulated.all_to_alls, accumulated.all_to_all) == (2 * 4 * layers, 32 * slots * 2)
    assert accumulated.fsdp == 2 * whole_groups.fsdp
    # A locked tower on images runs forward only; LiT's accumulation runs each micro-batch forward twice.
    lit = count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={TINY}", "precision=bf16",
                                                             f"data.train={tmp_path / 'images'}"]))
    locked = bytes_moved(lit, batch, gpus, Levers(sharding="fsdp", expert_parallel=4))
    assert (locked.all_to_alls, locked.all_to_all) == (2 * layers, 64 * slots * 2)
    assert locked.fsdp == lit.trainable * 4 * 3  # the text side; the locked tower is not sharded
    assert bytes_moved(lit, batch, gpus, Levers(sharding="fsdp", expert_parallel=4, accum_steps=2)).all_to_alls \
        == 2 * 2 * 2 * layers
    unlocked = count_lit(load_config(LiTConfig, "lit/fmnist-tiny", [f"image_tower={TINY}", "unlocked_blocks=1",
                                                                f"data.train={tmp_path / 'images'}"]))
    # The last block (a Soft MoE one) trains: 4 all-to-alls; the other 2 Soft MoE layers run forward only.
    assert bytes_moved(unlocked, batch, gpus, Levers(sharding="fsdp", expert_parallel=4)).all_to_alls == 4 + 2 * 2


def test_the_b16_traffic_is_the_docs():
    """docs/training.md ("Expert parallelism"): soft-b16-128e at batch 4,096 on 128 GPUs, fp32 weights,
    FSDP moves about 44 GB per GPU a step; with 128 experts over 128 GPUs, 6.3 MB each all-to-all, 24 a step."""
    count = count_pretrain("soft-b16-128e", {}, 1000, "bf16")
    assert round(bytes_moved(count, 4096, 128, Levers(sharding="fsdp")).total / 1e9) == 44
    ep = bytes_moved(count, 4096, 128, Levers(sharding="fsdp", expert_parallel=128))
    assert (ep.all_to_alls, ep.all_to_all) == (4 * 6, 32 * 128 * 1 * 768 * 2)
    assert 0.14e9 < ep.all_to_alls * ep.all_to_all < 0.16e9
    assert ep.fsdp == (count.trainable - count.experts.trained) * 4 * 3  # one expert a GPU: never gathered
    plan = plan_memory(count, 4096, 128, Levers(sharding="fsdp", expert_parallel=128))
    assert plan.experts == count.experts.trained // 128 * 4 and 27e6 < count.experts.trained // 128 < 29e6


@pytest.fixture(scope="module")
def h14_lit(tmp_path_factory):
    """lit/soft-b16-128e-cc12m against soft-h14-256e, a registered name (53.7B expert parameters, no folder):
    counted once, planned on images (data.train is not found here)."""
    cfg = load_config(LiTConfig, "lit/soft-b16-128e-cc12m",
                      ["image_tower=soft-h14-256e", f"data.train={tmp_path_factory.mktemp('none') / 'train'}"])
    return cfg, count_config(cfg)


def test_soft_h14_256e_fits_8_80gb_gpus_with_expert_parallel_only(h14_lit, monkeypatch):
    cfg, (count, what) = h14_lit
    assert "soft-h14-256e (registered" in what
    assert count.experts.per_layer == 256 and count.experts.layers == 16
    for levers in (Levers(), Levers(sharding="fsdp"), Levers(True, "fsdp", 8)):  # the locked tower is whole
        assert not plan_memory(count, cfg.batch_size, 8, levers).fits(80 * GIB)
    fitting = levers_that_fit(count, cfg.batch_size, 8, 80 * GIB, Levers())
    assert fitting and all(lv.expert_parallel > 1 for lv in fitting)
    assert fitting[0] == Levers(sharding="fsdp", expert_parallel=4)  # the smallest expert group that fits
    assert plan_memory(count, cfg.batch_size, 8, Levers(sharding="fsdp", expert_parallel=8)).fits(80 * GIB)
    monkeypatch.setattr(memory_plan, "count_config", lambda _: (count, what))  # counted once
    report, fits = plan_report(cfg, 8, 80 * GIB)
    lines = report.splitlines()
    assert not fits and next(line for line in lines if line.startswith("does not fit: ")).startswith(
        "does not fit: set sharding=fsdp expert_parallel=4 (")
    ep = load_config(LiTConfig, "lit/soft-b16-128e-cc12m",
                     ["image_tower=soft-h14-256e", "sharding=fsdp", "expert_parallel=8"])
    report, fits = plan_report(ep, 8, 80 * GIB)
    assert fits, report
    assert "of the weights: 32 of 256 experts in each of 16 Soft MoE layers; locked: whole" in report
    # the locked tower's forward on 2,048 images a GPU: 2 all-to-alls per layer of 2,048 · 256 · 1 · 1280 bf16
    assert "expert_parallel=8: 32 all-to-alls of 1,342.2 MB, bf16" in report


def test_train_plan_takes_a_registered_name_and_reports_both_traffics(tmp_path, monkeypatch, capsys):
    """The issue's check for soft-b16-128e: fits as shipped on 8 GPUs, and says what a step moves with FSDP alone
    (the trained text side: the locked tower is not sharded) and with expert parallelism (its forward's
    all-to-alls)."""
    monkeypatch.chdir(tmp_path)  # no folder named soft-b16-128e, no data
    assert main(["train", "--config", "lit/soft-b16-128e-cc12m", "image_tower=soft-b16-128e", "--plan",
                 "--plan-gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("fits")).split() == ["fits", "yes"]
    fsdp = next(line for line in out.splitlines() if line.startswith("  FSDP "))
    assert "sharding=fsdp: 123.6M trained parameters gathered 2×, their gradients reduce-scattered 1×" in fsdp
    ep = next(line for line in out.splitlines() if line.startswith("  expert parallel "))
    assert f"expert_parallel=8: 12 all-to-alls of {2048 * 128 * 768 * 2 / 1e6:,.1f} MB, bf16" in ep
    assert not (tmp_path / "runs").exists()


def test_a_training_run_still_needs_the_tower_folder(tmp_path, monkeypatch, capsys):
    """Only the plan builds a registered name: loading one as a tower is refused as before, and a name that is
    neither a folder nor registered is one line in the plan too."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"^{TINY} is not a tower checkpoint"):
        load_tower(TINY)
    line = one_line_error(capsys, ["train", "--config", "lit/fmnist-tiny", "image_tower=soft-tiny-p4-17e", "--plan"])
    assert line.endswith("soft-tiny-p4-17e is not a tower checkpoint (needs config.json and model.safetensors); "
                         "point to the `tower` folder of a finished pretraining run")


@pytest.mark.parametrize(("config", "overrides", "error"), [
    ("fmnist-soft-tiny", ["expert_parallel=3", "sharding=fsdp"],
     "expert_parallel=3 must divide both the 16 experts of each Soft MoE layer and the 4 GPUs; set it to 2 or 4"),
    ("fmnist-soft-tiny", ["expert_parallel=8", "sharding=fsdp"],
     "expert_parallel=8 must divide both the 16 experts of each Soft MoE layer and the 4 GPUs; set it to 2 or 4"),
    ("fmnist-soft-tiny", ["expert_parallel=2"],
     "expert_parallel=2 needs sharding=fsdp (the other weights shard over every GPU, each expert chunk over the "
     "GPUs that hold it); set sharding=fsdp"),
    ("fmnist-dense-tiny", ["expert_parallel=2", "sharding=fsdp"],
     "expert_parallel=2 splits the experts of Soft MoE layers, and this model has none; set expert_parallel=1"),
])
def test_an_expert_parallel_the_run_cannot_take_is_one_line(config, overrides, error, capsys):
    line = one_line_error(capsys, ["pretrain", "--config", f"pretrain/{config}", "--plan", "--plan-gpus", "4",
                                   *overrides])
    assert line.endswith(error), line


def test_an_expert_group_that_divides_both_is_planned(capsys):
    assert main(["pretrain", "--config", "pretrain/fmnist-soft-tiny", "--plan", "--plan-gpus", "4", "sharding=fsdp",
                 "expert_parallel=4"]) == 0
    assert "of the weights: 4 of 16 experts in each of 3 Soft MoE layers" in capsys.readouterr().out
