"""Text towers for LiT: a from-scratch CLIP text transformer, or a pretrained Hugging Face encoder.

LiT (Zhai et al., "LiT: Zero-Shot Transfer with Locked-image text Tuning", CVPR 2022) trains the
text tower against a locked image tower, either from scratch or starting from a pretrained language
model (both work; pretrained helps a little), on 16-token texts, with a projection from the text
width to the image embedding width.

Two kinds, one interface (`TextTower.forward(ids (B, L)) → (B, embed_dim)`, unnormalized):
    "transformer"  open_clip's `TextTransformer` (the CLIP text tower, Radford et al. 2021) with
                   random init: causal attention, pooled at <end_of_text> ("argmax": CLIP's BPE
                   gives <end_of_text> the largest id), bias-free projection to `embed_dim`.
    "hf"           `transformers.AutoModel.from_pretrained(path)`, pooled over the attention mask
                   (mean / [CLS] / last real token), then a bias-free Linear to `embed_dim` — the
                   shape of Hugging Face's `VisionTextDualEncoderModel` text side.

A tower carries `tokenizer_spec` and `context_length`, so the recipe builds the matching tokenizer
with `lit_softmoe.models.tokenizers.create_tokenizer(tower.tokenizer_spec, tower.context_length)`.

Both number their parameters by layer as timm numbers a ViT's for layer-wise lr decay (`layer_ids`),
and `lock(unlocked_layers)` freezes them by that numbering, as open_clip's `lock_text_tower` does.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn

from lit_softmoe.errors import UserError, check_known_keys, first_line
from lit_softmoe.models.tokenizers import (
    HF_PREFIX,
    LIT_CONTEXT_LENGTH,
    OPENCLIP_BPE,
    create_tokenizer,
)

TEXT_TOWER_KINDS = ("transformer", "hf")
# CLIP's BPE gives ids 0 … 49407 (<end_of_text>, where the tower pools, is the largest): the size
# of the smallest embedding table that every id it produces fits.
OPENCLIP_BPE_VOCAB_SIZE = 49408
HF_POOLINGS = ("mean", "cls", "eos")


@dataclass
class TextTowerConfig:
    """A text tower's shape. `embed_dim` (the image embedding width) is set by the caller."""
    kind: str = "transformer"  # "transformer" (from scratch) | "hf" (pretrained)
    # kind="transformer": open_clip's TextTransformer; defaults are CLIP's base text tower.
    width: int = 512
    layers: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    context_length: int = LIT_CONTEXT_LENGTH  # LiT's 16 tokens (CLIP used 77)
    vocab_size: int = OPENCLIP_BPE_VOCAB_SIZE  # CLIP's BPE
    tokenizer: str = OPENCLIP_BPE
    # kind="hf": a local folder (works offline) or a hub id; the tokenizer is "hf:<path>".
    path: str = ""
    # "mean" (sentence-transformers' choice) | "cls" | "eos" (last real token)
    pooling: str = "mean"
    # Both: the projection's output width; 0 = not set yet (create_text_tower's argument sets it).
    embed_dim: int = 0
    # Both: lock the tower (open_clip's --lock-text): no gradient, no update. unlocked_layers=N
    # keeps its last N transformer blocks and what follows them (final norm, projection) training.
    # The metadata is `lit_softmoe.config.number`'s constraint (this layer cannot import it), which
    # `load_config` checks.
    locked: bool = False
    unlocked_layers: int = field(default=0, metadata={"minimum": 0})

    def validate(self) -> None:
        if self.kind not in TEXT_TOWER_KINDS:
            raise UserError(f"unknown text tower kind {self.kind!r}; "
                            f"use one of {list(TEXT_TOWER_KINDS)}")
        if self.context_length < 2:
            raise UserError(f"text context_length must be at least 2 (a start and an end token), "
                            f"got {self.context_length}")
        if self.unlocked_layers < 0:
            raise UserError(f"text.unlocked_layers must be at least 0, got {self.unlocked_layers}")
        if self.unlocked_layers and not self.locked:
            raise UserError(f"text.unlocked_layers={self.unlocked_layers} says which layers of a "
                            "locked text tower train, but text.locked is false; set "
                            "text.locked=true, or text.unlocked_layers=0 to train the whole tower")
        if self.kind == "transformer":
            if self.tokenizer != OPENCLIP_BPE:
                # The tower pools at the largest id, which is <end_of_text> only for CLIP's BPE.
                raise UserError("text tower kind 'transformer' pools at CLIP's <end_of_text> and "
                                f"needs tokenizer '{OPENCLIP_BPE}', got {self.tokenizer!r}; for a "
                                "Hugging Face tokenizer use kind 'hf' with its pretrained model")
            # Caught here: torch and open_clip would fail on them as tracebacks (a modulo by zero,
            # an out-of-range embedding index at the first step).
            for name in ("width", "heads", "layers"):
                if getattr(self, name) < 1:
                    raise UserError(f"text.{name} must be at least 1, got {getattr(self, name)}")
            if not self.mlp_ratio > 0:  # 0 built MLPs of no hidden unit, a negative one a traceback
                raise UserError(f"text.mlp_ratio must be above 0, got {self.mlp_ratio:g}; "
                                "CLIP's is 4")
            if self.vocab_size < OPENCLIP_BPE_VOCAB_SIZE:
                raise UserError(f"text.vocab_size {self.vocab_size} is smaller than the "
                                f"{OPENCLIP_BPE_VOCAB_SIZE} ids of tokenizer '{OPENCLIP_BPE}'; "
                                "leave text.vocab_size at its default")
            if self.width % self.heads:
                raise UserError(f"text width {self.width} is not divisible by heads {self.heads}")
            if self.unlocked_layers > self.layers:
                raise UserError(f"text.unlocked_layers={self.unlocked_layers} but the text tower "
                                f"has {self.layers} layers; give at most {self.layers}")
        else:
            if not self.path:
                raise UserError("text tower kind 'hf' needs a path: set text.path to a local model "
                                "folder (config.json + weights) or a hub id")
            if self.pooling not in HF_POOLINGS:
                raise UserError(f"unknown text pooling {self.pooling!r}; "
                                f"use one of {list(HF_POOLINGS)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TextTowerConfig":
        """The config `to_dict` wrote; a key it lacks takes the field's default, an unknown key is a
        UserError."""
        check_known_keys(d, {f.name for f in fields(cls)}, "text tower config")
        return cls(**d)


class TextTower(nn.Module):
    """What every text tower offers: ids (B, L) → unnormalized embeddings (B, embed_dim)."""
    embed_dim: int
    context_length: int
    tokenizer_spec: str
    pad_id: int

    def no_weight_decay(self) -> set[str]:
        return set()

    def is_stochastic(self) -> bool:
        """Whether a forward in the current mode may embed the same ids differently: a dropout (or
        any other drop- module) with a nonzero rate, in training mode. A tower that is not may embed
        each distinct caption of a batch once (`LiTModel.forward`'s `text_rows`)."""
        return any(module.training and "drop" in type(module).__name__.lower()
                   and getattr(module, "p", getattr(module, "drop_prob", None)) != 0
                   for module in self.modules())

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer's activations in the backward pass instead of keeping them (timm's
        name)."""
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        """The transformer's layers, first to last: the units sharded training gathers one at a
        time."""
        raise NotImplementedError

    def layer_ids(self) -> dict[str, int]:
        """Each parameter's layer (names as in `named_parameters()`), numbered as timm's
        `group_matcher` numbers a ViT's for `param_groups_layer_decay` (and open_clip its text
        towers' layer groups): 0 the token and position embeddings, i + 1 block i, the final norm
        with the last block, blocks + 1 the projection."""
        raise NotImplementedError

    def lock(self, unlocked_layers: int = 0) -> None:
        """No gradient to the tower but its last `unlocked_layers` blocks and what follows them
        (final norm, projection): open_clip's `lock_text_tower` with freeze_layer_norm (the norms
        inside locked blocks lock too), its N counting blocks (open_clip counts the projection as
        one more group)."""
        self.requires_grad_(False)
        if not unlocked_layers:
            return
        ids = self.layer_ids()
        blocks = max(ids.values()) - 1  # the projection's layer is blocks + 1
        if unlocked_layers > blocks:
            raise UserError(f"text.unlocked_layers={unlocked_layers} but the text tower has "
                            f"{blocks} layers; give at most {blocks}")
        for name, param in self.named_parameters():
            # block i is layer i + 1, the final norm the last block's
            if ids[name] > blocks - unlocked_layers:
                param.requires_grad_(True)


class OpenClipTextTower(TextTower):
    """CLIP's text transformer from open_clip, randomly initialized, pooled at <end_of_text>."""

    def __init__(self, cfg: TextTowerConfig, embed_dim: int):
        super().__init__()
        from open_clip.transformer import TextTransformer

        self.cfg = cfg
        self.embed_dim = embed_dim
        self.context_length = cfg.context_length
        self.tokenizer_spec = cfg.tokenizer
        # open_clip's BPE pads with 0; pooling needs no mask (argmax + causal attention)
        self.pad_id = 0
        self.transformer = TextTransformer(
            context_length=cfg.context_length, vocab_size=cfg.vocab_size, width=cfg.width,
            heads=cfg.heads, layers=cfg.layers, mlp_ratio=cfg.mlp_ratio, output_dim=embed_dim,
            # argmax = the <end_of_text> position; with causal attention nothing after it leaks in.
            pool_type="argmax", proj_type="linear", proj_bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.context_length:
            raise ValueError(f"text ids of length {ids.shape[1]} exceed the tower's context_length "
                             f"{self.context_length}; build the tokenizer with the tower's "
                             "context_length")
        return self.transformer(ids)  # (B, embed_dim)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.transformer.set_grad_checkpointing(enable)  # per residual block, non-reentrant

    def blocks(self) -> nn.ModuleList:
        return self.transformer.transformer.resblocks

    def no_weight_decay(self) -> set[str]:
        return {f"transformer.{n}" for n in self.transformer.no_weight_decay()}

    def layer_ids(self) -> dict[str, int]:
        blocks = len(self.transformer.transformer.resblocks)
        ids = {}
        for name, _ in self.named_parameters():
            block = re.match(r"transformer\.transformer\.resblocks\.(\d+)\.", name)
            if block:
                ids[name] = int(block.group(1)) + 1
            elif name.startswith(("transformer.token_embedding.",
                                  "transformer.positional_embedding", "transformer.cls_emb")):
                ids[name] = 0
            elif name.startswith("transformer.ln_final."):
                ids[name] = blocks
            else:  # text_projection
                ids[name] = blocks + 1
        return ids


def _fp32_kwargs() -> dict:
    """The from_pretrained / from_config keyword that loads a model in fp32 (renamed in transformers
    4.56)."""
    import transformers
    from packaging.version import Version

    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: torch.float32}


class HFTextTower(TextTower):
    """A pretrained Hugging Face encoder + masked pooling + a bias-free projection to `embed_dim`.

    `pretrained_weights=False` builds the encoder from its config.json alone, for a caller that
    loads every weight itself (an export's text_encoder.safetensors).
    """

    def __init__(self, cfg: TextTowerConfig, embed_dim: int, pretrained_weights: bool = True):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        self.cfg = cfg
        self.embed_dim = embed_dim
        self.context_length = cfg.context_length
        self.tokenizer_spec = f"{HF_PREFIX}{cfg.path}"
        self.pooling = cfg.pooling
        try:
            # Loaded in fp32 whatever dtype the checkpoint was saved in (transformers >= 5 keeps the
            # saved fp16/bf16): the master weights the optimizer updates stay fp32, the fp32
            # projection matches them, and autocast alone decides where to compute in low precision.
            self.encoder = (AutoModel.from_pretrained(cfg.path, **_fp32_kwargs())
                            if pretrained_weights else
                            AutoModel.from_config(AutoConfig.from_pretrained(cfg.path)))
        except (OSError, ValueError) as exn:
            raise UserError(
                f"cannot load the Hugging Face text model {cfg.path!r} ({first_line(exn)}); set "
                "text.path to a local folder holding config.json and the weights "
                "(model.safetensors), or a hub id with network access"
            ) from None
        # BERT-like models come with a pooler (dense + tanh over [CLS]) that forward below never
        # uses: frozen, so no parameter goes without a gradient, which DDP (several processes)
        # refuses at the second step. Kept in the state dict, which stays the Hugging Face model's
        # own.
        self._freeze_pooler()
        max_positions = getattr(self.encoder.config, "max_position_embeddings", None)
        if max_positions is not None and cfg.context_length > max_positions:
            raise UserError(f"text context_length {cfg.context_length} exceeds the {max_positions} "
                            f"positions of {cfg.path!r}; lower text.context_length")
        # The mask is `ids != pad_id`, so pad_id must be the one the recipe's tokenizer pads with
        # (HFTokenizer falls back to the end token when a tokenizer defines no padding).
        self.pad_id = create_tokenizer(self.tokenizer_spec, cfg.context_length).pad_id
        self.proj = nn.Linear(self.encoder.config.hidden_size, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=self.encoder.config.hidden_size ** -0.5)

    def _freeze_pooler(self) -> None:
        if getattr(self.encoder, "pooler", None) is not None:
            self.encoder.pooler.requires_grad_(False)

    def blocks(self) -> nn.ModuleList:
        """The encoder's transformer layers: its ModuleList of `num_hidden_layers` modules (the
        largest, should there be several), whatever the architecture names it (`encoder.layer`,
        `layers`, `h`, `block`)."""
        count = getattr(self.encoder.config, "num_hidden_layers", None)
        lists = [m for m in self.encoder.modules()
                 if isinstance(m, nn.ModuleList) and len(m) and (count is None or len(m) == count)]
        if not lists:
            raise UserError("cannot find the transformer layers of the text model "
                            f"{self.cfg.path!r} (no list of {count or 'its'} layers), which "
                            "text.unlocked_layers and optim.layer_decay count; set "
                            "text.unlocked_layers=0 and optim.layer_decay=1")
        return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))

    def layer_ids(self) -> dict[str, int]:
        # The encoder's parameters before its layers (in registration order) are the embeddings;
        # after them, a final norm (and BERT's pooler, frozen), grouped with the last layer. The
        # projection is ours, on top.
        layers = self.blocks()
        in_layer = {id(p): i + 1 for i, layer in enumerate(layers) for p in layer.parameters()}
        ids, past_layers = {}, False
        for name, param in self.encoder.named_parameters(prefix="encoder"):
            past_layers = past_layers or id(param) in in_layer
            ids[name] = in_layer.get(id(param), len(layers) if past_layers else 0)
        ids.update({name: len(layers) + 1 for name, _ in self.proj.named_parameters(prefix="proj")})
        return ids

    def lock(self, unlocked_layers: int = 0) -> None:
        super().lock(unlocked_layers)
        self._freeze_pooler()  # after the layers, but unused: it stays frozen (see __init__)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != self.pad_id).long()  # (B, L), 1 = real token
        if self.pad_id in (getattr(self.encoder.config, "bos_token_id", None),
                           getattr(self.encoder.config, "cls_token_id", None)):
            # a tokenizer padding with its start token: the first position is still real
            mask[:, 0] = 1
        tokens = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, width)
        if self.pooling == "cls":
            pooled = tokens[:, 0]  # (B, width)
        elif self.pooling == "eos":
            # (B,) index of the last real token ([SEP] for BERT)
            last = mask.sum(dim=1).clamp(min=1) - 1
            pooled = tokens[torch.arange(ids.shape[0], device=ids.device), last]  # (B, width)
        else:
            weights = mask.unsqueeze(-1).to(tokens.dtype)  # (B, L, 1)
            pooled = (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # (B, width)
        return self.proj(pooled)  # (B, embed_dim)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        # Per layer, non-reentrant as our towers; transformers applies it in train mode only. Its
        # newer activation_checkpointing_* names where they exist (the old ones warn), else the old
        # ones.
        new_names = hasattr(self.encoder, "activation_checkpointing_enable")
        if enable and new_names:
            self.encoder.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        elif enable:
            self.encoder.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        elif new_names:
            self.encoder.activation_checkpointing_disable()
        else:
            self.encoder.gradient_checkpointing_disable()

    def no_weight_decay(self) -> set[str]:
        # Pretrained position / token-type embeddings are tables, not kernels: keep them undecayed.
        return {n for n, p in self.named_parameters()
                if p.ndim <= 1 or "position_embeddings" in n or "token_type_embeddings" in n}


def create_text_tower(cfg: TextTowerConfig, embed_dim: int | None = None,
                      pretrained_weights: bool = True) -> TextTower:
    """The text tower described by `cfg`, projecting to `embed_dim` (default: `cfg.embed_dim`).

    `pretrained_weights=False`: an "hf" tower's encoder is built from its config without reading its
    weights (the caller loads them all); a "transformer" tower is randomly initialized either way.
    """
    cfg.validate()
    embed_dim = embed_dim if embed_dim is not None else cfg.embed_dim
    if not embed_dim or embed_dim < 1:
        raise UserError("the text tower needs embed_dim (the image embedding width); "
                        "pass create_text_tower(cfg, embed_dim=image_tower.embed_dim)")
    if cfg.kind == "transformer":
        return OpenClipTextTower(cfg, embed_dim)
    return HFTextTower(cfg, embed_dim, pretrained_weights)
