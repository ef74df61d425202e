"""A tower's preprocessing, described once: the "preprocess" entry of its config.json, checked.

    "preprocess": {"image_size": 224, "mean": [0.5], "std": [0.5], "decode": "full"}

`Preprocess` is that entry read and validated once, its mean and std given for each channel. Every
reader of images builds from it (`data.transforms`: the per-image steps to uint8 pixels, then the
one normalization, where the tower runs), and so do the descriptions other programs read (the
export's "preprocess", timm's pretrained cfg, open_clip's `preprocess_cfg`). Plain data: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lit_softmoe.errors import UserError


def per_channel(values: float | Sequence[float], channels: int) -> tuple[float, ...]:
    """One value (or a list of one) for every channel; a list of one per channel as it is."""
    values = [values] if isinstance(values, (int, float)) else list(values)
    return tuple(float(v) for v in (values * channels if len(values) == 1 else values))


def check_settings(settings, channels: int | None, source: str | Path) -> None:
    """One UserError line, naming `source` and the key, for a "preprocess" entry no image could go
    through: "image_size" not a positive whole number; "mean" or "std" not a number or a list of one
    number or one per channel; a std of 0 or below (every embedding would be non-finite). Keys left
    out are left to `require_settings`.
    """
    def refuse(what: str) -> None:
        raise UserError(f"{source}: preprocess{what}; the tower folder is damaged or was edited by "
                        "hand: save it again, or correct the key")

    def number(value) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))

    if not isinstance(settings, dict):
        refuse(f" is a {type(settings).__name__}, not {{image_size, mean, std}}")
    size = settings.get("image_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        refuse(f".image_size is {size!r}, not a whole number of pixels")
    for key in ("mean", "std"):
        if key not in settings:
            continue
        values = settings[key] if isinstance(settings[key], list) else [settings[key]]
        if not values or not all(number(v) for v in values):
            refuse(f".{key} is {settings[key]!r}, not a number or a list of numbers")
        if isinstance(channels, int) and len(values) not in (1, channels):
            refuse(f".{key} has {len(values)} values, but the tower takes {channels} channel(s)")
        if key == "std" and any(v <= 0 for v in values):
            refuse(f".std is {settings[key]!r}: each must be above 0 (pixels are divided by it)")


def require_settings(settings, source: str | Path) -> None:
    """One UserError line naming `source` when a "preprocess" entry lacks a key every reader
    needs."""
    if not isinstance(settings, dict) or not {"image_size", "mean", "std"} <= set(settings):
        raise UserError(f"{source} has no \"preprocess\" with image_size, mean and std, so its "
                        "images cannot be prepared as the tower was trained; save the tower as "
                        "pretraining does (save_tower(..., extra={\"preprocess\": {...}}))")


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes a tower's input, as the tower was trained.

    Decode (`decode`: "full", or "reduced": JPEGs decoded at a DCT scale keeping at least
    `images.REDUCED_DECODE_FACTOR` × `image_size` pixels), convert to `channels` (PIL's luma for
    gray), resize the shorter side to `image_size` (bilinear, antialiased), crop the center square,
    then x / 255 − mean, / std per channel.
    """

    image_size: int
    channels: int
    mean: tuple[float, ...]  # one per channel
    std: tuple[float, ...]
    decode: str = "full"

    @classmethod
    def from_settings(cls, settings, channels: int, source: str | Path) -> Preprocess:
        """The preprocessing a "preprocess" entry describes for a tower taking `channels`;
        one UserError line naming `source` when it is missing a key or holds a bad value."""
        require_settings(settings, source)
        check_settings(settings, channels, source)
        # No "decode" (a `convert`ed tower's): images decoded in full.
        return cls(settings["image_size"], channels, per_channel(settings["mean"], channels),
                   per_channel(settings["std"], channels), settings.get("decode", "full"))

    @property
    def mode(self) -> str:
        """The PIL mode of the images the tower takes."""
        return "L" if self.channels == 1 else "RGB"
