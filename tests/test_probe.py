"""The closed-form few-shot linear probe, on data whose right answer is known by construction."""
import torch

from lit_softmoe.train.probe import fewshot_probe, fit_ridge, sample_shots


def _blobs(num_classes=5, per_class=40, dim=16, spread=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(num_classes, dim, generator=g) * 3
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return centers[labels] + spread * torch.randn(len(labels), dim, generator=g), labels


def test_sample_shots_takes_k_per_class_deterministically():
    labels = torch.arange(4).repeat(30)
    idx = sample_shots(labels, 10, seed=3)
    assert torch.equal(torch.bincount(labels[idx]), torch.full((4,), 10))
    assert torch.equal(idx, sample_shots(labels, 10, seed=3))
    assert not torch.equal(idx, sample_shots(labels, 10, seed=4))


def test_probe_separates_separable_classes_and_fails_on_shuffled_labels():
    x, y = _blobs()
    idx = sample_shots(y, 5, seed=0)
    good = fewshot_probe(x[idx], y[idx], x, y, shots=5)
    assert good["fewshot5_top1"] == 1.0
    shuffled = y[idx][torch.randperm(len(idx), generator=torch.Generator().manual_seed(0))]
    bad = fewshot_probe(x[idx], shuffled, x, y, shots=5)
    assert bad["fewshot5_top1"] < 0.6


def test_ridge_matches_lstsq_and_leave_one_out_is_exact():
    x, y = _blobs(num_classes=3, per_class=6, dim=4, spread=2.0)
    predict, l2, loo = fit_ridge(x, y, 3, l2_grid=(0.5,))
    # The closed-form leave-one-out accuracy equals refitting without each point in turn.
    hits = 0
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        # Same standardization as the full fit: LOO of the ridge solve, not of the preprocessing.
        mean, std = x.double().mean(0), x.double().std(0) + 1e-6
        design = torch.cat([(x.double() - mean) / std, torch.ones(len(x), 1, dtype=torch.float64)], 1)
        targets = 2.0 * torch.nn.functional.one_hot(y, 3).double() - 1
        a = design[keep]
        w = torch.linalg.solve(a.T @ a + 0.5 * torch.eye(a.shape[1], dtype=a.dtype), a.T @ targets[keep])
        hits += int((design[i] @ w).argmax() == y[i])
    assert loo == hits / len(y)
    assert l2 == 0.5
