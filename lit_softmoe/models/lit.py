"""The paired image–text model of LiT: a locked image tower, a trained text tower, a learned scale.

Follows big_vision's two-tower model (`big_vision/models/proj/image_text/two_towers.py`): the model
owns the log-temperature (and, for the SigLIP loss, the bias) and L2-normalizes both towers'
outputs; its interface is open_clip's (`logit_scale`, `encode_image(x, normalize=...)`,
`model(image, text)` with either left out, returning
`(image_features, text_features, logit_scale[, logit_bias])`), so open_clip's helpers such as
`build_zero_shot_classifier` take it. Locking follows LiT (Zhai et al., CVPR 2022): the image tower
gets no gradient and no update, and — unlike open_clip's `--lock-image`, which only clears
`requires_grad` — it also stays in eval mode, so no dropout or drop-path ever perturbs the features,
and a fully locked tower's output can be computed once and cached (`encode_image_features` takes
those cached `forward_pooled` outputs). The text tower trains, or is locked too (open_clip's
`--lock-text`, optionally with its last layers unlocked): then the logit scale, and the image head
or unlocked blocks if any, are what learns. Scale/bias inits: softmax loss t = log 10 (big_vision),
sigmoid loss t = log 10, b = -10 (SigLIP, Zhai et al., ICCV 2023).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTower
from lit_softmoe.models.tower_layers import check_unlockable
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.utils.hashing import weights_sha256

LOSSES = ("softmax", "sigmoid")


class LiTModel(nn.Module):
    """Locked image tower (or cached image features) + text tower + logit scale (and bias).

    Args:
        image_tower: the pretrained tower, or None when training only from cached image features.
        text_tower: projects ids (B, L) to (B, D) with D = the image embedding width.
        loss: "softmax" (CLIP/LiT contrastive) or "sigmoid" (SigLIP; adds the learned bias).
        temperature_init: initial logit scale, stored as its log in `logit_scale` (big_vision's `t`;
            open_clip's name and meaning: the scale is `logit_scale.exp()`).
        max_temperature: the scale is capped at this value (CLIP's 100); at the cap it still learns.
        bias_init: initial logit bias of the sigmoid loss.
        image_head: a trainable Linear(width, D) on top of the locked features (LiT found none
            best).
        unlocked_blocks: how many of the tower's last blocks train (0 = fully locked, LiT's choice).
        text_locked: lock the text tower too (open_clip's `--lock-text`); a fully locked one stays
            in eval mode.
        text_unlocked_layers: with text_locked, how many of its last blocks train (with its final
            norm and projection); see `TextTower.lock`.
    """

    def __init__(self, image_tower: VisionTransformer | None, text_tower: TextTower,
                 loss: str = "softmax", temperature_init: float = 10.0,
                 max_temperature: float = 100.0, bias_init: float = -10.0,
                 image_head: bool = False, unlocked_blocks: int = 0, text_locked: bool = False,
                 text_unlocked_layers: int = 0):
        super().__init__()
        if loss not in LOSSES:
            raise UserError(f"unknown loss {loss!r}; use one of {list(LOSSES)}")
        if image_tower is None and unlocked_blocks:
            raise UserError("unlocked_blocks needs the image tower; cached image features cannot "
                            "be fine-tuned")
        # its log is the parameter; past the cap it would not learn
        if not 0 < temperature_init <= max_temperature:
            raise UserError(f"temperature_init must be above 0 and at most {max_temperature:g}, "
                            f"got {temperature_init:g}")
        if text_unlocked_layers and not text_locked:
            raise UserError(f"text_unlocked_layers={text_unlocked_layers} needs text_locked (set "
                            "text.locked=true)")
        # Which parameters train: the tower's last blocks by its own layer numbering (timm's
        # group_matcher), whatever its layout (a ViT's blocks, a ResNet's stages, a Swin's layers).
        layers = check_unlockable(image_tower, unlocked_blocks) if image_tower is not None else None
        self.unlocked_image_names = (layers.unlocked(unlocked_blocks) if layers is not None
                                     else set())
        self.image_tower = image_tower
        self.text_tower = text_tower
        self.loss = loss
        self.max_temperature = max_temperature
        self.unlocked_blocks = unlocked_blocks
        self.text_locked = text_locked
        self.text_unlocked_layers = text_unlocked_layers
        embed_dim = text_tower.embed_dim
        image_width = image_tower.embed_dim if image_tower is not None else embed_dim
        if not image_head and image_width != embed_dim:
            raise UserError(f"the image tower's width {image_width} differs from the text tower's "
                            f"embed_dim {embed_dim}; build the text tower with "
                            f"embed_dim={image_width} or set image_head")
        self.image_head = nn.Linear(image_width, embed_dim) if image_head else nn.Identity()
        # The *log* of the scale, as open_clip's `logit_scale` (big_vision's `t`); forward returns
        # its exp.
        self.logit_scale = nn.Parameter(torch.tensor(math.log(temperature_init)))
        self.logit_bias = (nn.Parameter(torch.tensor(float(bias_init))) if loss == "sigmoid"
                           else None)
        self.lock_image_tower()
        self.lock_text_tower()

    # ---- locking ------------------------------------------------------------------------------

    def lock_image_tower(self) -> None:
        """No gradient to the tower except its last `unlocked_blocks` blocks and what runs after
        them (a final norm, an attention pool: left frozen, they would pin the unlocked blocks'
        output; models.tower_layers)."""
        if self.image_tower is None:
            return
        for name, param in self.image_tower.named_parameters():
            param.requires_grad_(name in self.unlocked_image_names)
        self.image_tower.eval()

    def lock_text_tower(self) -> None:
        """With `text_locked`: no gradient to the text tower but its last `text_unlocked_layers`
        blocks (+ its final norm and projection then); fully locked, it stays in eval mode as the
        image tower does."""
        if not self.text_locked:
            return
        self.text_tower.lock(self.text_unlocked_layers)
        if self.text_tower_locked:
            self.text_tower.eval()

    @property
    def image_tower_locked(self) -> bool:
        return self.image_tower is not None and self.unlocked_blocks == 0

    @property
    def text_tower_locked(self) -> bool:
        """The whole text tower locked (`text_locked` with no unlocked layer)."""
        return self.text_locked and self.text_unlocked_layers == 0

    def train(self, mode: bool = True) -> "LiTModel":
        super().train(mode)
        if self.image_tower is not None:
            self.image_tower.eval()  # deterministic features, always (see the module docstring)
        if self.text_tower_locked:
            self.text_tower.eval()  # no dropout on features nothing learns from
        return self

    def image_tower_sha256(self) -> str:
        """The tower's weights as they are now, by `utils.hashing.weights_sha256` (names, dtypes,
        shapes, bytes): the recipe proves with it that a locked tower never changed. In the tower
        folder's dtype it is the folder's `tower_sha256`; a tower cast to bf16 has another."""
        if self.image_tower is None:
            raise ValueError("this LiTModel has no image tower (it trains from cached features)")
        return weights_sha256(self.image_tower.state_dict())

    def locked_image_parameters(self) -> dict[str, nn.Parameter]:
        """The image tower's parameters that never train, by their names in it: all of them when it
        is fully locked, else all but those of its unlocked blocks and final norms (none without a
        tower)."""
        if self.image_tower is None:
            return {}
        return {n: p for n, p in self.image_tower.named_parameters() if not p.requires_grad}

    def locked_image_keys(self) -> list[str]:
        """The state-dict keys (`image_tower.*`) of the image tower's locked part: every key of a
        fully locked tower, else its locked parameters'. Training checkpoints and model/ leave them
        out, since the tower folder holds them in its own dtype (checked by its `tower_sha256`)."""
        if self.image_tower_locked:
            return [f"image_tower.{k}" for k in self.image_tower.state_dict()]
        return [f"image_tower.{name}" for name in self.locked_image_parameters()]

    def locked_image_sha256(self) -> str | None:
        """The image tower's locked part as it is now (None without a tower): the whole tower's
        `image_tower_sha256` when it is fully locked, else its locked parameters'. The recipe proves
        with it that the locked part never changed."""
        if self.image_tower is None:
            return None
        if self.image_tower_locked:
            return self.image_tower_sha256()
        return weights_sha256(self.locked_image_parameters())

    def hold_locked_image_in(self, dtype: torch.dtype) -> None:
        """Cast the image tower's locked part to `dtype`, once. It only runs forward, so it is held
        in the dtype it runs in (bf16 under bf16 autocast) instead of being cast by autocast at
        every call, at half the bytes. Unlocked blocks and their final norms stay as they are: they
        train, in fp32."""
        if self.image_tower is None:
            return
        if self.image_tower_locked:
            self.image_tower.to(dtype)
            return
        with torch.no_grad():
            for param in self.locked_image_parameters().values():
                # The same Parameter object, its data replaced: the optimizer, FSDP's ignored
                # parameters and a copy that shares it all keep seeing it.
                param.data = param.data.to(dtype)

    def locked_text_sha256(self) -> str | None:
        """The text tower's locked parameters as they are now (`weights_sha256`, names as in the
        tower's `named_parameters()`), or None when it is not locked: the recipe proves with it that
        they never changed."""
        if not self.text_locked:
            return None
        return weights_sha256({n: p for n, p in self.text_tower.named_parameters()
                               if not p.requires_grad})

    # ---- encoders -----------------------------------------------------------------------------

    def encode_image_features(self, features: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Pooled tower features (B, width), e.g. cached ones → embeddings (B, D), L2-normalized by
        default."""
        embeddings = self.image_head(features)
        return F.normalize(embeddings, dim=-1) if normalize else embeddings

    def encode_image(self, image: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """image (B, C, H, W), preprocessed → embeddings (B, D); `normalize=False` as in open_clip
        (whose default it is) gives them before the L2 norm. Ours defaults to normalized: what every
        caller wants."""
        if self.image_tower is None:
            raise ValueError("this LiTModel has no image tower; pass image_features (the cached "
                             "embeddings)")
        # Fully locked: no graph at all (activations freed at once). Partly unlocked: autograd
        # records nothing before the first unlocked block anyway, since nothing there needs grad.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.image_tower_locked):
            # (B, width); at least float32, also from a tower held in bf16 (what a head and the text
            # side expect); a float64 pair stays float64
            features = self.image_tower.forward_pooled(image)
            features = features.to(torch.promote_types(features.dtype, torch.float32))
        return self.encode_image_features(features, normalize=normalize)

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """text ids (B, L) → embeddings (B, D), L2-normalized unless `normalize=False` (as
        encode_image)."""
        embeddings = self.text_tower(text)
        return F.normalize(embeddings, dim=-1) if normalize else embeddings

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None, *,
                image_features: torch.Tensor | None = None, text_rows: torch.Tensor | None = None):
        """open_clip's `CLIP.forward` contract: → (image_features (B, D) or None, text_features (B',
        D) or None, logit_scale), plus logit_bias for the sigmoid loss; features normalized, either
        tower may be left out (`model(text=ids)` embeds text alone). The scale is
        `logit_scale.exp()` capped at max_temperature. `image_features`: pooled tower features (e.g.
        cached) in place of `image`. `text_rows` (B',): the texts as rows of `text`, which then
        holds each distinct caption once (see `distinct_rows`): the text features are
        `encode_text(text)[text_rows]`, with each caption's gradient summed over its rows."""
        if image is not None and image_features is not None:
            raise ValueError("give at most one of image and image_features")
        zimg = None
        if image is not None:
            zimg = self.encode_image(image)
        elif image_features is not None:
            if self.unlocked_blocks:
                raise UserError("cached image features come from the locked tower, but "
                                f"unlocked_blocks={self.unlocked_blocks} trains part of it; use "
                                "unlocked_blocks=0 with an embedding cache, or feed images")
            zimg = self.encode_image_features(image_features)
        ztxt = self.encode_text(text) if text is not None else None
        if ztxt is not None and text_rows is not None:
            ztxt = ztxt[text_rows]  # (distinct, D) → (B', D)
        # Capped at max_temperature in value only: the gradient passes as if uncapped, because a
        # clamp gives none at or past its bound (and exp(float32 ln 100) is just past 100), so a
        # scale that reached the cap could never come back down. The recipe also caps the
        # parameter itself after each step (`clamp_logit_scale_`), as CLIP and open_clip do.
        overshoot = (self.logit_scale.detach() - math.log(self.max_temperature)).clamp(min=0)
        scale = (self.logit_scale - overshoot).exp()
        if self.logit_bias is not None:
            return zimg, ztxt, scale, self.logit_bias
        return zimg, ztxt, scale

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the activations of each block in the backward pass: the text tower's and an
        unlocked image tower's (a locked one keeps none)."""
        self.text_tower.set_grad_checkpointing(enable)
        if self.image_tower is not None:
            self.image_tower.set_grad_checkpointing(enable)

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Cap the log-scale parameter at log(max_temperature); call after each optimizer step
        (open_clip's `logit_scale.clamp_(0, math.log(100))`), so Adam cannot carry it past the
        cap."""
        self.logit_scale.clamp_(max=math.log(self.max_temperature))

    def no_weight_decay(self) -> set[str]:
        """Biases, norms, logit scale/bias, position embeddings, phi: names as in
        `named_parameters()`."""
        names = {"logit_scale"} | ({"logit_bias"} if self.logit_bias is not None else set())
        if self.image_tower is not None:
            names |= {f"image_tower.{n}" for n in self.image_tower.no_weight_decay()}
        names |= {f"text_tower.{n}" for n in self.text_tower.no_weight_decay()}
        # Every other scalar and vector (biases, norms) too, except the image tower's: its own list
        # leaves out Soft MoE's scalar `scale` on purpose (decayed like a kernel, as vmoe does).
        names |= {n for n, p in self.named_parameters()
                  if p.ndim <= 1 and not n.startswith("image_tower.")}
        return names


def distinct_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Text ids (B, L) → (the distinct rows (U, L), each row's index among them (B,)), what
    `LiTModel.forward` takes as `text` and `text_rows`; (ids, None) when no row repeats. Captions
    written from class names repeat within a batch (Fashion-MNIST's 50 in every batch of 256), and
    the text tower then runs on U rows instead of B."""
    distinct, rows = torch.unique(ids, dim=0, return_inverse=True)
    return (ids, None) if len(distinct) == len(ids) else (distinct, rows)
