"""Expert parallelism (`expert_parallel: E`, lit_softmoe.nn.expert_parallel and train.sharding): each group of
E processes splits every MoE layer's experts and moves the slots with all-to-alls, inside FSDP's sharded path
on a (replicate, expert) mesh. Pretraining on 2 and 4 gloo processes (torchrun) with E = 2 and 4 equals one
process on the same global batches as closely as FSDP alone does (tests/train/test_sharding.py), the tower
folder is the whole single-process tower, a kill -9 then a rerun ends as the uninterrupted run, and the layer
on a group of one is the plain layer. LiT with a locked tower split over the processes (each holds its chunk of
the experts), and with an unlocked MoE block, follows one process and resumes exactly. `embed --expert-parallel
2` writes the feature shards one process writes, byte for byte, also when the processes' batches differ in
number and size. Refusals are one line."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from cli_errors import one_line_error
from launch import python_command, torchrun_args
from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower, load_weights, save_tower
from lit_softmoe.nn.expert_parallel import experts_held, place_experts, split_experts
from lit_softmoe.nn.soft_moe import SoftMoE
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.runtime import check_same_run
from lit_softmoe.train.sharding import check_sharding
from sharded_runs import (
    assert_lit_follows,
    assert_same_run,
    built_fmnist_1000,
    built_sharded_lit_data,
    checkpoint_pieces,
    finish,
    kill_after_first_checkpoint,
    largest_gap,
    launch_lit,
    launch_pretrain,
    lit_overrides,
    lit_results,
    losses,
    plain_lit,
    plain_pretrain_run,
    pretrain_overrides,
    tower_state,
)
from shared_builds import built_once

# RUN's tower (tests/sharded_runs.py): 16 experts in each of its MoE blocks 2 and 3.
EXPERTS = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return built_fmnist_1000(tmp_path_factory)


@pytest.fixture(scope="module")
def plain_run(shards, tmp_path_factory):
    return plain_pretrain_run(tmp_path_factory, shards)


def _expert_parallel_run(tmp_path_factory, shards, nproc: int, experts_per_group: int):
    """The uninterrupted run on `nproc` processes with expert_parallel=`experts_per_group`; read, never
    written to."""
    return built_once(tmp_path_factory, f"expert-parallel-{nproc}x{experts_per_group}",
                      lambda out: finish(launch_pretrain(shards, out / "run", f"expert_parallel={experts_per_group}",
                                                         nproc=nproc))) / "run"


@pytest.fixture(scope="module")
def two_process_run(shards, tmp_path_factory):
    return _expert_parallel_run(tmp_path_factory, shards, 2, 2)


# ---- the layer, in one process --------------------------------------------------------------------

def test_experts_on_a_group_of_one_are_the_layer_to_the_bit(one_process_group):
    """Placed on a group of one, the layer holds its experts as DTensors (one chunk: all of them), has nothing
    to exchange, and gives the plain layer's output and gradients (the launched runs below exchange)."""
    torch.manual_seed(0)
    layer = SoftMoE(dim=16, num_experts=4, hidden_dim=32, slots_per_expert=2)
    placed = copy.deepcopy(layer)
    assert place_experts(placed, init_device_mesh("cpu", (1,))) == 1
    assert isinstance(placed.experts.w1, DTensor) and placed.experts.w1.to_local().shape == (4, 16, 32)
    assert "expert_parallel=1" in repr(placed.experts)
    x = torch.randn(3, 10, 16)
    y, y_placed = layer(x), placed(x)
    assert torch.equal(y, y_placed)
    y.square().sum().backward()
    y_placed.square().sum().backward()
    for name, param in layer.named_parameters():
        grad = dict(placed.named_parameters())[name].grad
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        assert torch.equal(param.grad, grad), name


def test_experts_are_split_only_by_a_group_that_divides_them(one_process_group):
    """Process 1 of a group of 2 would keep experts 2..3 of 4; a group of 3 cannot split 4 (checked before any
    weight moves)."""
    layer = SoftMoE(dim=8, num_experts=4, hidden_dim=8, slots_per_expert=1)
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the 4 experts"):
        place_experts(layer, SimpleNamespace(size=lambda: 3, get_local_rank=lambda: 0))
    assert not isinstance(layer.experts.w1, DTensor)
    with pytest.raises(UserError, match="expert_parallel=3 does not divide the 4 experts.*set an expert_parallel"):
        split_experts(layer, SimpleNamespace(size=lambda: 3, get_local_rank=lambda: 0))


def test_a_tower_folder_is_read_split(one_process_group, tmp_path):
    """`load_tower(..., expert_mesh=)` places the experts as it reads them: on a group of one the chunk is all of
    them, the tower the folder holds; `load_weights` reads only the rows it is given of a tensor."""
    torch.manual_seed(0)
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10),
               extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    whole, _ = load_tower(tmp_path / "tower")
    split, _ = load_tower(tmp_path / "tower", expert_mesh=init_device_mesh("cpu", (1,)))
    assert experts_held(split) == (4, 4) and experts_held(whole) is None
    for (name, p), q in zip(whole.state_dict().items(), split.state_dict().values(), strict=True):
        assert torch.equal(p, q.full_tensor() if isinstance(q, DTensor) else q), name
    pixels = torch.randn(2, 1, 28, 28)
    assert torch.equal(whole.forward_pooled(pixels), split.forward_pooled(pixels))
    name = "blocks.1.mlp.experts.w1"
    rows = load_weights(tmp_path / "tower" / "model.safetensors", rows={name: slice(2, 4)})
    assert torch.equal(rows[name], whole.state_dict()[name][2:4])


def test_a_tower_without_experts_is_refused(one_process_group):
    with pytest.raises(UserError, match="no MoE layer whose experts could be split; set expert_parallel=1"):
        split_experts(create_image_tower("vit-tiny-p7", num_classes=10), init_device_mesh("cpu", (1,)))


def test_expert_parallel_must_divide_the_processes(one_process_group):
    assert dist.get_world_size() == 1
    with pytest.raises(UserError, match="expert_parallel=2 must divide the 1 processes"):
        check_sharding("fsdp", "fp32", "pretrain", expert_parallel=2)


def test_expert_parallel_without_fsdp_is_one_line_before_any_work(shards, tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    line = one_line_error(capsys, ["pretrain", "--config", str(empty),
                                   *pretrain_overrides(shards, tmp_path / "run", "expert_parallel=2")])
    assert "expert_parallel=2 splits the experts inside FSDP's sharded path" in line
    assert "set sharding=fsdp too, or expert_parallel=1" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- launched runs (torchrun, gloo) ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("nproc, experts_per_group", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_pretraining_equals_one_process(plain_run, shards, tmp_path_factory, nproc,
                                                        experts_per_group):
    """The losses of every step and the final tower within FSDP's own bound (1e-4; FSDP alone measures ~2e-6):
    E processes each run 1/E of the experts on every process's slots, and on 4 processes with E = 2 each chunk is
    also FSDP-sharded over its 2 replicas (the 2-D mesh)."""
    run = _expert_parallel_run(tmp_path_factory, shards, nproc, experts_per_group)
    a, b = losses(plain_run), losses(run)
    assert sorted(b) == list(range(1, 21)) and a[20] < 0.9 * a[1]
    assert largest_gap(plain_run, run) <= 1e-4


@pytest.mark.slow
def test_each_process_holds_its_expert_chunk_and_the_tower_folder_all_of_them(two_process_run):
    """The final checkpoint's two files hold 8 of the 16 experts each (process r: experts 8r..8r+7), and put
    together in process order they are the tower that one process loads from the folder, to the bit."""
    final = two_process_run / "checkpoints" / "step_00000020"
    pieces = checkpoint_pieces(final, 2)
    tower = tower_state(two_process_run)
    for block in (2, 3):
        for weight in ("w1", "b1", "w2", "b2"):
            name = f"blocks.{block}.mlp.experts.{weight}"
            assert [piece[f"model.{name}"].shape[0] for piece in pieces] == [EXPERTS // 2] * 2
            assert torch.equal(torch.cat([piece[f"model.{name}"] for piece in pieces]), tower[name]), name
            # AdamW's moments are split as their weights
            assert pieces[1][f"optim.{name}.exp_avg"].shape == pieces[1][f"model.{name}"].shape
    # the other weights are FSDP's: split over both processes along dim 0
    assert pieces[0]["model.blocks.2.mlp.phi"].shape[0] == tower["blocks.2.mlp.phi"].shape[0] // 2


@pytest.mark.slow
def test_killed_expert_parallel_run_resumes_exactly(shards, two_process_run, tmp_path):
    run_dir = tmp_path / "killed" / "run"
    run_dir.parent.mkdir()
    resumed_from = kill_after_first_checkpoint(shards, run_dir, "expert_parallel=2")
    assert 4 <= resumed_from < 20
    assert f"(step {resumed_from} of 20)" in finish(launch_pretrain(shards, run_dir, "expert_parallel=2"))
    assert_same_run(two_process_run, run_dir)


@pytest.mark.slow
def test_a_run_resumes_only_with_the_expert_parallel_that_wrote_it(two_process_run):
    """Its checkpoint files hold E's expert chunks; another E is refused in one line that names both."""
    cfg = load_config(PretrainConfig, str(two_process_run / "config.yaml"), ["expert_parallel=1"])
    with pytest.raises(UserError, match="trained with expert_parallel=2 and this run sets 1.*rerun with "
                                        "expert_parallel=2"):
        check_same_run(two_process_run, cfg)


# ---- embed ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lit_data(tmp_path_factory):
    """400 Fashion-MNIST images in shards of 40 and a random soft-test-4e tower (4 experts a MoE layer)."""
    return built_sharded_lit_data(tmp_path_factory)


def _feature_shards(split_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(split_dir.glob("*.tar"))}


@pytest.mark.slow
def test_embed_with_expert_parallel_writes_one_process_features(lit_data, tmp_path):
    """Two processes, each holding 2 of the 4 experts, over 3 shards: process 0 embeds shards 0 and 2, process 1
    shard 1 and then joins process 0's forwards with padding; batches of 16 leave a last batch of 8 per shard.
    The feature shards equal those one process writes with the whole tower, byte for byte."""
    shards = f"{lit_data / 'fmnist' / 'train'}/{{0..2}}.tar"
    flags = ["--tower", str(lit_data / "tower"), "--shards", shards, "--split", "train", "--workers", "0",
             "--batch-size", "16"]
    embed_shards(lit_data / "tower", shards, tmp_path / "one", split="train", workers=0, batch_size=16)
    launched = subprocess.run([*python_command(), *torchrun_args(2), "-m", "lit_softmoe.cli", "embed", *flags,
                               "--out", str(tmp_path / "two"), "--expert-parallel", "2"],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "eager (expert_parallel=2)" in launched.stderr
    assert "120 embeddings (dim 32, float16)" in launched.stdout and "by 2 processes" in launched.stdout
    one, two = _feature_shards(tmp_path / "one" / "train"), _feature_shards(tmp_path / "two" / "train")
    assert sorted(two) == ["0.tar", "1.tar", "2.tar"] and two == one


def test_embed_expert_parallel_outside_a_launch_is_one_line(lit_data, tmp_path, capsys):
    line = one_line_error(capsys, ["embed", "--tower", str(lit_data / "tower"), "--shards",
                                   str(lit_data / "fmnist" / "train"), "--out", str(tmp_path / "out"),
                                   "--expert-parallel", "2"])
    assert "expert_parallel=2 must divide the 1 processes" in line
    assert not (tmp_path / "out" / "train").exists()


# ---- LiT ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lit_run(lit_data, tmp_path_factory):
    """LiT on images against the locked tower split over 2 processes; its checkpoints kept, read only."""
    def build(out):
        (out / "output.txt").write_text(launch_lit(lit_data, out / "run", "expert_parallel=2"))
    return built_once(tmp_path_factory, "expert-parallel-lit", build) / "run"


@pytest.mark.slow
def test_expert_parallel_lit_equals_one_process(lit_data, lit_run, tmp_path_factory):
    """Each process holds 2 of the 4 experts of each locked MoE layer and runs every image batch's forward with
    the other (the training steps, and the eval images once, all processes together): the one-process curve,
    evaluations and text tower, within FSDP's bound."""
    assert_lit_follows(plain_lit(tmp_path_factory, lit_data), lit_run)
    assert "2 of the 4 experts of each MoE layer here" in (lit_run.parent / "output.txt").read_text()
    assert not any(name.startswith("image_tower.") for name in lit_results(lit_run)[2])


@pytest.mark.slow
def test_expert_parallel_lit_with_an_unlocked_moe_block_equals_one_process(lit_data, tmp_path):
    """The last block, a Soft MoE one, trains: its expert chunks sharded and split, its eval features recomputed
    by both processes at each evaluation. The model folder holds its 4 experts whole."""
    one, two = tmp_path / "one", tmp_path / "two"
    train_lit(load_config(LiTConfig, None, lit_overrides(lit_data, one, "unlocked_blocks=1")))
    launch_lit(lit_data, two, "unlocked_blocks=1", "expert_parallel=2")
    assert_lit_follows(one, two)
    assert lit_results(two)[2]["image_tower.blocks.1.mlp.experts.w1"].shape[0] == 4


@pytest.mark.slow
def test_expert_parallel_lit_resumes_exactly(lit_data, lit_run, tmp_path):
    """Stopped after its step-6 checkpoint (its later ones and its model gone) and rerun: the uninterrupted run,
    to the bit."""
    cut = tmp_path / "cut"
    shutil.copytree(lit_run, cut, ignore=shutil.ignore_patterns("model", "results.json"))
    for step in (9, 12):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:08d}")
    assert "(step 6 of 12)" in launch_lit(lit_data, cut, "expert_parallel=2")
    (losses_a, evals_a, model_a), (losses_b, evals_b, model_b) = lit_results(lit_run), lit_results(cut)
    assert losses_a == losses_b and evals_a == evals_b
    assert sorted(model_a) == sorted(model_b)
    for name, value in model_a.items():
        assert torch.equal(value, model_b[name]), name
