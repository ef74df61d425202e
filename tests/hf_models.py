"""A tiny local Hugging Face model folder, for the HF text-tower and export tests (no download)."""
from __future__ import annotations

import torch


def tiny_bert(folder, dtype: torch.dtype):
    """A randomly initialized 1-layer BERT + its tokenizer, saved in `dtype` as a local HF model folder."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "cat", "dog"]
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).to(dtype).save_pretrained(folder)
    return str(folder)
