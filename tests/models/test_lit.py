"""lit_softmoe.models.lit: LiTModel keeps its locked tower locked, in eval mode and bit-for-bit unchanged;
unlocked blocks, the image head, the logit scale and weight decay."""
from __future__ import annotations

import math

import pytest
import torch

from lit_data import lit_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel, distinct_rows
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss
from tiny_text import TINY_TEXT, token_ids

ONE_LAYER_TEXT = TextTowerConfig(kind="transformer", width=32, layers=1, heads=2, context_length=16)


def _model(**kwargs) -> LiTModel:
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e")
    return LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=tower.embed_dim), **kwargs)


def _pixels(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(1))


def test_locked_tower_gets_no_gradient_stays_in_eval_and_never_changes():
    model = _model(loss="sigmoid")
    before = model.image_tower_sha256()
    model.train()
    assert model.training and model.text_tower.training and not model.image_tower.training
    assert not any(p.requires_grad for p in model.image_tower.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # every parameter handed in
    sigmoid_loss(*model(_pixels(), token_ids())).backward()
    assert all(p.grad is None for p in model.image_tower.parameters())
    assert model.logit_scale.grad is not None and model.logit_bias.grad is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.text_tower.parameters())
    optimizer.step()
    assert model.image_tower_sha256() == before


def test_state_hash_sees_a_one_bit_change():
    model = _model()
    before = model.image_tower_sha256()
    with torch.no_grad():
        weight = model.image_tower.blocks[0].attn.qkv.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert model.image_tower_sha256() != before


def test_one_unlocked_block_trains_only_the_last_block_and_norm():
    model = _model(unlocked_blocks=1)
    model.train()
    assert not model.image_tower.training
    contrastive_loss(*model(_pixels(), token_ids())).backward()
    last = len(model.image_tower.blocks) - 1
    for name, param in model.image_tower.named_parameters():
        trains = name.startswith(f"blocks.{last}.") or name.startswith("norm.")
        assert (param.grad is not None) == trains, name
    with pytest.raises(UserError, match="unlocked_blocks"):
        model(image_features=torch.randn(4, model.image_tower.embed_dim), text=token_ids())


def test_image_head_trains_on_locked_features():
    model = _model(image_head=True)
    contrastive_loss(*model(image=_pixels(), text=token_ids())).backward()
    assert model.image_head.weight.grad is not None and model.image_head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.image_tower.parameters())


def test_encode_image_is_unit_norm_and_matches_cached_features():
    model = _model().eval()
    pixels = _pixels()
    zimg = model.encode_image(pixels)
    assert zimg.shape == (4, model.image_tower.embed_dim) and not zimg.requires_grad  # fully locked: no graph
    torch.testing.assert_close(zimg.norm(dim=-1), torch.ones(4))
    with torch.no_grad():
        cached = model.image_tower.forward_pooled(pixels)
    torch.testing.assert_close(model.encode_image_features(cached), zimg, rtol=0, atol=0)
    ztxt = model.encode_text(token_ids())
    torch.testing.assert_close(ztxt.norm(dim=-1), torch.ones(4))


def test_normalize_false_gives_the_embeddings_before_the_l2_norm():
    """open_clip's `encode_image(x, normalize=False)` / `encode_text(t, normalize=False)`: the raw
    projections, whose L2 normalization is what the default (normalize=True) returns."""
    model = _model(image_head=True).eval()
    with torch.no_grad():
        for encode, inputs in ((model.encode_image, _pixels()), (model.encode_text, token_ids())):
            raw, unit = encode(inputs, normalize=False), encode(inputs)
            assert not torch.allclose(raw.norm(dim=-1), torch.ones(4), atol=1e-3), encode.__name__
            torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=-1), unit, rtol=0, atol=1e-7)
            assert torch.equal(encode(inputs, normalize=True), unit)


def test_either_tower_may_be_left_out_of_forward():
    """`model(text=ids)` alone, as open_clip allows (its helpers call it so): the features of the
    tower given, None for the other, and the same values as the encoders."""
    model = _model().eval()
    pixels, ids = _pixels(), token_ids()
    with torch.no_grad():
        zimg, ztxt, scale = model(pixels, ids)
        text_only, image_only = model(text=ids), model(image=pixels)
        nothing = model()
    assert text_only[0] is None and torch.equal(text_only[1], model.encode_text(ids))
    assert torch.equal(text_only[1], ztxt)
    assert image_only[1] is None and torch.equal(image_only[0], model.encode_image(pixels))
    assert torch.equal(image_only[0], zimg)
    assert nothing[:2] == (None, None) and scale.item() == text_only[2].item() == pytest.approx(10.0)


def test_text_rows_embed_each_distinct_caption_once_with_every_rows_gradient():
    """`distinct_rows` + `text_rows`: the features and gradients of embedding every row, each caption's gradient
    summed over its rows. In float64, where the tower's sums over a batch of 3 rows and of 6 agree far below
    the tolerance."""
    model = _model().double()
    ids = token_ids()
    batch = ids[[0, 1, 0, 2, 1, 0]]
    distinct, rows = distinct_rows(batch)
    assert len(distinct) == 3 and torch.equal(distinct[rows], batch)
    assert distinct_rows(ids)[0] is ids and distinct_rows(ids)[1] is None  # nothing repeats: nothing changes
    features = torch.randn(6, model.image_tower.embed_dim, dtype=torch.float64)
    grads = []
    for kwargs in [{"text": batch}, {"text": distinct, "text_rows": rows}]:
        model.zero_grad()
        zimg, ztxt, scale = model(image_features=features, **kwargs)
        contrastive_loss(zimg, ztxt, scale).backward()
        grads.append((ztxt.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (every_row, every_grad), (once, once_grad) = grads
    torch.testing.assert_close(once, every_row)
    assert once_grad.keys() == every_grad.keys() and any(n.startswith("text_tower.") for n in once_grad)
    for name in every_grad:
        torch.testing.assert_close(once_grad[name], every_grad[name], msg=name)


def test_forward_returns_open_clips_tuple_with_the_capped_scale():
    model = _model(loss="softmax")
    outputs = model(image_features=torch.randn(4, model.image_tower.embed_dim), text=token_ids())
    assert len(outputs) == 3 and outputs[2].item() == pytest.approx(10.0)  # (zimg, ztxt, logit_scale.exp())
    with torch.no_grad():
        model.logit_scale.fill_(10.0)  # e^10 > 100: clamped
    assert model(image_features=torch.randn(4, 32), text=token_ids())[2].item() == pytest.approx(100.0)
    sig = _model(loss="sigmoid")
    outputs = sig(image_features=torch.randn(4, 32), text=token_ids())
    assert len(outputs) == 4 and outputs[3].item() == pytest.approx(-10.0)  # + logit_bias, as open_clip's
    with pytest.raises(ValueError, match="at most one"):
        model(_pixels(), image_features=torch.randn(4, 32))
    with pytest.raises(ValueError, match="at most one"):
        model(token_ids(), image_features=torch.randn(4, 32))  # the old (text_ids, ...) order is refused, not misread


def test_features_only_model_without_an_image_tower():
    text = create_text_tower(TINY_TEXT, embed_dim=32)
    model = LiTModel(None, text, loss="sigmoid")
    zimg, ztxt, _, _ = model(image_features=torch.randn(4, 32), text=token_ids())
    assert zimg.shape == ztxt.shape == (4, 32)
    with pytest.raises(ValueError, match="no image tower"):
        model.encode_image(_pixels())


def test_no_weight_decay_names_exist_and_cover_scale_norms_and_positions():
    model = _model(loss="sigmoid", image_head=True)
    names = dict(model.named_parameters())
    skip = model.no_weight_decay()
    assert skip <= set(names)
    assert {"logit_scale", "logit_bias", "image_head.bias", "image_tower.pos_embed",
            "text_tower.transformer.positional_embedding"} <= skip
    assert "image_head.weight" not in skip and "text_tower.transformer.text_projection" not in skip


def test_bad_options_are_user_errors():
    tower = create_image_tower("vit-test")
    with pytest.raises(UserError, match="unknown loss"):
        LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=32), loss="hinge")
    with pytest.raises(UserError, match="unlocked_blocks"):
        LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=32), unlocked_blocks=3)
    with pytest.raises(UserError, match="differs"):
        LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=16))


@pytest.mark.parametrize("init", [0.0, -1.0, 150.0])
def test_temperature_init_outside_its_range_is_a_user_error(init):
    text = create_text_tower(ONE_LAYER_TEXT, embed_dim=16)
    with pytest.raises(UserError, match="temperature_init"):
        LiTModel(None, text, temperature_init=init)


def _scale_gradient(model: LiTModel) -> torch.Tensor:
    torch.manual_seed(1)
    ids = torch.randint(1, 49000, (8, 16))
    contrastive_loss(*model(image_features=torch.randn(8, 16), text=ids)).backward()
    return model.logit_scale.grad


def test_logit_scale_at_its_cap_still_learns():
    """CLIP and open_clip clamp the parameter after each step, so at the cap it still gets a gradient
    and can come back down. A clamp inside forward alone gave none from the cap on: exp(float32 ln 100)
    is just above 100, so temperature_init=100 never moved, and a scale that reached 100 (Adam
    overshoots it) stayed there for good."""
    torch.manual_seed(0)
    model = LiTModel(None, create_text_tower(ONE_LAYER_TEXT, embed_dim=16), temperature_init=100.0)
    assert float(model(image_features=torch.randn(2, 16), text=torch.randint(1, 49000, (2, 16)))[2].detach()) == \
        pytest.approx(100.0)
    assert _scale_gradient(model) != 0
    model.zero_grad()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0) + 0.3)  # where an optimizer step past the cap leaves it
    model.clamp_logit_scale_()
    assert float(model.logit_scale) <= math.log(100.0) + 1e-6
    assert _scale_gradient(model) != 0


def test_unlocked_soft_moe_blocks_decay_their_scale_as_pretraining_does(data, tmp_path):
    """Soft MoE's `scale` is decayed like a kernel (vmoe's configs; ViT.no_weight_decay leaves it out
    on purpose), but LiTModel.no_weight_decay added every 0-d/1-d parameter back, so with
    unlocked_blocks the LiT optimizer trained it without weight decay."""
    from lit_softmoe.train import lit as lit_recipe

    cfg = lit_config(data, tmp_path / "run", "unlocked_blocks=1", "optim.weight_decay=0.1")
    model, _ = lit_recipe._setup_model(cfg)
    optimizer = lit_recipe._setup_optimizer(cfg, model)
    names = {id(param): name for name, param in model.named_parameters()}
    decay_of = {names[id(param)]: group["weight_decay"]
                for group in optimizer.param_groups for param in group["params"]}
    assert decay_of["image_tower.blocks.1.mlp.scale"] == 0.1
    assert decay_of["image_tower.blocks.1.mlp.experts.w1"] == 0.1
    assert decay_of["image_tower.blocks.1.mlp.phi"] == 0.0 and decay_of["image_tower.norm.weight"] == 0.0
    assert decay_of["text_tower.transformer.positional_embedding"] == 0.0 and decay_of["logit_scale"] == 0.0
    assert "image_tower.blocks.0.mlp.fc1.weight" not in decay_of  # locked
    assert "image_tower.blocks.1.mlp.scale" not in model.no_weight_decay()


def test_grad_checkpointing_reaches_the_text_tower_and_an_unlocked_image_tower():
    model = _model(unlocked_blocks=1)
    model.set_grad_checkpointing()
    assert model.text_tower.transformer.transformer.grad_checkpointing and model.image_tower.grad_checkpointing
    model.set_grad_checkpointing(False)
    assert not model.text_tower.transformer.transformer.grad_checkpointing
    assert not model.image_tower.grad_checkpointing


def test_a_locked_text_tower_gets_no_gradient_stays_in_eval_and_never_changes():
    model = _model(text_locked=True, image_head=True)
    before = model.locked_text_sha256()
    model.train()
    assert model.text_tower_locked and not model.text_tower.training and model.image_head.training
    assert not any(p.requires_grad for p in model.text_tower.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # every parameter handed in
    contrastive_loss(*model(_pixels(), token_ids())).backward()
    assert all(p.grad is None for p in model.text_tower.parameters())
    assert model.logit_scale.grad is not None and model.image_head.weight.grad is not None
    optimizer.step()
    assert model.locked_text_sha256() == before
    assert _model().locked_text_sha256() is None  # not locked: nothing to prove


def test_unlocked_text_layers_train_in_train_mode_and_only_they_change():
    model = _model(text_locked=True, text_unlocked_layers=1)  # TINY_TEXT: 2 blocks
    model.train()
    assert model.text_tower.training and not model.text_tower_locked
    before = model.locked_text_sha256()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    contrastive_loss(*model(_pixels(), token_ids())).backward()
    optimizer.step()
    trained = {name for name, p in model.text_tower.named_parameters() if p.grad is not None}
    assert trained == {name for name, _ in model.text_tower.named_parameters()
                       if name.startswith(("transformer.transformer.resblocks.1.", "transformer.ln_final.",
                                           "transformer.text_projection"))}
    assert model.locked_text_sha256() == before
    with pytest.raises(UserError, match="text_unlocked_layers=1 needs text_locked"):
        _model(text_unlocked_layers=1)
