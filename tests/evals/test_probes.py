"""lit_softmoe.evals.probes: the closed-form few-shot and linear probes, on data whose right answer is
known by construction."""
import pytest
import torch

from lit_softmoe.evals.probes import L2_GRID, fewshot_probe, fit_ridge, linear_probe, sample_shots


def test_sample_shots_takes_k_per_class_deterministically():
    labels = torch.arange(4).repeat(30)
    idx = sample_shots(labels, 10, seed=3)
    assert torch.equal(torch.bincount(labels[idx]), torch.full((4,), 10))
    assert torch.equal(idx, sample_shots(labels, 10, seed=3))
    assert not torch.equal(idx, sample_shots(labels, 10, seed=4))


def _blobs(num_classes=5, per_class=40, dim=16, spread=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(num_classes, dim, generator=g) * 3
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return centers[labels] + spread * torch.randn(len(labels), dim, generator=g), labels


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


def _hand_ridge(x, y, num_classes, l2, keep=None):
    """Ridge on {-1, +1} targets with the standardization of all of x (as fit_ridge), solved directly."""
    mean, std = x.double().mean(0), x.double().std(0) + 1e-6
    design = torch.cat([(x.double() - mean) / std, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    targets = 2.0 * torch.nn.functional.one_hot(y, num_classes).double() - 1
    a, t = (design, targets) if keep is None else (design[keep], targets[keep])
    w = torch.linalg.solve(a.T @ a + l2 * torch.eye(a.shape[1], dtype=a.dtype), a.T @ t)
    return w, design, mean, std


def test_fit_ridge_picks_the_best_leave_one_out_penalty_and_predicts_with_its_weights():
    # The test above has a one-value grid (its l2 == 0.5 cannot fail) and never calls `predict`.
    x, y = _blobs(num_classes=3, per_class=6, dim=4, spread=2.0)
    grid = (2.0 ** -6, 0.5, 8.0, 64.0, 1024.0)
    loo_by_l2 = {}
    for l2 in grid:  # leave-one-out by refitting without each point
        hits = 0
        for i in range(len(y)):
            w, design, _, _ = _hand_ridge(x, y, 3, l2, keep=torch.arange(len(y)) != i)
            hits += int((design[i] @ w).argmax() == y[i])
        loo_by_l2[l2] = hits / len(y)
    assert len(set(loo_by_l2.values())) > 1  # the grid is discriminative
    best = max(grid, key=lambda l2: loo_by_l2[l2])  # the first of the best, in grid order
    predict, l2, loo = fit_ridge(x, y, 3, l2_grid=grid)
    assert (l2, loo) == (best, loo_by_l2[best])
    # Predictions on other features: the chosen penalty's weights, with the shots' standardization.
    test = _blobs(num_classes=3, per_class=10, dim=4, spread=4.0, seed=1)[0] * 2 + 1
    w, _, mean, std = _hand_ridge(x, y, 3, best)
    scores = torch.cat([(test.double() - mean) / std, torch.ones(len(test), 1, dtype=torch.float64)], 1) @ w
    want = scores.argmax(1)
    assert len(want.unique()) == 3
    assert torch.equal(predict(test), want)
    other = _hand_ridge(x, y, 3, grid[-1] if best != grid[-1] else grid[0])[0]
    assert not torch.equal(want, (torch.cat([(test.double() - mean) / std, torch.ones(len(test), 1,
                                  dtype=torch.float64)], 1) @ other).argmax(1))  # another penalty predicts otherwise


def _few_examples(num_train=9):
    """3 classes in 8 noisy dimensions: 9 training examples, where leave-one-out picks l2 = 16 (its
    error 1/9 against 3/9 at the smallest penalty), and 300 test examples."""
    generator = torch.Generator().manual_seed(3)
    centers = torch.randn(3, 8, generator=generator) * 2
    train_labels, test_labels = torch.arange(3).repeat(num_train // 3), torch.arange(3).repeat(100)
    train = centers[train_labels] + 2.0 * torch.randn(len(train_labels), 8, generator=generator)
    test = centers[test_labels] + 2.0 * torch.randn(len(test_labels), 8, generator=generator)
    return train, train_labels, test, test_labels


def test_linear_probe_without_a_hold_out_picks_its_penalty_by_leave_one_out(caplog):
    """Under 10 samples the 10% hold-out was empty: every penalty scored NaN and the smallest was
    taken, silently. The penalty is now chosen by leave-one-out on the training samples, and the
    probe says so."""
    train, train_labels, test, test_labels = _few_examples()
    with caplog.at_level("WARNING", logger="lit_softmoe.evals.probes"):
        results = linear_probe(train, train_labels, test, test_labels)
    assert results["linear_probe_l2"] == 16.0  # the empty hold-out gave the smallest, 2**-10
    predict, _, _ = fit_ridge(train, train_labels, 3, l2_grid=(16.0,))  # refit on all 9 at that penalty
    assert results["linear_probe_top1"] == (predict(test) == test_labels).double().mean().item()
    assert [r.getMessage() for r in caplog.records] == [
        "linear probe: 9 training examples are too few for a hold-out of 0.1 of them; its L2 penalty is chosen by "
        "leave-one-out on all of them instead"]
    # 10 samples hold one out, as before: no warning.
    caplog.clear()
    train, train_labels, test, test_labels = _few_examples(num_train=12)
    with caplog.at_level("WARNING", logger="lit_softmoe.evals.probes"):
        results = linear_probe(train[:10], train_labels[:10], test, test_labels)
    assert results["linear_probe_l2"] in L2_GRID and not caplog.records
    with pytest.raises(ValueError, match="the linear probe needs at least 2 training examples, got 1"):
        linear_probe(train[:1], train_labels[:1], test, test_labels)
