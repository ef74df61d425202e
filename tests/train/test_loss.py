"""lit_softmoe.train.loss: the CLIP and SigLIP losses against explicit-loop references and open_clip's, and
the global batch over several processes."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from launch import python_command
from lit_softmoe.train.loss import contrastive_loss, gather_with_grad, sigmoid_loss

LOCAL_BATCH, FEATURES, EMBED = 3, 5, 4
WORLD, LOCAL = 3, 4


def _reference_clip(zimg: np.ndarray, ztxt: np.ndarray, scale: float) -> float:
    """Symmetric cross-entropy written out one row at a time."""
    b = len(zimg)
    total = 0.0
    for i in range(b):
        img_row = [scale * float(np.dot(zimg[i], ztxt[j])) for j in range(b)]
        txt_row = [scale * float(np.dot(ztxt[i], zimg[j])) for j in range(b)]
        total += -img_row[i] + math.log(sum(math.exp(v) for v in img_row))
        total += -txt_row[i] + math.log(sum(math.exp(v) for v in txt_row))
    return total / (2 * b)


def _unit(b: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_contrastive_loss_matches_loop_reference(batch):
    zimg, ztxt = _unit(batch, 8, 0), _unit(batch, 8, 1)
    loss = contrastive_loss(zimg, ztxt, torch.tensor(7.0, dtype=torch.float64))
    assert loss.item() == pytest.approx(_reference_clip(zimg.numpy(), ztxt.numpy(), 7.0), rel=1e-12)


def _reference_siglip(zimg: np.ndarray, ztxt: np.ndarray, scale: float, bias: float) -> float:
    """-Σ_ij log σ(z_ij (s·<x_i, y_j> + b)) / B, z = +1 iff i == j."""
    b = len(zimg)
    total = 0.0
    for i in range(b):
        for j in range(b):
            z = 1.0 if i == j else -1.0
            logit = scale * float(np.dot(zimg[i], ztxt[j])) + bias
            total += math.log(1.0 + math.exp(-z * logit))  # -log σ(z·logit)
    return total / b


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_sigmoid_loss_matches_loop_reference(batch):
    zimg, ztxt = _unit(batch, 8, 2), _unit(batch, 8, 3)
    loss = sigmoid_loss(zimg, ztxt, torch.tensor(10.0, dtype=torch.float64), torch.tensor(-3.0, dtype=torch.float64))
    assert loss.item() == pytest.approx(_reference_siglip(zimg.numpy(), ztxt.numpy(), 10.0, -3.0), rel=1e-12)


def test_contrastive_loss_limits():
    # Aligned orthonormal pairs with a large scale: each positive wins by the scale → loss ≈ 0.
    eye = torch.eye(6, dtype=torch.float64)
    assert contrastive_loss(eye, eye, torch.tensor(100.0, dtype=torch.float64)).item() < 1e-30
    # Random embeddings at scale → 0: every row is uniform over B → exactly log B; small scale ≈ log B.
    zimg, ztxt = _unit(64, 32, 4), _unit(64, 32, 5)
    assert contrastive_loss(zimg, ztxt, torch.tensor(0.0, dtype=torch.float64)).item() == pytest.approx(math.log(64))
    assert contrastive_loss(zimg, ztxt, torch.tensor(1.0, dtype=torch.float64)).item() == pytest.approx(
        math.log(64), abs=0.2)


def test_sigmoid_loss_at_siglip_init_is_dominated_by_the_positives():
    # Scale 10, bias -10 (SigLIP's init): negatives cost ~e^-10 each, each positive ~log(1+e^(10-10cos)).
    eye = torch.eye(4)
    loss = sigmoid_loss(eye, eye, torch.tensor(10.0), torch.tensor(-10.0))
    assert loss.item() == pytest.approx(math.log(2) + 3 * math.log1p(math.exp(-10)), rel=1e-5)


def test_gradients_reach_scale_and_bias():
    log_scale = torch.tensor(math.log(10.0), requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    zimg, ztxt = _unit(4, 8, 6).float(), _unit(4, 8, 7).float().requires_grad_()
    contrastive_loss(zimg, ztxt, log_scale.exp()).backward()
    assert log_scale.grad is not None and log_scale.grad.abs() > 0 and ztxt.grad.abs().sum() > 0
    log_scale.grad = None
    sigmoid_loss(zimg, ztxt, log_scale.exp(), bias).backward()
    assert log_scale.grad.abs() > 0 and bias.grad.abs() > 0


def test_gather_is_identity_without_distributed():
    t = torch.randn(3, 4)
    assert gather_with_grad(t) is t


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="differ in shape"):
        contrastive_loss(torch.randn(3, 4), torch.randn(2, 4), torch.tensor(1.0))


def _data():
    g = torch.Generator().manual_seed(1)
    zimg = F.normalize(torch.randn(2 * LOCAL_BATCH, EMBED, generator=g, dtype=torch.float64), dim=-1)
    text_inputs = torch.randn(2 * LOCAL_BATCH, FEATURES, generator=g, dtype=torch.float64)
    return zimg, text_inputs


def _text_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights in every process, as DDP guarantees
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, EMBED)).double()


def _losses_and_grads(zimg, text_inputs):
    """For each loss: (loss, text-model gradients, log-scale gradient) on the rows given."""
    results = {}
    for name in ("softmax", "sigmoid"):
        model = _text_model()
        log_scale = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(-5.0, dtype=torch.float64, requires_grad=True)
        ztxt = F.normalize(model(text_inputs), dim=-1)
        if name == "softmax":
            loss = contrastive_loss(zimg, ztxt, log_scale.exp())
        else:
            loss = sigmoid_loss(zimg, ztxt, log_scale.exp(), bias)
        loss.backward()
        results[name] = [loss.detach()] + [p.grad for p in model.parameters()] + [log_scale.grad, bias.grad]
    return results


def _worker(rank: int, world_size: int, init_file: str, out_file: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        zimg, text_inputs = _data()
        rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        results = _losses_and_grads(zimg[rows], text_inputs[rows])
        # What DDP does: average gradients (and we average the losses for the report) over processes.
        for tensors in results.values():
            for t in tensors:
                if t is not None:
                    dist.all_reduce(t)
                    t /= world_size
        if rank == 0:
            torch.save(results, out_file)
        # Both processes end their collectives before either tears gloo down: one leaving while the
        # other still talks to it aborts the process now and then (SIGABRT, "terminate called").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


def _exit_without_teardown():
    """End a worker process whose results are saved without running C++ static destructors: gloo's
    (with a file:// store) abort a process now and then (once in about 60 runs here) ("terminate called without an
    active exception", SIGABRT) after every collective has finished, which is no fault of the code
    under test."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_in_processes(worker: str, nprocs: int, *args) -> None:
    """`worker(rank, *args)` of this module in `nprocs` processes at once, started as the tests start processes
    (tests/launch.py: forked from a server that has imported torch, open_clip and the package)."""
    here = Path(__file__).resolve().parent
    code = (f"import json, sys; sys.path[:0] = {[str(here), str(here.parent)]!r}; import test_loss; "
            f"test_loss.{worker}(int(sys.argv[1]), *json.loads(sys.argv[2]))")
    processes = [subprocess.Popen([*python_command(), "-c", code, str(rank), json.dumps(args)], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(nprocs)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank}: {output[-3000:]}"


def test_two_processes_match_one_process_with_the_combined_batch(tmp_path):
    out_file = tmp_path / "results.pt"
    _run_in_processes("_worker", 2, 2, str(tmp_path / "init"), str(out_file))
    distributed = torch.load(out_file, weights_only=True)
    single = _losses_and_grads(*_data())
    for name in ("softmax", "sigmoid"):
        assert len(distributed[name]) == len(single[name])
        for got, want in zip(distributed[name], single[name]):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert single[name][1].abs().sum() > 0  # the comparison is not vacuous


# ---- losses against open_clip --------------------------------------------------------------------

def _loss_and_grads(fn, zimg, ztxt, bias: float = -10.0):
    zimg, ztxt = zimg.clone().requires_grad_(), ztxt.clone().requires_grad_()
    log_scale = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
    logit_bias = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    loss = fn(zimg, ztxt, log_scale.exp(), logit_bias)
    loss.backward()
    return [loss.detach(), zimg.grad, ztxt.grad, log_scale.grad,
            logit_bias.grad if logit_bias.grad is not None else torch.zeros((), dtype=torch.float64)]


def _loss_inputs(batch: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    zimg = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=-1)
    ztxt = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64) + zimg, dim=-1)
    return zimg, ztxt


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_losses_match_open_clip_on_one_process(batch):
    from open_clip.loss import ClipLoss, SigLipLoss

    zimg, ztxt = _loss_inputs(batch, 16, seed=batch)
    pairs = [(lambda i, t, s, b: contrastive_loss(i, t, s), lambda i, t, s, b: ClipLoss()(i, t, s)),
             (lambda i, t, s, b: sigmoid_loss(i, t, s, b), lambda i, t, s, b: SigLipLoss()(i, t, s, b))]
    for ours, theirs in pairs:
        for got, want in zip(_loss_and_grads(ours, zimg, ztxt), _loss_and_grads(theirs, zimg, ztxt)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _dist_worker(rank: int, init_file: str, out_file: str):
    import torch.distributed as dist
    from open_clip.loss import ClipLoss, SigLipLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        zimg, ztxt = _loss_inputs(WORLD * LOCAL, 8, seed=0)
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        zimg, ztxt = zimg[rows], ztxt[rows]
        results = {
            "softmax": (_loss_and_grads(lambda i, t, s, b: contrastive_loss(i, t, s), zimg, ztxt),
                        [_loss_and_grads(lambda i, t, s, b: ClipLoss(local_loss=True, gather_with_grad=True,
                                                                     rank=rank, world_size=WORLD)(i, t, s),
                                         zimg, ztxt)]),
            "sigmoid": (_loss_and_grads(lambda i, t, s, b: sigmoid_loss(i, t, s, b), zimg, ztxt, bias=-3.0),
                        [_loss_and_grads(lambda i, t, s, b, impl=impl: SigLipLoss(rank=rank, world_size=WORLD,
                                                                                  dist_impl=impl)(i, t, s, b),
                                         zimg, ztxt, bias=-3.0) for impl in ("bidir", "shift", "gather")]),
        }
        torch.save(results, f"{out_file}.{rank}")
        dist.barrier()  # as in _worker: no process tears gloo down while another still uses it
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


def test_losses_match_open_clip_across_three_processes(tmp_path):
    """Per process: the same loss and the same gradients (embeddings, scale, bias) as open_clip's
    distributed ClipLoss (local loss, gather with grad) and SigLipLoss (bidir, shift, gather)."""
    out = tmp_path / "out"
    _run_in_processes("_dist_worker", WORLD, str(tmp_path / "init"), str(out))
    for rank in range(WORLD):
        results = torch.load(f"{out}.{rank}", weights_only=True)
        for name, (ours, references) in results.items():
            for reference in references:
                for got, want in zip(ours, reference):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert ours[2].abs().sum() > 0, name  # the text gradient came back through the gather
