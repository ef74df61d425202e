"""The image-feature cache of the eval suite: each benchmark's images are encoded by the locked
tower once, and kept on disk keyed by everything the features depend on.

The key is the image tower's weights (`utils.hashing.weights_sha256` of its state), its config, the
preprocessing and the data files, so a new text tower against a locked image tower re-encodes only
text (CLIP_benchmark re-encodes every image every time). The cache holds the tower's pooled
`forward_pooled` (before any trainable image head), so it stays valid for every text tower and head
trained against the same locked tower.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, IterableDataset

# not tqdm.auto: its asyncio class calls iter() on the loader twice, starting the workers twice
from tqdm import tqdm

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.evals.eval_data import EvalData
from lit_softmoe.utils.atomic import write_folder_atomically
from lit_softmoe.utils.device import autocast_context, autocast_dtype, precision_name
from lit_softmoe.utils.hashing import cache_key, file_sha256, weights_sha256
from lit_softmoe.utils.paths import cache_root

logger = logging.getLogger(__name__)

# part of every key: a change to what an entry holds bumps it, so no entry of another is read
CACHE_FORMAT = 4
FEATURES_FILE = "features.safetensors"


def default_cache_dir() -> Path:
    return cache_root() / "eval"


def _collate(items: list[tuple]) -> tuple:
    good = [(i, image, target) for i, image, target in items if image is not None]
    indices = torch.tensor([i for i, _, _ in good], dtype=torch.long)
    images = torch.stack([image for _, image, _ in good]) if good else None
    return indices, images, [t for _, _, t in good], len(items) - len(good)


@torch.inference_mode()
def encode_eval_images(model, data: EvalData, batch_size: int, workers: int, device: torch.device,
                  progress: bool = False, desc: str = "images",
                  precision: str = "auto") -> tuple[torch.Tensor, list, int]:
    """→ (features (N, width) float32 in dataset order, targets (N,), skipped bad images)."""
    loader = DataLoader(data.dataset, batch_size=batch_size, num_workers=workers,
                        collate_fn=_collate, pin_memory=device.type == "cuda",
                        persistent_workers=False)
    autocast = autocast_context(device, precision)
    indices, features, targets, bad = [], [], [], 0
    total = _streamed_batches(data, batch_size, workers)
    for index, images, target, skipped in tqdm(loader, total=total, desc=desc, disable=not progress,
                                               leave=False):
        bad += skipped
        if images is None:
            continue
        with autocast:
            features.append(model.image_tower.forward_pooled(images.to(device, non_blocking=True))
                            .float().cpu())
        indices.append(index)
        targets.extend(target)
    if not features:
        return torch.empty(0), [], bad
    order = torch.cat(indices).argsort()  # workers interleave samples; restore the dataset's order
    features = torch.cat(features)[order]  # (N, width)
    return features, [targets[i] for i in order.tolist()], bad


def _streamed_batches(data: EvalData, batch_size: int, workers: int) -> int | None:
    """The batches a DataLoader over streamed shards yields, from the samples they list (a progress
    bar's total; a map-style set has its len() for that). Each of the workers takes every workers-th
    sample and batches its own share. None when the shards list no sizes (remote ones)."""
    if not isinstance(data.dataset, IterableDataset) or data.listed_samples is None:
        return None
    streams = max(1, workers)
    shares = [len(range(worker, data.listed_samples, streams)) for worker in range(streams)]
    return sum(-(-share // batch_size) for share in shares)


def tower_hash(model) -> str:
    """`weights_sha256` of the tower's state, computed once per state: every benchmark of a suite
    needs it, and a 3.7B-parameter tower takes seconds to hash. A tensor written in place bumps its
    version counter and a replaced one has a new address, so either change recomputes it."""
    stamp = tuple((t.data_ptr(), t._version) for t in model.image_tower.state_dict().values())
    cached = getattr(model, "_eval_tower_hash", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, weights_sha256(model.image_tower.state_dict()))
        model._eval_tower_hash = cached
    return cached[1]


def _cache_key(model, spec: BenchmarkConfig, data: EvalData, device: torch.device,
               precision: str) -> str:
    """What the cached features and targets depend on. The tower is identified by its weights as
    they are in memory (`weights_sha256` of its state), not by a recorded `image_tower_sha256`: the
    same weights give the same key whether they came from a run, an export or memory, and a tower
    changed in memory never meets its old features.

    The task is part of the key because the cache holds the targets as well as the features: class
    indices for classification, captions for retrieval, read from the same files (a webdataset's
    task comes from the suite or from dataset_type.txt, neither of which the file signature covers).
    The transform's repr is too: a model handed in without `pretrained_info` has no recorded
    preprocessing, and its own transform is what the images went through (torchvision's repr spells
    out the sizes, mean and std; a transform whose repr is unstable only costs cache misses)."""
    info = getattr(model, "pretrained_info", None) or {}
    identity = {"format": CACHE_FORMAT, "tower_sha256": tower_hash(model),
                "tower": model.image_tower.cfg.to_dict(), "preprocess": info.get("preprocess"),
                "transform": repr(getattr(data.dataset, "transform", None)),
                "benchmark": spec.name, "split": spec.split, "task": data.task,
                "reader": data.format, "data": data.signature,
                "precision": precision_name(autocast_dtype(precision, device))}
    return cache_key(identity, 32)


def cached_image_features(model, spec: BenchmarkConfig, data: EvalData, cfg: EvalSuiteConfig,
                          device: torch.device, cache_dir: Path | None, progress: bool) -> tuple:
    """(features, targets, bad, "hit" | "miss" | "off"): from the cache when it holds this key."""
    if cache_dir is None:
        return (*encode_eval_images(model, data, cfg.batch_size, cfg.workers, device, progress,
                                    spec.name, cfg.precision), "off")
    folder = cache_dir / _cache_key(model, spec, data, device, cfg.precision)
    cached = _read_entry(folder) if (folder / "meta.json").is_file() else None
    if cached is not None:
        return (*cached, "hit")
    features, targets, bad = encode_eval_images(model, data, cfg.batch_size, cfg.workers, device,
                                                progress, spec.name, cfg.precision)

    def write(tmp: Path) -> None:
        save_file({"features": features.contiguous()}, tmp / FEATURES_FILE)
        # Its own key too: an entry whose files were copied from another entry is the other's, not
        # this one.
        meta = {"benchmark": spec.name, "key": folder.name, "targets": targets, "bad": bad,
                "sha256": file_sha256(tmp / FEATURES_FILE)}
        (tmp / "meta.json").write_text(json.dumps(meta))

    try:
        write_folder_atomically(folder, write)
    # A read-only ~/.cache, a full disk (safetensors raises its own error for it): the features are
    # in hand, so the suite goes on without caching them.
    except (OSError, SafetensorError) as err:
        logger.warning("image features of %s not cached in %s (%s); set cache_dir= or pass "
                       "--no-cache", spec.name, cache_dir, err)
        return features, targets, bad, "off"
    return features, targets, bad, "miss"


def _read_entry(folder: Path) -> tuple[torch.Tensor, list, int] | None:
    """(features, targets, bad) of a cache entry whose features file still has the sha256 recorded
    beside it, else None: a damaged entry (a disk that filled, a copy cut short) is warned about and
    encoded again, where it crashed every later eval of its benchmark."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        # (an entry that records no key: taken as it is)
        if meta.get("key", folder.name) != folder.name:
            raise ValueError(f"meta.json is of the entry {meta['key']} (copied from another entry)")
        if file_sha256(folder / FEATURES_FILE) != meta["sha256"]:
            raise ValueError(f"{FEATURES_FILE} is not the file that was cached")
        features = load_file(folder / FEATURES_FILE)["features"]
        if features.shape[0] != len(meta["targets"]):
            raise ValueError("features and targets differ in number")
        return features, meta["targets"], meta["bad"]
    except Exception as err:  # noqa: BLE001 — anything wrong with an entry: never trusted,
        # encoded again
        logger.warning("ignoring the damaged image-feature cache entry %s (%s: %s); encoding again",
                       folder, type(err).__name__, err)
        return None
