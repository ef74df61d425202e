"""LiTModel: the locked tower stays locked, in eval mode and bit-for-bit unchanged; text towers pool right."""
from __future__ import annotations

import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss

from hf_models import _tiny_bert
from tiny_text import EOT, TINY_TEXT, _ids


# ---- text towers ---------------------------------------------------------------------------------

def test_transformer_text_tower_shape_and_spec():
    tower = create_text_tower(TINY_TEXT, embed_dim=24)
    assert tower(_ids()).shape == (4, 24)
    assert (tower.tokenizer_spec, tower.context_length, tower.embed_dim) == ("openclip-bpe", 16, 24)


def test_transformer_text_tower_pools_at_end_of_text():
    tower = create_text_tower(TINY_TEXT, embed_dim=24).eval()
    ids = _ids()
    changed = ids.clone()
    end = int((ids[0] == EOT).nonzero())
    changed[0, end + 1:] = 123  # overwrite the padding after <end_of_text>
    with torch.no_grad():
        torch.testing.assert_close(tower(changed), tower(ids), rtol=0, atol=0)
        changed[0, end - 1] = 321  # a real token before it does change the output
        assert not torch.allclose(tower(changed)[0], tower(ids)[0])


def test_text_tower_needs_embed_dim_and_a_known_kind():
    with pytest.raises(UserError, match="embed_dim"):
        create_text_tower(TINY_TEXT)
    with pytest.raises(UserError, match="unknown text tower kind"):
        create_text_tower(TextTowerConfig(kind="rnn"), embed_dim=8)
    with pytest.raises(UserError, match="needs a path"):
        create_text_tower(TextTowerConfig(kind="hf"), embed_dim=8)


def test_missing_hf_path_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load the Hugging Face text model"):
        create_text_tower(TextTowerConfig(kind="hf", path=str(tmp_path / "missing")), embed_dim=8)


def test_hf_text_tower_mean_pooling_ignores_padding(minilm_path):
    from lit_softmoe.models.tokenizers import create_tokenizer

    cfg = TextTowerConfig(kind="hf", path=minilm_path, pooling="mean", context_length=16)
    tower = create_text_tower(cfg, embed_dim=24).eval()
    assert tower.tokenizer_spec == f"hf:{minilm_path}" and tower.pad_id == 0
    texts = ["a photo of a dog", "a blurry photo of many cats on a sofa"]
    short = create_tokenizer(tower.tokenizer_spec, 16)(texts)
    long = create_tokenizer(tower.tokenizer_spec, 32)(texts)  # the same texts with 16 more pads
    with torch.no_grad():
        out_short, out_long = tower(short), tower(long)
    assert out_short.shape == (2, 24)
    torch.testing.assert_close(out_short, out_long, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "eos"])
def test_hf_text_tower_other_poolings_ignore_padding(minilm_path, pooling):
    from lit_softmoe.models.tokenizers import create_tokenizer

    tower = create_text_tower(TextTowerConfig(kind="hf", path=minilm_path, pooling=pooling), embed_dim=8).eval()
    texts = ["a photo of a dog", "two cats"]
    with torch.no_grad():
        torch.testing.assert_close(tower(create_tokenizer(tower.tokenizer_spec, 16)(texts)),
                                   tower(create_tokenizer(tower.tokenizer_spec, 24)(texts)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hf_text_tower_loads_a_half_precision_checkpoint_in_fp32(tmp_path, monkeypatch, dtype):
    from lit_softmoe.models.tokenizers import create_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tower = create_text_tower(TextTowerConfig(kind="hf", path=_tiny_bert(tmp_path / "bert", dtype),
                                              context_length=16), embed_dim=8)
    assert {p.dtype for p in tower.parameters()} == {torch.float32}  # the optimizer's master weights
    out = tower(create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a cat", "a dog"]))
    assert out.shape == (2, 8) and out.dtype == torch.float32


@pytest.mark.parametrize("pooling", ["mean", "cls", "eos"])
def test_hf_text_tower_pools_the_tokens_its_pooling_names(tmp_path, monkeypatch, pooling):
    """The padding-invariance tests above hold for any pooling that ignores pads (cls for eos, say):
    here each pooling is checked against the encoder's own token outputs, picked out by hand."""
    from lit_softmoe.models.tokenizers import create_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tower = create_text_tower(TextTowerConfig(kind="hf", path=_tiny_bert(tmp_path / "bert", torch.float32),
                                              pooling=pooling, context_length=16), embed_dim=8).eval()
    ids = create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a cat", "dog"])
    lengths = (ids != tower.pad_id).sum(dim=1).tolist()
    assert lengths == [7, 3] and tower.pad_id == 0  # [CLS] a photo of a cat [SEP] / [CLS] dog [SEP], then pads
    with torch.no_grad():
        tokens = tower.encoder(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state  # (2, 16, 16)
        if pooling == "mean":
            pooled = torch.stack([tokens[row, :n].mean(dim=0) for row, n in enumerate(lengths)])
        elif pooling == "cls":
            pooled = tokens[:, 0]
        else:  # the last real token: [SEP]
            pooled = torch.stack([tokens[row, n - 1] for row, n in enumerate(lengths)])
        want = pooled @ tower.proj.weight.T
        torch.testing.assert_close(tower(ids), want, rtol=1e-5, atol=1e-6)
        # The three poolings give different vectors here, so the comparison tells them apart.
        others = [tokens[:, 0], tokens[:, 1], torch.stack([tokens[r, n - 1] for r, n in enumerate(lengths)])]
        assert sum(torch.allclose(pooled, o, atol=1e-4) for o in others) <= 1


def _model(**kwargs) -> LiTModel:
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e")
    return LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=tower.embed_dim), **kwargs)


def _pixels(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(1))


# ---- the locked image tower ----------------------------------------------------------------------

def test_locked_tower_gets_no_gradient_stays_in_eval_and_never_changes():
    model = _model(loss="sigmoid")
    before = model.image_tower_state_hash()
    model.train()
    assert model.training and model.text_tower.training and not model.image_tower.training
    assert not any(p.requires_grad for p in model.image_tower.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # every parameter handed in
    zimg, ztxt, extras = model(_ids(), pixels=_pixels())
    sigmoid_loss(zimg, ztxt, extras["logit_scale"], extras["logit_bias"]).backward()
    assert all(p.grad is None for p in model.image_tower.parameters())
    assert model.log_scale.grad is not None and model.logit_bias.grad is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.text_tower.parameters())
    optimizer.step()
    assert model.image_tower_state_hash() == before


def test_state_hash_sees_a_one_bit_change():
    model = _model()
    before = model.image_tower_state_hash()
    with torch.no_grad():
        weight = model.image_tower.blocks[0].attn.qkv.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert model.image_tower_state_hash() != before


def test_one_unlocked_block_trains_only_the_last_block_and_norm():
    model = _model(unlocked_blocks=1)
    model.train()
    assert not model.image_tower.training
    zimg, ztxt, extras = model(_ids(), pixels=_pixels())
    contrastive_loss(zimg, ztxt, extras["logit_scale"]).backward()
    last = len(model.image_tower.blocks) - 1
    for name, param in model.image_tower.named_parameters():
        trains = name.startswith(f"blocks.{last}.") or name.startswith("norm.")
        assert (param.grad is not None) == trains, name
    with pytest.raises(UserError, match="unlocked_blocks"):
        model(_ids(), image_features=torch.randn(4, model.image_tower.embed_dim))


def test_image_head_trains_on_locked_features():
    model = _model(image_head=True)
    zimg, ztxt, extras = model(_ids(), pixels=_pixels())
    contrastive_loss(zimg, ztxt, extras["logit_scale"]).backward()
    assert model.image_head.weight.grad is not None and model.image_head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.image_tower.parameters())


def test_encode_image_is_unit_norm_and_matches_cached_features():
    model = _model().eval()
    pixels = _pixels()
    zimg = model.encode_image(pixels)
    assert zimg.shape == (4, model.image_tower.embed_dim) and not zimg.requires_grad  # fully locked: no graph
    torch.testing.assert_close(zimg.norm(dim=-1), torch.ones(4))
    with torch.no_grad():
        cached = model.image_tower.forward_features(pixels)
    torch.testing.assert_close(model.encode_image_features(cached), zimg, rtol=0, atol=0)
    ztxt = model.encode_text(_ids())
    torch.testing.assert_close(ztxt.norm(dim=-1), torch.ones(4))


def test_forward_extras_and_temperature():
    model = _model(loss="softmax")
    _, _, extras = model(_ids(), image_features=torch.randn(4, model.image_tower.embed_dim))
    assert extras["logit_scale"].item() == pytest.approx(10.0) and extras["logit_bias"] is None
    with torch.no_grad():
        model.log_scale.fill_(10.0)  # e^10 > 100: clamped
    assert model(_ids(), image_features=torch.randn(4, 32))[2]["logit_scale"].item() == pytest.approx(100.0)
    sig = _model(loss="sigmoid")
    assert sig(_ids(), image_features=torch.randn(4, 32))[2]["logit_bias"].item() == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="exactly one"):
        model(_ids())


def test_features_only_model_without_an_image_tower():
    text = create_text_tower(TINY_TEXT, embed_dim=32)
    model = LiTModel(None, text, loss="sigmoid")
    zimg, ztxt, _ = model(_ids(), image_features=torch.randn(4, 32))
    assert zimg.shape == ztxt.shape == (4, 32)
    with pytest.raises(ValueError, match="no image tower"):
        model.encode_image(_pixels())


def test_no_weight_decay_names_exist_and_cover_scale_norms_and_positions():
    model = _model(loss="sigmoid", image_head=True)
    names = dict(model.named_parameters())
    skip = model.no_weight_decay()
    assert skip <= set(names)
    assert {"log_scale", "logit_bias", "image_head.bias", "image_tower.pos_embed",
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
