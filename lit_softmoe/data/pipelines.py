"""Streaming shard pipelines: batches of (image, caption), (image, class) or (embedding, caption).

Follows open_clip's `get_wds_dataset` (open_clip_train/data.py) and its webdataset stages, each
stage a small function in `shard_stream`, composed in its `ShardStream` (which runs inside each
DataLoader worker):

    shard urls ─► this epoch's shard order ─► split by node ─► split by worker (or: resampled draws)
      ─► tar → samples (a bad shard is counted, reading goes on)
      ─► sample shuffle buffer ─► decode + transform (a bad sample is counted and skipped)
      ─► batch + collate (tokenizes captions) ─► epoch length

What differs from open_clip:
- Every random choice is a function of (seed, epoch, node, worker): the shard order of an epoch is
  the same on every node and worker (so splitting it partitions the shards), and the sample
  shuffle buffer is seeded too, so the same seed (and the same numbers of nodes and workers) gives
  the same batches.
- Node rank and world size come from the config when set (tests simulate nodes that way), else
  from torch.distributed / RANK and WORLD_SIZE.
- Bad samples and shards are counted by reason in each worker; the counts travel to the main
  process with the batches, where the first of each reason is logged once, the totals go into the
  run's metrics (`ShardLoader.metrics()`), and `max_bad_fraction` stops the run with one line
  instead of letting it train on garbage.
- The epoch length is the sum of the shards' sizes (`tar_reading.listed_sizes`): our sizes.json,
  img2dataset's `_stats.json`, or one count of each tar's samples.
- `exact_epoch` reads every sample exactly once per epoch (for embedding and evaluation); otherwise
  every worker yields the same number of full batches, rolling over its shards (open_clip's
  `with_epoch`), because every process of a data-parallel run must take the same number of steps.

Sample fields: an image (`.png`, `.jpg`, `.jpeg`, `.webp`), a caption (`.txt`, UTF-8), a class
(`.cls`, ASCII digits) or an embedding (`.npy`, a float array; see `samples.read_npy`).
"""
from __future__ import annotations

import math
import multiprocessing
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from lit_softmoe.data.shard_stream import (
    MIN_SAMPLES_BEFORE_CHECK,
    REPORT_KEY,
    ShardDataConfig,
    ShardStream,
    epoch_shard_order,
    format_reasons,
    share_of,
)
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.tar_reading import BadSampleCounter, listed_sizes
from lit_softmoe.errors import UserError
from lit_softmoe.utils.distributed import rank_and_world_size

SAMPLE_KINDS = ("image-caption", "image-class", "embedding-caption", "embedding-class")
SHARD_REASONS = BadSampleCounter.SHARD_REASONS  # counted per shard, not per sample


# ---------------------------------------------------------------------------------- the loader

def _node(cfg: ShardDataConfig) -> tuple[int, int]:
    """(rank, world size) of this process: each from the config if set there, else the launcher's.

    Each on its own: a config setting only world_size took rank 0 on every process, which then all
    read the same shards.
    """
    rank, world_size = rank_and_world_size()
    rank = cfg.rank if cfg.rank >= 0 else rank
    world_size = cfg.world_size if cfg.world_size > 0 else world_size
    if not 0 <= rank < world_size:
        raise UserError(f"data rank {rank} is not in [0, world_size={world_size}); set data.rank "
                        "below data.world_size")
    return rank, world_size


def _check_config(cfg: ShardDataConfig, kind: str) -> None:
    if kind not in SAMPLE_KINDS:
        raise UserError(f"unknown sample kind {kind!r}; choose one of {', '.join(SAMPLE_KINDS)}")
    if not cfg.urls:
        raise UserError("data.urls is empty; set it to a split folder (holding nshards.txt, or "
                        "img2dataset's output), a pattern such as DIR/{0..9}.tar, or several "
                        "joined with '::'")
    if cfg.batch_size < 1:
        raise UserError(f"data.batch_size must be at least 1, got {cfg.batch_size}")
    if cfg.workers < 0:
        raise UserError(f"data.workers must be 0 or more, got {cfg.workers}")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise UserError(f"data.max_bad_fraction must be in [0, 1], got {cfg.max_bad_fraction}")
    if cfg.exact_epoch and cfg.resampled:
        raise UserError("data.exact_epoch reads each sample once and data.resampled draws shards "
                        "with replacement; set only one of them")
    if cfg.exact_epoch and cfg.samples_per_epoch:
        raise UserError("data.samples_per_epoch sets a training epoch's length; with "
                        "data.exact_epoch an epoch is the shards themselves: set "
                        "samples_per_epoch=0")
    if cfg.samples_per_epoch < 0:
        raise UserError("data.samples_per_epoch must be 0 (the shards' sizes) or more, got "
                        f"{cfg.samples_per_epoch}")


class ShardLoader:
    """Batches of one process's share of the shards, epoch after epoch.

    Call `set_epoch(epoch)` before iterating an epoch (as with a DistributedSampler): the shard
    order, the sample shuffle and resampled draws are functions of (seed, epoch). Each batch is a
    dict: "image" (B, C, H, W) or "embedding" (B, …) float32; "label" (B,) int64 for class
    samples; "caption" (B strings) and, with a tokenizer, "text" (B, L) int64 for caption samples;
    "key" (the B sample keys).

    Attributes:
        num_batches: batches this process yields per epoch (for exact epochs: at most this many,
            since skipped samples can shorten workers' streams; None for remote shards, whose sizes
            are unknown).
        num_samples: samples per epoch over all processes (rolled up to whole global batches).
        bad: a BadSampleCounter holding the skipped samples and shards of the run, by reason.
        samples_read: samples read in the run (used or skipped).
        smallest_pass: for endless streams read from whole shards, the fewest samples one of the
            processes × workers streams can hold in one pass over its shards (any epoch's order);
            a batch larger than that repeats samples. None for exact epochs, resampled shards or
            unknown sizes.
    """

    def __init__(self, cfg: ShardDataConfig, kind: str, transform: Callable | None = None,
                 tokenizer: Callable[[list[str]], torch.Tensor] | None = None):
        _check_config(cfg, kind)
        self.cfg, self.kind = cfg, kind
        self.urls = shard_urls(cfg.urls)
        self.rank, self.world_size = _node(cfg)
        self._sizes = listed_sizes(self.urls)
        workers = max(1, cfg.workers)

        if cfg.exact_epoch:
            batches_per_worker = None
            self.num_samples = sum(self._sizes.values()) if self._sizes is not None else None
        else:
            total = cfg.samples_per_epoch or (
                sum(self._sizes.values()) if self._sizes is not None else 0)
            if total <= 0:
                unknown = ("remote shards list no sizes" if self._sizes is None
                           else "its shards hold no sample")
                raise UserError(f"the epoch length of {cfg.urls} is unknown ({unknown}); set "
                                "data.samples_per_epoch")
            if not cfg.resampled and len(self.urls) < self.world_size * workers:
                raise UserError(f"{len(self.urls)} shards cannot feed {self.world_size} processes "
                                f"× {workers} workers (each needs a shard of its own): write "
                                "smaller shards, lower data.workers, or set data.resampled=true")
            # Every worker yields the same number of full batches, as open_clip's `with_epoch`.
            global_batch = cfg.batch_size * self.world_size
            batches_per_worker = math.ceil(math.ceil(total / global_batch) / workers)
            self.num_samples = batches_per_worker * workers * global_batch
        self._batches_per_worker = batches_per_worker
        self.smallest_pass = None
        if not cfg.exact_epoch and not cfg.resampled and self._sizes is not None:
            # A stream gets every world_size-th shard, then every workers-th of those: at least this
            # many.
            fewest_shards = len(self.urls) // self.world_size // workers
            self.smallest_pass = sum(sorted(self._sizes.values())[:fewest_shards])

        self._epoch = multiprocessing.Value("i", 0)
        self.dataset = ShardStream(self.urls, kind, cfg, self.rank, self.world_size,
                                   batches_per_worker, self._epoch, transform, tokenizer,
                                   self._sizes)
        self.dataloader = DataLoader(self.dataset, batch_size=None, shuffle=False,
                                     num_workers=cfg.workers, persistent_workers=cfg.workers > 0,
                                     pin_memory=cfg.pin_memory)
        self.bad = BadSampleCounter()
        self.samples_read = 0

    # -- epochs

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = int(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @property
    def num_batches(self) -> int | None:
        if self._batches_per_worker is not None:
            return self._batches_per_worker * max(1, self.cfg.workers)
        if self._sizes is None:
            return None
        order = epoch_shard_order(self.urls, self.cfg.shuffle, self.cfg.seed, self.epoch)
        mine = share_of(order, self.rank, self.world_size)
        workers = max(1, self.cfg.workers)
        return sum(math.ceil(sum(self._sizes[url] for url in share_of(mine, worker, workers))
                             / self.cfg.batch_size)
                   for worker in range(workers))

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError(f"the number of batches of {self.cfg.urls} is unknown: remote shards "
                            "list no sizes")
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in self.dataloader:
            self._absorb(item.pop(REPORT_KEY))
            if item:
                yield item
        self.check_bad_fraction()

    # -- bad samples

    def _absorb(self, report: dict[str, Any]) -> None:
        """Add a worker's report to the run's counts; log each reason the first time any worker
        meets it."""
        self.samples_read += report["read"]
        for reason, count in report["bad"].items():
            if self.bad.counts[reason] == 0:
                # logs, counts one
                self.bad.skip(reason, report["first"].get(reason, "(no detail)"))
                count -= 1
            self.bad.counts[reason] += count
        if report["fatal"]:
            raise UserError(report["fatal"])
        if self.samples_read >= MIN_SAMPLES_BEFORE_CHECK:
            self.check_bad_fraction()

    def check_bad_fraction(self) -> None:
        """Raise a UserError if more than `max_bad_fraction` of what was read so far was skipped."""
        bad = self.bad.total
        # What was read, and what should have been: samples, damaged shards and samples they lost.
        seen = self.samples_read + sum(self.bad.counts[reason]
                                       for reason in (*SHARD_REASONS, "missing_samples"))
        if seen and bad / seen > self.cfg.max_bad_fraction:
            raise UserError(f"{bad} of {seen} samples were bad "
                            f"({format_reasons(self.bad.counts)}), over "
                            f"max_bad_fraction={self.cfg.max_bad_fraction}; fix the shards or "
                            "raise data.max_bad_fraction")

    def metrics(self) -> dict[str, int]:
        """Counts for the run's metrics: samples read, samples (and shards) skipped, by reason."""
        return {"data/samples_read": self.samples_read, "data/bad_samples": self.bad.total,
                **{f"data/bad/{reason}": count
                   for reason, count in sorted(self.bad.counts.items()) if count}}


def create_shard_loader(
    cfg: ShardDataConfig, kind: str, transform: Callable | None = None,
    tokenizer: Callable[[list[str]], torch.Tensor] | None = None,
) -> ShardLoader:
    """A `ShardLoader` for `kind` samples: "image-caption", "image-class", "embedding-caption" or
    "embedding-class".

    Args:
        cfg: which shards, batch size, workers, shuffling, epoch length, bad-sample limit.
        kind: the sample type; a sample without the fields it needs is skipped and counted.
        transform: PIL image → tensor for image samples (`transforms.eval_transform` or
            `train_transform`); None gives uint8 (C, H, W) tensors, which then need one size.
            JPEGs are decoded as the transform's `decode` setting says
            (`transforms.decode_min_side`).
        tokenizer: list of captions → (B, L) ids (`tokenizers.create_tokenizer`), applied in the
            workers' collate; None leaves only the raw "caption" strings.
    """
    if transform is not None and kind == "embedding-caption":
        raise UserError("an embedding-caption pipeline reads no images; drop its image transform")
    return ShardLoader(cfg, kind, transform=transform, tokenizer=tokenizer)
