"""lit_softmoe.nn.soft_moe: the Soft MoE layer against Algorithm 1 of Puigcerver et al. (ICLR 2024) as
google-research/vmoe `vmoe/projects/soft_moe/router.py` runs it, a loop-by-loop reference and the
step-by-step oracle (tests/soft_moe_reference.py); padding masks, noise, mixed precision and the fused
forward. Shapes are tiny (CPU, < 1 s each)."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_softmoe.nn.soft_moe import BatchedExperts, SoftMoE, slots_for_capacity
from soft_moe_layers import make_layer, randn
from soft_moe_reference import reference_forward

# ---- a slot-by-slot reference with explicit loops ------------------------------------------------

def _gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def naive_soft_moe(layer: SoftMoE, x: torch.Tensor) -> torch.Tensor:
    """Soft MoE written the slow way: loops over examples, experts, slots and tokens."""
    b, m, d = x.shape
    n, p = layer.num_experts, layer.slots_per_expert
    phi, scale = layer.phi.detach(), float(layer.scale.detach())
    w1, b1 = layer.experts.w1.detach(), layer.experts.b1.detach()
    w2, b2 = layer.experts.w2.detach(), layer.experts.b2.detach()
    out = torch.zeros_like(x)
    for e in range(b):
        # logits[i][j][s] = scale * <x_i / |x_i|, phi_js / |phi_js|>
        logits = [[[0.0] * p for _ in range(n)] for _ in range(m)]
        for i in range(m):
            xi = x[e, i]
            xi_hat = xi / math.sqrt(float((xi * xi).sum()) + 1e-6)
            for j in range(n):
                for s in range(p):
                    ph = phi[:, j, s]
                    ph_hat = ph / math.sqrt(float((ph * ph).sum()) + 1e-6)
                    logits[i][j][s] = scale * float((xi_hat * ph_hat).sum())
        # Each slot: a convex mix of the raw tokens, weights = softmax over tokens.
        slot_out = {}
        for j in range(n):
            for s in range(p):
                denom = sum(math.exp(logits[i][j][s]) for i in range(m))
                slot_in = torch.zeros(d, dtype=x.dtype)
                for i in range(m):
                    slot_in = slot_in + math.exp(logits[i][j][s]) / denom * x[e, i]
                hidden = _gelu_tanh(slot_in @ w1[j] + b1[j])  # expert j alone
                slot_out[j, s] = hidden @ w2[j] + b2[j]
        # Each token: a convex mix of all slot outputs, weights = softmax over all n·p slots.
        for i in range(m):
            denom = sum(math.exp(logits[i][j][s]) for j in range(n) for s in range(p))
            for j in range(n):
                for s in range(p):
                    out[e, i] += math.exp(logits[i][j][s]) / denom * slot_out[j, s]
    return out


def test_matches_naive_loop_reference_fp32():
    layer = make_layer(dim=8, num_experts=3, slots=2, hidden=12, dtype=torch.float32)
    x = randn(2, 5, 8, dtype=torch.float32, std=2.0)
    with torch.no_grad():
        got = layer(x)
    want = naive_soft_moe(layer, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The reference is discriminative: it is far from a zero output.
    assert want.abs().max() > 0.1


def expected_logits(layer: SoftMoE, x: torch.Tensor) -> torch.Tensor:
    """scale · cos(x_i, phi_{j,s}), shape (b, m, n, p), written independently of the layer."""
    x_hat = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    phi = layer.phi.detach()
    phi_hat = phi / torch.sqrt((phi * phi).sum(0, keepdim=True) + 1e-6)
    return layer.scale.detach() * torch.einsum("bmd,dnp->bmnp", x_hat, phi_hat)


def test_routing_weights_equal_the_two_softmaxes_of_the_cosine_logits():
    layer = make_layer()
    x = randn(2, 7, 8)  # m = 7 tokens, n·p = 6 slots: the axes are distinguishable
    dispatch, combine = layer.routing_weights(x)
    logits = expected_logits(layer, x)
    want_dispatch = logits.softmax(dim=1)
    want_combine = logits.flatten(2).softmax(dim=-1).view_as(logits)
    torch.testing.assert_close(dispatch, want_dispatch)
    torch.testing.assert_close(combine, want_combine)


def test_fp64_stays_fp64():
    # Routing is done in fp32 *at least*: an fp64 layer must not be rounded through fp32.
    layer = make_layer(dtype=torch.float64)
    x = randn(2, 5, 8)
    dispatch, combine = layer.routing_weights(x)
    assert dispatch.dtype == combine.dtype == torch.float64
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, naive_soft_moe(layer, x), atol=1e-12, rtol=1e-12)


# ---- properties the reference lists --------------------------------------------------------------

def test_dispatch_and_combine_are_normalized_on_their_own_axes():
    layer = make_layer(num_experts=4, slots=2)
    x = randn(3, 10, 8, std=3.0)
    dispatch, combine = layer.routing_weights(x)
    assert dispatch.shape == combine.shape == (3, 10, 4, 2)
    assert (dispatch >= 0).all() and (combine >= 0).all()
    # Dispatch: for each slot, a distribution over the 10 tokens.
    torch.testing.assert_close(dispatch.sum(dim=1), torch.ones(3, 4, 2, dtype=dispatch.dtype))
    # Combine: for each token, a distribution over all 4·2 slots jointly (not per expert).
    torch.testing.assert_close(combine.sum(dim=(2, 3)), torch.ones(3, 10, dtype=combine.dtype))
    assert not torch.allclose(combine.sum(dim=3), torch.ones(3, 10, 4, dtype=combine.dtype))
    # No token is dropped: every token gets a positive weight from every slot.
    assert (combine > 0).all()


def test_no_token_dropped_even_with_sharp_routing():
    layer = make_layer(scale=30.0)
    x = randn(2, 9, 8)
    dispatch, combine = layer.routing_weights(x)
    assert (combine > 0).all() and (dispatch > 0).all()
    # Sharp: the weights are far from uniform, so this is not the trivial init case.
    assert combine.max() > 0.5


def test_output_of_one_example_ignores_the_rest_of_the_batch():
    layer = make_layer()
    x = randn(4, 6, 8)
    others = x.clone()
    others[1:] = randn(3, 6, 8, seed=7, std=10.0)
    with torch.no_grad():
        y = layer(x)
        y_others = layer(others)
        y_alone = layer(x[:1])
    torch.testing.assert_close(y_others[0], y[0])
    torch.testing.assert_close(y_alone[0], y[0])
    assert not torch.allclose(y_others[1], y[1])  # the other rows did change
    d_full, c_full = layer.routing_weights(x)
    d_alone, c_alone = layer.routing_weights(x[:1])
    torch.testing.assert_close(d_full[:1], d_alone)
    torch.testing.assert_close(c_full[:1], c_alone)


def test_permuting_tokens_permutes_the_output():
    layer = make_layer()
    x = randn(2, 7, 8)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:, perm]), layer(x)[:, perm])


def test_routing_is_invariant_to_scaling_a_token():
    layer = make_layer()
    x = randn(2, 6, 8)
    c = torch.tensor([0.3, 1.0, 2.5, 7.0, 40.0, 1.7], dtype=x.dtype)[None, :, None]
    d1, c1 = layer.routing_weights(x)
    d2, c2 = layer.routing_weights(x * c)
    # Not bit-exact: the 1e-6 inside the normalization's square root breaks exact invariance.
    torch.testing.assert_close(d2, d1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(c2, c1, atol=1e-6, rtol=1e-6)


def test_every_expert_phi_and_scale_receive_gradient():
    layer = make_layer(num_experts=4, slots=2)
    x = randn(2, 6, 8, std=2.0)
    target = randn(2, 6, 8, seed=5)
    loss = ((layer(x) - target) ** 2).sum()
    loss.backward()
    ex = layer.experts
    for name in ("w1", "b1", "w2", "b2"):
        grad = getattr(ex, name).grad
        assert grad is not None, name
        per_expert = grad.flatten(1).abs().amax(dim=1)  # (n,)
        assert (per_expert > 0).all(), f"{name}: an expert got no gradient: {per_expert}"
    assert (layer.phi.grad.abs().amax(dim=0) > 0).all()  # every slot's phi column
    assert layer.scale.grad is not None and layer.scale.grad.abs() > 0


def test_every_expert_receives_gradient_with_shared_init():
    # With the default shared init, all experts are equal, but each is a separate parameter slice.
    torch.manual_seed(0)
    layer = SoftMoE(8, 4, 12, slots_per_expert=1)
    layer(torch.randn(2, 5, 8)).square().sum().backward()
    for name in ("w1", "w2"):
        assert (getattr(layer.experts, name).grad.flatten(1).abs().amax(dim=1) > 0).all()


# ---- one test per bug seen in public ports -------------------------------------------------------

def test_bug_swapped_softmax_axes():
    layer = make_layer()
    x = randn(1, 7, 8)
    dispatch, combine = layer.routing_weights(x)
    logits = expected_logits(layer, x)
    swapped_dispatch = logits.flatten(2).softmax(-1).view_as(logits)  # over slots
    swapped_combine = logits.softmax(dim=1)  # over tokens
    assert not torch.allclose(dispatch, swapped_dispatch, atol=1e-3)
    assert not torch.allclose(combine, swapped_combine, atol=1e-3)


def test_bug_dispatch_softmax_over_the_batch_axis():
    # A softmax over dim 0 would make row 0's dispatch depend on row 1 (and sum to 1 over rows).
    layer = make_layer()
    x = randn(2, 5, 8)
    d_pair, _ = layer.routing_weights(x)
    d_single, _ = layer.routing_weights(x[:1])
    torch.testing.assert_close(d_pair[:1], d_single)
    assert not torch.allclose(d_pair.sum(dim=0), torch.ones_like(d_pair[0]), atol=1e-3)


def _capture_expert_inputs(layer: SoftMoE, x: torch.Tensor) -> torch.Tensor:
    seen = []
    handle = layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            layer(x)
    finally:
        handle.remove()
    return seen[0]  # (n, b·p, d)


def test_bug_normalized_tokens_fed_to_the_experts():
    layer = make_layer(num_experts=3, slots=2)
    x = randn(2, 6, 8, std=5.0)
    slots = _capture_expert_inputs(layer, x)  # (n, b·p, d)
    dispatch, _ = layer.routing_weights(x)
    want = torch.einsum("bmnp,bmd->nbpd", dispatch, x).reshape(3, 2 * 2, 8)
    torch.testing.assert_close(slots, want)
    # Collinear tokens of magnitudes c_i: every x̂ is equal, so dispatch is uniform and each slot
    # input is mean(c)·v. Feeding x̂ would give v itself (norm 1 instead of mean(c)).
    v = F.normalize(randn(8, seed=4), dim=0)
    c = torch.tensor([5.0, 6.0, 7.0, 8.0, 9.0, 10.0], dtype=torch.float64)
    slots = _capture_expert_inputs(layer, (c[:, None] * v)[None])  # (n, p, d)
    torch.testing.assert_close(slots.norm(dim=-1), torch.full((3, 2), 7.5, dtype=torch.float64))


def test_bug_rmsnorm_gain_makes_initial_logits_about_d_times_cosine():
    # At init (scale 1) logits are cosines in [-1, 1]: for every token the combine weights differ by
    # at most a factor e² across slots, for every slot the dispatch weights by e² across tokens.
    # With an RMSNorm sqrt(d) gain on both sides, logits would be d·cos and those ratios huge.
    torch.manual_seed(0)
    d = 256
    layer = SoftMoE(d, 8, 16, slots_per_expert=2, dtype=torch.float64)
    x = F.layer_norm(randn(2, 20, d), (d,))  # LayerNorm output: norm ≈ sqrt(d) = 16
    logits = layer.routing_logits(x)
    assert logits.abs().max() <= 1.0 + 1e-9
    torch.testing.assert_close(logits.view(2, 20, 8, 2), expected_logits(layer, x))
    dispatch, combine = layer.routing_weights(x)
    log_c, log_d = combine.log(), dispatch.log()
    assert (log_c.amax(dim=(2, 3)) - log_c.amin(dim=(2, 3))).max() <= 2.0 + 1e-9
    assert (log_d.amax(dim=1) - log_d.amin(dim=1)).max() <= 2.0 + 1e-9


def test_bug_experts_in_a_python_loop_over_a_modulelist():
    layer = SoftMoE(8, 5, 12, slots_per_expert=1)
    assert not any(isinstance(mod, nn.ModuleList) for mod in layer.modules())
    assert layer.experts.w1.shape == (5, 8, 12) and layer.experts.w2.shape == (5, 12, 8)
    assert layer.experts.b1.shape == (5, 12) and layer.experts.b2.shape == (5, 8)


def test_batched_experts_equal_each_expert_alone():
    torch.manual_seed(0)
    experts = BatchedExperts(3, 6, 10, shared_init=False, dtype=torch.float64)
    with torch.no_grad():
        experts.b1.normal_()
        experts.b2.normal_()
    x = randn(3, 4, 6)
    out = experts(x)
    for j in range(3):
        want = _gelu_tanh(x[j] @ experts.w1[j] + experts.b1[j]) @ experts.w2[j] + experts.b2[j]
        torch.testing.assert_close(out[j], want.detach())


# ---- shapes, capacity, init ----------------------------------------------------------------------

def test_official_router_shape_anchor():
    # vmoe router_test: x (1, 8, 16), 5 experts, capacity factor 1.0 -> mu of shape (16, 5, 2).
    layer = SoftMoE(16, 5, 32, capacity_factor=1.0, num_tokens=8)
    assert layer.phi.shape == (16, 5, 2)
    assert layer.slots_per_expert == 2 and layer.num_slots == 10
    x = torch.randn(1, 8, 16)
    assert layer(x).shape == (1, 8, 16)
    dispatch, combine = layer.routing_weights(x)
    assert dispatch.shape == combine.shape == (1, 8, 5, 2)


def test_slots_for_capacity():
    assert slots_for_capacity(8, 5, 1.0) == 2  # 1.6 rounds to 2
    assert slots_for_capacity(196, 128, 1.0) == 2  # 1.53
    assert slots_for_capacity(196, 196, 1.0) == 1
    assert slots_for_capacity(16, 4, 2.0) == 8
    with pytest.raises(ValueError, match="< 1"):
        slots_for_capacity(4, 16, 1.0)  # 0.25 slots per expert
    with pytest.raises(ValueError):
        SoftMoE(16, 32, 8, capacity_factor=1.0, num_tokens=8)
    with pytest.raises(ValueError):
        SoftMoE(16, 4, 8)  # neither slots nor capacity given
    with pytest.raises(ValueError):
        SoftMoE(16, 4, 8, capacity_factor=1.0)  # capacity without num_tokens
    with pytest.raises(ValueError):
        SoftMoE(16, 4, 8, slots_per_expert=0)


def test_accepts_other_sequence_lengths_than_its_capacity_was_derived_for():
    layer = make_layer(dim=8, num_experts=4, slots=None, capacity_factor=1.0, num_tokens=8)
    assert layer.slots_per_expert == 2
    for m in (3, 8, 13):
        x = randn(2, m, 8)
        with torch.no_grad():
            y = layer(x)
        assert y.shape == (2, m, 8) and torch.isfinite(y).all()
        dispatch, combine = layer.routing_weights(x)
        torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 4, 2, dtype=torch.float64))
        torch.testing.assert_close(combine.sum((2, 3)), torch.ones(2, m, dtype=torch.float64))
        torch.testing.assert_close(y, naive_soft_moe(layer, x))


def test_phi_init_statistics():
    torch.manual_seed(0)
    d, n, p = 64, 32, 4
    layer = SoftMoE(d, n, 16, slots_per_expert=p)
    phi = layer.phi.detach()
    std = 1.0 / math.sqrt(n * d)  # lecun-normal with fan_in = n·d
    assert abs(phi.std().item() / std - 1.0) < 0.05
    assert abs(phi.mean().item()) < 0.05 * std
    bound = 2.0 * std / 0.87962566103423978  # truncated at ±2 σ of the *untruncated* normal
    assert phi.abs().max() <= bound + 1e-7
    assert phi.abs().max() > 0.95 * bound  # truncated there, not tighter
    assert layer.scale.item() == 1.0 and layer.scale.shape == ()


def test_initial_logits_are_cosines():
    torch.manual_seed(0)
    layer = SoftMoE(32, 6, 16, slots_per_expert=2, dtype=torch.float64)
    x = randn(3, 9, 32, std=50.0)
    logits = layer.routing_logits(x)
    assert logits.shape == (3, 9, 12)
    assert logits.abs().max() <= 1.0 + 1e-12
    torch.testing.assert_close(logits.view(3, 9, 6, 2), expected_logits(layer, x))


def test_scale_multiplies_the_logits_on_either_side():
    # The scalar goes into whichever operand is smaller; both branches must give scale·cos.
    torch.manual_seed(0)
    layer = SoftMoE(8, 4, 16, slots_per_expert=2, dtype=torch.float64)
    with torch.no_grad():
        layer.scale.fill_(2.5)
    small, large = randn(1, 2, 8), randn(5, 20, 8)  # 16 < 64 = phi.numel() < 800
    for x in (small, large):
        torch.testing.assert_close(layer.routing_logits(x).view(*x.shape[:2], 4, 2), expected_logits(layer, x))


def test_shared_and_independent_expert_init():
    torch.manual_seed(0)
    shared = SoftMoE(8, 4, 12, slots_per_expert=1)
    independent = SoftMoE(8, 4, 12, slots_per_expert=1, shared_expert_init=False)
    for name in ("w1", "w2"):
        w = getattr(shared.experts, name)
        for j in range(1, 4):
            assert torch.equal(w[j], w[0])
        w = getattr(independent.experts, name)
        for j in range(1, 4):
            assert not torch.allclose(w[j], w[0])
    # Shared or not, each expert's kernel is xavier-uniform: bounded by sqrt(6 / (fan_in + fan_out)).
    bound = math.sqrt(6.0 / (8 + 12))
    assert independent.experts.w1.abs().max() <= bound
    assert independent.experts.w1.abs().max() > 0.9 * bound
    assert independent.experts.b1.abs().max() < 1e-4  # N(0, 1e-6) biases
    # Shared init is a starting point, not a tie: the slices are separate parameters.
    with torch.no_grad():
        shared.experts.w1[0].add_(1.0)
    assert not torch.equal(shared.experts.w1[1], shared.experts.w1[0])


def test_meta_device_allocates_nothing():
    layer = SoftMoE(64, 8, 128, slots_per_expert=1, device="meta")
    assert all(p.is_meta for p in layer.parameters())
    assert layer(torch.empty(2, 10, 64, device="meta")).shape == (2, 10, 64)


# ---- padding mask --------------------------------------------------------------------------------

def test_padding_mask_matches_the_unpadded_sequence():
    layer = make_layer()
    x = randn(2, 7, 8, std=2.0)
    x[0, 5:] = 1e3  # padding with huge values must not leak into the valid tokens
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 5:] = False
    with torch.no_grad():
        y = layer(x, mask)
        y_unpadded = layer(x[:1, :5])
        y_full_row = layer(x[1:])
    torch.testing.assert_close(y[0, :5], y_unpadded[0])
    torch.testing.assert_close(y[1], y_full_row[0])
    assert torch.equal(y[0, 5:], torch.zeros_like(y[0, 5:]))
    dispatch, combine = layer.routing_weights(x, mask)
    assert torch.equal(dispatch[0, 5:], torch.zeros_like(dispatch[0, 5:]))
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 3, 2, dtype=dispatch.dtype))
    d_unpadded, c_unpadded = layer.routing_weights(x[:1, :5])
    torch.testing.assert_close(dispatch[:1, :5], d_unpadded)
    torch.testing.assert_close(combine[:1, :5], c_unpadded)


def test_padding_with_inf_or_nan_does_not_leak():
    layer = make_layer()
    x = randn(1, 6, 8)
    mask = torch.tensor([[True, True, True, True, False, False]])
    with torch.no_grad():
        expected = layer(x[:, :4])
        x[0, 4], x[0, 5] = float("inf"), float("nan")
        y = layer(x, mask)
    torch.testing.assert_close(y[:, :4], expected)
    assert torch.equal(y[0, 4:], torch.zeros_like(y[0, 4:]))


def test_padding_mask_gradient_ignores_padded_tokens():
    layer = make_layer()
    x = randn(1, 6, 8).requires_grad_()
    mask = torch.tensor([[True, True, True, True, False, False]])
    layer(x, mask).square().sum().backward()
    assert torch.equal(x.grad[0, 4:], torch.zeros_like(x.grad[0, 4:]))
    assert (x.grad[0, :4].abs().amax(-1) > 0).all()


# ---- noise ---------------------------------------------------------------------------------------

def test_noise_is_off_by_default():
    layer = make_layer()
    assert layer.noise_std == 0.0
    layer.train()
    x = randn(2, 6, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)


def test_noise_on_in_training_only():
    x = randn(2, 6, 8)
    noisy = make_layer(noise_std=0.5)
    clean = make_layer(noise_std=0.0)  # same seed, same parameters
    noisy.train()
    with torch.no_grad():
        y1, y2 = noisy(x), noisy(x)
        dispatch, combine = noisy.routing_weights(x)
    assert not torch.allclose(y1, y2)
    assert not torch.allclose(y1, clean(x).detach())
    # Still convex weights with noise on.
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 3, 2, dtype=dispatch.dtype))
    torch.testing.assert_close(combine.sum((2, 3)), torch.ones(2, 6, dtype=combine.dtype))
    noisy.eval()
    with torch.no_grad():
        torch.testing.assert_close(noisy(x), noisy(x), rtol=0, atol=0)
        torch.testing.assert_close(noisy(x), clean(x))


# ---- mixed precision -----------------------------------------------------------------------------

def test_bf16_autocast_agrees_with_fp32():
    layer = make_layer(dim=32, num_experts=4, slots=2, hidden=64, dtype=torch.float32, scale=1.0)
    x = F.layer_norm(randn(2, 16, 32, dtype=torch.float32), (32,))
    with torch.no_grad():
        ref = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = layer(x)
            dispatch, combine = layer.routing_weights(x)
    assert low.dtype == torch.bfloat16  # autocast did reach the matmuls
    assert torch.isfinite(low).all()
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 3e-2, rel
    # Routing weights stay fp32 and normalized under autocast.
    assert dispatch.dtype == combine.dtype == torch.float32
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 4, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(combine.sum((2, 3)), torch.ones(2, 16), atol=1e-5, rtol=0)


def test_bf16_weights_forward_and_backward():
    layer = make_layer(dim=16, num_experts=4, slots=1, hidden=32, dtype=torch.bfloat16, scale=1.0)
    ref = make_layer(dim=16, num_experts=4, slots=1, hidden=32, dtype=torch.float32, scale=1.0)
    with torch.no_grad():
        for p_low, p_ref in zip(layer.parameters(), ref.parameters()):
            p_ref.copy_(p_low.float())
    x = randn(2, 8, 16, dtype=torch.float32)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    rel = (y.float() - ref(x)).norm() / ref(x).norm()
    assert rel < 5e-2, rel
    y.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


# ---- the fused forward (what `forward` runs) against the step-by-step reference -----------------

@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_forward_equals_the_reference_fp32(slots, masked):
    """The same sums in another grouping, in float32: a sum of K terms is off by up to ~K 2^-24 times the sum of
    their magnitudes, whatever its own size. Forward: K = 24 (the width) of terms up to ~2, so 3e-6 absolute;
    backward: K = 33 (3 examples x 11 tokens) of gradients up to 5.5, so 1.1e-5 (measured: 2.4e-7 and 9.5e-7,
    under two CPU kernel sets). A wrong routing or a dropped term is off by 1e-2 or more."""
    layer = make_layer(dim=24, num_experts=5, slots=slots, hidden=40, dtype=torch.float32, seed=slots)
    x = randn(3, 11, 24, dtype=torch.float32, seed=10 + slots, std=2.0)
    mask = (torch.arange(11)[None] < torch.tensor([[11], [7], [3]])) if masked else None
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, new = reference_forward(layer, x_ref, mask), layer(x_new, mask)
    torch.testing.assert_close(new, ref, rtol=1e-5, atol=5e-6)
    grad = randn(*ref.shape, dtype=torch.float32, seed=99)
    ref_grads = torch.autograd.grad(ref, [x_ref, *layer.parameters()], grad)
    new_grads = torch.autograd.grad(new, [x_new, *layer.parameters()], grad)
    for got, want in zip(new_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


class _ReferenceForward(nn.Module):
    """`reference_forward(layer, ...)` as a module's forward, for `torch.func.functional_call`."""

    def __init__(self, layer: SoftMoE):
        super().__init__()
        self.layer = layer

    def forward(self, x, mask=None):
        return reference_forward(self.layer, x, mask)


@pytest.mark.parametrize("path", ["forward", "forward_reference"])
def test_forward_gradcheck_fp64(path):
    layer = make_layer(dim=6, num_experts=3, slots=2, hidden=5, dtype=torch.float64)
    module = layer if path == "forward" else _ReferenceForward(layer)
    x = randn(2, 4, 6, std=1.5).requires_grad_()
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]

    def run(x, *ps, mask=None):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, mask))

    assert torch.autograd.gradcheck(run, (x, *params))
    assert torch.autograd.gradcheck(lambda x, *ps: run(x, *ps, mask=mask), (x, *params))


def test_fused_forward_under_bf16_matches_the_reference_under_bf16():
    layer = make_layer(dim=32, num_experts=4, slots=1, hidden=64, dtype=torch.float32, scale=2.0)
    x = F.layer_norm(randn(2, 16, 32, dtype=torch.float32), (32,))
    with torch.no_grad():
        ref32 = reference_forward(layer, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref, new = reference_forward(layer, x), layer(x)
        low = make_layer(dim=32, num_experts=4, slots=1, hidden=64, dtype=torch.float32, scale=2.0).bfloat16()
        weights16 = low(x.bfloat16())
    assert new.dtype == ref.dtype == weights16.dtype == torch.bfloat16
    for out in (new, weights16):
        assert ((out.float() - ref32).norm() / ref32.norm()) < 2e-2
    # Not worse than the reference's own bf16 error.
    assert (new.float() - ref32).norm() <= 1.5 * (ref.float() - ref32).norm()


def test_fused_forward_traces_as_one_graph():
    # fullgraph: no graph break anywhere (what lets inductor fuse it); aot_eager also runs the
    # backward through AOTAutograd without compiling kernels, so this stays fast on the CPU.
    from lit_softmoe.nn.soft_moe import soft_moe_forward
    layer = make_layer(dim=16, num_experts=4, slots=1, hidden=32, dtype=torch.float32)
    compiled = torch.compile(soft_moe_forward, backend="aot_eager", fullgraph=True, dynamic=False)
    x = randn(2, 9, 16, dtype=torch.float32).requires_grad_()
    got = compiled(x, layer.phi, layer.scale, layer.experts)
    # Another grouping of the same float32 sums: the bound of test_fused_forward_equals_the_reference_fp32.
    torch.testing.assert_close(got, reference_forward(layer, x), rtol=1e-5, atol=5e-6)
    got.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_compiled_flag_is_kept_and_shown():
    layer = SoftMoE(8, 2, 16, slots_per_expert=1, compiled=True)
    assert layer.compiled and "compiled=True" in repr(layer)
    assert not SoftMoE(8, 2, 16, slots_per_expert=1).compiled


def test_compiled_flag_routes_the_forward_through_the_compiled_function(monkeypatch):
    # The flag must change what runs, not only the repr: a spy stands in for torch.compile's output.
    import lit_softmoe.nn.soft_moe as soft_moe_module
    calls = []

    def fake_compiled(mode=None, backend="inductor"):
        def run(*args):
            calls.append(args[-1])  # the noise std it was given
            return soft_moe_module.soft_moe_forward(*args)
        return run

    monkeypatch.setattr(soft_moe_module, "compiled_soft_moe_forward", fake_compiled)
    x = randn(2, 5, 8, dtype=torch.float32)
    compiled = make_layer(dtype=torch.float32, compiled=True, noise_std=0.5).eval()
    plain = make_layer(dtype=torch.float32, noise_std=0.5).eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)
        assert calls == [0.0]  # eval: no noise
        plain(x)
        assert len(calls) == 1  # the plain layer never calls it
        compiled.train()(x)
    assert calls == [0.0, 0.5]


@pytest.mark.parametrize("impl", ["forward", "forward_reference"])
def test_fully_padded_example_gives_zeros_and_finite_gradients(impl):
    layer = make_layer()
    run = layer if impl == "forward" else functools.partial(reference_forward, layer)
    x = randn(3, 5, 8, std=2.0).requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # example 1: padding only
    mask[2, 3:] = False
    y = run(x, mask)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    # The other examples are what they would be without it.
    keep = torch.tensor([0, 2])
    x_kept = x.detach()[keep].clone().requires_grad_()
    y_kept = run(x_kept, mask[keep])
    torch.testing.assert_close(y[keep], y_kept)
    grad = randn(*y.shape, seed=3)
    params = list(layer.parameters())
    grads = torch.autograd.grad(y, [x, *params], grad)
    grads_kept = torch.autograd.grad(y_kept, [x_kept, *params], grad[keep])
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))
    torch.testing.assert_close(grads[0][keep], grads_kept[0])
    for got, want in zip(grads[1:], grads_kept[1:]):
        torch.testing.assert_close(got, want)


def test_fully_padded_example_routing_weights_are_finite():
    layer = make_layer()
    mask = torch.tensor([[False] * 4, [True, True, False, False]])
    dispatch, combine = layer.routing_weights(randn(2, 4, 8), mask)
    assert torch.isfinite(dispatch).all() and torch.isfinite(combine).all()
    assert torch.equal(dispatch[1, 2:], torch.zeros_like(dispatch[1, 2:]))


def test_bf16_weights_forward_equals_reference_and_routing_stays_fp32():
    layer = make_layer(dim=32, num_experts=4, slots=2, hidden=64, dtype=torch.float32, scale=2.0)
    x = F.layer_norm(randn(2, 16, 32, dtype=torch.float32), (32,))
    with torch.no_grad():
        ref32 = reference_forward(layer, x)
        low = layer.bfloat16()
        new, ref = low(x.bfloat16()), reference_forward(low, x.bfloat16())
        dispatch, combine = low.routing_weights(x.bfloat16())
    assert new.dtype == ref.dtype == torch.bfloat16
    assert dispatch.dtype == combine.dtype == torch.float32
    # Softmaxes summed back in float32: n = 16 tokens (8 slots) of up to 2^-24 relative error each, plus the
    # sum's own, bound |sum - 1| by ~(n + 2) 2^-24 = 1.1e-6 (1.8e-7 measured); a wrong axis is off by O(1).
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 4, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(combine.sum((2, 3)), torch.ones(2, 16), atol=1e-5, rtol=0)
    err_new = (new.float() - ref32).norm() / ref32.norm()
    err_ref = (ref.float() - ref32).norm() / ref32.norm()
    assert err_new < 2e-2 and err_ref < 2e-2, (err_new, err_ref)
    assert ((new.float() - ref.float()).norm() / ref32.norm()) < 2e-2


def test_fused_forward_slots_are_dispatch_weighted_raw_tokens_per_example():
    # The bugs list on the path `forward` runs (not only on `routing_weights`): the slot inputs the
    # experts see are softmax-over-tokens mixes of the raw x of the same example.
    layer = make_layer(num_experts=3, slots=2)
    x = randn(2, 7, 8, std=4.0)
    seen = []
    handle = layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        layer(x)
    handle.remove()
    logits = layer.routing_logits(x).detach().view(2, 7, 3, 2)
    want = torch.einsum("bmnp,bmd->nbpd", logits.softmax(dim=1), x).reshape(3, 4, 8)
    torch.testing.assert_close(seen[0], want)


def test_routing_weights_are_the_weights_forward_routes_with():
    """`routing_weights` (what `inspect-routing` draws) comes from the forward pass's own functions:
    rebuilding the output from them with the forward's steps gives the forward's output bit for bit."""
    torch.manual_seed(0)
    layer = SoftMoE(16, 4, 24, slots_per_expert=2).eval()
    x = torch.randn(3, 10, 16) * 3.0
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 6:] = False
    with torch.no_grad():
        for m in (None, mask):
            dispatch, combine = layer.routing_weights(x, m)  # (b, m, n, p) each
            b, tokens, d = x.shape
            n, p = layer.num_experts, layer.slots_per_expert
            x_in = x if m is None else x.masked_fill(~m[:, :, None], 0.0)
            slots = dispatch.flatten(2).transpose(1, 2) @ x_in  # (b, n·p, d)
            slots = slots.view(b, n, p, d).transpose(0, 1).reshape(n, b * p, d)
            outputs = layer.experts(slots).view(n, b, p, d).transpose(0, 1).reshape(b, n * p, d)
            rebuilt = combine.flatten(2) @ outputs  # (b, m, d)
            if m is not None:
                rebuilt = rebuilt * m[:, :, None].to(rebuilt.dtype)
            assert torch.equal(rebuilt, layer(x, m))
