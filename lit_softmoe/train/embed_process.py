"""One process's share of `embed` (`train.embed`): the locked tower over its shards, batch by batch,
into feature shards.

Batches are decoded by the loader's workers (or on the GPU by nvJPEG), padded to a fixed batch size
so a compiled tower sees one shape, and embedded while the next batch is read; each finished source
shard's features are written as a feature shard of the same index, and the bad-sample fraction is
checked as the counts come in.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.utils.data import DataLoader

from lit_softmoe.data import gpu_jpeg
from lit_softmoe.data.device_prefetch import DevicePrefetcher, ToHost
from lit_softmoe.data.feature_cache import feature_samples
from lit_softmoe.data.shard_batches import ShardBatches
from lit_softmoe.data.shard_stream import MIN_SAMPLES_BEFORE_CHECK
from lit_softmoe.errors import UserError
from lit_softmoe.train.embed_job import FeatureShardWriter, seen_and_bad


def _embed_batch(tower: torch.nn.Module, pixels: torch.Tensor,
                 normalize: Callable[[torch.Tensor], torch.Tensor],
                 pad_to: int | None = None) -> torch.Tensor:
    """uint8 pixels (B, C, H, W) on the tower's device → float16 pooled embeddings (B, width) there,
    queued (on a GPU not waited for: `ToHost` fetches them). The tower runs in its weights' dtype
    (bf16 on GPUs, `prepare_for_inference`). `pad_to`: a compiled tower's batch size; a shard's
    last, smaller batch is padded to it with black images, so the compiled graph's static shapes
    hold (no recompilation)."""
    count = len(pixels)
    if pad_to is not None and count < pad_to:
        pixels = torch.cat([pixels, pixels.new_zeros(pad_to - count, *pixels.shape[1:])])
    with torch.inference_mode():
        # float32, as the transform computes it; the tower casts to its dtype
        images = normalize(pixels)
        features = tower.forward_pooled(images)[:count]  # (B, width)
    return features.float().to(torch.float16)


def _pixels_on_device(batch: dict, device: torch.device,
                      gpu_decoder: gpu_jpeg.JpegBatchDecoder | None
                      ) -> tuple[torch.Tensor, list[int]]:
    """A loader batch's uint8 pixels (B', C, H, W) on `device`, and the positions of the images that
    could not be decoded (left out of the B'). Decoded by the workers, or, with a `gpu_decoder`,
    JPEGs decoded on `device` now and the rest by the workers."""
    if gpu_decoder is None:
        return batch.pop("image").to(device, non_blocking=True), []
    pixels, good = gpu_decoder(batch.pop("packed"))
    return pixels, (~good).nonzero().flatten().tolist()


def bad_fraction_error(source: str, records: Iterable[dict], max_bad_fraction: float,
                        at_least: int = 0) -> str | None:
    seen, bad, reasons = seen_and_bad(records)
    if seen < max(at_least, 1) or bad / seen <= max_bad_fraction:
        return None
    return (f"{bad} of {seen} samples of {source} were bad "
            f"({', '.join(f'{r}: {n}' for r, n in reasons.items())}), "
            f"over max_bad_fraction={max_bad_fraction}; fix or rewrite the source shards")


def embed_this_process_shards(todo: list[tuple[int, str]], work_dir: Path, dataset: ShardBatches,
                              tower, normalize: Callable[[torch.Tensor], torch.Tensor], device,
                              pad_to: int | None, gpu_decoder: gpu_jpeg.JpegBatchDecoder | None,
                              workers: int, max_bad_fraction: float, source: str,
                              finished: list[dict], progress, timing: dict) -> None:
    """Embed the source shards in `todo`, writing each feature shard to `work_dir` as it completes.

    `dataset` yields uint8 pixels (or packed JPEGs, which `gpu_decoder` decodes on `device`);
    `normalize` (`transforms.BatchNormalize`) turns them into the tower's input on `device`;
    `pad_to`: see `_embed_batch`. Batches are put on the device by a thread ahead of the tower
    (`DevicePrefetcher`); one stays queued on the device while the previous one's features are
    written.

    `timing` gets "first_batch" (perf_counter once the first batch is embedded) and "later_images"
    (the images embedded after it): the steady rate, without the tower's loading and the workers'
    start. After the first batch it also sums where the loop's time goes (`_rates` reports it):
    "waiting_for_pixels" (the next batch not on the device yet: reading or decoding bounds the run),
    "waiting_for_features" (the tower not done with the batch before: the tower bounds it), and
    "preparing" (the thread's time putting batches on the device, decoding included).

    Raises UserError once over 1,000 samples were read and more than `max_bad_fraction` of them were
    bad (the shards finished so far stay: a rerun on fixed shards starts over, they are keyed by the
    source's files).
    """
    # Pinned pixels copy to the GPU without a stop; JPEG bytes for the GPU decoder are read on the
    # host, and pinning them (tens of MB a batch of photos) would be a copy for nothing (the decoder
    # pins the pixels the workers decoded, `gpu_jpeg.to_device_async`).
    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                        pin_memory=device.type == "cuda" and gpu_decoder is None)
    pending: dict[int, list[dict]] = {}  # samples of the shards being read (one per worker)
    skipped: dict[int, dict[str, int]] = {}  # embed's own skips, per shard
    # The report of a shard whose last batch is still on the device: the shard completes once it is
    # kept.
    reported: dict[int, dict] = {}

    def keep(embedded: ToHost) -> None:
        """Wait for a batch's features and add its good samples to its shard's; complete the shard
        after its last batch."""
        tic = time.perf_counter()
        batch, embeddings = embedded.batch, embedded.wait()  # (B, width) float16
        if "first_batch" in timing:
            timing["waiting_for_features"] += time.perf_counter() - tic
        pending.setdefault(batch["shard"], []).extend(feature_samples(
            batch["key"], batch["caption"], batch["cls"], embeddings,
            skipped.setdefault(batch["shard"], {})))
        progress.update(len(batch["key"]))
        if "first_batch" in timing:
            timing["later_images"] += len(batch["key"])
        else:
            timing["first_batch"] = time.perf_counter()
        if batch["shard"] in reported:
            complete(batch["shard"], reported.pop(batch["shard"]))

    def to_device(batch: dict) -> tuple[dict, torch.Tensor | None]:
        """Metadata only, and the pixels on the device: the host's copy of the pixels is dropped
        here."""
        if "done" in batch:
            return batch, None
        tic = time.perf_counter()
        meta = {key: batch[key] for key in ("shard", "key", "caption", "cls")}
        pixels, meta["undecodable"] = _pixels_on_device(batch, device, gpu_decoder)
        if "first_batch" in timing:
            timing["preparing"] += time.perf_counter() - tic
        return meta, pixels

    # Feature shards are written by a thread of their own, in the order they finish; the bad-sample
    # check counts each shard once it is complete, before it is written.
    with FeatureShardWriter(work_dir, finished) as writer:
        counted = list(finished)  # the killed run's shards, then each new one as it completes

        def complete(index: int, record: dict) -> None:
            for reason, count in skipped.pop(index, {}).items():
                record["bad"][reason] = record["bad"].get(reason, 0) + count
            counted.append(record)
            writer.write(index, pending.pop(index, []), dict(record))
            progress.set_postfix(shards=f"{len(counted)}/{total_shards}")
            error = bad_fraction_error(source, counted, max_bad_fraction,
                                       at_least=MIN_SAMPLES_BEFORE_CHECK)
            if error:
                raise UserError(error)

        total_shards = len(finished) + len(todo)
        # the batch queued on the device, kept once the next one is queued
        in_flight: ToHost | None = None
        asked = time.perf_counter()
        for batch, pixels in DevicePrefetcher(loader, to_device, device):
            if "first_batch" in timing:
                timing["waiting_for_pixels"] += time.perf_counter() - asked
            index = batch["shard"]
            if "done" in batch:
                if in_flight is not None and in_flight.batch["shard"] == index:
                    reported[index] = batch["done"]  # its last batch is on the device
                else:
                    complete(index, batch["done"])
                continue
            meta, undecodable = batch, batch.pop("undecodable")
            # JPEGs that neither nvJPEG nor the host decoder could read: skipped and counted
            if undecodable:
                bad = skipped.setdefault(index, {})
                bad["bad_image"] = bad.get("bad_image", 0) + len(undecodable)
                for key in ("key", "caption", "cls"):
                    meta[key] = [value for position, value in enumerate(meta[key])
                                 if position not in undecodable]
                if not meta["key"]:
                    continue
            queued = ToHost(meta, _embed_batch(tower, pixels, normalize, pad_to))
            if in_flight is not None:
                # the host's share of the previous batch, while the device computes this one
                keep(in_flight)
            in_flight = queued
            asked = time.perf_counter()
        if in_flight is not None:
            keep(in_flight)
