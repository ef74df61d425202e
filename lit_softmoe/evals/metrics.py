"""Zero-shot metrics as pure functions on embeddings: classification (top-k accuracy, mean per-class
recall) and retrieval (recall@k in both directions).

Definitions follow CLIP_benchmark (`metrics/zeroshot_classification.py`, `zeroshot_retrieval.py`),
so the two suites agree on the same embeddings:
- top-k: the true class is among the k highest logits; top-5 only with >= 5 classes (undefined
  below);
- mean per-class recall (balanced accuracy): per-class recall averaged over the classes present in
  the labels — a class absent from the split has no recall and is left out, as in sklearn's
  `balanced_accuracy_score`;
- retrieval recall@k, as the CLIP paper counts it: image→text is a hit when ANY of the image's
  captions is among the k captions ranked highest; text→image when the caption's image is among
  the k images ranked highest.

Ties are broken toward the lower index (a stable descending sort, the same rule as `argmax`), so a
result never depends on the order `topk` happens to return equal scores in.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _ranking(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(N, M) scores → (N, min(k, M)) column indices, best first, ties to the lower index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    topk = _ranking(logits, k)  # (N, k)
    return (topk == labels[:, None]).any(dim=1).float().mean().item()


def mean_per_class_recall(logits: torch.Tensor, labels: torch.Tensor) -> float:
    predictions = _ranking(logits, 1)[:, 0]
    recalls = [(predictions[labels == c] == c).float().mean() for c in labels.unique()]
    return torch.stack(recalls).mean().item()


def zeroshot_metrics(image_embeddings: torch.Tensor, labels: torch.Tensor,
                     classifier: torch.Tensor) -> dict:
    """top-1, top-5 (with >= 5 classes) and mean per-class recall for normalized image
    embeddings."""
    logits = image_embeddings.float() @ classifier.float().to(image_embeddings.device)  # (N, C)
    labels = labels.to(logits.device)
    metrics = {"top1": topk_accuracy(logits, labels, 1)}
    if classifier.shape[1] >= 5:
        metrics["top5"] = topk_accuracy(logits, labels, 5)
    metrics["mean_per_class_recall"] = mean_per_class_recall(logits, labels)
    return metrics


def retrieval_metrics(image_embeddings: torch.Tensor, text_embeddings: torch.Tensor,
                      text_to_image: torch.Tensor, ks: Sequence[int] = (1, 5, 10),
                      chunk: int = 4096) -> dict:
    """Recall@k both ways for normalized embeddings.

    Args:
        image_embeddings: (N, D); text_embeddings: (M, D), every caption of every image.
        text_to_image: (M,) the index of each caption's image.
        chunk: rows of the (rows, N or M) score matrix held at once (COCO: 25k × 5k).
    """
    if len(text_embeddings) == 0 or len(image_embeddings) == 0:  # not a 0: there is nothing to rank
        raise ValueError(f"retrieval needs images and captions; got {len(image_embeddings)} images "
                         f"and {len(text_embeddings)} captions")
    images, texts = image_embeddings.float(), text_embeddings.float()
    text_to_image = text_to_image.to(images.device)
    kmax = max(ks)
    # text → image: the caption's own image among its top k images.
    t2i_rank = torch.cat([_ranking(texts[s:s + chunk] @ images.T, kmax)
                          for s in range(0, len(texts), chunk)])
    # image → text: any caption of the image among its top k captions.
    i2t_rank = torch.cat([_ranking(images[s:s + chunk] @ texts.T, kmax)
                          for s in range(0, len(images), chunk)])
    i2t_hits = (text_to_image[i2t_rank]
                == torch.arange(len(images), device=images.device)[:, None])  # (N, kmax)
    t2i_hits = t2i_rank == text_to_image[:, None]  # (M, kmax)
    metrics = {}
    for k in ks:
        metrics[f"image_to_text_R@{k}"] = i2t_hits[:, :k].any(dim=1).float().mean().item()
    for k in ks:
        metrics[f"text_to_image_R@{k}"] = t2i_hits[:, :k].any(dim=1).float().mean().item()
    return metrics
