"""Image–text losses over the global batch: CLIP's softmax contrastive loss and SigLIP's sigmoid
loss.

- Softmax: CLIP (Radford et al., 2021), as LiT (Zhai et al., CVPR 2022) trains it — symmetric
  cross-entropy over the image→text and text→image similarity rows of the whole (all-device) batch.
- Sigmoid: SigLIP (Zhai et al., "Sigmoid Loss for Language Image Pre-Training", ICCV 2023) — every
  pair is a binary problem, −log σ(z·(s·cos + b)), z = +1 on the diagonal and −1 elsewhere, summed
  over pairs and divided by the batch size (big_vision `trainers/proj/image_text/siglip.py`).

Distributed: following open_clip's `--local-loss --gather-with-grad` (`open_clip/loss.py`), each
process gathers the other processes' embeddings *with gradient* and scores only its own rows against
the global batch (B × N logits instead of N × N). Its loss is the mean over its own rows; averaging
the processes' losses — and DDP's averaging of their gradients — gives exactly the loss and gradient
of one process holding the whole batch. All processes must hold the same local batch size (drop
the last incomplete batch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_softmoe.utils.distributed import in_process_group, rank_and_world_size


def _world() -> tuple[int, int]:
    """(rank, world_size) of the process group the features are gathered over; (0, 1) without
    one."""
    return rank_and_world_size() if in_process_group() else (0, 1)


def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """(B, D) local rows → (world_size·B, D) global rows, ordered by rank; gradients flow back to
    every process's rows (the backward sums each row's gradient over processes). Identity without
    distributed or with one process."""
    _, world_size = _world()
    if world_size == 1:
        return t
    return _GatherRows.apply(t)  # (world_size·B, D)


class _GatherRows(torch.autograd.Function):
    """all_gather with a backward (torch's `torch.distributed.nn.functional.all_gather` is
    deprecated, and its replacement lives in a private module): every process computes a gradient
    for every gathered row, and a process's own rows get the sum of them all. Runs on any backend
    (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.rank = dist.get_rank()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # (world_size·B, D), reduced in place
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)  # summed over processes
        return grad.chunk(dist.get_world_size())[ctx.rank]


def _global_batch(zimg: torch.Tensor, ztxt: torch.Tensor, gather: bool):
    """→ (all images (N, D), all texts (N, D), index of this process's first row in them)."""
    if zimg.shape != ztxt.shape:
        raise ValueError(f"image and text embeddings differ in shape: {tuple(zimg.shape)} vs "
                         f"{tuple(ztxt.shape)}")
    rank, world_size = _world() if gather else (0, 1)
    if world_size == 1:
        return zimg, ztxt, 0
    return gather_with_grad(zimg), gather_with_grad(ztxt), rank * zimg.shape[0]


def contrastive_loss(zimg: torch.Tensor, ztxt: torch.Tensor, logit_scale: torch.Tensor,
                     gather: bool = True) -> torch.Tensor:
    """CLIP's symmetric softmax cross-entropy; zimg, ztxt (B, D) local, normalized; scalar loss.
    `logit_scale` is the scale itself (`LiTModel(...)[2]`, the parameter `model.logit_scale` exp'd),
    as the argument of open_clip's ClipLoss, so `contrastive_loss(*model(image, text))` works."""
    all_img, all_txt, offset = _global_batch(zimg, ztxt, gather)
    logits_per_image = logit_scale * zimg @ all_txt.T  # (B, N): my images vs every text
    logits_per_text = logit_scale * ztxt @ all_img.T  # (B, N): my texts vs every image
    # my positives sit at rank·B + i
    labels = offset + torch.arange(zimg.shape[0], device=zimg.device)
    return 0.5 * (F.cross_entropy(logits_per_image, labels)
                  + F.cross_entropy(logits_per_text, labels))


def sigmoid_loss(zimg: torch.Tensor, ztxt: torch.Tensor, logit_scale: torch.Tensor,
                 logit_bias: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss; zimg, ztxt (B, D) local, normalized; scalar loss.
    `logit_scale` is the scale itself, as in `contrastive_loss`:
    `sigmoid_loss(*model(image, text))`.

    Every pair enters once (my images × all texts), so only the texts need gathering.
    """
    if zimg.shape != ztxt.shape:
        raise ValueError(f"image and text embeddings differ in shape: {tuple(zimg.shape)} vs "
                         f"{tuple(ztxt.shape)}")
    rank, world_size = _world() if gather else (0, 1)
    all_txt = gather_with_grad(ztxt) if world_size > 1 else ztxt  # (N, D)
    local_batch = zimg.shape[0]
    logits = logit_scale * zimg @ all_txt.T + logit_bias  # (B, N)
    labels = -torch.ones_like(logits)  # z = -1 for every negative pair …
    rows = torch.arange(local_batch, device=zimg.device)
    labels[rows, rank * local_batch + rows] = 1.0  # … and +1 for my image with its own text
    # Sum over pairs / batch size, as big_vision: keeps the loss O(1) per image whatever N is.
    return -F.logsigmoid(labels * logits).sum() / local_batch
