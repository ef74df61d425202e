"""lit_softmoe.train.accumulation: N micro-batches give the loss and the gradient of the N-times batch for both
contrastive losses (open_clip's recompute scheme); the pretraining loop's plain accumulation is tested in
tests/train/test_pretrain.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.train.accumulation import contrastive_accumulation, split_batch
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss
from tiny_text import TINY_TEXT, token_ids


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(accumulated: dict, whole: dict, atol: float, rtol: float) -> None:
    assert accumulated.keys() == whole.keys() and whole
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], atol=atol, rtol=rtol, msg=name)


def test_split_batch_keeps_order_and_structure():
    batch = {"image": torch.arange(8).view(8, 1), "text": torch.arange(8, 16)}
    parts = split_batch(batch, 4)
    assert len(parts) == 4 and all(p["image"].shape == (2, 1) for p in parts)
    assert torch.equal(torch.cat([p["text"] for p in parts]), batch["text"])
    assert torch.equal(split_batch((batch["text"],), 2)[1][0], torch.arange(12, 16))
    with pytest.raises(ValueError, match="does not split into 3"):
        split_batch(batch, 3)


@pytest.mark.parametrize("loss_name", ["softmax", "sigmoid"])
@pytest.mark.parametrize("cached", [False, True])
def test_contrastive_accumulation_equals_the_whole_batch(loss_name, cached):
    """Equal in exact arithmetic; in floats the two sum the same terms in another order. In float32 that left
    gradients up to ~2e-6 apart on one CPU and not another (another kernel, another order): in float64 the gap is
    ~1e-15 relative (2^-53 times the few dozen terms of a sum), so 1e-10 is a bound with a wide margin on any
    CPU, while a wrong gradient (a micro-batch counted twice or with fewer negatives) misses it by 1e-3 or more."""
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e")
    model = LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=tower.embed_dim), loss=loss_name,
                     image_head="linear").train().double()
    loss_fn = sigmoid_loss if loss_name == "sigmoid" else contrastive_loss
    images = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if cached:  # pooled tower features, as the feature cache holds them
        with torch.no_grad():
            images = tower.forward_pooled(images)
    batch = {"image": images, "text": token_ids(8)}

    def embed(mb):
        return model(text=mb["text"], **{"image_features" if cached else "image": mb["image"]})

    whole = loss_fn(*embed(batch))
    whole.backward()
    expected = _grads(model)
    assert "logit_scale" in expected and any(name.startswith("image_head") for name in expected)
    model.zero_grad()

    loss, outputs = contrastive_accumulation(embed, loss_fn, split_batch(batch, 4), backward=torch.Tensor.backward)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, whole.detach(), atol=1e-10, rtol=1e-10)
    assert outputs[0].shape == (2, tower.embed_dim)  # the last micro-batch's own embeddings
    _assert_same_grads(_grads(model), expected, atol=1e-10, rtol=1e-10)


def test_contrastive_accumulation_is_not_a_mean_of_micro_batch_losses():
    """Why the recompute scheme: averaging the 4 small batches' own losses (fewer negatives) is another loss.
    In float64, where the accumulated and the whole-batch loss (the same sums in another order) agree to ~1e-15."""
    torch.manual_seed(0)
    model = LiTModel(None, create_text_tower(TINY_TEXT, embed_dim=16)).train().double()
    features = torch.randn(8, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    text = token_ids(8)
    whole = contrastive_loss(*model(image_features=features, text=text)).item()
    naive = sum(contrastive_loss(*model(image_features=f, text=t)).item()
                for f, t in zip(features.chunk(4), text.chunk(4))) / 4
    accumulated, _ = contrastive_accumulation(lambda mb: model(image_features=mb[0], text=mb[1]), contrastive_loss,
                                              split_batch((features, text), 4), backward=torch.Tensor.backward)
    assert accumulated.item() == pytest.approx(whole, abs=1e-10)
    assert abs(naive - whole) > 0.1


def test_contrastive_accumulation_replays_dropout():
    """The recompute draws the dropout masks of the first pass: the loss is the one of the embeddings the
    first pass gave, and the global random state ends where the first pass left it."""
    torch.manual_seed(0)
    model = LiTModel(None, create_text_tower(TINY_TEXT, embed_dim=16)).train()
    features, text = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)), token_ids(8)
    first_pass = []

    def embed(mb):
        zimg, ztxt, scale = model(image_features=mb[0], text=mb[1])
        ztxt = F.normalize(F.dropout(ztxt, p=0.5, training=True), dim=-1)  # a tower with dropout
        if not torch.is_grad_enabled():
            first_pass.append((zimg, ztxt))
        return zimg, ztxt, scale

    torch.manual_seed(5)
    loss, _ = contrastive_accumulation(embed, contrastive_loss, split_batch((features, text), 4),
                                       backward=torch.Tensor.backward)
    after = torch.rand(1)
    expected = contrastive_loss(torch.cat([z for z, _ in first_pass]), torch.cat([t for _, t in first_pass]),
                                model.logit_scale.exp().detach())
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    torch.manual_seed(5)
    for _ in range(4):
        torch.empty(2, 16).bernoulli_(0.5)  # the first pass's four dropout draws
    assert torch.equal(torch.rand(1), after)


def test_no_sync_wraps_every_backward_but_the_last():
    entered, calls = [], []

    class Recorder:
        def __enter__(self):
            entered.append(len(calls))

        def __exit__(self, *exc):
            return False

    model = LiTModel(None, create_text_tower(TINY_TEXT, embed_dim=16)).train()
    features, text = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)), token_ids(8)
    contrastive_accumulation(lambda mb: model(image_features=mb[0], text=mb[1]), contrastive_loss,
                             split_batch((features, text), 4), backward=lambda loss: calls.append(loss.backward()),
                             no_sync=Recorder)
    assert len(calls) == 4 and entered == [0, 1, 2]  # micro-batches 0-2 skip the gradient sync; 3 syncs
