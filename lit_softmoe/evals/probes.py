"""The paper's few-shot linear probe: closed-form ridge regression on frozen features.

As in big_vision's few-shot evaluator (the Soft MoE paper's "10-shot" numbers): take k training
images per class, regress {-1, +1} one-hot targets on their features with an L2 penalty, classify
test images by the largest output. The penalty is chosen by leave-one-out error on the k-shot set
itself (closed form for ridge regression), so no test or validation image ever picks it.
"""
from __future__ import annotations

import logging

import torch

_log = logging.getLogger(__name__)

L2_GRID = tuple(2.0 ** e for e in range(-10, 11, 2))


def sample_shots(labels: torch.Tensor, shots: int, seed: int = 0) -> torch.Tensor:
    """Indices of `shots` examples of every class, drawn with a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    picked = []
    for cls in labels.unique(sorted=True):
        members = (labels == cls).nonzero().flatten()
        if len(members) < shots:
            raise ValueError(f"class {int(cls)} has {len(members)} examples, "
                             f"fewer than {shots} shots")
        picked.append(members[torch.randperm(len(members), generator=generator)[:shots]])
    return torch.cat(picked)


def _design(features: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    x = (features.double() - mean) / std
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)  # bias column


def fit_ridge(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2_grid=L2_GRID):
    """Fit the probe; returns (predict function, chosen l2, leave-one-out accuracy)."""
    mean, std = features.double().mean(0), features.double().std(0) + 1e-6
    x = _design(features, mean, std)  # (k·C, d + 1)
    targets = 2.0 * torch.nn.functional.one_hot(labels, num_classes).double() - 1.0  # (k·C, C)
    best = None
    for l2 in l2_grid:
        gram = x.T @ x + l2 * torch.eye(x.shape[1], dtype=x.dtype)
        weights = torch.linalg.solve(gram, x.T @ targets)  # (d + 1, C)
        hat_diag = (x @ torch.linalg.solve(gram, x.T)).diagonal()  # leverage of each shot
        loo_outputs = targets - (targets - x @ weights) / (1.0 - hat_diag)[:, None]
        loo_acc = (loo_outputs.argmax(1) == labels).double().mean().item()
        if best is None or loo_acc > best[2]:
            best = (weights, l2, loo_acc)
    weights, l2, loo_acc = best

    def predict(test_features: torch.Tensor) -> torch.Tensor:
        return (_design(test_features, mean, std) @ weights).argmax(1)

    return predict, l2, loo_acc


def fewshot_probe(shot_features: torch.Tensor, shot_labels: torch.Tensor,
                  test_features: torch.Tensor, test_labels: torch.Tensor, shots: int) -> dict:
    """Fit the probe on the k-shot features (from `sample_shots`); report test top-1."""
    num_classes = int(max(shot_labels.max(), test_labels.max())) + 1
    predict, l2, loo_acc = fit_ridge(shot_features, shot_labels, num_classes)
    acc = (predict(test_features) == test_labels).double().mean().item()
    return {f"fewshot{shots}_top1": acc, f"fewshot{shots}_l2": l2,
            f"fewshot{shots}_loo_top1": loo_acc}


def linear_probe(train_features: torch.Tensor, train_labels: torch.Tensor,
                 test_features: torch.Tensor, test_labels: torch.Tensor, holdout: float = 0.1,
                 seed: int = 0, l2_grid=L2_GRID) -> dict:
    """Full linear probe (all training examples): ridge regression whose L2 penalty is chosen on a
    held-out slice of the training set, then refit on all of it. The ceiling a zero-shot classifier
    over the same frozen features can reach.

    A training set too small to hold out one example (fewer than 1 / `holdout`: 10 at the default)
    has its penalty chosen by leave-one-out error on all of it instead, as the few-shot probe's is,
    with a warning saying so: an empty hold-out scored every penalty NaN, and the smallest was taken
    silently. (Larger sets keep the hold-out: leave-one-out's hat matrix is N × N.) The features are
    standardized, so fewer than 2 training examples are a ValueError."""
    if len(train_labels) < 2:
        raise ValueError("the linear probe needs at least 2 training examples, got "
                         f"{len(train_labels)}")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    order = torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(order) * holdout)
    if cut == 0:
        _log.warning("linear probe: %d training examples are too few for a hold-out of %g of them; "
                     "its L2 penalty is chosen by leave-one-out on all of them instead",
                     len(order), holdout)
        predict, best_l2, _ = fit_ridge(train_features, train_labels, num_classes, l2_grid)
        return {"linear_probe_top1": (predict(test_features) == test_labels).double().mean().item(),
                "linear_probe_l2": best_l2}
    held, fit = order[:cut], order[cut:]
    best_l2 = max(l2_grid, key=lambda l2: (
        _ridge(train_features[fit], train_labels[fit], num_classes, l2)(train_features[held])
        == train_labels[held]).double().mean().item())
    predict = _ridge(train_features, train_labels, num_classes, best_l2)
    return {"linear_probe_top1": (predict(test_features) == test_labels).double().mean().item(),
            "linear_probe_l2": best_l2}


def _ridge(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float):
    mean, std = features.double().mean(0), features.double().std(0) + 1e-6
    x = _design(features, mean, std)
    targets = 2.0 * torch.nn.functional.one_hot(labels, num_classes).double() - 1.0
    weights = torch.linalg.solve(x.T @ x + l2 * torch.eye(x.shape[1], dtype=x.dtype), x.T @ targets)
    return lambda test: (_design(test, mean, std) @ weights).argmax(1)
