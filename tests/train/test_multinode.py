"""Several nodes: two nodes simulated on this machine (two torchrun launchers started together, `--nnodes 2
--node_rank 0|1`, one process each, meeting at 127.0.0.1 on a port of their own) run pretrain, then embed with its
tower, then LiT on those features, as docs/training.md's "Several nodes" runbook says; every result equals one
node's two processes (`torchrun --standalone --nproc_per_node 2`) doing the same: pretraining's losses and tower,
embed's feature shards, LiT's losses, zero-shot accuracies and saved model, to the bit. Pretraining and LiT run
sharded (`sharding=fsdp`): their checkpoints name the number of processes that wrote them, one file each, which
shows both nodes took part."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from launch import free_port, kill_tree, python_command, torchrun_args, torchrun_node_args
from sharded_runs import (
    LIT_RUN,
    assert_same_run,
    built_fmnist_1000,
    built_sharded_lit_data,
    checkpoint_pieces,
    largest_gap,
    lit_results,
    pretrain_overrides,
    sharded_pretrain_run,
)

NODE = "node"  # the launchers of two simulated nodes: `_launch` gives each its own rendezvous port
ONE_NODE = "one node"  # one launcher of two processes (`torchrun --standalone`)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """test_sharding.py's pretraining data (1000 Fashion-MNIST images a split), built once a test run."""
    return built_fmnist_1000(tmp_path_factory)


@pytest.fixture(scope="module")
def lit_data(tmp_path_factory):
    """test_sharding.py's LiT data: 400 Fashion-MNIST images a split, in shards of 40, built once a test run."""
    return built_sharded_lit_data(tmp_path_factory)


@pytest.fixture(scope="module")
def one_node_pretraining(shards, tmp_path_factory):
    """One node's pretraining: test_sharding.py's run on two processes (`torchrun --standalone`), built once a run."""
    return sharded_pretrain_run(tmp_path_factory, shards, 2)


def _launch(launchers, command: list[str], root) -> list[str]:
    """`command` (what follows `python -m lit_softmoe.cli`) under each launcher at once (NODE: under two simulated
    nodes' launchers), each ending well; what each launcher's processes printed (stdout, then stderr)."""
    if launchers == NODE:
        port = free_port()
        launchers = [torchrun_node_args(0, port), torchrun_node_args(1, port)]
    else:
        launchers = [torchrun_args(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIT_SOFTMOE_CACHE": str(root / "cache")}
    procs = [subprocess.Popen([*python_command(), *launcher, "-m", "lit_softmoe.cli", *command], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for launcher in launchers]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{' '.join(proc.args[1:8])}: {err[-3000:]}"
            outputs.append(out + err)
    finally:
        for proc in procs:  # a node failed or hung: the other would wait for it up to the rendezvous timeout
            if proc.poll() is None:
                kill_tree(proc)  # torchrun's workers run in sessions of their own and hold the pipes
                proc.communicate()
    return outputs


def _embed_and_lit(lit_data, tower, root, launchers) -> dict[str, list[str]]:
    """embed (the LiT data's training split, with `tower`), then LiT on those features against `tower`, zero-shot
    evaluated on the test images (embedded by the main process); each command's output, launcher by launcher."""
    root.mkdir(exist_ok=True)
    (root / "empty.yaml").write_text("{}\n")
    return {
        "embed": _launch(launchers, ["embed", "--tower", str(tower), "--shards", str(lit_data / "fmnist" / "train"),
                                     "--out", str(root / "features"), "--batch-size", "40", "--workers", "0"], root),
        "lit": _launch(launchers, ["train", "--config", str(root / "empty.yaml"), f"run_dir={root / 'lit'}",
                                   f"image_tower={tower}", f"data.train={root / 'features' / 'train'}",
                                   f"eval.shards={lit_data / 'fmnist' / 'test'}", *LIT_RUN, "sharding=fsdp"], root),
    }


def _lines(output: str, phrase: str, root, pretrain) -> list[str]:
    """The lines of `output` that hold `phrase`, with PRETRAIN for the pretraining run's folder and ROOT for `root`."""
    return [line.replace(str(pretrain), "PRETRAIN").replace(str(root), "ROOT") for line in output.splitlines()
            if phrase in line]


def _shard_bytes(split) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(split.glob("*.tar"))}


@pytest.mark.slow
def test_two_nodes_run_pretrain_embed_and_lit_as_one_node_of_two_processes(shards, lit_data, one_node_pretraining,
                                                                           tmp_path):
    # One node: the shared two-process pretraining run, then embed and LiT with its tower.
    one_pretrain = one_node_pretraining
    one = tmp_path / "one-node"
    one_out = _embed_and_lit(lit_data, one_pretrain / "tower", one, ONE_NODE)
    # Two nodes: the same three commands, each node's launcher started at once.
    two = tmp_path / "two-nodes"
    two.mkdir()
    (two / "empty.yaml").write_text("{}\n")
    two_out = {"pretrain": _launch(NODE, ["pretrain", "--config", str(two / "empty.yaml"),
                                          *pretrain_overrides(shards, two / "pretrain", "sharding=fsdp")], two)}
    two_out |= _embed_and_lit(lit_data, two / "pretrain" / "tower", two, NODE)

    # Both nodes took part: the sharded checkpoints were written by 2 processes, one file each; so was the split.
    for run, last in (("pretrain", 20), ("lit", 12)):
        final = two / run / "checkpoints" / f"step_{last:08d}"
        assert json.loads((final / "state.json").read_text())["processes"] == 2, run
        assert all(checkpoint_pieces(final, 2)), run
    assert json.loads((two / "features" / "train" / "embed.json").read_text())["processes"] == 2
    # Node 0 holds rank 0: it prints one node's start and closing lines; node 1 closes nothing.
    node_0, node_1 = two_out["pretrain"]
    assert len(_lines(node_0, "steps of 64", two, two)) == 1 and len(_lines(node_0, "tower saved to", two, two)) == 1
    assert not _lines(node_1, "saved to", two, two)
    for command, start, closing in (("embed", None, "written by 2 processes"), ("lit", "steps of 80", "saved to")):
        [one_node], (node_0, node_1) = one_out[command], two_out[command]
        assert len(_lines(node_0, closing, two, two)) == 1 and not _lines(node_1, closing, two, two), command
        if start:  # embed's closing line says how long it took
            ours, theirs = (two, two / "pretrain"), (one, one_pretrain)
            assert _lines(node_0, start, *ours) == _lines(one_node, start, *theirs) != []
            assert _lines(node_0, closing, *ours) == _lines(one_node, closing, *theirs)

    # Pretraining: the same losses, step by step, and the same tower, to the bit.
    print(f"pretrain: largest gap {largest_gap(one_pretrain, two / 'pretrain'):.1e}")
    assert_same_run(one_pretrain, two / "pretrain")

    # Embed: every feature shard the same file (rank 0 writes the even shards, rank 1 the odd ones, in both layouts).
    features = _shard_bytes(two / "features" / "train")
    assert len(features) == 10 and features == _shard_bytes(one / "features" / "train")

    # LiT: the same losses, zero-shot accuracies and saved model, to the bit.
    (losses_a, evals_a, model_a), (losses_b, evals_b, model_b) = lit_results(one / "lit"), lit_results(two / "lit")
    assert sorted(losses_b) == list(range(1, 13)) and sorted(evals_b) == [6, 12]
    gap = max([abs(losses_a[step] - losses_b[step]) for step in losses_a]
              + [float((model_a[name] - model_b[name]).abs().max()) for name in model_a])
    print(f"LiT: largest gap {gap:.1e}")
    assert losses_a == losses_b and evals_a == evals_b
    assert sorted(model_a) == sorted(model_b)
    for name, value in model_a.items():
        assert torch.equal(value, model_b[name]), name
