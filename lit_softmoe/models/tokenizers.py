"""Text tokenizers behind one interface: CLIP's BPE (open_clip) and any Hugging Face tokenizer.

LiT (Zhai et al., 2022) trains its text tower on 16-token texts; CLIP (Radford et al., 2021) uses
77. `create_tokenizer(spec, context_length)` returns an object that turns a list of strings into
a (B, context_length) LongTensor of ids, so the collate function of a shard pipeline and the
zero-shot classifier builder tokenize the same way whatever the text tower is.

Specs:
    "openclip-bpe"     open_clip's `SimpleTokenizer` (the object `open_clip.get_tokenizer` returns
                       for CLIP models): byte-level BPE, vocabulary 49,408, <start_of_text> 49406,
                       <end_of_text> 49407, zero padding; a text that is too long is cut and its
                       last kept token replaced by <end_of_text>, because CLIP towers pool at that
                       token.
    "hf:PATH_OR_ID"    `transformers.AutoTokenizer.from_pretrained(PATH_OR_ID)`: a local folder
                       (works offline) or a hub id; padded on the right to `context_length`,
                       truncated keeping the closing special token ([SEP] for BERT).

Tokenizers are plain picklable objects: DataLoader workers tokenize inside the collate function.
"""
from __future__ import annotations

import functools
import os
from typing import Protocol, Sequence, runtime_checkable

import torch

from lit_softmoe.errors import UserError, first_line

LIT_CONTEXT_LENGTH = 16  # the LiT paper's text length
OPENCLIP_BPE = "openclip-bpe"
HF_PREFIX = "hf:"
_SPEC_HINT = (f"use '{OPENCLIP_BPE}' (CLIP's BPE) or '{HF_PREFIX}PATH_OR_ID' (a Hugging Face "
              "tokenizer folder or hub id)")


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer here offers."""

    context_length: int  # L: every output row has exactly this many ids
    vocab_size: int  # ids are in [0, vocab_size): the size of the text tower's embedding table
    pad_id: int  # the id filling the row after the text

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """texts → (B, L) int64 ids."""
        ...


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):  # one string is a common slip: tokenize it as a batch of one
        return [texts]
    return list(texts)


@functools.cache
def _open_clip_bpe():
    """open_clip's `SimpleTokenizer`, made once per process: making one reads and parses the
    49,152-merge vocabulary file (~70 ms), and a LiT run, its eval, an export and each loaded pair
    make a tokenizer. Every call passes its own context length; the instance's only state is its
    word cache, which any caller may share."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer()


# Distinct texts whose ids a BPE tokenizer keeps (about 0.6 KB each, measured; the table starts over
# when full).
CACHED_TEXTS = 10_000


class OpenClipBPETokenizer:
    """CLIP's byte-level BPE through open_clip's `SimpleTokenizer`, with the ids of each text it has
    seen kept (`CACHED_TEXTS` of them): captions and prompts repeat (the templates of a class, a
    caption shared by many images), and `SimpleTokenizer` cleans every text with ftfy and a regex
    before its word cache, 70 us a short caption against 0.2 us for a kept one."""

    def __init__(self, context_length: int = LIT_CONTEXT_LENGTH):
        self._bpe = _open_clip_bpe()
        self.context_length = context_length
        self.vocab_size = self._bpe.vocab_size
        self.sot_id = self._bpe.sot_token_id
        self.eot_id = self._bpe.eot_token_id
        # open_clip pads with 0 (which is also the id of "!"); CLIP towers find the text's end at
        # the largest id (<end_of_text>), not through a padding mask.
        self.pad_id = 0
        self._ids: dict[str, torch.Tensor] = {}  # text: its (L,) ids

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = _check_texts(texts)
        new = [text for text in dict.fromkeys(texts) if text not in self._ids]
        if new:
            if len(self._ids) + len(new) > CACHED_TEXTS:
                self._ids.clear()
            ids = self._bpe(new, context_length=self.context_length)  # (N, L) int64
            self._ids.update(zip(new, ids.unbind()))
        if not texts:
            return torch.zeros(0, self.context_length, dtype=torch.long)
        return torch.stack([self._ids[text] for text in texts])  # (B, L) int64

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ids": {}}  # a DataLoader worker's copy starts its own table

    def __repr__(self) -> str:
        return f"OpenClipBPETokenizer(context_length={self.context_length})"


class HFTokenizer:
    """A Hugging Face tokenizer loaded with `AutoTokenizer.from_pretrained`."""

    def __init__(self, name_or_path: str, context_length: int = LIT_CONTEXT_LENGTH):
        from transformers import AutoTokenizer

        # Batches are tokenized inside DataLoader workers; the tokenizers library's own thread pool
        # buys nothing there and warns (or deadlocks) when a process forks after using it.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exn:
            raise UserError(
                f"cannot load the Hugging Face tokenizer {name_or_path!r} ({first_line(exn)}); "
                "pass a local folder holding tokenizer.json (or vocab.txt) and "
                "tokenizer_config.json, or a hub id with network access"
            ) from None
        if self._tokenizer.pad_token_id is None:
            if self._tokenizer.eos_token is None:
                raise UserError(f"the tokenizer {name_or_path!r} has neither a padding nor an end "
                                "token; pick a tokenizer that defines pad_token")
            # GPT-2 style: pad with the end token
            self._tokenizer.pad_token = self._tokenizer.eos_token
        # Padding after the text, whatever the saved tokenizer says (many decoder tokenizers pad on
        # the left): the HF tower takes [CLS] at position 0 and the last real token at
        # `mask.sum() - 1`, and with left padding they would be pads, and a text's embedding would
        # change with context_length.
        self._tokenizer.padding_side = "right"
        self.name_or_path = name_or_path
        self.context_length = context_length
        self.vocab_size = len(self._tokenizer)  # includes added tokens, unlike `.vocab_size`
        self.pad_id = int(self._tokenizer.pad_token_id)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        encoded = self._tokenizer(_check_texts(texts), padding="max_length", truncation=True,
                                  max_length=self.context_length, return_tensors="pt")
        return encoded["input_ids"].long()  # (B, L)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name_or_path!r}, context_length={self.context_length})"


def create_tokenizer(spec: str, context_length: int = LIT_CONTEXT_LENGTH) -> Tokenizer:
    """The tokenizer named by `spec` ("openclip-bpe" or "hf:PATH_OR_ID"), cutting texts to
    `context_length`."""
    if not isinstance(context_length, int) or context_length < 2:
        raise UserError(f"context_length must be an integer of at least 2 (a start and an end "
                        f"token), got {context_length!r}")
    spec = str(spec).strip()
    if spec == OPENCLIP_BPE:
        return OpenClipBPETokenizer(context_length)
    if spec.startswith(HF_PREFIX) and spec[len(HF_PREFIX):].strip():
        return HFTokenizer(spec[len(HF_PREFIX):].strip(), context_length)
    raise UserError(f"unknown tokenizer {spec!r}; {_SPEC_HINT}")
