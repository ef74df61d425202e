"""lit_softmoe.nn.routers: the sparse Tokens Choice and Experts Choice layers against the Soft MoE
paper's sparse baselines (Puigcerver et al., ICLR 2024, §3; google-research/vmoe `vmoe/nn/routing.py`):
routing, capacities, auxiliary losses, noise and gradients.

The routing tests feed the layers chosen gates (the router's logits are replaced by log-gates) and
experts that output a one-hot vector per expert (w1 = b1 = 0, so expert j returns b2[j] = e_j): the
layer's output for a token is then exactly its combine weights, one column per expert, which makes
the reference page's hand-checked vectors directly comparable."""
from __future__ import annotations

import math

import pytest
import torch

from lit_softmoe.nn.routers import (
    ExpertsChoiceMoE,
    TokensChoiceMoE,
    experts_choice_capacity,
    importance_loss,
    load_loss,
    tokens_choice_capacity,
)

# The reference page's gates: 3 tokens (rows) × 3 experts (columns).
PAGE_GATES = torch.tensor([[.4, 0., .2], [.5, .1, .4], [.3, .2, .6]], dtype=torch.float64)


def one_hot_experts(layer):
    """Expert j outputs e_j whatever its input: the layer's output is its combine-weight matrix."""
    n = layer.num_experts
    assert layer.dim == n
    with torch.no_grad():
        for p in (layer.experts.w1, layer.experts.b1, layer.experts.w2):
            p.zero_()
        layer.experts.b2.copy_(torch.eye(n, dtype=layer.experts.b2.dtype))
    return layer


def with_gates(layer, gates: torch.Tensor):
    """Make the layer's router produce `gates` (b, m, n) as given (the page's rows do not sum to 1)."""
    logits = gates.log()
    layer._gates = lambda x: (logits, logits, gates)
    return layer


def combine_matrix(layer, gates: torch.Tensor) -> torch.Tensor:
    layer = with_gates(one_hot_experts(layer), gates).eval()
    b, m, n = gates.shape
    return layer(torch.zeros(b, m, n, dtype=gates.dtype))


# ---- Tokens Choice: the hand-checked vectors -------------------------------------------------------

def tc_layer(**kwargs):
    kwargs = {"num_selected": 2, "capacity_factor": 1.0, "capacity_multiple_of": 1, **kwargs}
    return TokensChoiceMoE(3, 3, 4, dtype=torch.float64, **kwargs)


def test_tokens_choice_page_vector_without_bpr():
    layer = tc_layer(batch_priority=False)
    assert layer.capacity(3) == 2  # ceil(3·2·1 / 3)
    expert, position, kept, gate = layer.route(PAGE_GATES[None], capacity=2)
    # token0 → e0 place 0 (.4), e2 place 1 (.2); token1 → e0 place 1 (.5), its e2 choice dropped
    # (third in e2's buffer); token2 → e2 place 0 (.6), its e0 choice dropped.
    assert expert[0].tolist() == [[0, 2], [0, 2], [2, 0]]
    assert position[0].tolist() == [[0, 1], [1, 2], [0, 2]]
    assert kept[0].tolist() == [[True, True], [True, False], [True, False]]
    y = combine_matrix(layer, PAGE_GATES[None])[0]
    torch.testing.assert_close(y, torch.tensor([[.4, 0, .2], [.5, 0, 0], [0, 0, .6]], dtype=torch.float64))
    assert layer.dropped_fraction == 0  # every token kept at least one choice


def test_tokens_choice_page_vector_with_bpr():
    layer = tc_layer(batch_priority=True)
    expert, position, kept, _ = layer.route(PAGE_GATES[None], capacity=2)
    # Served by top-1 gate: token2 (.6), token1 (.5), token0 (.4). token1 → e0 place 0 (.5), e2 place 1
    # (.4); token0 → e0 place 1 (.4), its e2 choice dropped; token2 → e2 place 0, its e0 choice dropped.
    assert position[0].tolist() == [[1, 2], [0, 1], [0, 2]]
    assert kept[0].tolist() == [[True, False], [True, True], [True, False]]
    y = combine_matrix(layer, PAGE_GATES[None])[0]
    torch.testing.assert_close(y, torch.tensor([[.4, 0, 0], [.5, 0, .4], [0, 0, .6]], dtype=torch.float64))


def test_tokens_choice_groups_are_routed_independently():
    # The same three tokens twice in one batch: each example has its own buffers.
    gates = torch.stack([PAGE_GATES, PAGE_GATES])
    y = combine_matrix(tc_layer(batch_priority=False), gates)
    torch.testing.assert_close(y[0], y[1])
    torch.testing.assert_close(y[0, 1], torch.tensor([.5, 0, 0], dtype=torch.float64))


def test_top1_choices_take_places_before_top2_choices():
    # Capacity 1. token0's second choice is e0, token2's first is e0: e0's only place goes to token2
    # although token0 comes earlier. token1 loses e1 to token0's top-1, then gets e2 as its top-2.
    gates = torch.tensor([[[.3, .6, .1], [.1, .7, .2], [.8, .05, .15]]], dtype=torch.float64)
    layer = tc_layer(batch_priority=False)
    _, position, kept, _ = layer.route(gates, capacity=1)
    assert kept[0].tolist() == [[True, False], [False, True], [True, False]]
    assert position[0, 2, 0] == 0 and position[0, 0, 1] == 1  # token0's top-2 (e0) came after token2's top-1


def test_tokens_choice_dropped_fraction_and_bpr_on_a_crowded_expert():
    # Four tokens, all prefer e0, K=1, capacity 1: three tokens are dropped (zero output).
    gates = torch.tensor([[[.5, .25, .25], [.7, .15, .15], [.6, .2, .2], [.4, .3, .3]]], dtype=torch.float64)
    layer = tc_layer(num_selected=1, capacity_factor=0.75, batch_priority=False)
    assert layer.capacity(4) == 1
    y = combine_matrix(layer, gates)[0]
    assert layer.dropped_fraction.item() == 0.75
    torch.testing.assert_close(y[0], torch.tensor([.5, 0, 0], dtype=torch.float64))  # first come, first served
    assert y[1:].abs().sum() == 0
    layer = tc_layer(num_selected=1, capacity_factor=0.75, batch_priority=True)
    y = combine_matrix(layer, gates)[0]
    assert layer.dropped_fraction.item() == 0.75
    torch.testing.assert_close(y[1], torch.tensor([.7, 0, 0], dtype=torch.float64))  # largest top-1 gate first
    assert y[[0, 2, 3]].abs().sum() == 0


def test_tokens_choice_matches_a_loop_over_tokens():
    """Random gates and real experts against a slow reference written with Python loops."""
    torch.manual_seed(0)
    b, m, d, n, k = 3, 10, 6, 4, 2
    layer = TokensChoiceMoE(d, n, 8, num_selected=k, capacity_factor=0.5, capacity_multiple_of=1,
                            batch_priority=True, shared_expert_init=False, dtype=torch.float64).eval()
    x = torch.randn(b, m, d, dtype=torch.float64)
    y = layer(x)
    capacity = layer.capacity(m)
    assert capacity == 3  # ceil(10·2·0.5 / 4), no rounding
    with torch.no_grad():
        gates = (x @ layer.router).softmax(-1)
    e = layer.experts
    assert layer.dropped_fraction > 0  # the case exercises drops
    for i in range(b):
        top_gate, top_expert = gates[i].topk(k, dim=-1)
        order = sorted(range(m), key=lambda t: -top_gate[t, 0].item())
        load, want = [0] * n, torch.zeros(m, d, dtype=torch.float64)
        for rank in range(k):
            for t in order:
                j = top_expert[t, rank].item()
                if load[j] < capacity:
                    load[j] += 1
                    with torch.no_grad():
                        hidden = torch.nn.functional.gelu(x[i, t] @ e.w1[j] + e.b1[j], approximate="tanh")
                        want[t] += top_gate[t, rank] * (hidden @ e.w2[j] + e.b2[j])
        torch.testing.assert_close(y[i].detach(), want)


# ---- Experts Choice ------------------------------------------------------------------------------

def test_experts_choice_page_vector():
    layer = ExpertsChoiceMoE(3, 3, 4, capacity_factor=2.0, dtype=torch.float64)
    assert layer.capacity(3) == 2  # round(3·2 / 3)
    token_index, gate = layer.route(PAGE_GATES[None], capacity=2)
    assert token_index[0].tolist() == [[1, 0], [2, 1], [2, 1]]  # e0 picks (1, 0), e1 (2, 1), e2 (2, 1)
    y = combine_matrix(layer, PAGE_GATES[None])[0]
    torch.testing.assert_close(y, torch.tensor([[.4, 0, 0], [.5, .1, .4], [0, .2, .6]], dtype=torch.float64))
    assert layer.dropped_fraction == 0 and layer.aux_loss == 0


def test_experts_choice_drops_tokens_no_expert_picks():
    # C=1: e0's best token is token3; e1's and e2's best is token1 (both): tokens 0 and 2 go unprocessed.
    gates = torch.tensor([[[.34, .33, .33], [.2, .4, .4], [.3, .35, .35], [.8, .1, .1]]], dtype=torch.float64)
    layer = ExpertsChoiceMoE(3, 3, 4, capacity_factor=0.75, dtype=torch.float64)
    assert layer.capacity(4) == 1  # round(4·0.75 / 3)
    y = combine_matrix(layer, gates)[0]
    # e0 → token3 (.8), e1 → token1 (.4), e2 → token1 (.4): tokens 0 and 2 are dropped.
    torch.testing.assert_close(y, torch.tensor([[0, 0, 0], [0, .4, .4], [0, 0, 0], [.8, 0, 0]], dtype=torch.float64))
    assert layer.dropped_fraction.item() == 0.5


def test_experts_choice_matches_a_loop_over_experts():
    """Random gates and real experts (which read their inputs) against a slow loop reference: the
    one-hot experts above ignore what they are fed, so only this checks which tokens reach which
    expert and where each output is added back."""
    torch.manual_seed(0)
    b, m, d, n = 3, 10, 6, 4
    layer = ExpertsChoiceMoE(d, n, 8, capacity_factor=1.2, shared_expert_init=False, dtype=torch.float64).eval()
    with torch.no_grad():
        layer.experts.b1.normal_(std=0.3)
        layer.experts.b2.normal_(std=0.3)
    x = torch.randn(b, m, d, dtype=torch.float64)
    y = layer(x)
    capacity = layer.capacity(m)
    assert capacity == 3  # round(10·1.2 / 4)
    with torch.no_grad():
        gates = (x @ layer.router).softmax(-1)
    e = layer.experts
    picked_any = torch.zeros(b, m, dtype=torch.bool)
    for i in range(b):
        want = torch.zeros(m, d, dtype=torch.float64)
        for j in range(n):
            for t in gates[i, :, j].topk(capacity).indices.tolist():  # expert j picks its top-C tokens
                picked_any[i, t] = True
                with torch.no_grad():
                    hidden = torch.nn.functional.gelu(x[i, t] @ e.w1[j] + e.b1[j], approximate="tanh")
                    want[t] += gates[i, t, j] * (hidden @ e.w2[j] + e.b2[j])
        torch.testing.assert_close(y[i].detach(), want)
    assert layer.dropped_fraction.item() == pytest.approx((~picked_any).float().mean().item())
    assert 0 < layer.dropped_fraction < 1  # the case exercises both picked and unpicked tokens


# ---- capacities --------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,cf,multiple,want", [
    (196, 32, 2, 1.0, 4, 16),  # ceil(12.25) = 13 → 16
    (196, 32, 1, 1.0, 4, 8),  # ceil(6.125) = 7 → 8
    (16, 16, 1, 1.0, 4, 4),  # 1 → 4: at tiny sizes the rounding quadruples the real capacity factor
    (16, 16, 2, 1.0, 4, 4),  # 2 → 4
    (64, 4, 2, 1.25, 4, 40),  # already a multiple of 4
    (196, 32, 2, 1.0, 1, 13),  # no rounding
    (10, 4, 2, 0.5, 1, 3),  # ceil(2.5)
])
def test_tokens_choice_capacity(m, n, k, cf, multiple, want):
    assert tokens_choice_capacity(m, n, k, cf, multiple) == want


def test_experts_choice_capacity():
    assert experts_choice_capacity(196, 32, 1.0) == 6  # round(6.125)
    assert experts_choice_capacity(196, 32, 2.0) == 12
    assert experts_choice_capacity(16, 16, 1.0) == 1
    assert experts_choice_capacity(16, 16, 1.0, multiple_of=4) == 4
    assert experts_choice_capacity(4, 2, 3.0) == 4  # never more than the tokens there are
    with pytest.raises(ValueError, match="< 1"):
        experts_choice_capacity(16, 64, 1.0)


# ---- auxiliary losses --------------------------------------------------------------------------------

def test_importance_loss_by_hand():
    balanced = torch.full((2, 5, 4), 0.25)
    assert importance_loss(balanced).item() == 0
    # All gate mass on expert 0: importance (m, 0, 0, 0) → CV² = n − 1 = 3.
    collapsed = torch.zeros(1, 5, 4)
    collapsed[..., 0] = 1
    assert importance_loss(collapsed).item() == pytest.approx(3.0)
    # importance (1.2, 0.8) → mean 1, population var 0.04 → CV² 0.04.
    gates = torch.tensor([[[.6, .4], [.6, .4]]])
    assert importance_loss(gates).item() == pytest.approx(0.04)


def test_load_loss_by_hand():
    # One token, two experts, K=1, logits (1, 0), no noise drawn, σ = 1: the bar is 1, so
    # P(e0 clears it) = 1 − Φ(0) = 0.5 and P(e1) = 1 − Φ(1).
    logits = torch.tensor([[[1.0, 0.0]]])
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    p = [1 - phi(0.0), 1 - phi(1.0)]
    mean = sum(p) / 2
    want = ((p[0] - mean) ** 2 + (p[1] - mean) ** 2) / 2 / mean ** 2
    assert load_loss(logits, logits, 1.0, 1).item() == pytest.approx(want, rel=1e-5)
    # Equal logits: every expert equally likely to be picked → 0.
    flat = torch.zeros(2, 3, 4)
    assert load_loss(flat, flat + 0.1, 0.25, 2).item() == pytest.approx(0.0, abs=1e-12)


def test_tokens_choice_aux_loss_is_importance_in_eval_and_adds_load_in_training():
    torch.manual_seed(0)
    layer = TokensChoiceMoE(8, 4, 16, num_selected=2, dtype=torch.float64)
    x = torch.randn(3, 12, 8, dtype=torch.float64)
    layer.eval()
    layer(x)
    clean = x @ layer.router
    torch.testing.assert_close(layer.aux_loss, importance_loss(clean.softmax(-1)))
    layer.train()
    torch.manual_seed(1)
    layer(x)
    torch.manual_seed(1)
    noisy = clean + torch.randn_like(clean) / 4  # the same draw: std 1/n with n = 4
    want = importance_loss(clean.softmax(-1)) + load_loss(clean, noisy, 0.25, 2)
    torch.testing.assert_close(layer.aux_loss, want)
    ec = ExpertsChoiceMoE(8, 4, 16, dtype=torch.float64)
    ec(x)
    assert ec.aux_loss.item() == 0


@pytest.mark.parametrize("cls", [TokensChoiceMoE, ExpertsChoiceMoE])
def test_noise_only_in_training_with_std_one_over_n(cls):
    torch.manual_seed(0)
    layer = cls(16, 8, 32)
    x = torch.randn(64, 64, 16)
    clean, used = layer.train()._logits(x)
    assert (used - clean).std().item() == pytest.approx(1 / 8, rel=0.03)
    assert (used - clean).mean().abs() < 0.01
    clean, used = layer.eval()._logits(x)
    assert used is clean
    y1, y2 = layer(x), layer(x)
    assert torch.equal(y1, y2)  # eval: deterministic
    layer.train()
    assert not torch.equal(layer(x), layer(x))  # training: the noise changes routing and weights
    quiet = cls(16, 8, 32, noise_std=0.0).train()
    assert torch.equal(quiet(x), quiet(x))


@pytest.mark.parametrize("cls", [TokensChoiceMoE, ExpertsChoiceMoE])
def test_gradients_reach_router_and_every_expert(cls):
    torch.manual_seed(0)
    layer = cls(8, 4, 16, shared_expert_init=False, dtype=torch.float64)
    x = torch.randn(4, 16, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    (y.pow(2).sum() + layer.aux_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_aux_loss_alone_trains_the_router():
    torch.manual_seed(0)
    layer = TokensChoiceMoE(8, 4, 16, num_selected=1).train()
    layer(torch.randn(2, 16, 8))
    layer.aux_loss.backward()
    assert layer.router.grad.abs().sum() > 0
    assert layer.experts.w1.grad is None  # the balancing losses do not touch the experts


@pytest.mark.parametrize("noise", [-0.5, float("nan")])
def test_a_negative_router_noise_is_refused(noise):
    # `noise_std > 0` switches the noise on, so a negative std silently trained without noise.
    from lit_softmoe.models.registry import image_tower_config
    from lit_softmoe.nn.routers import ExpertsChoiceMoE, TokensChoiceMoE
    from lit_softmoe.nn.soft_moe import SoftMoE
    with pytest.raises(ValueError, match=r"router_noise is a noise std and must be >= 0 \(0: off\), got "):
        image_tower_config("tc-test-4e-k1", router_noise=noise)
    for layer in (TokensChoiceMoE, ExpertsChoiceMoE):
        with pytest.raises(ValueError, match=r"noise_std must be >= 0 \(0: no noise\), got "):
            layer(8, 4, 16, noise_std=noise)
    with pytest.raises(ValueError, match=r"noise_std must be >= 0 \(0: no noise\), got "):
        SoftMoE(8, 4, 16, slots_per_expert=1, noise_std=noise)
    assert image_tower_config("tc-test-4e-k1", router_noise=0.0).router_noise == 0.0  # 0 = off, still allowed
    assert TokensChoiceMoE(8, 4, 16, noise_std=0.0).noise_std == 0.0
