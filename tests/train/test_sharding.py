"""lit_softmoe.train.sharding and sharded_checkpoint (`sharding: fsdp`): FSDP2 pretraining on two gloo
processes (torchrun) equals one process on the same global batches, a kill -9 mid-epoch then a rerun
equals the uninterrupted sharded run, and the tower folder loads in one process with the weights the
processes held. Sharded LiT (the text tower, and unlocked image blocks) equals one process too, and
resumes exactly. A torchrun launch of one process runs the same sharded path (the one-GPU user's):
it trains as a plain process does and resumes exactly; a plain process is refused in one line. The
checkpoint's own checks run in-process, on a one-process gloo group. The launchers and settings are
tests/sharded_runs.py's (tests/test_cuda.py runs the one-process case on a GPU)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cli_errors import one_line_error
from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.hub import load_pretrained
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.models.tower_layers import modules_of, tower_layers
from lit_softmoe.train.checkpoint import DamagedCheckpoint
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.optim import create_optimizer
from lit_softmoe.train.runtime import resume_state
from lit_softmoe.train.sharded_checkpoint import load_sharded_state, save_sharded_state, shard_file
from lit_softmoe.train.sharding import gather_into, gather_tower, plain_copy, shard_lit_model, shard_tower
from sharded_runs import (
    assert_lit_follows,
    assert_same_run,
    built_fmnist_1000,
    built_sharded_lit_data,
    checkpoint_pieces,
    finish,
    kill_after_first_checkpoint,
    launch_lit,
    launch_pretrain,
    lit_overrides,
    lit_results,
    losses,
    plain_lit,
    plain_pretrain_run,
    pretrain_overrides,
    sharded_pretrain_run,
    tower_state,
)
from shared_builds import built_once
from timm_families import TIMM_FAMILIES, random_timm_tower


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return built_fmnist_1000(tmp_path_factory)


@pytest.fixture(scope="module")
def sharded_run(shards, tmp_path_factory):
    return sharded_pretrain_run(tmp_path_factory, shards, 2)


@pytest.fixture(scope="module")
def one_process_sharded_run(shards, tmp_path_factory):
    return sharded_pretrain_run(tmp_path_factory, shards, 1)


@pytest.fixture(scope="module")
def plain_run(shards, tmp_path_factory):
    return plain_pretrain_run(tmp_path_factory, shards)


def _assert_follows(plain, sharded) -> None:
    """The sharded run follows the plain one: the losses of every step and the final weights within 1e-4."""
    a, b = losses(plain), losses(sharded)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert a[20] < 0.9 * a[1]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-4), step
    for (name, p), q in zip(tower_state(plain).items(), tower_state(sharded).values(), strict=True):
        assert (p - q).abs().max() <= 1e-4, name
    assert [r["step"] for r in read_metrics(sharded / "metrics.jsonl") if "test_top1" in r] == [10, 20]


def _assert_resumes_exactly(shards, uninterrupted, run_dir, nproc: int) -> None:
    """Killed after its first checkpoint and rerun, the sharded run resumes there (not from step 0, which
    would end the same) and ends as the uninterrupted run, to the bit."""
    resumed_from = kill_after_first_checkpoint(shards, run_dir, nproc=nproc)
    assert 4 <= resumed_from < 20
    assert f"(step {resumed_from} of 20)" in finish(launch_pretrain(shards, run_dir, nproc=nproc))
    assert_same_run(uninterrupted, run_dir)


# ---- two processes (torchrun, gloo) ---------------------------------------------------------------

@pytest.mark.slow
def test_fsdp_pretraining_equals_one_process_on_the_same_global_batches(plain_run, sharded_run):
    """In-memory batches give process r the samples r::2 of the global batch, and FSDP averages the
    gradients as DDP does: one unsharded process on the same global batches follows the same curve."""
    _assert_follows(plain_run, sharded_run)


@pytest.mark.slow
def test_the_tower_folder_holds_the_weights_the_processes_held(sharded_run):
    """The final checkpoint's two files, put together along dim 0 (FSDP's shards), are the tower that
    one process loads from the folder, to the bit; Soft MoE's `scale` is 0-d again there."""
    final = sharded_run / "checkpoints" / "step_00000020"
    pieces = checkpoint_pieces(final, 2)
    tower = tower_state(sharded_run)
    for name, value in tower.items():
        held = torch.cat([piece[f"model.{name}"] for piece in pieces])
        assert torch.equal(held.reshape(value.shape), value), name
    assert tower["blocks.2.mlp.scale"].shape == ()
    assert json.loads((final / "state.json").read_text())["processes"] == 2


@pytest.mark.slow
def test_killed_sharded_run_resumes_exactly(shards, sharded_run, tmp_path):
    _assert_resumes_exactly(shards, sharded_run, tmp_path / "killed", nproc=2)


@pytest.mark.slow
def test_a_shard_damaged_on_one_process_makes_both_resume_from_the_checkpoint_before(shards, sharded_run, tmp_path):
    """Process 1's file of the newest checkpoint cut short (a disk that filled while it was copied):
    both processes pass over that checkpoint together, resume at step 4, and end as the uninterrupted run."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(sharded_run / name, run / name)
    for step in (4, 8):
        shutil.copytree(sharded_run / "checkpoints" / f"step_{step:08d}", run / "checkpoints" / f"step_{step:08d}")
    damaged = run / "checkpoints" / "step_00000008" / shard_file(1, 2)
    damaged.write_bytes(damaged.read_bytes()[:1000])
    output = finish(launch_pretrain(shards, run))
    assert "step_00000008 is damaged" in output and "(step 4 of 20)" in output
    assert_same_run(sharded_run, run)


# ---- one launched process (torchrun --nproc_per_node 1, gloo): a one-GPU machine's sharded run ---------

@pytest.mark.slow
def test_fsdp_on_one_launched_process_trains_as_a_plain_process(plain_run, one_process_sharded_run):
    """At world size 1 every shard is the whole tensor and FSDP's collectives copy: the run follows the
    plain one, and its checkpoint is the sharded format, one file holding the whole tower."""
    _assert_follows(plain_run, one_process_sharded_run)
    final = one_process_sharded_run / "checkpoints" / "step_00000020"
    assert sorted(p.name for p in final.iterdir()) == ["state.json", shard_file(0, 1)]
    assert json.loads((final / "state.json").read_text())["processes"] == 1
    [held] = checkpoint_pieces(final, 1)
    for name, value in tower_state(one_process_sharded_run).items():
        assert torch.equal(held[f"model.{name}"].reshape(value.shape), value), name


@pytest.mark.slow
def test_killed_one_process_sharded_run_resumes_exactly(shards, one_process_sharded_run, tmp_path):
    _assert_resumes_exactly(shards, one_process_sharded_run, tmp_path / "killed", nproc=1)


# ---- LiT, two processes (torchrun, gloo) ---------------------------------------------------------


@pytest.fixture(scope="module")
def lit_data(tmp_path_factory):
    return built_sharded_lit_data(tmp_path_factory)


@pytest.fixture(scope="module")
def plain_lit_run(lit_data, tmp_path_factory):
    return plain_lit(tmp_path_factory, lit_data)


@pytest.fixture(scope="module")
def sharded_lit_run(lit_data, tmp_path_factory):
    """The uninterrupted sharded LiT run (two processes), its checkpoints kept; read, never written to."""
    return built_once(tmp_path_factory, "sharded-lit", lambda out: launch_lit(lit_data, out / "run")) / "run"


@pytest.mark.slow
def test_fsdp_lit_equals_one_process_on_the_same_global_batches(plain_lit_run, sharded_lit_run):
    """The text tower sharded, the locked tower whole on both processes: one process's curve, and a
    model folder with the text side only (the locked tower is the tower folder's)."""
    two = sharded_lit_run
    assert_lit_follows(plain_lit_run, two)
    assert not any(name.startswith("image_tower.") for name in lit_results(two)[2])
    # The checkpoints hold no piece of the locked tower either, on either process.
    for held in checkpoint_pieces(two / "checkpoints" / "step_00000012", 2):
        assert held and not any(name.startswith(("model.image_tower.", "optim.image_tower.")) for name in held)


@pytest.mark.slow
def test_fsdp_lit_with_an_unlocked_block_equals_one_process(lit_data, tmp_path):
    """The tower's last block trains, sharded (Soft MoE's 0-d `scale` among its parameters)."""
    one = tmp_path / "one"
    train_lit(load_config(LiTConfig, None, lit_overrides(lit_data, one, "unlocked_blocks=1")))
    two = tmp_path / "two"
    launch_lit(lit_data, two, "unlocked_blocks=1")
    assert_lit_follows(one, two)
    trained = lit_results(two)[2]
    tower = load_tower(lit_data / "tower")[0].state_dict()
    assert not torch.equal(trained["image_tower.blocks.1.mlp.scale"], tower["blocks.1.mlp.scale"])
    assert "image_tower.blocks.0.attn.qkv.weight" not in trained  # locked: the tower folder holds it
    pair = load_pretrained(two / "model")[0].image_tower.state_dict()
    assert torch.equal(pair["blocks.0.attn.qkv.weight"], tower["blocks.0.attn.qkv.weight"])
    assert torch.equal(pair["blocks.1.mlp.scale"], trained["image_tower.blocks.1.mlp.scale"])


@pytest.mark.slow
def test_sharded_lit_resumes_exactly(lit_data, sharded_lit_run, tmp_path):
    """A sharded run stopped after its step-6 checkpoint (its later ones and its model gone) and rerun
    ends as the uninterrupted sharded run, to the bit."""
    straight = sharded_lit_run
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut, ignore=shutil.ignore_patterns("model", "results.json"))
    for step in (9, 12):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:08d}")
    assert "(step 6 of 12)" in launch_lit(lit_data, cut)
    (losses_a, evals_a, model_a), (losses_b, evals_b, model_b) = lit_results(straight), lit_results(cut)
    assert losses_a == losses_b and evals_a == evals_b
    assert sorted(model_a) == sorted(model_b)
    for name, value in model_a.items():
        assert torch.equal(value, model_b[name]), name


@pytest.mark.slow
def test_fsdp_lit_on_one_launched_process_trains_as_a_plain_process(lit_data, plain_lit_run, tmp_path):
    """torchrun with one process: the text tower sharded over a group of one follows the plain run, and
    its checkpoints are the sharded format, one file without the locked tower."""
    one = tmp_path / "one"
    launch_lit(lit_data, one, nproc=1)
    assert_lit_follows(plain_lit_run, one)
    final = one / "checkpoints" / "step_00000012"
    assert json.loads((final / "state.json").read_text())["processes"] == 1
    [held] = checkpoint_pieces(final, 1)
    assert "model.logit_scale" in held and not any(name.startswith("model.image_tower.") for name in held)


def test_lit_on_one_process_with_fsdp_is_refused_in_one_line(lit_data, tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    line = one_line_error(capsys, ["train", "--config", str(empty),
                                   *lit_overrides(lit_data, tmp_path / "run", "sharding=fsdp")])
    assert "sharding=fsdp shards the tower over the processes of a distributed launch" in line
    # The launch lines name the command that was run (they named `pretrain` for a LiT run once).
    assert "-m lit_softmoe.cli train ...` (N=1 included)" in line and "pretrain" not in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- the checkpoint and the gathered tower, on one in-process gloo process -------------------------

def _trained_sharded_tower(seed: int = 0):
    """A sharded soft-test-4e tower and its AdamW, one step trained."""
    torch.manual_seed(seed)
    tower = shard_tower(create_image_tower("soft-test-4e", num_classes=10), torch.device("cpu"))
    optimizer = create_optimizer(tower, load_config(PretrainConfig).optim)
    F.cross_entropy(tower(torch.randn(4, 1, 28, 28)), torch.arange(4)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return tower, optimizer


def test_sharded_state_restores_weights_moments_and_rng(one_process_group, tmp_path):
    tower, optimizer = _trained_sharded_tower()
    rng = torch.get_rng_state()
    save_sharded_state(tmp_path / "step_00000001", 1, tower, optimizer, meta={"train_seconds": 1.5})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temporary folder left
    other, other_optimizer = _trained_sharded_tower(seed=1)
    torch.manual_seed(7)
    info = load_sharded_state(tmp_path / "step_00000001", other, other_optimizer)
    assert info["step"] == 1 and info["train_seconds"] == 1.5 and info["processes"] == 1
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, p), q in zip(tower.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    for p, q in zip(tower.parameters(), other.parameters()):
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            a, b = optimizer.state[p][moment], other_optimizer.state[q][moment]
            assert torch.equal(getattr(a, "full_tensor", a.clone)(), getattr(b, "full_tensor", b.clone)()), moment


def test_gathered_tower_is_a_plain_tower_with_the_full_weights(one_process_group):
    tower, _ = _trained_sharded_tower()
    plain = gather_tower(tower, torch.device("cpu"))
    assert type(plain).__name__ == "VisionTransformer"  # no FSDP hooks: the main process runs it alone
    assert plain.blocks[1].mlp.scale.shape == ()  # held as (1,) while sharded
    for (name, p), q in zip(tower.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p.full_tensor().reshape(q.shape), q), name
    pixels = torch.randn(2, 1, 28, 28)
    assert torch.allclose(plain(pixels), tower(pixels), atol=1e-6)


@pytest.mark.parametrize("damage", ["truncated", "another run's of the same step", "another process's"])
def test_damaged_shard_is_passed_over_for_the_checkpoint_before(one_process_group, tmp_path, caplog, damage):
    """A rank's file cut short, copied in from another run's checkpoint of the same step (its step agrees: it
    was resumed as this run's), or another process's file under this one's name (two rank files swapped were
    refused as "another model", and the checkpoint before was never tried)."""
    tower, optimizer = _trained_sharded_tower()
    for step in (1, 2):
        save_sharded_state(tmp_path / f"step_{step:08d}", step, tower, optimizer)
    shard = tmp_path / "step_00000002" / shard_file(0, 1)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:500])
    elif damage == "another process's":  # process 1's file of this very checkpoint, at process 0's name
        from lit_softmoe.model_folders import load_step_tensors, read_state_meta, save_step_tensors
        info = read_state_meta(shard.parent)
        save_step_tensors(load_step_tensors(shard, info), shard, info, rank=1)
    else:
        other, other_optimizer = _trained_sharded_tower(seed=1)
        save_sharded_state(tmp_path / "other" / "step_00000002", 2, other, other_optimizer)
        shard.write_bytes((tmp_path / "other" / "step_00000002" / shard_file(0, 1)).read_bytes())
    with pytest.raises(DamagedCheckpoint, match="state.rank0-of-1.safetensors"):
        load_sharded_state(tmp_path / "step_00000002", tower, optimizer)
    with caplog.at_level("WARNING"):
        step, _, latest = resume_state(tmp_path, tower, optimizer, 10, load=load_sharded_state)
    assert (step, latest.name) == (1, "step_00000001")
    assert any("step_00000002 is damaged" in r.getMessage() for r in caplog.records)


def test_checkpoint_of_another_number_of_processes_is_refused(one_process_group, tmp_path):
    tower, optimizer = _trained_sharded_tower()
    ckpt = save_sharded_state(tmp_path / "step_00000001", 1, tower, optimizer)
    info = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**info, "processes": 2}))
    with pytest.raises(UserError, match="written by 2 processes and this run has 1; resume it with 2"):
        load_sharded_state(ckpt, tower, optimizer)


def test_fsdp_on_one_process_is_one_line_before_any_work(shards, tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    line = one_line_error(capsys, ["pretrain", "--config", str(empty),
                                   *pretrain_overrides(shards, tmp_path / "run", "sharding=fsdp")])
    assert "sharding=fsdp shards the tower over the processes of a distributed launch" in line
    assert "torchrun --nproc_per_node N -m lit_softmoe.cli pretrain ...`" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
    line = one_line_error(capsys, ["pretrain", "--config", str(empty),
                                   *pretrain_overrides(shards, tmp_path / "run", "sharding=zero")])
    assert "sharding" in line and "fsdp" in line, line


def _lit_model(unlocked_blocks: int = 0) -> LiTModel:
    torch.manual_seed(0)
    text = create_text_tower(TextTowerConfig(width=32, layers=2, heads=2, context_length=16), embed_dim=32)
    tower = create_image_tower("soft-test-4e", num_classes=10)
    return LiTModel(tower, text, loss="sigmoid", unlocked_blocks=unlocked_blocks)


def test_sharded_lit_model_shards_what_trains_and_shares_the_locked_tower(one_process_group):
    from torch.distributed.tensor import DTensor

    model = _lit_model(unlocked_blocks=1)
    plain = plain_copy(model)
    shard_lit_model(model, torch.device("cpu"))
    for name, param in model.named_parameters():
        # Trained: a shard (the scalars held as (1,)); locked: the very tensor the plain copy holds.
        assert isinstance(param, DTensor) == param.requires_grad, name
        if not param.requires_grad:
            assert param is plain.get_parameter(name), name
    assert plain.logit_scale.shape == () and model.logit_scale.shape == (1,)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(1, 100, (4, 16))
    zimg, ztxt, scale, bias = model(torch.randn(4, 1, 28, 28), ids)
    (-(zimg * ztxt).sum() * scale + bias).backward()
    optimizer.step()
    assert not torch.equal(plain.logit_scale, model.logit_scale.full_tensor()[0])  # the copy is not updated...
    assert gather_into(plain, model) is plain  # ...until gathered into
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(full.reshape(plain.get_parameter(name).shape), plain.get_parameter(name)), name
    pixels = torch.randn(2, 1, 28, 28)
    for a, b in zip(plain(pixels, ids[:2]), model(pixels, ids[:2])):
        assert torch.allclose(a, b.reshape(a.shape), atol=1e-6)


@pytest.mark.parametrize("family", TIMM_FAMILIES)
def test_a_timm_towers_unlocked_layer_group_is_one_unit_of_the_sharded_model(one_process_group, family):
    """Any timm layout (a ResNet stage's block, EfficientNet's last block with conv_head and bn2, a Swin
    block, an attention pool): the last layer group's modules shard as one unit, the locked rest stays
    whole, and the sharded model steps and gathers as the plain one."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    tower = random_timm_tower(TIMM_FAMILIES[family])
    text = create_text_tower(TextTowerConfig(width=32, layers=1, heads=2, context_length=16), embed_dim=tower.embed_dim)
    model = LiTModel(tower, text, unlocked_blocks=1)
    before = {name: p.detach().clone() for name, p in tower.named_parameters()}
    plain = plain_copy(model)
    shard_lit_model(model, torch.device("cpu"))
    layers = tower_layers(tower)
    for module in modules_of(tower, layers.block_parameters(-1)):
        assert isinstance(module, FSDPModule)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) == param.requires_grad, name
        assert param.requires_grad == (name.removeprefix("image_tower.") in layers.unlocked(1)
                                       or not name.startswith("image_tower.")), name
    size = tower.cfg.image_size
    pixels, ids = torch.randn(2, 3, size, size), torch.randint(1, 100, (2, 16))
    zimg, ztxt, scale = model(pixels, ids)
    (-(zimg * ztxt).sum() * scale).backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    gather_into(plain, model)
    for a, b in zip(plain(pixels, ids), model(pixels, ids)):
        assert torch.allclose(a, b.reshape(a.shape), atol=1e-5)
    after = dict(plain.image_tower.named_parameters())
    assert any(not torch.equal(after[name], before[name]) for name in layers.block_parameters(-1))
    assert all(torch.equal(after[name], before[name]) for name in set(before) - layers.unlocked(1))


@pytest.mark.slow
def test_fsdp_lit_with_an_unlocked_timm_cnn_block_equals_one_process(lit_data, tmp_path, monkeypatch):
    """An EfficientNet (BatchNorm, its last layer group three modules: a block, conv_head, bn2) as the tower,
    its last group sharded over two processes: the one-process run's curve and weights.

    Half of LIT_RUN's steps, evaluated at the end only: what this adds to the ViT test above is a layer group of
    several modules with BatchNorm as one sharded unit, which every step exercises alike, and the network's
    convolutions on 160-px images cost ~0.4 s a step and ~3 s an evaluation on one core (LIT_RUN's 12 steps and
    two evaluations took this test 26 s)."""
    import timm
    from safetensors.torch import save_file

    monkeypatch.setenv("LIT_SOFTMOE_CACHE", str(tmp_path / "cache"))  # both processes write the tower folder
    torch.manual_seed(0)
    save_file(timm.create_model("test_efficientnet").state_dict(), tmp_path / "weights.safetensors")
    spec = f"image_tower=timm:test_efficientnet?file={tmp_path / 'weights.safetensors'}"
    shorter = ["unlocked_blocks=1", "steps=6", "eval.every=6"]
    one = tmp_path / "one"
    train_lit(load_config(LiTConfig, None, lit_overrides(lit_data, one, spec, *shorter)))
    two = tmp_path / "two"
    launch_lit(lit_data, two, spec, *shorter)
    assert_lit_follows(one, two, steps=6, eval_every=6)
    trained = lit_results(two)[2]
    assert "image_tower.conv_head.weight" in trained and "image_tower.conv_stem.weight" not in trained


def test_sharded_lit_checkpoint_leaves_the_locked_tower_out_and_restores_the_rest(one_process_group, tmp_path):
    model = _lit_model()
    shard_lit_model(model, torch.device("cpu"))
    optimizer = create_optimizer(model, load_config(LiTConfig).optim)
    zimg, ztxt, scale, bias = model(torch.randn(4, 1, 28, 28), torch.randint(1, 100, (4, 16)))
    (-(zimg * ztxt).sum() * scale + bias).backward()
    optimizer.step()
    ckpt = save_sharded_state(tmp_path / "step_00000001", 1, model, optimizer)
    held = load_file(ckpt / shard_file(0, 1))
    assert not any("image_tower." in name for name in held)
    assert "model.logit_bias" in held and any(name.startswith("model.text_tower.") for name in held)
    other = _lit_model()
    torch.manual_seed(1)
    other.text_tower.apply(lambda m: [torch.nn.init.normal_(p) for p in m.parameters(recurse=False)])
    shard_lit_model(other, torch.device("cpu"))
    other_optimizer = create_optimizer(other, load_config(LiTConfig).optim)
    load_sharded_state(ckpt, other, other_optimizer, skip_prefixes=("image_tower.",))
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        p, q = (getattr(t, "full_tensor", t.clone)() for t in (p, q))
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="name trained parameters"):
        load_sharded_state(ckpt, other, other_optimizer, skip_prefixes=("text_tower.",))
