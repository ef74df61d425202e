"""A pretraining run's class splits, however they are read: decoded into memory when small and of
the tower's size (`data.loader=auto`), else streamed from their shards; with their class names, the
mean and std that normalize them, the test batches and the few-shot probe's shots (`ClassData`)."""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from lit_softmoe.config import PretrainConfig
from lit_softmoe.data.class_batches import (
    InMemoryClassBatches,
    StreamedClassBatches,
    read_samples,
    split_batches,
    split_labels,
)
from lit_softmoe.data.class_split import holds_images_of, load_class_split
from lit_softmoe.data.shards import CLASSNAMES_FILE, dataset_dir, read_classnames, shard_urls
from lit_softmoe.data.tar_reading import listed_sizes
from lit_softmoe.data.transforms import eval_transform, train_transform
from lit_softmoe.errors import UserError
from lit_softmoe.evals.probes import sample_shots

_log = logging.getLogger(__name__)

# data.loader=auto streams a training split whose shards total more than this.
AUTO_MEMORY_BYTES = 256 * 2**20
# the mean and std come from this many training images (when the config gives none)
STATS_IMAGES = 10_000


@dataclass
class ClassData:
    """A run's splits, however they are read: `train` gives the training batches; `test_batches` and
    `shots` read the test split and the few-shot probe's shots, as uint8 images."""

    train: InMemoryClassBatches | StreamedClassBatches
    classnames: list[str]
    mean: list[float]  # per channel, of the training images in [0, 1] (or the config's)
    std: list[float]
    num_test: int
    # batch size → (images, labels)
    test_batches: Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]
    # (k, seed) → k per class, or why not
    shots: Callable[[int, int], tuple[torch.Tensor, torch.Tensor] | str]
    bad_samples: Callable[[], dict]
    streamed: bool


def _drop_unnamed_classes(split: str, images, labels, bad, classnames: list[str]):
    """Skip and count (as bad_cls) the samples whose class index has no name: a wrong .cls, or a
    classnames.txt of fewer classes, would otherwise end the run inside the loss."""
    unnamed = labels >= len(classnames)
    if not unnamed.any():
        return images, labels
    _log.warning("skipping bad_cls: %d %s samples have a class index past the %d class names "
                 "(largest %d)", int(unnamed.sum()), split, len(classnames), int(labels.max()))
    bad["bad_cls"] += int(unnamed.sum())
    return images[~unnamed], labels[~unnamed]


def _loader_kind(cfg: PretrainConfig, tower_cfg) -> str:
    """memory or stream, decided once, before any image is decoded. data.loader=auto: memory for
    small splits whose augmentation the in-memory batches have and whose images all have the tower's
    size and channels (found from the images' headers or the decoded cache's,
    `class_split.holds_images_of`), which the stream would otherwise resize and convert."""
    if cfg.data.loader != "auto":
        return cfg.data.loader
    if cfg.data.augment and (cfg.data.crop != "pad" or cfg.data.randaugment):
        return "stream"  # the in-memory batches have the padded crop + flip only
    try:
        size = sum(Path(url).stat().st_size for url in shard_urls(cfg.data.train))
    except OSError:  # remote shards (or a name that is not a file): never loaded whole
        return "stream"
    if size > AUTO_MEMORY_BYTES:
        return "stream"
    splits = ((cfg.data.train, cfg.data.max_train_samples),
              (cfg.data.test, cfg.data.max_test_samples))
    if all(holds_images_of(split, tower_cfg.in_channels, tower_cfg.image_size, limit or None)
           for split, limit in splits):
        return "memory"
    _log.info("data.loader=auto: the images are not all %d×%d px with %d channels: streaming them",
              tower_cfg.image_size, tower_cfg.image_size, tower_cfg.in_channels)
    return "stream"


def setup_class_data(cfg: PretrainConfig, tower_cfg, rank: int, world_size: int) -> ClassData:
    if _loader_kind(cfg, tower_cfg) == "memory":
        return memory_class_data(cfg, tower_cfg, rank, world_size)
    return streamed_class_data(cfg, tower_cfg, rank, world_size)


def _check_bad_fraction(cfg: PretrainConfig, split: str, bad: dict, good: int) -> None:
    num_bad = sum(bad.values())
    if num_bad > cfg.data.max_bad_fraction * (num_bad + good):
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(bad.items()))
        raise UserError(f"{num_bad} of {num_bad + good} {split} samples were bad ({reasons}), over "
                        f"data.max_bad_fraction={cfg.data.max_bad_fraction}; fix the shards or "
                        "raise it")


def memory_class_data(cfg: PretrainConfig, tower_cfg, rank: int, world_size: int) -> ClassData:
    """The splits decoded into memory (images of mixed sizes, or of another size than the tower's,
    are a UserError naming data.loader=stream)."""
    train_images, train_labels, train_bad = load_class_split(cfg.data.train,
                                                             cfg.data.max_train_samples or None)
    test_images, test_labels, test_bad = load_class_split(cfg.data.test,
                                                          cfg.data.max_test_samples or None)
    # beside the split, for a pattern or a '::' list too
    classnames_dir = dataset_dir(cfg.data.train)
    has_names = classnames_dir is not None and (classnames_dir / CLASSNAMES_FILE).exists()
    classnames = (read_classnames(classnames_dir) if has_names
                  else [str(i) for i in range(int(train_labels.max()) + 1)])
    train_images, train_labels = _drop_unnamed_classes("train", train_images, train_labels,
                                                       train_bad, classnames)
    test_images, test_labels = _drop_unnamed_classes("test", test_images, test_labels, test_bad,
                                                     classnames)
    _check_bad_fraction(cfg, "train", train_bad, len(train_labels))
    _check_bad_fraction(cfg, "test", test_bad, len(test_labels))
    _check_fits(cfg, tower_cfg, train_images)
    mean, std = ((list(cfg.data.mean), list(cfg.data.std)) if cfg.data.mean
                 else _channel_stats(train_images))
    train = InMemoryClassBatches(train_images, train_labels, cfg.batch_size, cfg.seed, rank,
                                 world_size, augment=cfg.data.augment,
                                 crop_padding=cfg.data.crop_padding)

    def test_batches(batch_size: int):
        return zip(test_images.split(batch_size), test_labels.split(batch_size))

    def shots(k: int, seed: int):
        why = fewshot_skip_reason(k, train_labels, classnames)
        if why:
            return why
        ids = sample_shots(train_labels, k, seed)
        return train_images[ids], train_labels[ids]

    return ClassData(train, classnames, mean, std, len(test_labels), test_batches, shots,
                     lambda: {"train": dict(train_bad), "test": dict(test_bad)}, streamed=False)


def _channel_stats(images: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std in [0, 1] of the first `STATS_IMAGES` of uint8 images (N, C, H, W):
    the tower's normalization where the config gives none, however the split is read."""
    pixels = images[:STATS_IMAGES].float() / 255
    return pixels.mean(dim=(0, 2, 3)).tolist(), pixels.std(dim=(0, 2, 3)).tolist()


def streamed_class_data(cfg: PretrainConfig, tower_cfg, rank: int, world_size: int) -> ClassData:
    """The splits streamed from their shards, each image resized (and converted) to the tower's
    input."""
    if cfg.data.max_train_samples or cfg.data.max_test_samples:
        raise UserError("data.max_train_samples and data.max_test_samples keep the first N images "
                        "of a split held in memory; with data.loader=stream, write a smaller split "
                        "instead (or set them to 0)")
    classnames_dir = dataset_dir(cfg.data.train)
    if classnames_dir is None or not (classnames_dir / CLASSNAMES_FILE).exists():
        raise UserError(f"streaming {cfg.data.train} needs its classnames.txt (one class name per "
                        "line, in label order) beside the split folder: `lit-softmoe data "
                        "from-folder --layout classes` writes it")
    classnames = read_classnames(classnames_dir)
    size, channels = tower_cfg.image_size, tower_cfg.in_channels
    # uint8 (C, size, size)
    eval_pixels = eval_transform(size, channels, decode=cfg.data.decode, normalize=False)
    workers = cfg.data.workers
    if cfg.data.mean:
        mean, std = list(cfg.data.mean), list(cfg.data.std)
    else:  # each process reads the same first images, so all normalize alike
        batches, _ = split_batches(cfg.data.train, eval_pixels, 256, workers=0,
                                   num_classes=len(classnames), max_bad_fraction=1.0)
        first = itertools.islice(batches, math.ceil(STATS_IMAGES / 256))
        mean, std = _channel_stats(torch.cat([batch.images for batch in first]))
    if cfg.data.augment:
        crop = dict(crop_padding=cfg.data.crop_padding) if cfg.data.crop == "pad" else \
            dict(random_resized_crop=True, scale=tuple(cfg.data.crop_scale))
        train_pixels = train_transform(size, channels, hflip=True, decode=cfg.data.decode,
                                       randaugment=cfg.data.randaugment, normalize=False, **crop)
    else:
        train_pixels = eval_pixels
    train = StreamedClassBatches(cfg.data.train, cfg.batch_size, train_pixels, seed=cfg.seed,
                                 rank=rank, world_size=world_size, workers=workers,
                                 shuffle_buffer=cfg.data.shuffle_buffer,
                                 max_bad_fraction=cfg.data.max_bad_fraction,
                                 num_classes=len(classnames))
    test_bad: dict = {}

    def test_batches(batch_size: int):
        batches, loader = split_batches(cfg.data.test, eval_pixels, batch_size, workers,
                                        len(classnames), cfg.data.max_bad_fraction)
        yield from ((b.images, b.labels) for b in batches)
        test_bad.clear()
        test_bad.update(loader.bad.counts)

    def shots(k: int, seed: int):
        labels = split_labels(cfg.data.train, len(classnames))
        why = fewshot_skip_reason(k, labels, classnames)
        if why:
            return why
        return read_samples(cfg.data.train, sample_shots(labels, k, seed).tolist(), eval_pixels,
                            len(classnames))

    sizes = listed_sizes(shard_urls(cfg.data.test)) or {}
    return ClassData(train, classnames, mean, std, sum(sizes.values()), test_batches, shots,
                     lambda: {"train": dict(train.loader.bad.counts), "test": dict(test_bad)},
                     streamed=True)


def fewshot_skip_reason(shots: int, labels: torch.Tensor, classnames: list[str]) -> str | None:
    """Why the k-shot probe cannot run on these training labels, or None: it takes k of every
    class."""
    if shots <= 0:
        return None
    counts = torch.bincount(labels, minlength=len(classnames))
    smallest = int(counts.argmin())
    if counts[smallest] >= shots:
        return None
    return (f"the {shots}-shot linear probe is skipped: class {smallest} ({classnames[smallest]}) "
            f"has {int(counts[smallest])} training images; lower fewshot_shots (0 turns the probe "
            "off) or train on more images")


def _check_fits(cfg: PretrainConfig, tower_cfg, images: torch.Tensor) -> None:
    _, channels, height, _ = images.shape
    if channels != tower_cfg.in_channels or height != tower_cfg.image_size:
        # A split is read as RGB as soon as one of its images is in color (load_class_split says how
        # many).
        read_as = " (read as RGB: one or more of its images are in color)" if channels == 3 else ""
        raise UserError(
            f"tower {cfg.tower.name!r} takes {tower_cfg.in_channels}×{tower_cfg.image_size}px "
            f"images but {cfg.data.train} holds {channels}×{height}px{read_as}; set "
            f"data.loader=stream (it resizes and converts every image), pick a tower for this "
            f"size, or set tower.options.image_size / tower.options.in_channels")
