"""Zero-shot classifiers as pure functions (as open_clip's `zero_shot_classifier.py` and big_vision's
evaluator do): every (class, template) prompt is encoded, the normalized embeddings of one class
are averaged over its templates and renormalized, giving a (D, C) matrix; an image's logits are its
normalized embedding times that matrix.

All prompts go through the text tower in large batches (not one class per forward pass, the
slowness CLIP_benchmark's users report).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@torch.no_grad()
def build_zeroshot_classifier(encode_text: Callable[[torch.Tensor], torch.Tensor], tokenizer,
                              classnames: Sequence[str], templates: Sequence[str],
                              batch_size: int = 1024, device=None) -> torch.Tensor:
    """(D, C) classifier: column c is the renormalized mean of class c's prompt embeddings."""
    prompts = [template.format(c=name) for name in classnames for template in templates]  # C·T
    embeddings = []
    for start in range(0, len(prompts), batch_size):
        ids = tokenizer(prompts[start:start + batch_size])
        embeddings.append(F.normalize(encode_text(ids.to(device)).float(), dim=-1))
    per_prompt = torch.cat(embeddings).view(len(classnames), len(templates), -1)  # (C, T, D)
    return F.normalize(per_prompt.mean(dim=1), dim=-1).T  # (D, C)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    topk = logits.topk(min(k, logits.shape[1]), dim=1).indices  # (N, k)
    return (topk == labels[:, None]).any(dim=1).float().mean().item()


def mean_per_class_recall(logits: torch.Tensor, labels: torch.Tensor) -> float:
    predictions = logits.argmax(dim=1)
    recalls = [(predictions[labels == c] == c).float().mean() for c in labels.unique()]
    return torch.stack(recalls).mean().item()


def zeroshot_metrics(image_embeddings: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor) -> dict:
    """top-1, top-5 (with >= 5 classes) and mean per-class recall for normalized image embeddings."""
    logits = image_embeddings.float() @ classifier.float().to(image_embeddings.device)  # (N, C)
    labels = labels.to(logits.device)
    metrics = {"top1": topk_accuracy(logits, labels, 1), "mean_per_class_recall": mean_per_class_recall(logits, labels)}
    if classifier.shape[1] >= 5:
        metrics["top5"] = topk_accuracy(logits, labels, 5)
    return metrics
