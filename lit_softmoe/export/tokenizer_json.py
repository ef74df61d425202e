"""An export's tokenizer files: `tokenizer.json` (the `tokenizers` package: ids without torch, with
truncation and padding to the context length built in) and the original files under `tokenizer/`."""
from __future__ import annotations

import shutil
from pathlib import Path

from lit_softmoe.model_folders import TOKENIZER_DIR, TOKENIZER_JSON
from lit_softmoe.models.tokenizers import OPENCLIP_BPE


def write_tokenizer(out: Path, spec: str, context_length: int, tokenizer) -> dict:
    """tokenizer.json (the `tokenizers` package, no torch) + the original files under tokenizer/."""
    from tokenizers import Tokenizer
    (out / TOKENIZER_DIR).mkdir()
    if spec == OPENCLIP_BPE:
        from open_clip.tokenizer import default_bpe
        shutil.copy(default_bpe(), out / TOKENIZER_DIR / Path(default_bpe()).name)
        fast = _openclip_bpe_as_tokenizers(tokenizer._bpe)
        pad_token = "!"  # id 0, open_clip's padding (it never names the token)
    else:
        hf = tokenizer._tokenizer
        hf.save_pretrained(out / TOKENIZER_DIR)
        fast = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        pad_token = hf.pad_token
    fast.enable_truncation(context_length)
    fast.enable_padding(pad_id=tokenizer.pad_id, pad_token=pad_token, length=context_length)
    fast.save(str(out / TOKENIZER_JSON))
    info = {"spec": spec, "context_length": context_length, "pad_id": tokenizer.pad_id,
            "vocab_size": tokenizer.vocab_size, "tokenizer_json": TOKENIZER_JSON,
            "files": TOKENIZER_DIR}
    if spec == OPENCLIP_BPE:
        info["tokenizer_json_differences"] = OPENCLIP_BPE_DIFFERENCES
    return info


# What tokenizer.json does not reproduce of open_clip's text clean-up (recorded in the export's
# config).
OPENCLIP_BPE_DIFFERENCES = (
    "tokenizer.json replays ftfy.fix_text's character fixes (curly quotes, ligatures, fullwidth "
    "forms, control characters, NFC), the common HTML entities (&amp; &lt; &gt; &quot; &#39; "
    "&apos; &nbsp;), whitespace clean-up and lower-casing; it cannot repair mojibake (ftfy's "
    "fix_encoding) or decode other HTML entities, so such text gets other ids than open_clip's "
    "tokenizer")


def _openclip_clean_normalizer():
    """`tokenizers` normalizers for open_clip's `basic_clean` (ftfy.fix_text, html.unescape twice),
    `whitespace_clean` and `lower()`. Without them everyday captions ("it’s", "“a photo”", "ﬁsh")
    get other ids in the ONNX path than in training and eval."""
    from ftfy.chardata import CONTROL_CHARS, DOUBLE_QUOTE_RE, LIGATURES, SINGLE_QUOTE_RE, WIDTH_MAP
    from tokenizers import Regex, normalizers

    # {codepoint: replacement or None}, one Replace per replacement
    def table(mapping: dict) -> list:
        by_target: dict[str, list[str]] = {}
        for code, target in mapping.items():
            by_target.setdefault(target or "", []).append(chr(code))
        return [normalizers.Replace(Regex("[" + "".join(f"\\x{{{ord(c):x}}}" for c in chars) + "]"),
                                    target)
                for target, chars in by_target.items()]

    # ftfy.fix_text's steps that map characters, in its order (uncurl_quotes runs after the
    # ligatures: ŉ becomes ʼn, then 'n), ending with its NFC.
    steps = table(LIGATURES) + table(WIDTH_MAP) + [
        normalizers.Replace(Regex(DOUBLE_QUOTE_RE.pattern), '"'),
        normalizers.Replace(Regex(SINGLE_QUOTE_RE.pattern), "'")] + table(CONTROL_CHARS) + [
        normalizers.NFC()]
    # html.unescape for the entities captions carry; "&amp;" first and twice, as open_clip
    # unescapes twice.
    steps += [normalizers.Replace("&amp;", "&"), normalizers.Replace("&amp;", "&")] + [
        normalizers.Replace(entity, char) for entity, char in
        (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&#39;", "'"), ("&apos;", "'"),
         ("&nbsp;", "\xa0"))]
    steps += [normalizers.Replace(Regex(r"\s+"), " "),
              # Python's lower() writes a word-final capital sigma as ς; Lowercase alone would
              # give σ.
              normalizers.Replace(Regex(r"(?<=\p{L})Σ(?!\p{L})"), "ς"),
              normalizers.Lowercase()]
    return normalizers.Sequence(steps)


def _openclip_bpe_as_tokenizers(bpe):
    """open_clip's SimpleTokenizer as a `tokenizers` Tokenizer (the recipe of transformers'
    CLIPConverter).

    The normalizer replays what open_clip's `basic_clean` + `whitespace_clean` + `lower()` do, as
    far as a fixed normalizer can (`OPENCLIP_BPE_DIFFERENCES` says what is left).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get)
    fast = Tokenizer(models.BPE(vocab=dict(bpe.encoder), merges=merges,
                                continuing_subword_prefix="", end_of_word_suffix="</w>",
                                fuse_unk=False))
    fast.normalizer = _openclip_clean_normalizer()
    fast.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(
            Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
            behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast.decoder = decoders.ByteLevel()
    fast.post_processor = processors.TemplateProcessing(
        single="<start_of_text> $A <end_of_text>",
        special_tokens=[("<start_of_text>", bpe.sot_token_id), ("<end_of_text>", bpe.eot_token_id)])
    return fast
