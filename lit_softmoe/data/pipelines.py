"""Streaming shard pipelines: batches of (image, caption), (image, class) or (embedding, caption).

Follows open_clip's `get_wds_dataset` (open_clip_train/data.py) and its webdataset stages, each
stage a small function here, composed in `_ShardStream` (which runs inside each DataLoader worker):

    shard urls ─► this epoch's shard order ─► split by node ─► split by worker   (or: resampled draws)
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
(`.cls`, ASCII digits) or an embedding (`.npy`, a float array; see `feature_cache.read_npy`).
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from lit_softmoe.data.sample_decoding import sample_decoder, sample_seed
from lit_softmoe.data.samples import SampleSkip
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.tar_reading import BadSampleCounter, listed_sizes, tar_samples
from lit_softmoe.errors import UserError
from lit_softmoe.utils.distributed import rank_and_world_size

SAMPLE_KINDS = ("image-caption", "image-class", "embedding-caption", "embedding-class")
SHARD_REASONS = BadSampleCounter.SHARD_REASONS  # counted per shard, not per sample
# The bad-sample fraction is checked at the end of every epoch, and during one once this many
# samples were read (a fraction over a handful of samples says little).
MIN_SAMPLES_BEFORE_CHECK = 1000
_REPORT = "_shard_report"  # key of the counts a worker sends along with each batch


@dataclass
class ShardDataConfig:
    """How to read one stream of shards; every pipeline takes this, never a CLI namespace."""

    # A split folder (its nshards.txt, or img2dataset's output), a brace pattern DIR/{0..9}.tar, `pipe:CMD`,
    # several joined with `::`.
    urls: str = ""
    batch_size: int = 256  # per process: the global batch is batch_size × world_size
    workers: int = 2  # DataLoader worker processes (per process); 0 reads in the main process
    shuffle: bool = True  # shuffle the shard order every epoch and the samples in a buffer; False: read in order
    shuffle_buffer: int = 5000  # samples (still encoded) held by the sample shuffle; 0 or 1: shard order only
    seed: int = 0  # shard order is a function of (seed, epoch); the sample shuffle of (seed, epoch, node, worker)
    resampled: bool = False  # draw shards with replacement: an endless stream, cut into epochs
    samples_per_epoch: int = 0  # all processes together; 0: the shards' sizes (`tar_reading.listed_sizes`)
    exact_epoch: bool = False  # every sample exactly once per epoch, partial last batches (embedding, evaluation)
    max_bad_fraction: float = 0.01  # more skipped samples than this fraction stops the run
    rank: int = -1  # this process's index among world_size; -1: from torch.distributed or RANK / WORLD_SIZE
    world_size: int = 0  # 0: from torch.distributed or WORLD_SIZE (1 if neither)
    pin_memory: bool = False
    # Random transforms draw from a generator seeded with (seed, epoch, sample key): the same sample gets
    # the same crop in an epoch whatever process, worker or pass reads it (exact resume, padding passes).
    seed_transforms: bool = False
    num_classes: int = 0  # class samples: a class index ≥ this is skipped as bad_cls; 0 checks nothing


# ---------------------------------------------------------------------------------- counting

class _StreamCounter(BadSampleCounter):
    """A worker's counts. Logs nothing: the main process logs the first of each reason, once for
    all workers, from the reports this produces."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = 0  # samples that came out of the tars
        self.read = 0  # samples decoded or skipped
        self.good = 0
        self.fatal: str | None = None  # set when the stream must stop: the main process raises it
        self._first: dict[str, str] = {}
        self._reported_counts: dict[str, int] = {}
        self._reported_read = 0

    def skip(self, reason: str, detail: str, count: int = 1) -> None:
        self._first.setdefault(reason, detail)
        self.counts[reason] += count

    def report(self) -> dict[str, Any]:
        """What changed since the last report: samples read, skips by reason, first detail of each."""
        bad = {reason: count - self._reported_counts.get(reason, 0) for reason, count in self.counts.items()
               if count > self._reported_counts.get(reason, 0)}
        first = {reason: self._first[reason] for reason in bad if reason not in self._reported_counts}
        report = {"read": self.read - self._reported_read, "bad": bad, "first": first, "fatal": self.fatal}
        self._reported_counts = dict(self.counts)
        self._reported_read = self.read
        return report


def read_shard(url: str, kind: str, transform: Callable | None = None, listed: int | None = None,
               defer: Callable[[str, bytes], Any] | None = None) -> tuple[Iterator[tuple], BadSampleCounter]:
    """One shard's decoded samples, in the shard's order, and the counter they are counted in.

    The stages of a stream (tar → decode → skip and count) without shuffling, splitting or
    batching: for jobs that work shard by shard (`train.embed`). Yields (key, input, target) as
    `sample_decoder(kind, transform)` makes them; the counter's `counts` (bad samples and shards by
    reason) and `read` are complete once the iterator is exhausted. `listed`: the shard's count in
    its sizes.json, if known (a shard that holds fewer is counted as truncated). `defer`: images decoded
    later, elsewhere (`_decode_image`).
    """
    counter = _StreamCounter()
    samples = _decode_stage(_open_tars(iter([url]), counter, {url: listed} if listed is not None else None),
                            sample_decoder(kind, transform, defer=defer), counter, give_up_without_good=False)
    return samples, counter


# ---------------------------------------------------------------------------------- stages

def _epoch_shard_order(urls: Sequence[str], shuffle: bool, seed: int, epoch: int) -> list[str]:
    """This epoch's shard order: the same on every node and worker, so splitting it partitions it."""
    order = list(urls)
    if shuffle:
        random.Random(f"shards/{seed}/{epoch}").shuffle(order)
    return order


def _split(items: list[str], index: int, count: int) -> list[str]:
    """Every `count`-th item starting at `index`: a node's (or a worker's) share."""
    return items[index::count]


def _nothing_read(opened: int, example: str, counter: _StreamCounter) -> str:
    return (f"no sample could be read from {opened} shards (such as {example}; skipped: "
            f"{_reasons(counter.counts) or 'nothing'}); check that the shards are tar files of samples")


def _open_tars(urls: Iterator[str], counter: _StreamCounter, listed: dict[str, int] | None,
               patience: int | None = None) -> Iterator[dict]:
    """Tar stage: raw samples ({"__key__", "__url__", extension: bytes}) from each shard in turn.

    A shard that fails to open or read is counted and skipped, one that holds fewer samples than
    `listed` (its sizes.json) is counted as truncated (`tar_reading.tar_samples`). For an endless shard
    stream, `patience` shards opened without a single sample read stops the stream (`counter.fatal`)
    instead of spinning forever on unreadable or empty shards.
    """
    for opened, url in enumerate(urls):
        if patience is not None and opened >= patience and counter.raw == 0:
            counter.fatal = _nothing_read(opened, url, counter)
            return
        for sample in tar_samples(url, counter, (listed or {}).get(url)):
            counter.raw += 1
            yield sample


def _decode_stage(samples: Iterator[dict], decode: Callable[[dict], tuple], counter: _StreamCounter,
                  give_up_without_good: bool) -> Iterator[tuple]:
    """Decode stage: each raw sample → a tuple of fields, or skipped and counted by reason."""
    for sample in samples:
        counter.read += 1
        try:
            decoded = decode(sample)
        except SampleSkip as skip:
            detail = f": {skip}" if str(skip) else ""
            counter.skip(skip.reason, f"{sample.get('__key__')} in {sample.get('__url__')}{detail}")
            if give_up_without_good and counter.good == 0 and counter.read >= MIN_SAMPLES_BEFORE_CHECK:
                counter.fatal = (f"none of the first {counter.read} samples could be used "
                                 f"({_reasons(counter.counts)}); fix the shards")
                return
            continue
        counter.good += 1
        yield decoded


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(counts.items()) if count)


# ---------------------------------------------------------------------------------- the stream

class _ShardStream(IterableDataset):
    """One process's shard stream; iterated inside each DataLoader worker (or in-process)."""

    def __init__(self, urls: list[str], kind: str, cfg: ShardDataConfig, rank: int, world_size: int,
                 batches_per_worker: int | None, epoch, transform: Callable | None, tokenizer: Callable | None,
                 listed: dict[str, int] | None):
        super().__init__()
        self.urls, self.kind, self.cfg = urls, kind, cfg
        self.listed = listed  # {url: samples} from sizes.json: a shard that holds fewer is truncated
        self.rank, self.world_size = rank, world_size
        self.batches_per_worker = batches_per_worker  # None: exact epoch, every sample once
        self.epoch = epoch  # a multiprocessing.Value shared with the workers (open_clip's SharedEpoch)
        self.transform, self.tokenizer = transform, tokenizer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        counter = _StreamCounter()
        endless = self.batches_per_worker is not None  # rolls over its shards, or resamples

        epoch = self.epoch.value
        decoded = self._decoded_samples(epoch, worker, num_workers, counter, endless)
        batches = wds.batched(self.cfg.batch_size, collation_fn=self._collate, partial=not endless)(decoded)
        if endless:
            batches = itertools.islice(batches, self.batches_per_worker)
        for batch in batches:
            batch[_REPORT] = counter.report()
            yield batch
        yield {_REPORT: counter.report()}  # counts after the last batch, and why a stream stopped early

    def _decoded_samples(self, epoch: int, worker: int, num_workers: int, counter: _StreamCounter,
                         endless: bool) -> Iterator[tuple]:
        """This worker's decoded samples: one pass over its shards, or passes until its batches are out.

        Each pass shuffles within itself, so a pass holds each of its samples once (a roll-over
        never mixes the next pass's samples into this one's).
        """
        cfg, decode = self.cfg, self._decoder(epoch)
        if cfg.resampled:
            # Each node and worker draws its own shards, with replacement (open_clip's ResampledShards2).
            rng = random.Random(f"resampled/{cfg.seed}/{epoch}/{self.rank}/{worker}")
            draws = (rng.choice(self.urls) for _ in itertools.count())
            patience = max(3 * len(self.urls), 64)  # draws without a single sample before giving up
            yield from self._one_pass(_open_tars(draws, counter, self.listed, patience),
                                      f"{epoch}/{self.rank}/{worker}",
                                      decode, counter, give_up_without_good=True)
            return
        order = _epoch_shard_order(self.urls, cfg.shuffle, cfg.seed, epoch)
        mine = _split(_split(order, self.rank, self.world_size), worker, num_workers)
        for pass_index in itertools.count():
            read_before = counter.raw
            yield from self._one_pass(_open_tars(iter(mine), counter, self.listed),
                                      f"{epoch}/{self.rank}/{worker}/{pass_index}",
                                      decode, counter, give_up_without_good=endless)
            if not endless or not mine or counter.fatal:
                return
            if counter.raw == read_before:  # the next pass would read nothing again
                counter.fatal = _nothing_read(len(mine), mine[0], counter)
                return

    def _one_pass(self, samples: Iterator[dict], shuffle_key: str, decode: Callable[[dict], tuple],
                  counter: _StreamCounter, give_up_without_good: bool) -> Iterator[tuple]:
        cfg = self.cfg
        if cfg.shuffle and cfg.shuffle_buffer > 1:
            rng = random.Random(f"samples/{cfg.seed}/{shuffle_key}")
            # Starts yielding at a fifth of the buffer, as open_clip does (1,000 of 5,000).
            samples = wds.shuffle(cfg.shuffle_buffer, max(1, cfg.shuffle_buffer // 5), rng=rng)(samples)
        return _decode_stage(samples, decode, counter, give_up_without_good)

    def _decoder(self, epoch: int) -> Callable[[dict], tuple]:
        seed_of = (lambda key: sample_seed(self.cfg.seed, epoch, key)) if self.cfg.seed_transforms else None
        return sample_decoder(self.kind, self.transform, seed_of, self.cfg.num_classes)

    def _collate(self, samples: list[tuple]) -> dict[str, Any]:
        keys, inputs, targets = zip(*samples)
        input_name = "image" if self.kind.startswith("image") else "embedding"
        # default_collate stacks straight into shared memory in a worker; a plain torch.stack is
        # copied there again when the batch is sent (a float 224-px batch of 64: 38 MB more to copy).
        if inputs[0].dim() == 3:
            # An image is (C, H, W) over PIL's (H, W, C) memory (kept by the crop, resize and casts):
            # stacked as (B, H, W, C) the batch is one plain copy, where stacking (C, H, W) moved every
            # byte apart. The batch is (B, C, H, W) in channels-last memory.
            stacked = default_collate([image.permute(1, 2, 0) for image in inputs]).permute(0, 3, 1, 2)
        else:
            stacked = default_collate(list(inputs))  # (B, D) embeddings
        if self.kind.endswith("-class"):
            return {input_name: stacked, "label": torch.tensor(targets, dtype=torch.int64), "key": list(keys)}
        batch = {input_name: stacked, "caption": list(targets), "key": list(keys)}
        if self.tokenizer is not None:
            batch["text"] = self.tokenizer(list(targets))  # (B, L)
        return batch


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
        raise UserError(f"data rank {rank} is not in [0, world_size={world_size}); set data.rank below data.world_size")
    return rank, world_size


def _check_config(cfg: ShardDataConfig, kind: str) -> None:
    if kind not in SAMPLE_KINDS:
        raise UserError(f"unknown sample kind {kind!r}; choose one of {', '.join(SAMPLE_KINDS)}")
    if not cfg.urls:
        raise UserError("data.urls is empty; set it to a split folder (holding nshards.txt, or img2dataset's "
                        "output), a pattern such as DIR/{0..9}.tar, or several joined with '::'")
    if cfg.batch_size < 1:
        raise UserError(f"data.batch_size must be at least 1, got {cfg.batch_size}")
    if cfg.workers < 0:
        raise UserError(f"data.workers must be 0 or more, got {cfg.workers}")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise UserError(f"data.max_bad_fraction must be in [0, 1], got {cfg.max_bad_fraction}")
    if cfg.exact_epoch and cfg.resampled:
        raise UserError("data.exact_epoch reads each sample once and data.resampled draws shards with replacement; "
                        "set only one of them")
    if cfg.exact_epoch and cfg.samples_per_epoch:
        raise UserError("data.samples_per_epoch sets a training epoch's length; with data.exact_epoch an epoch is "
                        "the shards themselves: set samples_per_epoch=0")
    if cfg.samples_per_epoch < 0:
        raise UserError(f"data.samples_per_epoch must be 0 (the shards' sizes) or more, got {cfg.samples_per_epoch}")


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
            total = cfg.samples_per_epoch or (sum(self._sizes.values()) if self._sizes is not None else 0)
            if total <= 0:
                unknown = "remote shards list no sizes" if self._sizes is None else "its shards hold no sample"
                raise UserError(f"the epoch length of {cfg.urls} is unknown ({unknown}); set data.samples_per_epoch")
            if not cfg.resampled and len(self.urls) < self.world_size * workers:
                raise UserError(f"{len(self.urls)} shards cannot feed {self.world_size} processes × {workers} workers "
                                "(each needs a shard of its own): write smaller shards, lower data.workers, "
                                "or set data.resampled=true")
            # Every worker yields the same number of full batches, as open_clip's `with_epoch`.
            global_batch = cfg.batch_size * self.world_size
            batches_per_worker = math.ceil(math.ceil(total / global_batch) / workers)
            self.num_samples = batches_per_worker * workers * global_batch
        self._batches_per_worker = batches_per_worker
        self.smallest_pass = None
        if not cfg.exact_epoch and not cfg.resampled and self._sizes is not None:
            # A stream gets every world_size-th shard, then every workers-th of those: at least this many.
            fewest_shards = len(self.urls) // self.world_size // workers
            self.smallest_pass = sum(sorted(self._sizes.values())[:fewest_shards])

        self._epoch = multiprocessing.Value("i", 0)
        self.dataset = _ShardStream(self.urls, kind, cfg, self.rank, self.world_size, batches_per_worker,
                                    self._epoch, transform, tokenizer, self._sizes)
        self.dataloader = DataLoader(self.dataset, batch_size=None, shuffle=False, num_workers=cfg.workers,
                                     persistent_workers=cfg.workers > 0, pin_memory=cfg.pin_memory)
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
        order = _epoch_shard_order(self.urls, self.cfg.shuffle, self.cfg.seed, self.epoch)
        mine = _split(order, self.rank, self.world_size)
        workers = max(1, self.cfg.workers)
        return sum(math.ceil(sum(self._sizes[url] for url in _split(mine, worker, workers)) / self.cfg.batch_size)
                   for worker in range(workers))

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError(f"the number of batches of {self.cfg.urls} is unknown: remote shards list no sizes")
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in self.dataloader:
            self._absorb(item.pop(_REPORT))
            if item:
                yield item
        self.check_bad_fraction()

    # -- bad samples

    def _absorb(self, report: dict[str, Any]) -> None:
        """Add a worker's report to the run's counts; log each reason the first time any worker meets it."""
        self.samples_read += report["read"]
        for reason, count in report["bad"].items():
            if self.bad.counts[reason] == 0:
                self.bad.skip(reason, report["first"].get(reason, "(no detail)"))  # logs, counts one
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
        seen = self.samples_read + sum(self.bad.counts[reason] for reason in (*SHARD_REASONS, "missing_samples"))
        if seen and bad / seen > self.cfg.max_bad_fraction:
            raise UserError(f"{bad} of {seen} samples were bad ({_reasons(self.bad.counts)}), over "
                            f"max_bad_fraction={self.cfg.max_bad_fraction}; fix the shards or raise "
                            "data.max_bad_fraction")

    def metrics(self) -> dict[str, int]:
        """Counts for the run's metrics: samples read, samples (and shards) skipped, by reason."""
        return {"data/samples_read": self.samples_read, "data/bad_samples": self.bad.total,
                **{f"data/bad/{reason}": count for reason, count in sorted(self.bad.counts.items()) if count}}


def create_shard_loader(cfg: ShardDataConfig, kind: str, transform: Callable | None = None,
                        tokenizer: Callable[[list[str]], torch.Tensor] | None = None) -> ShardLoader:
    """A `ShardLoader` for `kind` samples: "image-caption", "image-class", "embedding-caption" or
    "embedding-class".

    Args:
        cfg: which shards, batch size, workers, shuffling, epoch length, bad-sample limit.
        kind: the sample type; a sample without the fields it needs is skipped and counted.
        transform: PIL image → tensor for image samples (`transforms.eval_transform` or
            `train_transform`); None gives uint8 (C, H, W) tensors, which then need one size.
            JPEGs are decoded as the transform's `decode` setting says (`transforms.decode_min_side`).
        tokenizer: list of captions → (B, L) ids (`tokenizers.create_tokenizer`), applied in the
            workers' collate; None leaves only the raw "caption" strings.
    """
    if transform is not None and kind == "embedding-caption":
        raise UserError("an embedding-caption pipeline reads no images; drop its image transform")
    return ShardLoader(cfg, kind, transform=transform, tokenizer=tokenizer)
