"""A shard write's options and the checks of their values: `WriteOptions`, a split's folder name
(`check_split_name`) and sizes in bytes (`parse_byte_size`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from lit_softmoe.data.images import IMAGE_FORMATS
from lit_softmoe.errors import UserError, setting


@dataclass(frozen=True)
class WriteOptions:
    """How a split is written; the same for folders and tables.

    Args:
        split: the split folder's name under the output folder, e.g. "train" or "test".
        image_format: "keep" (the file's own format: png, jpg or webp; others become png), or the
            format every image is stored in.
        max_size: shrink images whose longer side is larger to this many pixels (None: never).
        samples_per_shard: a new shard starts after this many samples …
        max_shard_bytes: … or once a shard holds this many bytes.
    """

    split: str = "train"
    image_format: str = "keep"
    max_size: int | None = None
    samples_per_shard: int = 10_000
    max_shard_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.image_format not in IMAGE_FORMATS:
            raise UserError(f"unknown image format {self.image_format!r}; "
                            f"choose one of {', '.join(IMAGE_FORMATS)}")
        check_split_name(self.split)
        for name in ("max_size", "samples_per_shard", "max_shard_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name.replace('_', '-')} must be at least 1, got {value}")


def check_split_name(split: str, setting_names: Mapping[str, str] | None = None) -> None:
    """Refuse a split name that is not a plain folder name (a path, `..`, hidden). Messages call it
    as `setting_names` calls `split` (`errors.setting`; the CLI passes --split, and checks it before
    making its `WriteOptions`)."""
    if not split or split != Path(split).name or split.startswith("."):
        raise UserError(f"{setting(setting_names, 'split')} {split!r} is not a plain folder name; "
                        f"pass e.g. {setting(setting_names, 'split', 'train')}")


def parse_byte_size(text: str) -> int:
    """`"1G"`, `"500M"`, `"64k"` or a plain number of bytes → bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if match is None:
        raise UserError(f"cannot read {text!r} as a size in bytes; write e.g. 1G, 500M or 1048576")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))
