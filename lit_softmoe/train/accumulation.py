"""Gradient accumulation: `accum_steps` micro-batches give the gradient of one batch that many times
larger.

- A classification loss is a mean over independent examples, so each micro-batch's loss, divided by
  the number of micro-batches, is backpropagated on its own and the gradients add up
  (the pretraining loop).
- A contrastive loss is not: every example's loss depends on the whole batch (its negatives). As
  open_clip's `--accum-freq` (`open_clip_train/train.py`) does, the embeddings of every micro-batch
  are computed first without a graph; then each micro-batch is embedded again with one, put in its
  place among the others, and the loss over the whole batch is backpropagated
  (`contrastive_accumulation`). Each backward carries the gradient through that micro-batch's
  embeddings only, so the sum over micro-batches is the whole batch's gradient (the logit scale and
  bias, shared by all, take theirs from one backward: open_clip lets every micro-batch add it, N
  times the whole batch's); the price is one extra forward pass. The recompute must give the
  embeddings the first pass gave, also through dropout (a Hugging Face text tower has it): it runs
  from the random state the first pass started from, as activation checkpointing does.

Under DDP each backward but the last runs in `no_sync`, so gradients cross the network once per
step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch


def split_batch(batch: Any, parts: int) -> list:
    """A batch (a tensor, or a dict / tuple / list of tensors sharing dim 0) → `parts` micro-batches
    of equal size along dim 0, in order. The batch size must divide (the configs check it first)."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise ValueError(f"a batch of {batch.shape[0]} does not split into {parts} equal "
                             "micro-batches")
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        pieces = {key: split_batch(value, parts) for key, value in batch.items()}
        return [{key: pieces[key][i] for key in batch} for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        pieces = [split_batch(value, parts) for value in batch]
        return [type(batch)(piece[i] for piece in pieces) for i in range(parts)]
    raise TypeError(f"cannot split a {type(batch).__name__} into micro-batches")


def _random_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replaying(states: tuple):
    """Run the block from the random `states` (CPU, every GPU) and leave the global ones as they
    were."""
    cpu, cuda = states
    with torch.random.fork_rng(devices=range(len(cuda)) if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        yield


def _no_sync_unless_last(no_sync: Callable[[], ContextManager] | None, index: int,
                         count: int) -> ContextManager:
    return no_sync() if no_sync is not None and index < count - 1 else contextlib.nullcontext()


def contrastive_accumulation(embed: Callable[[Any], tuple], loss_fn: Callable[..., torch.Tensor],
                             micro_batches: Sequence, backward: Callable[[torch.Tensor], None],
                             no_sync: Callable[[], ContextManager] | None = None
                             ) -> tuple[torch.Tensor, tuple]:
    """Backpropagate a contrastive loss over the batch that `micro_batches` make up, one
    micro-batch's graph at a time; → (the loss, detached; the outputs of the last micro-batch's
    forward).

    `embed(micro_batch)` → the model's outputs, `(zimg (b, D), ztxt (b, D), *extras)` (a LiTModel's:
    the extras are the logit scale and bias, shared by every micro-batch);
    `loss_fn(zimg, ztxt, *extras)` → the loss over the rows given. Run both under the autocast of
    the step.
    """
    if len(micro_batches) == 1:  # the whole batch at once: no first pass needed
        outputs = embed(micro_batches[0])
        loss = loss_fn(*outputs)
        backward(loss)
        return loss.detach(), outputs
    states, first_pass = [], []  # [(zimg (b, D), ztxt (b, D))]
    with torch.no_grad():
        for micro_batch in micro_batches:
            states.append(_random_states())
            first_pass.append(embed(micro_batch)[:2])
    count = len(micro_batches)
    for index, micro_batch in enumerate(micro_batches):
        with _no_sync_unless_last(no_sync, index, count):
            with _replaying(states[index]):
                outputs = embed(micro_batch)
            zimg = torch.cat([outputs[0] if i == index else pair[0]
                              for i, pair in enumerate(first_pass)])  # (B, D)
            ztxt = torch.cat([outputs[1] if i == index else pair[1]
                              for i, pair in enumerate(first_pass)])  # (B, D)
            # The extras (the logit scale and bias) are the same in every micro-batch's loss: their
            # gradient, that of the whole batch's loss, is taken once, from the last one.
            extras = (outputs[2:] if index == count - 1
                      else tuple(extra.detach() for extra in outputs[2:]))
            loss = loss_fn(zimg, ztxt, *extras)
            backward(loss)
    return loss.detach(), outputs
