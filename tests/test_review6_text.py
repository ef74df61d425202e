"""Review 6, text side: the text towers, tokenizers and losses checked against open_clip's own code.

- losses: `contrastive_loss` / `sigmoid_loss` against open_clip's `ClipLoss` / `SigLipLoss`, one process
  and three gloo processes (open_clip's `--local-loss --gather-with-grad` and every SigLIP exchange);
- the from-scratch tower and the BPE tokenizer against open_clip's `CLIP.encode_text` / `get_tokenizer`;
- a Hugging Face tokenizer that pads on the left (its tokenizer_config says so) must still give the
  right-padded rows the HF tower's pooling assumes (last real token = mask sum - 1, [CLS] at 0).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss

WORLD, LOCAL = 3, 4


def _loss_and_grads(fn, zimg, ztxt, bias: float = -10.0):
    zimg, ztxt = zimg.clone().requires_grad_(), ztxt.clone().requires_grad_()
    log_scale = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
    logit_bias = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    loss = fn(zimg, ztxt, log_scale.exp(), logit_bias)
    loss.backward()
    return [loss.detach(), zimg.grad, ztxt.grad, log_scale.grad,
            logit_bias.grad if logit_bias.grad is not None else torch.zeros((), dtype=torch.float64)]


def _loss_inputs(batch: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    zimg = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=-1)
    ztxt = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64) + zimg, dim=-1)
    return zimg, ztxt


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_losses_match_open_clip_on_one_process(batch):
    from open_clip.loss import ClipLoss, SigLipLoss

    zimg, ztxt = _loss_inputs(batch, 16, seed=batch)
    pairs = [(lambda i, t, s, b: contrastive_loss(i, t, s), lambda i, t, s, b: ClipLoss()(i, t, s)),
             (lambda i, t, s, b: sigmoid_loss(i, t, s, b), lambda i, t, s, b: SigLipLoss()(i, t, s, b))]
    for ours, theirs in pairs:
        for got, want in zip(_loss_and_grads(ours, zimg, ztxt), _loss_and_grads(theirs, zimg, ztxt)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _dist_worker(rank: int, init_file: str, out_file: str):
    import torch.distributed as dist
    from open_clip.loss import ClipLoss, SigLipLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        zimg, ztxt = _loss_inputs(WORLD * LOCAL, 8, seed=0)
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        zimg, ztxt = zimg[rows], ztxt[rows]
        results = {
            "softmax": (_loss_and_grads(lambda i, t, s, b: contrastive_loss(i, t, s), zimg, ztxt),
                        [_loss_and_grads(lambda i, t, s, b: ClipLoss(local_loss=True, gather_with_grad=True,
                                                                     rank=rank, world_size=WORLD)(i, t, s),
                                         zimg, ztxt)]),
            "sigmoid": (_loss_and_grads(lambda i, t, s, b: sigmoid_loss(i, t, s, b), zimg, ztxt, bias=-3.0),
                        [_loss_and_grads(lambda i, t, s, b, impl=impl: SigLipLoss(rank=rank, world_size=WORLD,
                                                                                  dist_impl=impl)(i, t, s, b),
                                         zimg, ztxt, bias=-3.0) for impl in ("bidir", "shift", "gather")]),
        }
        torch.save(results, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_losses_match_open_clip_across_three_processes(tmp_path):
    """Per process: the same loss and the same gradients (embeddings, scale, bias) as open_clip's
    distributed ClipLoss (local loss, gather with grad) and SigLipLoss (bidir, shift, gather)."""
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    mp.spawn(_dist_worker, args=(str(tmp_path / "init"), str(out)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(f"{out}.{rank}", weights_only=True)
        for name, (ours, references) in results.items():
            for reference in references:
                for got, want in zip(ours, reference):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert ours[2].abs().sum() > 0, name  # the text gradient came back through the gather


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
