"""The members of one shard sample, read the same way by every reader (training streams, a class split
read whole, LiT's eval labels, the zero-shot suite).

A raw sample is webdataset's {"__key__", "__url__", extension: bytes}, extensions lowercased. Fields:
- the image: the first of `IMAGE_EXTENSIONS` the sample holds (`image_extension`);
- the class: `.cls`, a class index written as ASCII digits, surrounding whitespace allowed
  (`class_index`). A sign, an underscore or any other character makes it no class index: "+3",
  "-0" and "1_0" are what Python's `int` would read, and none is what a writer writes.

A sample a reader cannot use raises `SampleSkip`, whose reason is the name it is counted under.
"""
from __future__ import annotations

import re

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
_CLASS_INDEX = re.compile(rb"[0-9]+")
_ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"


class SampleSkip(Exception):
    """A sample that cannot be used, with the reason it is counted under ("missing_cls", "bad_image"…)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason = reason


def image_extension(sample: dict) -> str | None:
    """The member holding the sample's image (its extension), or None if it has none."""
    return next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)


def is_class_member(name: str) -> bool:
    """Whether a tar member is a sample's `.cls` (a `select_files` for reading labels alone)."""
    return name.lower().endswith(".cls")


def class_index(raw: bytes) -> int | None:
    """The class index a `.cls` member holds; None when it holds none ("dog", "-1", "+3", b"\\xff")."""
    digits = raw.strip(_ASCII_WHITESPACE)
    if not _CLASS_INDEX.fullmatch(digits):
        return None
    try:
        return int(digits)
    except ValueError:  # past Python's limit on the digits of an int read from text
        return None


def decode_label(sample: dict, num_classes: int = 0) -> int:
    """The sample's class index; `SampleSkip` ("missing_cls", "bad_cls") when it has no usable one.
    `num_classes`: an index from it on is bad_cls too (0: no check)."""
    if "cls" not in sample:
        raise SampleSkip("missing_cls")
    label = class_index(sample["cls"])
    if label is None:
        raise SampleSkip("bad_cls", f"{sample['cls'][:20]!r} is not a class index")
    if num_classes and label >= num_classes:
        raise SampleSkip("bad_cls", f"class {label} is past the {num_classes} class names")
    return label
