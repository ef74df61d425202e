"""Sharded runs (`sharding=fsdp`) launched as a user launches them, with torchrun, on any number of processes:
the settings, the launchers and the comparisons that tests/train/test_sharding.py (gloo, on the CPU) and
tests/test_cuda.py (NCCL, on a GPU) share."""
from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from launch import kill_tree, python_command, torchrun_args
from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain
from lit_softmoe.train.sharded_checkpoint import shard_file
from shared_builds import built_once

# ---- pretraining ------------------------------------------------------------------------------------

# The narrow Soft MoE tower of test_pretrain.py: seconds per run.
SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]
# 1000 images in batches of 64 make 15 steps an epoch: the run crosses an epoch, and its checkpoints
# at steps 4, 8 and 12 fall mid-epoch. Evaluated at step 10: the sharded tower is gathered mid-run.
RUN = ["batch_size=64", "optim.warmup=5", "optim.lr=3e-3", "steps=20", "log_every=1", "checkpoint_every=4",
       "keep_checkpoints=10", "eval_every=10", "fewshot_shots=0", "data.max_train_samples=1000",
       "data.max_test_samples=200", "precision=fp32", "log_with=[]", *SMALL_TOWER]


def write_fmnist_1000(out) -> None:
    """The data of RUN: Fashion-MNIST shards, 1000 samples a split (found where `find_fashion_mnist` looks)."""
    write_fashion_mnist_shards(out, limit=1000, allow_download=False)


def pretrain_overrides(shards, run_dir, *extra) -> list[str]:
    return [f"data.train={shards / 'train'}", f"data.test={shards / 'test'}", f"run_dir={run_dir}", *RUN, *extra]


def built_fmnist_1000(tmp_path_factory):
    """RUN's data (`write_fmnist_1000`), built once per test run and shared by every test that trains on it."""
    return built_once(tmp_path_factory, "fmnist-1000", write_fmnist_1000)


def plain_pretrain_run(tmp_path_factory, shards):
    """RUN unsharded, in this one process (no launcher), built once per test run: the run every sharded and
    expert-parallel one must follow."""
    def build(out):
        pretrain(load_config(PretrainConfig, None, pretrain_overrides(shards, out / "run")))
    return built_once(tmp_path_factory, "plain-pretrain", build) / "run"


def _empty_config(run_dir) -> str:
    empty = run_dir.parent / "empty.yaml"
    empty.write_text("{}\n")
    return str(empty)


def launch_pretrain(shards, run_dir, *extra, nproc: int = 2) -> subprocess.Popen:
    """The sharded run on `nproc` processes (gloo on the CPU, NCCL on a GPU: accelerate picks the backend);
    `extra` overrides RUN's settings."""
    return subprocess.Popen([*python_command(), *torchrun_args(nproc),
                             "-m", "lit_softmoe.cli", "pretrain", "--config", _empty_config(run_dir),
                             *pretrain_overrides(shards, run_dir, "sharding=fsdp", *extra)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    """Wait for a launched run to end well; its output (stdout, then stderr)."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out + err


def kill_after_first_checkpoint(shards, run_dir, *extra, nproc: int = 2) -> int:
    """Launch the sharded run and kill -9 the launcher and its processes as soon as the first checkpoint
    is in place (mid-epoch, mid-run); the step of the newest checkpoint they left."""
    proc = launch_pretrain(shards, run_dir, *extra, nproc=nproc)
    deadline = time.time() + 300
    while not list((run_dir / "checkpoints").glob("step_*")):
        if proc.poll() is not None:  # failed (or finished) before any checkpoint: say why
            raise AssertionError(f"the run ended before its first checkpoint: {proc.communicate()[1][-3000:]}")
        assert time.time() < deadline, "no checkpoint after 300 s"
        time.sleep(0.02)
    # torchrun starts each worker in a session of its own (its SubprocessHandler), so killing the
    # launcher's process group alone would leave the workers training to the end: each is killed by its
    # id, the launcher first (it would otherwise see them die and tear down).
    kill_tree(proc)
    proc.communicate()  # returns once every process holding its pipes is gone
    assert not (run_dir / "tower").exists(), "the run finished before it could be killed"
    return max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def tower_state(run_dir) -> dict[str, torch.Tensor]:
    tower, _ = load_tower(run_dir / "tower")  # in this one process, as LiT, embed and eval load it
    return tower.state_dict()


def assert_same_run(a, b) -> None:
    """Two runs that logged the same losses, step for step, and saved the same tower, to the bit."""
    assert losses(a) == losses(b)
    for (name, p), q in zip(tower_state(a).items(), tower_state(b).values(), strict=True):
        assert torch.equal(p, q), name


def largest_gap(a, b) -> float:
    """The largest difference between two runs of the same steps: over their losses and their towers' weights."""
    losses_a, losses_b = losses(a), losses(b)
    assert sorted(losses_a) == sorted(losses_b)
    gaps = [abs(losses_a[step] - losses_b[step]) for step in losses_a]
    gaps += [float((p - q).abs().max()) for p, q in zip(tower_state(a).values(), tower_state(b).values(), strict=True)]
    return max(gaps)


def checkpoint_pieces(checkpoint, nproc: int) -> list[dict[str, torch.Tensor]]:
    """Each process's file of a sharded checkpoint, in rank order."""
    return [load_file(checkpoint / shard_file(rank, nproc)) for rank in range(nproc)]


# ---- LiT -------------------------------------------------------------------------------------------

# 40-sample shards, a 40-sample step per process, no sample shuffle: rank r reads the one-process
# order's shards r, r+2, ..., so each global batch of 80 holds the one-process batch's samples, in order
# (as test_lit.py's DDP test). Evaluated at step 6: the sharded text tower is gathered mid-run.
LIT_RUN = ["steps=12", "batch_size=80", "data.shuffle_buffer=0", "data.workers=0", "optim.lr=3e-3",
           "optim.warmup=5", "log_every=1", "checkpoint_every=3", "keep_checkpoints=10", "eval.every=6",
           "precision=fp32", "log_with=[]", "text.width=64", "text.layers=2", "text.heads=2"]


def write_sharded_lit_data(root) -> None:
    """400 Fashion-MNIST images in shards of 40 (train and test) and a random Soft MoE tower."""
    write_fashion_mnist_shards(root / "fmnist", samples_per_shard=40, limit=400, allow_download=False)
    torch.manual_seed(0)
    save_tower(root / "tower", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": {"image_size": 28, "mean": [0.286], "std": [0.353]}})


def built_sharded_lit_data(tmp_path_factory):
    """LIT_RUN's data (`write_sharded_lit_data`), built once per test run and shared."""
    return built_once(tmp_path_factory, "sharded-lit-data", write_sharded_lit_data)


def lit_overrides(data, run_dir, *extra) -> list[str]:
    return [f"run_dir={run_dir}", f"image_tower={data / 'tower'}", f"data.train={data / 'fmnist' / 'train'}",
            f"eval.shards={data / 'fmnist' / 'test'}", *LIT_RUN, *extra]


def launch_lit(data, run_dir, *extra, nproc: int = 2) -> str:
    """The sharded LiT run on `nproc` processes, to its end; its output (stdout, then stderr)."""
    result = subprocess.run([*python_command(), *torchrun_args(nproc),
                             "-m", "lit_softmoe.cli", "train", "--config", _empty_config(run_dir),
                             *lit_overrides(data, run_dir, "sharding=fsdp", *extra)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def lit_results(run_dir) -> tuple[dict, dict, dict]:
    """(losses by step, zero-shot top-1 by step, the saved model's tensors)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["zeroshot_top1"] for r in records if "zeroshot_top1" in r},
            load_file(run_dir / "model" / "model.safetensors"))


def sharded_pretrain_run(tmp_path_factory, shards, nproc: int):
    """The uninterrupted sharded run of RUN on `nproc` processes of one node (`launch_pretrain`), every checkpoint
    kept, built once a test run (tests/shared_builds.py); read, never written to."""
    return built_once(tmp_path_factory, f"sharded-pretrain-{nproc}",
                      lambda out: finish(launch_pretrain(shards, out / "run", nproc=nproc))) / "run"


def assert_lit_follows(one, two, width: int = 64, steps: int = 12, eval_every: int = 6) -> None:
    """The sharded run `two` follows the one-process run `one` (of `steps` steps, evaluated every `eval_every`;
    LIT_RUN's by default): losses within 1e-4, the eval at the same steps, the saved weights within 1e-4 -- but
    the attention's key bias, whose true gradient is 0 (it cancels in the softmax): Adam turns the rounding noise
    standing in for that 0 into full-size steps."""
    (losses_a, evals_a, model_a), (losses_b, evals_b, model_b) = lit_results(one), lit_results(two)
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, steps + 1))
    assert losses_a[steps] < losses_a[1]
    for step in losses_a:
        assert losses_b[step] == pytest.approx(losses_a[step], abs=1e-4), step
    assert sorted(evals_a) == sorted(evals_b) == list(range(eval_every, steps + 1, eval_every))
    assert sorted(model_a) == sorted(model_b)
    gaps = {}
    for name, a in model_a.items():
        b = model_b[name]
        assert a.shape == b.shape, name  # the scalars are 0-d again
        if name.endswith("attn.in_proj_bias"):
            a, b = torch.cat([a[:width], a[2 * width:]]), torch.cat([b[:width], b[2 * width:]])
        gaps[name] = float((a - b).abs().max())
        assert gaps[name] <= 1e-4, name
    print(f"largest gaps: loss {max(abs(losses_a[s] - losses_b[s]) for s in losses_a):.1e}, "
          f"weights {max(gaps.values()):.1e}")


def plain_lit(tmp_path_factory, data):
    """The LiT run of LIT_RUN unsharded, in this one process (no launcher), built once per test run."""
    return built_once(tmp_path_factory, "plain-lit",
                      lambda out: train_lit(load_config(LiTConfig, None, lit_overrides(data, out / "run")))) / "run"
