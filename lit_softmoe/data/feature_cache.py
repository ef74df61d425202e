"""The feature cache's format: what `train.embed` writes, LiT training reads and both check.

A feature cache is a split folder of webdataset shards holding a locked image tower's pooled
embeddings, feature shard i for source shard i, beside the source's dataset metadata:

    out_dir/
        classnames.txt  zeroshot_classification_templates.txt  dataset_type.txt   (copied, if present)
        train/  0.tar … N-1.tar  nshards.txt  sizes.json  embed.json

Each sample keeps its source key and holds `.npy` (the pooled embedding, float16: half the bytes
of float32, and well inside the rounding a contrastive loss ignores), `.txt` (the caption) and
`.cls` (copied as-is) when the source had them; `create_shard_loader(…, "embedding-caption")`
reads them back. `embed.json` lives in the split folder, so train and test caches can share one
`out_dir` (the CLIP_benchmark layout, class names beside the splits); it holds the tower's
fingerprint (sha256 of its weights, its config, its preprocessing), the source shards' sizes and
modification times, and each feature shard's sha256. Its presence marks a finished cache.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import torch

from lit_softmoe.data.shards import is_local_url, shard_urls, splits_beside
from lit_softmoe.errors import UserError
from lit_softmoe.models.tower_folder import tower_fingerprint
from lit_softmoe.utils.atomic import write_text_atomic
from lit_softmoe.utils.hashing import file_sha256

EMBED_FILE = "embed.json"
FORMAT_VERSION = 1
# Dataset metadata that zero-shot evaluation reads beside the split folders (CLIP_benchmark layout).
METADATA_FILES = ("classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt")
_FINGERPRINT_KEYS = ("format", "tower_sha256", "tower", "preprocess")


# ---------------------------------------------------------------------------------- fingerprint and checks

def cache_fingerprint(tower_dir: str | Path) -> dict:
    """What a feature cache made with the tower in `tower_dir` is keyed by: the cache format and the
    tower's fingerprint (weights' sha256, config, preprocessing)."""
    return {"format": FORMAT_VERSION, **tower_fingerprint(tower_dir)}


def read_embed_json(split_dir: Path) -> dict | None:
    """A split folder's embed.json, or None (none, or unreadable)."""
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
    info = read_embed_json(split_dir)
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
    damaged = damaged_shard(split_dir, info.get("shard_sha256"))
    if damaged is not None:
        raise UserError(f"feature cache {split_dir}: {damaged}; "
                        f"{_rerun_hint(tower_dir, info.get('source', 'SHARDS'), split_dir)}")
    return info


def damaged_shard(split_dir: Path, recorded: dict | None) -> str | None:
    """What is wrong with a feature shard whose bytes differ from those embed wrote, or None (caches
    written before the hashes were recorded cannot be checked)."""
    for name, sha256 in (recorded or {}).items():
        path = split_dir / name
        if not path.is_file():
            return f"its shard {name} is missing"
        if file_sha256(path) != sha256:
            return f"its shard {name} is not the one embed wrote (damaged or replaced since)"
    return None


def source_stats(urls: list[str]) -> dict:
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


# ---------------------------------------------------------------------------------- samples

def npy_bytes(embedding: np.ndarray) -> bytes:
    """An embedding as a `.npy` member, in its own dtype (embed writes float16); `read_npy` reads it back."""
    buffer = io.BytesIO()
    np.save(buffer, embedding, allow_pickle=False)
    return buffer.getvalue()


def npy_rows(embeddings: np.ndarray) -> list[bytes]:
    """`npy_bytes` of each row of (B, width): np.save's header depends on the dtype and shape alone, so it is
    made once a batch and each row's bytes appended (np.save row by row cost more than the rest of the loop)."""
    row_bytes = embeddings.shape[1] * embeddings.itemsize
    first = npy_bytes(embeddings[0])
    header = first[:len(first) - row_bytes]
    return [header + row.tobytes() for row in embeddings]


def feature_sample(key: str, npy: bytes, caption: str | None, cls: bytes | None) -> dict:
    """One feature-shard sample: its source key, `.npy`, and `.txt` / `.cls` where the source had them."""
    sample = {"__key__": key, "npy": npy}
    if caption is not None:
        sample["txt"] = caption.encode("utf-8")
    if cls is not None:
        sample["cls"] = cls
    return sample


def embedding_caption_sample(embedding: np.ndarray | torch.Tensor, caption: str) -> dict[str, bytes]:
    """One (embedding, caption) sample as shard members: `.npy` (float32 array) + `.txt` (UTF-8).

    The format the embedding pipeline reads; pass these dicts to `shards.write_split`.
    """
    if isinstance(embedding, torch.Tensor):
        embedding = embedding.detach().cpu().float().numpy()
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(embedding, dtype=np.float32), allow_pickle=False)
    return {"npy": buffer.getvalue(), "txt": caption.encode("utf-8")}


def read_npy(data: bytes) -> np.ndarray:
    """A `.npy` member's embedding as float32; ValueError, saying why, for anything but a finite float array."""
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exn:  # ValueError, OSError, EOFError… for a damaged .npy
        # numpy's message for an object array names allow_pickle: a pickle is never loaded from a shard.
        detail = "holds Python objects, which are never unpickled" if "allow_pickle" in str(exn) else exn
        raise ValueError(f"{type(exn).__name__}: {detail}") from None
    if array.dtype.kind != "f" or array.ndim == 0:
        raise ValueError(f"expected a float array, got {array.dtype} with shape {array.shape}")
    with np.errstate(over="ignore"):  # a float64 value past float32's range becomes inf: checked below
        array = array.astype(np.float32, copy=False)
    # Checked after the cast: what trains is float32, and an overflow to inf there is as bad as a NaN.
    if not np.isfinite(array).all():
        raise ValueError("holds NaN or infinity (as float32)")
    return array


# ---------------------------------------------------------------------------------- detecting a cache

def feature_split_dirs(spec: str | Path) -> list[Path]:
    """The split folders of feature shards (written by `lit-softmoe embed`, which leaves embed.json in
    each) that `spec` names: a split folder, a brace pattern or several joined with `::`, as the
    shard reader takes them; [] for image shards. Parts of both kinds cannot share one loader."""
    if not str(spec).strip():
        return []
    if Path(spec).is_dir():
        return [Path(spec)] if (Path(spec) / EMBED_FILE).is_file() else []
    urls = shard_urls(str(spec))
    folders = list(dict.fromkeys(Path(url).parent for url in urls if is_local_url(url)))
    cached = [folder for folder in folders if (folder / EMBED_FILE).is_file()]
    if cached and (len(cached) < len(folders) or not all(map(is_local_url, urls))):
        raise UserError(f"{spec} mixes feature shards of `lit-softmoe embed` ({cached[0]}) with other shards; "
                        "give only feature caches, or only image shards")
    return cached


def is_feature_cache(split: str | Path) -> bool:
    """Feature shards (written by `lit-softmoe embed`): a split folder holding embed.json, or a
    pattern or `::` list of such splits."""
    return bool(feature_split_dirs(split))


def check_feature_caches(spec: str | Path, tower_dir) -> None:
    """check_feature_cache for every split `spec` names (a stale one in a `::` list is refused too)."""
    for split_dir in feature_split_dirs(spec):
        check_feature_cache(split_dir, tower_dir)


# ---------------------------------------------------------------------------------- dataset metadata

def copy_metadata(source_dir: Path | None, out_dir: Path) -> list[str]:
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


def refuse_other_metadata(source_dir: Path | None, out_dir: Path, split: str) -> None:
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
