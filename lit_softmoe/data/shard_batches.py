"""Source shards read whole, batch by batch, in each shard's own order: what a job that works shard
by shard (`train.embed`) reads, one DataLoader worker per shard at a time.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lit_softmoe.data import gpu_jpeg
from lit_softmoe.data.samples import read_class_members
from lit_softmoe.data.shard_stream import read_shard


class ShardBatches(IterableDataset):
    """Decoded images of whole source shards, batch by batch; runs in each DataLoader worker.

    `transform` gives each image's pixels (embed's: uint8): a batch stacks them, (B, C, H, W).

    A worker takes every `num_workers`-th of the shards it is given and reads each to its end, in
    the shard's own order: a batch never mixes two shards, and after a shard's last batch comes its
    report {"shard": index, "done": {"read", "bad"}}. So a feature shard holds its source shard's
    samples in their order whatever the numbers of workers and processes, and is complete when its
    report arrives.
    """

    def __init__(self, shards: list[tuple[int, str]], kind: str, transform, batch_size: int,
                 listed: dict[str, int], with_cls: bool, defer=None):
        super().__init__()
        self.shards, self.kind, self.transform = shards, kind, transform
        self.batch_size, self.listed, self.with_cls = batch_size, listed, with_cls
        # `gpu_jpeg.DeferToGpu`: JPEGs pass on undecoded, batches are `gpu_jpeg.pack`ed
        self.defer = defer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index, url in self.shards[worker::num_workers]:
            # The image-caption stream carries no class: `.cls` members are read apart, unextracted
            # others skipped.
            classes = read_class_members([url]) if self.with_cls else {}
            samples, counter = read_shard(url, self.kind, self.transform, self.listed.get(url),
                                          defer=self.defer)
            batch: list[tuple] = []
            for sample in samples:
                batch.append(sample)
                if len(batch) == self.batch_size:
                    yield self._collate(index, batch, classes)
                    batch = []
            if batch:
                yield self._collate(index, batch, classes)
            yield {"shard": index, "done": {"read": counter.read, "bad": dict(counter.counts)}}

    def _collate(self, index: int, samples: list[tuple], classes: dict[str, bytes]) -> dict:
        keys, images, targets = zip(*samples)
        captions = list(targets) if self.kind == "image-caption" else [None] * len(keys)
        batch = {"shard": index, "key": list(keys), "caption": captions,
                 "cls": [classes.get(key) for key in keys]}
        if self.defer is None:
            batch["image"] = torch.stack(images)  # (B, C, H, W)
        else:
            batch["packed"] = gpu_jpeg.pack(images)
        return batch
