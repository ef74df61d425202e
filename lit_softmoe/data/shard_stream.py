"""One process's stream of shard samples, iterated inside each DataLoader worker (`ShardStream`),
and the same stages over a single shard (`read_shard`).

The stages follow open_clip's webdataset stages (open_clip_train/data.py, `get_wds_dataset`), each a
small function here: this epoch's shard order, a node's and then a worker's share of it (or
resampled draws), tar → samples, the seeded sample shuffle buffer, decode, batch + collate.
`pipelines` draws them and says what differs from open_clip. A worker counts the samples and shards
it skips (`_StreamCounter`) and sends what changed along with each batch, under `REPORT_KEY`;
`pipelines.ShardLoader` adds the reports up in the main process and checks the bad fraction.
`ShardDataConfig`, what both halves read, lives here, below the loader (`pipelines` re-exports it).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from lit_softmoe.data.samples import SampleSkip, sample_decoder, sample_seed
from lit_softmoe.data.tar_reading import BadSampleCounter, tar_samples


@dataclass
class ShardDataConfig:
    """How to read one stream of shards; every pipeline takes this, never a CLI namespace."""

    # A split folder (its nshards.txt, or img2dataset's output), a brace pattern DIR/{0..9}.tar,
    # `pipe:CMD`, several joined with `::`.
    urls: str = ""
    batch_size: int = 256  # per process: the global batch is batch_size × world_size
    workers: int = 2  # DataLoader worker processes (per process); 0 reads in the main process
    # shuffle the shard order every epoch and the samples in a buffer; False: read in order
    shuffle: bool = True
    # samples (still encoded) held by the sample shuffle; 0 or 1: shard order only
    shuffle_buffer: int = 5000
    # shard order is a function of (seed, epoch); the sample shuffle of (seed, epoch, node, worker)
    seed: int = 0
    resampled: bool = False  # draw shards with replacement: an endless stream, cut into epochs
    # all processes together; 0: the shards' sizes (`tar_reading.listed_sizes`)
    samples_per_epoch: int = 0
    # every sample exactly once per epoch, partial last batches (embedding, evaluation)
    exact_epoch: bool = False
    max_bad_fraction: float = 0.01  # more skipped samples than this fraction stops the run
    # this process's index among world_size; -1: from torch.distributed or RANK / WORLD_SIZE
    rank: int = -1
    world_size: int = 0  # 0: from torch.distributed or WORLD_SIZE (1 if neither)
    pin_memory: bool = False
    # Random transforms draw from a generator seeded with (seed, epoch, sample key): the same sample
    # gets the same crop in an epoch whatever process, worker or pass reads it (exact resume,
    # padding passes).
    seed_transforms: bool = False
    # class samples: a class index ≥ this is skipped as bad_cls; 0 checks nothing
    num_classes: int = 0


# The bad-sample fraction is checked at the end of every epoch, and during one once this many
# samples were read (a fraction over a handful of samples says little).
MIN_SAMPLES_BEFORE_CHECK = 1000
REPORT_KEY = "_shard_report"  # key of the counts a worker sends along with each batch


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
        """What changed since the last report: samples read, skips by reason, first detail of
        each."""
        bad = {reason: count - self._reported_counts.get(reason, 0)
               for reason, count in self.counts.items()
               if count > self._reported_counts.get(reason, 0)}
        first = {reason: self._first[reason] for reason in bad
                 if reason not in self._reported_counts}
        report = {"read": self.read - self._reported_read, "bad": bad, "first": first,
                  "fatal": self.fatal}
        self._reported_counts = dict(self.counts)
        self._reported_read = self.read
        return report


def read_shard(
    url: str, kind: str, transform: Callable | None = None, listed: int | None = None,
    defer: Callable[[str, bytes], Any] | None = None,
) -> tuple[Iterator[tuple], BadSampleCounter]:
    """One shard's decoded samples, in the shard's order, and the counter they are counted in.

    The stages of a stream (tar → decode → skip and count) without shuffling, splitting or
    batching: for jobs that work shard by shard (`train.embed`). Yields (key, input, target) as
    `sample_decoder(kind, transform)` makes them; the counter's `counts` (bad samples and shards by
    reason) and `read` are complete once the iterator is exhausted. `listed`: the shard's count in
    its sizes.json, if known (a shard that holds fewer is counted as truncated). `defer`: images
    decoded later, elsewhere (`_decode_image`).
    """
    counter = _StreamCounter()
    samples = _decode_stage(_open_tars(iter([url]), counter,
                                       {url: listed} if listed is not None else None),
                            sample_decoder(kind, transform, defer=defer), counter,
                            give_up_without_good=False)
    return samples, counter


# ---------------------------------------------------------------------------------- stages

def epoch_shard_order(urls: Sequence[str], shuffle: bool, seed: int, epoch: int) -> list[str]:
    """This epoch's shard order: the same on every node and worker, so splitting it partitions
    it."""
    order = list(urls)
    if shuffle:
        random.Random(f"shards/{seed}/{epoch}").shuffle(order)
    return order


def share_of(items: list[str], index: int, count: int) -> list[str]:
    """Every `count`-th item starting at `index`: a node's (or a worker's) share."""
    return items[index::count]


def _nothing_read(opened: int, example: str, counter: _StreamCounter) -> str:
    return (f"no sample could be read from {opened} shards (such as {example}; skipped: "
            f"{format_reasons(counter.counts) or 'nothing'}); check that the shards are tar files "
            "of samples")


def _open_tars(urls: Iterator[str], counter: _StreamCounter, listed: dict[str, int] | None,
               patience: int | None = None) -> Iterator[dict]:
    """Tar stage: raw samples ({"__key__", "__url__", extension: bytes}) from each shard in turn.

    A shard that fails to open or read is counted and skipped, one that holds fewer samples than
    `listed` (its sizes.json) is counted as truncated (`tar_reading.tar_samples`). For an endless
    shard stream, `patience` shards opened without a single sample read stops the stream
    (`counter.fatal`) instead of spinning forever on unreadable or empty shards.
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
            if (give_up_without_good and counter.good == 0
                    and counter.read >= MIN_SAMPLES_BEFORE_CHECK):
                counter.fatal = (f"none of the first {counter.read} samples could be used "
                                 f"({format_reasons(counter.counts)}); fix the shards")
                return
            continue
        counter.good += 1
        yield decoded


def format_reasons(counts: dict[str, int]) -> str:
    """`reason: count, …` in sorted order, reasons counted zero left out."""
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(counts.items()) if count)


# ---------------------------------------------------------------------------------- the stream

class ShardStream(IterableDataset):
    """One process's shard stream; iterated inside each DataLoader worker (or in-process)."""

    def __init__(self, urls: list[str], kind: str, cfg: ShardDataConfig, rank: int, world_size: int,
                 batches_per_worker: int | None, epoch, transform: Callable | None,
                 tokenizer: Callable | None, listed: dict[str, int] | None):
        super().__init__()
        self.urls, self.kind, self.cfg = urls, kind, cfg
        # {url: samples} from sizes.json: a shard that holds fewer is truncated
        self.listed = listed
        self.rank, self.world_size = rank, world_size
        self.batches_per_worker = batches_per_worker  # None: exact epoch, every sample once
        # a multiprocessing.Value shared with the workers (open_clip's SharedEpoch)
        self.epoch = epoch
        self.transform, self.tokenizer = transform, tokenizer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        counter = _StreamCounter()
        endless = self.batches_per_worker is not None  # rolls over its shards, or resamples

        epoch = self.epoch.value
        decoded = self._decoded_samples(epoch, worker, num_workers, counter, endless)
        batches = wds.batched(self.cfg.batch_size, collation_fn=self._collate,
                              partial=not endless)(decoded)
        if endless:
            batches = itertools.islice(batches, self.batches_per_worker)
        for batch in batches:
            batch[REPORT_KEY] = counter.report()
            yield batch
        # counts after the last batch, and why a stream stopped early
        yield {REPORT_KEY: counter.report()}

    def _decoded_samples(self, epoch: int, worker: int, num_workers: int, counter: _StreamCounter,
                         endless: bool) -> Iterator[tuple]:
        """This worker's decoded samples: one pass over its shards, or passes until its batches are
        out.

        Each pass shuffles within itself, so a pass holds each of its samples once (a roll-over
        never mixes the next pass's samples into this one's).
        """
        cfg, decode = self.cfg, self._decoder(epoch)
        if cfg.resampled:
            # Each node and worker draws its own shards, with replacement (open_clip's
            # ResampledShards2).
            rng = random.Random(f"resampled/{cfg.seed}/{epoch}/{self.rank}/{worker}")
            draws = (rng.choice(self.urls) for _ in itertools.count())
            patience = max(3 * len(self.urls), 64)  # draws without a single sample before giving up
            yield from self._one_pass(_open_tars(draws, counter, self.listed, patience),
                                      f"{epoch}/{self.rank}/{worker}",
                                      decode, counter, give_up_without_good=True)
            return
        order = epoch_shard_order(self.urls, cfg.shuffle, cfg.seed, epoch)
        mine = share_of(share_of(order, self.rank, self.world_size), worker, num_workers)
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
            samples = wds.shuffle(cfg.shuffle_buffer, max(1, cfg.shuffle_buffer // 5),
                                  rng=rng)(samples)
        return _decode_stage(samples, decode, counter, give_up_without_good)

    def _decoder(self, epoch: int) -> Callable[[dict], tuple]:
        seed_of = ((lambda key: sample_seed(self.cfg.seed, epoch, key)) if self.cfg.seed_transforms
                   else None)
        return sample_decoder(self.kind, self.transform, seed_of, self.cfg.num_classes)

    def _collate(self, samples: list[tuple]) -> dict[str, Any]:
        keys, inputs, targets = zip(*samples)
        input_name = "image" if self.kind.startswith("image") else "embedding"
        # default_collate stacks straight into shared memory in a worker; a plain torch.stack is
        # copied there again when the batch is sent (a float 224-px batch of 64: 38 MB more to
        # copy).
        if inputs[0].dim() == 3:
            # An image is (C, H, W) over PIL's (H, W, C) memory (kept by the crop, resize and
            # casts): stacked as (B, H, W, C) the batch is one plain copy, where stacking (C, H, W)
            # moved every byte apart. The batch is (B, C, H, W) in channels-last memory.
            stacked = default_collate([image.permute(1, 2, 0)
                                       for image in inputs]).permute(0, 3, 1, 2)
        else:
            stacked = default_collate(list(inputs))  # (B, D) embeddings
        if self.kind.endswith("-class"):
            return {input_name: stacked, "label": torch.tensor(targets, dtype=torch.int64),
                    "key": list(keys)}
        batch = {input_name: stacked, "caption": list(targets), "key": list(keys)}
        if self.tokenizer is not None:
            batch["text"] = self.tokenizer(list(targets))  # (B, L)
        return batch
