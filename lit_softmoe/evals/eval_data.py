"""A benchmark split as the readers (`evals.readers`) hand it to the suite, and the image loading
they share.

`EvalData` holds the split's dataset, whose items are `(index, image tensor or None, target)`, with
what the files say of it (class names, templates, the samples listed) and the signature its cached
embeddings depend on; `evals.benchmark`, `features` and `prompts` take it. `MissingData` is raised
for a benchmark whose files are absent: the suite reports the benchmark as skipped. Images are
opened lazily, regular files only (`images.open_undecoded`), and decoded as the training pipeline
decodes them for the tower's transform (`transformed_image`); a broken image comes out as None,
which the encoder skips and counts. `IndexedImages` is the map-style dataset over (load image,
target) items.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import PIL.Image
import torch
from torch.utils.data import Dataset, IterableDataset

from lit_softmoe.data.images import decode
from lit_softmoe.data.transforms import decode_min_side


class MissingData(Exception):
    """The benchmark's files are not where the suite says: the benchmark is skipped, not failed."""

    def __init__(self, path: str | Path, what: str):
        super().__init__(f"{what} not found at {path}")
        self.path = str(path)


@dataclass
class EvalData:
    """One benchmark split, ready to encode."""
    task: str  # "classification" | "retrieval"
    # yields (index, image (C, H, W) or None if unreadable, target)
    dataset: Dataset | IterableDataset
    format: str
    classnames: list[str] | None = None  # from the dataset's own files, when it ships them
    templates: list[str] | None = None
    # what the cached embeddings depend on (files, sizes)
    signature: dict = field(default_factory=dict)
    # The samples of a webdataset split (`tar_reading.listed_sizes`: lit-softmoe's sizes.json,
    # img2dataset's _stats.json, or a count): reading fewer than listed means truncated shards, and
    # metrics over a part of the split; it also sizes the progress bar. None for remote shards.
    listed_samples: int | None = None
    # Local shards that end inside a member or a header (`tar_reading.is_damaged_tar`): read up to
    # the damage, so the metrics cover part of the split.
    damaged_shards: list[str] = field(default_factory=list)


def transformed_image(load: Callable[[], PIL.Image.Image], transform) -> torch.Tensor | None:
    """`load()`'s image decoded as the training pipeline decodes it for `transform` (full, or JPEGs
    at the reduced scale of the tower's preprocessing), then transformed; None for a broken
    image."""
    try:
        return transform(decode(load(), decode_min_side(transform)))
    except Exception:  # a broken image is skipped and counted by the encoder, never fatal
        return None


class IndexedImages(Dataset):
    """(index, transformed image, target) over a list of (load image, target) items."""

    def __init__(self, items: list[tuple[Callable[[], PIL.Image.Image], int | str]], transform):
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple:
        load, target = self.items[index]
        return index, transformed_image(load, self.transform), target
