"""lit_softmoe.export.tokenizer_json: the exported tokenizer.json gives open_clip's ids."""
from __future__ import annotations

import torch

from lit_runs import CAPTIONS
from lit_softmoe.models.tokenizers import create_tokenizer


def test_tokenizer_json_gives_open_clips_ids(onnx_export):
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(str(onnx_export / "tokenizer.json"))
    texts = CAPTIONS + ["", "  Ankle   BOOT!! ", "Café naïve 123 4567", "it's a dog's life, isn't it?",
                        "emoji 🐶 and 漢字", "tab\tnew\nline", "x" * 80,
                        # ftfy's clean-up in open_clip: curly quotes, ligatures, fullwidth forms, entities
                        "it’s a dog’s life", "“a photo” of a cat", "a ‘quoted’ word", "a ﬁsh ﬂying", "ĳs",
                        "ＡＢＣ fullwidth", "ﾊﾟﾝ", "Rock & Roll &amp; more", "a&nbsp;photo", "bell\x07", "ΟΔΟΣ σ"]
    ours = torch.tensor([e.ids for e in fast.encode_batch(texts)])
    assert torch.equal(ours, create_tokenizer("openclip-bpe", 16)(texts))
