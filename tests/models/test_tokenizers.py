"""lit_softmoe.models.tokenizers: CLIP's BPE gives open_clip's ids, a local Hugging Face tokenizer gives
AutoTokenizer's ids (right-padded whatever it saved), and a bad spec is one clear UserError."""
from __future__ import annotations

import pickle

import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import HFTokenizer, OpenClipBPETokenizer, Tokenizer, create_tokenizer

SOT, EOT = 49406, 49407
LONG_TEXT = " ".join(["a photo of a very small grey cat sitting on a red chair"] * 4)


def test_bpe_ids_match_open_clip_with_context_16():
    import open_clip

    tokenizer = create_tokenizer("openclip-bpe", context_length=16)
    assert isinstance(tokenizer, OpenClipBPETokenizer) and isinstance(tokenizer, Tokenizer)
    assert (tokenizer.context_length, tokenizer.vocab_size, tokenizer.pad_id) == (16, 49408, 0)
    ids = tokenizer(["hello world", "a photo of the ankle boot."])
    assert ids.dtype == torch.int64 and ids.shape == (2, 16)
    # "hello</w>" and "world</w>" in CLIP's vocabulary, between start and end, zero padded.
    assert ids[0].tolist() == [SOT, 3306, 1002, EOT] + [0] * 12
    assert torch.equal(ids, open_clip.get_tokenizer("ViT-B-32", context_length=16)(["hello world",
                                                                                    "a photo of the ankle boot."]))
    assert torch.equal(tokenizer("hello world"), ids[:1])  # one string is a batch of one


def test_bpe_truncation_keeps_the_end_token():
    tokenizer = create_tokenizer("openclip-bpe", context_length=16)
    ids = tokenizer([LONG_TEXT])[0]
    assert ids[0] == SOT and ids[-1] == EOT and (ids != 0).all()
    long = create_tokenizer("openclip-bpe", context_length=77)
    full = long([LONG_TEXT])[0]
    assert torch.equal(ids[:15], full[:15])  # the text's first 14 tokens, then the end token
    assert long._bpe is tokenizer._bpe  # one parsed vocabulary per process; each tokenizer cuts to its own length
    assert tokenizer([LONG_TEXT]).shape == (1, 16) and (full != 0).sum() == 4 * 13 + 2


def test_tokenizers_pickle_for_dataloader_workers():
    tokenizer = create_tokenizer("openclip-bpe", 16)
    again = pickle.loads(pickle.dumps(tokenizer))
    assert torch.equal(again(["a cat"]), tokenizer(["a cat"]))


def test_bad_specs_are_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown tokenizer 'bpe'; use 'openclip-bpe'"):
        create_tokenizer("bpe")
    with pytest.raises(UserError, match="context_length must be an integer of at least 2"):
        create_tokenizer("openclip-bpe", context_length=1)
    with pytest.raises(UserError, match="unknown tokenizer 'hf:'"):
        create_tokenizer("hf:")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load the Hugging Face tokenizer"):
        create_tokenizer(f"hf:{tmp_path / 'missing'}")


def test_hf_tokenizer_from_a_local_folder_matches_auto_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    tokenizer = create_tokenizer(f"hf:{minilm_path}", context_length=16)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.context_length, tokenizer.vocab_size, tokenizer.pad_id) == (16, 30522, 0)
    ids = tokenizer(["hello world", LONG_TEXT])
    assert ids.dtype == torch.int64 and ids.shape == (2, 16)
    # BERT's uncased vocabulary: [CLS] hello world [SEP], padded with [PAD] = 0.
    assert ids[0].tolist() == [101, 7592, 2088, 102] + [0] * 12
    reference = AutoTokenizer.from_pretrained(minilm_path)(["hello world", LONG_TEXT], padding="max_length",
                                                          truncation=True, max_length=16, return_tensors="pt")
    assert torch.equal(ids, reference["input_ids"])
    assert ids[1, 0] == 101 and ids[1, -1] == 102 and (ids[1] != 0).all()  # cut, [SEP] kept
    assert torch.equal(pickle.loads(pickle.dumps(tokenizer))(["hello world"]), ids[:1])


def _word_level_folder(folder, **special):
    """A local Hugging Face tokenizer with a 5-word vocabulary, no padding token, the given special tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "cat": 3, "dog": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", **special)
    assert fast.pad_token_id is None
    fast.save_pretrained(folder)
    return folder


def test_hf_tokenizer_without_a_padding_token_pads_with_its_end_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = create_tokenizer(f"hf:{_word_level_folder(tmp_path / 'eos', eos_token='</s>')}", context_length=6)
    assert tokenizer.pad_id == 1  # "</s>", GPT-2 style; the text tower's mask is `ids != pad_id`
    assert tokenizer(["a cat", "dog a cat a dog a cat"]).tolist() == [[2, 3, 1, 1, 1, 1], [4, 2, 3, 2, 4, 2]]
    with pytest.raises(UserError, match="has neither a padding nor an end token"):
        create_tokenizer(f"hf:{_word_level_folder(tmp_path / 'bare')}", context_length=6)


def _left_padding_bert(folder) -> str:
    """A tiny random BERT whose saved tokenizer pads on the left (many decoder tokenizers do)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "cat", "dog"]
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), padding_side="left").save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(folder)
    return str(folder)


def test_left_padding_tokenizer_still_pads_right_for_the_hf_tower(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _left_padding_bert(tmp_path / "bert")
    assert AutoTokenizer.from_pretrained(path).padding_side == "left"  # the set-up is what it claims
    tokenizer = create_tokenizer(f"hf:{path}", 8)
    ids = tokenizer(["a photo of a cat", "dog"])
    assert ids[:, 0].tolist() == [2, 2]  # [CLS] first: the rows are right padded
    assert ids[1, 3:].tolist() == [tokenizer.pad_id] * 5
    for pooling in ("mean", "cls", "eos"):
        tower = create_text_tower(TextTowerConfig(kind="hf", path=path, pooling=pooling, context_length=8),
                                  embed_dim=4).eval()
        with torch.no_grad():
            tokens = tower.encoder(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state
            lengths = (ids != 0).sum(dim=1).tolist()
            if pooling == "mean":
                want = torch.stack([tokens[r, :n].mean(dim=0) for r, n in enumerate(lengths)])
            elif pooling == "cls":
                want = tokens[:, 0]
            else:
                want = torch.stack([tokens[r, n - 1] for r, n in enumerate(lengths)])  # [SEP]
            torch.testing.assert_close(tower(ids), want @ tower.proj.weight.T, rtol=1e-5, atol=1e-6)
            # The text's embedding does not depend on how far it is padded.
            longer = tower(create_tokenizer(f"hf:{path}", 16)(["dog"]))
            torch.testing.assert_close(tower(tokenizer(["dog"])), longer, rtol=1e-5, atol=1e-5)


def test_bpe_keeps_the_ids_of_the_texts_it_has_seen(monkeypatch):
    import open_clip

    from lit_softmoe.models import tokenizers

    tokenizer = create_tokenizer("openclip-bpe", context_length=16)
    reference = open_clip.get_tokenizer("ViT-B-32", context_length=16)
    asked = []
    bpe = tokenizer._bpe
    monkeypatch.setattr(tokenizer, "_bpe", lambda texts, context_length: asked.append(list(texts)) or bpe(
        texts, context_length=context_length))
    first = ["a photo of a cat", LONG_TEXT, "a photo of a cat", "a dog"]
    assert torch.equal(tokenizer(first), reference(first))
    assert asked == [["a photo of a cat", LONG_TEXT, "a dog"]]  # each distinct text once
    second = ["a dog", "a bird", LONG_TEXT, "a photo of a cat"]
    ids = tokenizer(second)
    assert torch.equal(ids, reference(second)) and asked[1:] == [["a bird"]]
    ids[:] = 0  # the caller's batch is its own: the kept ids are unchanged
    assert torch.equal(tokenizer(second), reference(second)) and len(asked) == 2
    assert tokenizer([]).shape == (0, 16)
    # Full, the table starts over; a pickled copy (a DataLoader worker's) starts with none.
    monkeypatch.setattr(tokenizers, "CACHED_TEXTS", 5)
    more = [f"photo {i}" for i in range(3)]
    assert torch.equal(tokenizer(more), reference(more)) and asked[-1] == more and len(tokenizer._ids) == 3
    monkeypatch.setattr(tokenizer, "_bpe", bpe)
    again = pickle.loads(pickle.dumps(tokenizer))
    assert again._ids == {} and torch.equal(again(more), reference(more))
