"""Frozen-embedding cache: run the locked image tower once per image, not once per epoch.

LiT (Zhai et al., CVPR 2022, App. G) locks the image tower and uses no augmentation, so the
tower's output for an image never changes during LiT training: computing it once and storing it
raised their throughput from 17 to 2,409 img/s/core and the largest batch from 146 to 2,448. open_clip
has no such cache (its issue #99); this module is ours.

`embed_shards` reads image + caption shards (and `.cls` where present, so class shards such as a
zero-shot test split can be cached too, also without captions), runs `tower.forward_features` under inference mode
(bf16 autocast on GPUs that have it) and writes feature shards in the same webdataset layout:

    out_dir/
        classnames.txt  zeroshot_classification_templates.txt  dataset_type.txt   (copied, if present)
        train/  0.tar … N-1.tar  nshards.txt  sizes.json  embed.json

Each sample keeps its source key and holds `.npy` (the pooled embedding, float16: half the bytes
of float32, and well inside the rounding a contrastive loss ignores), `.txt` (the caption) and
`.cls` (copied as-is) when the source had them; `create_shard_loader(…, "embedding-caption")`
reads them back. `embed.json` lives in the split folder, so train and test caches can share one
`out_dir` (the CLIP_benchmark layout, class names beside the splits); it holds the tower's
fingerprint (sha256 of its weights, its config, its preprocessing). The whole split folder is
written under a temporary name and renamed when complete, so its presence means a finished
cache: a rerun with the same tower and the same source files (each shard's path, size and
modification time) is skipped, one with anything changed embeds again, and `check_feature_cache`
refuses a cache made with another tower or preprocessing, or one whose local source shards were
rewritten since, instead of training on stale embeddings (a deleted source is fine: the features
are what is left of it).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm
from webdataset.gopen import gopen
from webdataset.tariterators import group_by_keys, tar_file_expander

from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import (
    IMAGE_EXTENSIONS,
    dataset_dir,
    is_local_url,
    is_safe_key,
    read_class_members,
    shard_urls,
    splits_beside,
    write_split,
)
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.models.tower_folder import load_tower, tower_fingerprint
from lit_softmoe.utils.atomic import write_folder_atomically, write_text_atomic
from lit_softmoe.utils.device import autocast_dtype
from lit_softmoe.utils.hashing import file_sha256

EMBED_FILE = "embed.json"
FORMAT_VERSION = 1
# Dataset metadata that zero-shot evaluation reads beside the split folders (CLIP_benchmark layout).
METADATA_FILES = ("classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt")
_FINGERPRINT_KEYS = ("format", "tower_sha256", "tower", "preprocess")


def cache_fingerprint(tower_dir: str | Path) -> dict:
    """What a feature cache made with the tower in `tower_dir` is keyed by: the cache format and the
    tower's fingerprint (weights' sha256, config, preprocessing)."""
    return {"format": FORMAT_VERSION, **tower_fingerprint(tower_dir)}


def _read_embed_json(split_dir: Path) -> dict | None:
    try:
        return json.loads((split_dir / EMBED_FILE).read_text())
    except (OSError, ValueError):
        return None


def _rerun_hint(tower_dir, source, split_dir: Path) -> str:
    return (f"rerun `lit-softmoe embed --tower {tower_dir} --shards {source} --out {split_dir.parent} "
            f"--split {split_dir.name}`")


def check_feature_cache(feature_split_dir: str | Path, tower_dir: str | Path) -> dict:
    """Raise UserError unless `feature_split_dir` was embedded by the tower in `tower_dir`.

    Returns the cache's embed.json (its "dim" sizes the text tower's projection). A cache is
    refused when embed.json is missing (not a cache, or a run that did not finish), when the
    tower's weights, config or preprocessing differ from those it was made with, or when one of
    its local source shards still exists with another size or modification time, or when one of its
    own shards is not the file embed wrote (damaged, truncated or replaced since).
    """
    split_dir = Path(feature_split_dir)
    info = _read_embed_json(split_dir)
    if info is None:
        raise UserError(f"feature cache {split_dir} has no {EMBED_FILE} (not made by `lit-softmoe embed`, or the "
                        f"run did not finish); {_rerun_hint(tower_dir, 'SHARDS', split_dir)}")
    expected = cache_fingerprint(tower_dir)
    if any(info.get(key) != expected[key] for key in _FINGERPRINT_KEYS):
        raise UserError(f"feature cache {split_dir} was made with another tower (sha "
                        f"{str(info.get('tower_sha256'))[:12]} vs {expected['tower_sha256'][:12]}) or preprocessing; "
                        f"{_rerun_hint(tower_dir, info.get('source', 'SHARDS'), split_dir)}")
    changed = _changed_source_file(info.get("source_stats") or {})
    if changed is not None:
        raise UserError(f"feature cache {split_dir} is older than its source: {changed} changed since it was "
                        f"embedded; {_rerun_hint(tower_dir, info.get('source', 'SHARDS'), split_dir)}")
    damaged = _damaged_shard(split_dir, info.get("shard_sha256"))
    if damaged is not None:
        raise UserError(f"feature cache {split_dir}: {damaged}; "
                        f"{_rerun_hint(tower_dir, info.get('source', 'SHARDS'), split_dir)}")
    return info


def _damaged_shard(split_dir: Path, recorded: dict | None) -> str | None:
    """What is wrong with a feature shard whose bytes differ from those embed wrote, or None (caches
    written before the hashes were recorded cannot be checked)."""
    for name, sha256 in (recorded or {}).items():
        path = split_dir / name
        if not path.is_file():
            return f"its shard {name} is missing"
        if file_sha256(path) != sha256:
            return f"its shard {name} is not the one embed wrote (damaged or replaced since)"
    return None


def _source_stats(urls: list[str]) -> dict:
    """{resolved path: [size, mtime_ns]} of each local source shard, {url: None} of a remote one (it
    cannot be stat'ed): what embed.json records, a rerun compares and `check_feature_cache` checks."""
    stats = {}
    for url in urls:
        if is_local_url(url):
            stat = os.stat(url)
            stats[str(Path(url).resolve())] = [stat.st_size, stat.st_mtime_ns]
        else:
            stats[url] = None
    return stats


def _changed_source_file(source_stats: dict) -> str | None:
    """A source shard rewritten since embedding, if any. Deleted sources are fine: dropping the images
    once their features are cached is a reason to cache (and remote sources cannot be checked)."""
    for path, recorded in source_stats.items():
        if recorded is None:  # remote
            continue
        try:
            stat = os.stat(path)
        except OSError:
            continue
        if [stat.st_size, stat.st_mtime_ns] != recorded:
            return path
    return None


# ---------------------------------------------------------------------------------- reading the source

def _source_split_name(shards: str, urls: list[str]) -> str:
    """The source split folder's name ("train" for DATA/fashion-mnist/train or DATA/x/train/{0..9}.tar)."""
    spec = str(shards)
    if Path(spec).is_dir():
        return Path(spec).resolve().name
    return Path(os.path.dirname(urls[0])).name or "train"


def _ignore(exn: Exception) -> bool:
    return True  # webdataset handler: go on with the next shard


def _first_sample_members(first_url: str) -> set[str]:
    """The members ("cls", "txt", "png"…) of the first sample of the first shard (reads one sample)."""
    # A broken first shard reads as no members: the main pass counts and reports it.
    try:
        stream = gopen(first_url)
    except Exception:  # noqa: BLE001 — counted by the main pass
        return set()
    with contextlib.closing(stream):  # one sample read: the rest of the shard is left, its file closed now
        files = tar_file_expander(iter([{"url": first_url, "stream": stream}]), handler=_ignore)
        first = next(iter(group_by_keys(files, handler=_ignore)), None)
    return {key for key in first if not key.startswith("__")} if first is not None else set()


def _refuse_feature_shards(shards: str, urls: list[str], members: set[str]) -> None:
    """Feature shards (our own output) hold `.npy` embeddings and no image: every sample would be
    counted as missing_image and the bad-fraction message would send the user the wrong way.
    `members`: those of the first sample (`_first_sample_members`)."""
    first = urls[0]
    local = "://" not in first and not first.startswith("pipe:")
    info = _read_embed_json(Path(first).parent) if local else None
    if info is None:
        if "npy" not in members or members & set(IMAGE_EXTENSIONS):
            return
        info = {}
    source = f" (these came from --shards {info['source']})" if info.get("source") else ""
    raise UserError(f"{shards} holds feature shards written by `lit-softmoe embed`, not images; pass the "
                    f"image shards to embed{source}")


# ---------------------------------------------------------------------------------- embedding

def _embed_batch(tower: torch.nn.Module, images: torch.Tensor, device: torch.device,
                 autocast: torch.dtype | None) -> torch.Tensor:
    """images (B, C, H, W) → float16 pooled embeddings (B, width) on the CPU."""
    with torch.inference_mode(), torch.autocast(device.type, dtype=autocast or torch.float32,
                                                enabled=autocast is not None):
        features = tower.forward_features(images.to(device, non_blocking=True))  # (B, width)
    return features.float().to(torch.float16).cpu()


def _npy_bytes(embedding: np.ndarray) -> bytes:
    # The `.npy` member of `pipelines.embedding_caption_sample`, in float16; its reader accepts
    # any float dtype and returns float32.
    buffer = io.BytesIO()
    np.save(buffer, embedding, allow_pickle=False)
    return buffer.getvalue()


def _feature_samples(loader, tower, device, autocast, labels: dict[str, bytes] | None,
                     stats: dict, progress: bool) -> Iterator[dict]:
    """Feature-shard samples in the loader's order (shard order with workers=0: deterministic)."""
    for batch in tqdm(loader, total=loader.num_batches, desc="embed", unit="batch", disable=not progress):
        embeddings = _embed_batch(tower, batch["image"], device, autocast).numpy()  # (B, width) fp16
        finite = np.isfinite(embeddings).all(axis=1)
        captions = batch.get("caption", [None] * len(batch["key"]))  # None: class-only shards
        for key, caption, embedding, ok in zip(batch["key"], captions, embeddings, finite):
            if not ok:  # fp16 overflow or a NaN from the tower: the reader would skip it anyway
                stats["bad"]["nonfinite_embedding"] = stats["bad"].get("nonfinite_embedding", 0) + 1
                continue
            if not is_safe_key(key):  # `../x`, `/abs/x` from a hostile source: not written into our shards
                stats["bad"]["unsafe_key"] = stats["bad"].get("unsafe_key", 0) + 1
                continue
            sample = {"__key__": key, "npy": _npy_bytes(embedding)}
            if caption is not None:
                sample["txt"] = caption.encode("utf-8")
            if labels is not None and key in labels:
                sample["cls"] = labels[key]
            stats["num_samples"] += 1
            yield sample


def _copy_metadata(source_dir: Path | None, out_dir: Path) -> list[str]:
    """Copy classnames.txt & co. from beside the source split to beside the feature split."""
    copied = []
    for name in METADATA_FILES if source_dir is not None else ():
        source = source_dir / name
        if not source.is_file():
            continue
        text, target = source.read_text(encoding="utf-8"), out_dir / name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            write_text_atomic(target, text)
        copied.append(name)
    return copied


def _refuse_other_metadata(source_dir: Path | None, out_dir: Path, split: str) -> None:
    """Refuse to replace classnames.txt & co. in `out_dir` while other feature splits there still use them:
    embedding a second dataset into the same --out would rename the first one's classes."""
    others = splits_beside(out_dir, exclude={split})
    for name in METADATA_FILES if source_dir is not None and others else ():
        source, target = source_dir / name, out_dir / name
        if (source.is_file() and target.is_file()
                and source.read_text(encoding="utf-8") != target.read_text(encoding="utf-8")):
            raise UserError(f"{target} differs from {source} and the feature split(s) {', '.join(others)} in "
                            f"{out_dir} use it; embed another dataset into its own --out folder, or delete "
                            f"{target} to take the new one")


def _remove_leftovers(out_dir: Path, split: str) -> None:
    # A run killed mid-write leaves its temporary split folder (write_folder_atomically's naming).
    for leftover in out_dir.glob(f".{split}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def embed_shards(
    tower_dir: str | Path,
    shards: str,
    out_dir: str | Path,
    split: str | None = None,
    batch_size: int = 256,
    workers: int = 0,
    device: str | torch.device | None = None,
    precision: str = "auto",
    samples_per_shard: int = 10_000,
    max_bad_fraction: float = 0.01,
    progress: bool = False,
) -> dict:
    """Embed every image of `shards` with the tower in `tower_dir`; write feature shards to `out_dir/split/`.

    Args:
        tower_dir: a tower folder written by `save_tower` (its config.json holds "preprocess").
        shards: image + caption shards: a split folder, a brace pattern, several joined with `::`.
        out_dir: the feature dataset folder; gets `split/` and the source's classnames.txt & co.
        split: the feature split's name; default: the source split folder's name (e.g. "train").
        batch_size: images per tower forward.
        workers: DataLoader workers decoding images; 0 decodes in this process. The output
            order is the loader's: the same for the same shards and workers.
        device: where the tower runs; default CUDA when available, else the CPU.
        precision: auto (bf16 autocast on GPUs that support it, else fp32) | fp32 | bf16.
        samples_per_shard: feature samples per output tar.
        max_bad_fraction: stop (UserError) when more than this fraction of samples is unreadable;
            fewer are skipped and counted in "bad".
        progress: show a progress bar.

    Returns:
        {"split_dir", "num_samples", "dim", "seconds", "images_per_second", "bad": {reason: count},
        "skipped"}; "skipped" is True when the split already held this tower's embeddings of
        these shards, unchanged since (nothing was written).
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    # The command's own flags: the loader's checks would name data.* options embed does not take.
    for value, flag, least in ((batch_size, "--batch-size", 1), (workers, "--workers", 0),
                               (samples_per_shard, "samples_per_shard", 1)):
        if value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if split is not None and (split in ("", ".", "..") or "/" in split or "\\" in split):
        raise UserError(f"--split {split!r} must be a folder name (e.g. train), not a path; "
                        "give the parent folder as --out")
    urls = shard_urls(shards)  # a UserError for missing local shards, before any work
    members = _first_sample_members(urls[0])  # one sample read: what kind of shards these are
    _refuse_feature_shards(shards, urls, members)
    split = split or _source_split_name(shards, urls)
    split_dir = out_dir / split
    # The split is replaced whole at the end: only an earlier feature cache may be. `--out DATA`
    # for `--shards DATA/train` (the dataset folder, not a new one) replaced the images themselves.
    if split_dir.is_dir() and any(split_dir.iterdir()) and not (split_dir / EMBED_FILE).is_file():
        raise UserError(f"{split_dir} holds other data (not a feature cache of `lit-softmoe embed`), which embedding "
                        f"would replace; give a new --out folder (e.g. {out_dir}-features) or another --split")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast = autocast_dtype(precision, device)
    fingerprint = cache_fingerprint(tower_dir)
    wanted = {**fingerprint, "source": str(shards), "source_stats": _source_stats(urls),
              "precision": "bf16" if autocast else "fp32"}

    source_dir = dataset_dir(shards, urls)
    _refuse_other_metadata(source_dir, out_dir, split)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out_dir, split)
    _copy_metadata(source_dir, out_dir)
    done = _read_embed_json(split_dir)
    # Anything else (another tower, other source files, a cache from before source_stats was
    # recorded) is embedded again; the new split replaces the old one atomically.
    if done is not None and all(done.get(key) == value for key, value in wanted.items()) \
            and _damaged_shard(split_dir, done.get("shard_sha256")) is None:
        return {"split_dir": str(split_dir), "num_samples": done["num_samples"], "dim": done["dim"],
                "seconds": round(time.perf_counter() - start, 3), "images_per_second": None,
                "bad": done.get("bad", {}), "skipped": True}

    tower, meta = load_tower(tower_dir, device=device)
    tower.eval()  # no drop-path or dropout: the cache must be the locked tower's deterministic output
    preprocess = meta["preprocess"]
    transform = eval_transform(preprocess["image_size"], tower.cfg.in_channels, preprocess["mean"], preprocess["std"])
    # One process reads every sample once, in shard order; rank/world_size fixed so a launcher's
    # RANK/WORLD_SIZE cannot make this process embed only its share.
    data = ShardDataConfig(urls=shards, batch_size=batch_size, workers=workers, shuffle=False, exact_epoch=True,
                           rank=0, world_size=1, max_bad_fraction=max_bad_fraction,
                           pin_memory=device.type == "cuda")
    # Class shards without captions (`data from-folder --layout classes`: a labelled eval set) are
    # cached with their class alone, for zero-shot evaluation; everything else needs its caption.
    class_only = "cls" in members and "txt" not in members
    loader = create_shard_loader(data, "image-class" if class_only else "image-caption", transform)
    # The image-caption pipeline carries no class: class shards are read a second time, `.cls` only.
    labels = read_class_members(urls) if "cls" in members else None
    stats: dict = {"num_samples": 0, "bad": {}}

    def write(tmp_dir: Path) -> None:
        samples = _feature_samples(loader, tower, device, autocast, labels, stats, progress)
        try:
            sizes = write_split(samples, tmp_dir.parent, tmp_dir.name, samples_per_shard=samples_per_shard,
                                keep_keys=True)
        except UserError as err:
            # The loader's hint names data.max_bad_fraction, a training option `embed` does not take.
            message = str(err).replace("; fix the shards or raise data.max_bad_fraction",
                                       "; fix or rewrite the source shards")
            raise UserError(message) from None
        except ValueError as err:
            if "sample key" not in str(err):
                raise
            raise UserError(f"{shards}: {err}; embed each source into its own --split") from None
        if stats["num_samples"] == 0:
            needed = "an image and a .cls" if class_only else "an image and a .txt (or a .cls)"
            raise UserError(f"no sample of {shards} could be embedded "
                            f"(skipped: {dict(loader.bad.counts) or 'nothing'}); check that its shards hold "
                            f"{needed} per sample")
        stats["bad"].update({reason: count for reason, count in sorted(loader.bad.counts.items()) if count})
        stats["seconds"] = round(time.perf_counter() - start, 3)
        info = {**wanted, "split": split, "num_samples": stats["num_samples"], "dim": tower.cfg.width,
                "dtype": "float16", "with_cls": labels is not None, "with_txt": not class_only, "bad": stats["bad"],
                "seconds": stats["seconds"],
                # The cache's own bytes: a shard damaged or replaced since is refused, not trained on.
                "shard_sha256": {name: file_sha256(tmp_dir / name) for name in sizes}}
        # Last: inside the folder that is renamed into place, so it is never beside partial shards.
        write_text_atomic(tmp_dir / EMBED_FILE, json.dumps(info, indent=1) + "\n")

    write_folder_atomically(split_dir, write)
    rate = round(stats["num_samples"] / max(stats["seconds"], 1e-9), 1)
    return {"split_dir": str(split_dir), "num_samples": stats["num_samples"], "dim": tower.cfg.width,
            "seconds": stats["seconds"], "images_per_second": rate, "bad": stats["bad"], "skipped": False}
