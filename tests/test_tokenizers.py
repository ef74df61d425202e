"""Tokenizers behind one interface: CLIP's BPE gives open_clip's ids (start 49406, end 49407, the end
kept when a text is cut), a local Hugging Face tokenizer gives AutoTokenizer's ids, and a bad spec
is one clear UserError."""
import pickle

import pytest
import torch

from lit_softmoe.errors import UserError
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
    full = create_tokenizer("openclip-bpe", context_length=77)([LONG_TEXT])[0]
    assert torch.equal(ids[:15], full[:15])  # the text's first 14 tokens, then the end token


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
