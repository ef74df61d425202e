"""Training batches of a classification split, epoch by epoch: decoded in memory, or streamed.

Pretraining takes its batches from one of two sources with one interface — `steps_per_epoch` and
`epoch(epoch, start)`, which yields this process's `ClassBatch`es of uint8 images (normalized later,
on the device):

- `InMemoryClassBatches`: a small split decoded once (`class_split.load_class_split`;
  Fashion-MNIST's 60k × 28×28 is 47 MB), the epoch's order a permutation seeded with (seed, epoch),
  each batch cut from it and augmented at once (`transforms.batch_augment`: the padded crop + flip
  of `train_transform(crop_padding=...)`, one gather for the batch instead of a Python call per
  image).
- `StreamedClassBatches`: the shards through `pipelines.ShardLoader`, the loader LiT reads with
  (shard order a function of (seed, epoch), split by process and then by worker, a seeded shuffle
  buffer, decoding and the per-image `train_transform` in the workers, bad samples skipped and
  counted). Memory stays flat however large the split; images come in any size and mode. Every
  sample is read once per epoch; a process whose shards run out before the epoch's last step starts
  its shards again for the few samples equal batches need (`steps_per_epoch` is the same on every
  process).

In both, every batch is a function of (seed, epoch, rank, world size) — and for streams the number
of workers — and a sample's random crop of (seed, epoch, its key): `epoch(e, start=k)` yields what
`epoch(e)` yields from its k-th batch on, so a resumed run sees the batches the killed one would
have.

Also here, for evaluating on streamed splits: `split_batches` (a split read once by one process),
`split_labels` (its labels alone, without decoding an image) and `read_samples` (the images at
chosen positions, for the few-shot probe's shots).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.samples import SampleSkip, decode_label, read_labels, sample_decoder
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.tar_reading import BadSampleCounter, listed_sizes, tar_samples
from lit_softmoe.data.transforms import batch_augment
from lit_softmoe.errors import UserError


class ClassBatch(NamedTuple):
    images: torch.Tensor  # (b, C, H, W) uint8
    labels: torch.Tensor  # (b,) int64
    keys: list[str] | None  # the samples' keys (streams); None in memory


class InMemoryClassBatches:
    """Batches of a split held in memory as uint8 (N, C, H, W)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int, seed: int,
                 rank: int = 0, world_size: int = 1, augment: bool = False, crop_padding: int = 2):
        self.images, self.labels = images, labels
        self.global_batch, self.seed, self.rank, self.world_size = (
            global_batch, seed, rank, world_size)
        self.augment, self.crop_padding = augment, crop_padding
        self.steps_per_epoch = len(labels) // global_batch  # the last partial batch is dropped
        self.num_samples = len(labels)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[ClassBatch]:
        order = torch.randperm(
            len(self.labels), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        for index in range(start, self.steps_per_epoch):
            batch_ids = order[index * self.global_batch:(index + 1) * self.global_batch]
            batch_ids = batch_ids[self.rank::self.world_size]  # (local_batch,)
            images = self.images[batch_ids]
            if self.augment:
                step = epoch * self.steps_per_epoch + index
                generator = torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + step) * 1009 + self.rank)
                images = batch_augment(images, generator, padding=self.crop_padding)
            yield ClassBatch(images, self.labels[batch_ids], None)


class StreamedClassBatches:
    """Batches of this process's share of a split's shards, decoded and transformed by loader
    workers.

    Args:
        urls: the split (a folder, a pattern, a '::' list: `shards.shard_urls`); local shards, whose
            sizes fix the epoch's length.
        global_batch: over all processes; each yields global_batch / world_size samples a step.
        transform: PIL image → uint8 (C, H, W) at the tower's size
            (`train_transform(normalize=False)`).
        workers, shuffle_buffer, max_bad_fraction: as in `pipelines.ShardDataConfig`.
        num_classes: class indices from it on are skipped as bad_cls.
    """

    def __init__(self, urls: str, global_batch: int, transform: Callable, *, seed: int, rank: int,
                 world_size: int, workers: int = 2, shuffle_buffer: int = 5000,
                 max_bad_fraction: float = 0.01, num_classes: int = 0):
        if global_batch % world_size:
            raise UserError(f"batch_size {global_batch} does not split over {world_size} processes")
        self.local_batch, self.rank, self.world_size = global_batch // world_size, rank, world_size
        self.urls = shard_urls(urls)
        sizes = listed_sizes(self.urls)
        if sizes is None:
            raise UserError(f"{urls}: streaming pretraining needs local shards (their sizes give "
                            "an epoch's length); copy the shards to a local disk")
        if len(self.urls) < world_size:
            raise UserError(f"{len(self.urls)} shards cannot feed {world_size} processes "
                            "(each reads shards of its own): write the split again with fewer "
                            "samples per shard, or use fewer processes")
        # The largest share a process can get in any epoch's shard order: its steps are every
        # process's.
        largest_share = sum(
            sorted(sizes.values(), reverse=True)[:math.ceil(len(self.urls) / world_size)])
        self.steps_per_epoch = math.ceil(largest_share / self.local_batch)
        self.num_samples = sum(sizes.values())
        self.loader = create_shard_loader(ShardDataConfig(
            urls=urls, batch_size=self.local_batch, workers=workers, shuffle=True,
            shuffle_buffer=shuffle_buffer, seed=seed, exact_epoch=True,
            max_bad_fraction=max_bad_fraction, rank=rank, world_size=world_size,
            seed_transforms=True, num_classes=num_classes), "image-class", transform)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[ClassBatch]:
        """This process's batches of `epoch` from the `start`-th on (the ones before are read, not
        yielded)."""
        self.loader.set_epoch(epoch)
        # the loader's batches (one per worker in turn, partial at their ends)
        pending: list[ClassBatch] = []
        pending_count, emitted = 0, 0
        # a pass over this process's shards; a second one pads the last batches
        for _ in itertools.count():
            read = 0
            for batch in self.loader:
                read += len(batch["label"])
                pending.append(ClassBatch(batch["image"], batch["label"], batch["key"]))
                pending_count += len(batch["label"])
                while pending_count >= self.local_batch:
                    ready, pending = _take(pending, self.local_batch)
                    pending_count -= self.local_batch
                    if emitted >= start:
                        yield ready
                    emitted += 1
                    if emitted == self.steps_per_epoch:
                        return
            if read == 0:
                raise UserError(f"process {self.rank} read no usable sample from its shards of "
                                f"{self.loader.cfg.urls} (skipped: "
                                f"{dict(self.loader.bad.counts)}); check the shards")

    def metrics(self) -> dict[str, int]:
        return self.loader.metrics()


def _take(pending: list[ClassBatch], count: int) -> tuple[ClassBatch, list[ClassBatch]]:
    """The first `count` samples of the pending batches as one batch, and what remains."""
    images = torch.cat([b.images for b in pending])
    labels = torch.cat([b.labels for b in pending])
    keys = [key for b in pending for key in b.keys]
    rest = [ClassBatch(images[count:], labels[count:], keys[count:])] if len(labels) > count else []
    return ClassBatch(images[:count], labels[:count], keys[:count]), rest


# ----------------------------------------------------------------------------------
# evaluation reads

def split_batches(urls: str, transform: Callable, batch_size: int, workers: int = 2,
                  num_classes: int = 0,
                  max_bad_fraction: float = 0.01) -> tuple[Iterator[ClassBatch], object]:
    """A whole split once, by this process alone: (its batches, the loader whose `bad` counts the
    skipped samples once the batches are read). With workers, their shards' batches interleave; with
    none, the samples come in shard order."""
    loader = create_shard_loader(ShardDataConfig(
        urls=urls, batch_size=batch_size, workers=workers, shuffle=False, exact_epoch=True,
        rank=0, world_size=1, max_bad_fraction=max_bad_fraction, num_classes=num_classes),
        "image-class", transform)
    batches = (ClassBatch(b["image"], b["label"], b["key"]) for b in loader)
    return batches, loader


def split_labels(urls: str, num_classes: int = 0) -> torch.Tensor:
    """The class index of every sample of a split that has a valid one, in shard order, reading the
    `.cls` members alone (an image is never decoded: this is fast on any split)."""
    return torch.tensor(read_labels(shard_urls(urls), num_classes), dtype=torch.int64)


def read_samples(urls: str, positions: Sequence[int], transform: Callable,
                 num_classes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (n, C, H, W), labels (n,)) of the samples at `positions` among those `split_labels`
    lists, in that order; a sample whose image does not decode is left out."""
    wanted = {int(p): i for i, p in enumerate(positions)}
    found: dict[int, tuple[torch.Tensor, int]] = {}
    decode = sample_decoder("image-class", transform, num_classes=num_classes)
    counter, position, passed = BadSampleCounter(), 0, 0
    for url in shard_urls(urls):
        for sample in tar_samples(url, counter):
            try:
                decode_label(sample, num_classes)
            except SampleSkip:
                continue
            if position in wanted:
                passed += 1
                try:
                    _, image, label = decode(sample)
                    found[wanted[position]] = (image, label)
                except SampleSkip as skip:
                    counter.skip(skip.reason, f"{sample['__key__']} in {url}: {skip}")
            position += 1
            if passed == len(wanted):
                break
        if passed == len(wanted):
            break
    order = sorted(found)
    return (torch.stack([found[i][0] for i in order]),
            torch.tensor([found[i][1] for i in order], dtype=torch.int64))
