"""The feature cache's format: what `train.embed` writes, LiT training reads and both check.

A feature cache is a split folder of webdataset shards holding a locked image tower's pooled
embeddings, feature shard i for source shard i, beside the source's dataset metadata:

    out_dir/
        classnames.txt  zeroshot_classification_templates.txt  dataset_type.txt
            (copied, if present)
        train/  0.tar … N-1.tar  nshards.txt  sizes.json  embed.json

Each sample keeps its source key and holds `.npy` (the pooled embedding, float16: half the bytes
of float32, and well inside the rounding a contrastive loss ignores), `.txt` (the caption) and
`.cls` (copied as-is) when the source had them; `create_shard_loader(…, "embedding-caption")`
reads them back. `embed.json` lives in the split folder, so train and test caches can share one
`out_dir` (the CLIP_benchmark layout, class names beside the splits); it holds the tower's
fingerprint (sha256 of its weights, its config, its preprocessing), the source shards' sizes and
modification times, and each feature shard's sha256. Its presence marks a finished cache.

How embed's processes write a cache (its work folder, shard records, failure reports) is
`train.embed_job`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from lit_softmoe.data.samples import IMAGE_EXTENSIONS, npy_bytes
from lit_softmoe.data.shards import (
    CLASSNAMES_FILE,
    TEMPLATES_FILE,
    file_identity,
    is_local_url,
    is_safe_key,
    shard_urls,
    splits_beside,
)
from lit_softmoe.errors import UserError
from lit_softmoe.models.tower_folder import tower_fingerprint
from lit_softmoe.utils.atomic import write_text_atomic
from lit_softmoe.utils.hashing import file_sha256

EMBED_FILE = "embed.json"
FORMAT_VERSION = 1
# Dataset metadata that zero-shot evaluation reads beside the split folders (CLIP_benchmark layout).
METADATA_FILES = (CLASSNAMES_FILE, TEMPLATES_FILE, "dataset_type.txt")
_FINGERPRINT_KEYS = ("format", "tower_sha256", "tower", "preprocess")


# ----------------------------------------------------------------------------------
# fingerprint and checks

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


# What a message tells to do to make a cache again: (tower_dir, the source shards embed.json records
# or None, the split folder) → words, e.g. "embed SOURCE with the tower T into S again".
RemakeHint = Callable[[str | Path, str | None, Path], str]


def remake_words(tower_dir: str | Path, source: str | None, split_dir: Path) -> str:
    """How to make the cache in `split_dir` again, in the library's words (`check_feature_cache`'s
    default; the commands name their own, `train.embed.rerun_command`)."""
    source = source or "its source shards"
    return f"embed {source} with the tower {tower_dir} into {split_dir} again"


def check_feature_cache(feature_split_dir: str | Path, tower_dir: str | Path,
                        remake: RemakeHint = remake_words) -> dict:
    """Raise UserError unless `feature_split_dir` was embedded by the tower in `tower_dir`.

    Returns the cache's embed.json (its "dim" sizes the text tower's projection). A cache is
    refused when embed.json is missing (not a cache, or a run that did not finish), when the
    tower's weights, config or preprocessing differ from those it was made with, or when one of
    its local source shards still exists with another size or modification time, or when one of its
    own shards is not the file embed wrote (damaged, truncated or replaced since). Each refusal
    ends in `remake(tower_dir, source, split_dir)`: how to make the cache again, in the caller's
    words.
    """
    split_dir = Path(feature_split_dir)
    info = read_embed_json(split_dir)
    if info is None:
        raise UserError(f"feature cache {split_dir} has no {EMBED_FILE} (not made by `lit-softmoe "
                        f"embed`, or the run did not finish); {remake(tower_dir, None, split_dir)}")
    hint = remake(tower_dir, info.get("source"), split_dir)
    # a folder's files replaced by another split's
    if info.get("split", split_dir.name) != split_dir.name:
        raise UserError(f"feature cache {split_dir} holds the split {info['split']!r} (so says its "
                        f"{EMBED_FILE}: another split's cache copied or moved here); rename the "
                        f"folder back to {info['split']}, or {hint}")
    expected = cache_fingerprint(tower_dir)
    if any(info.get(key) != expected[key] for key in _FINGERPRINT_KEYS):
        raise UserError(f"feature cache {split_dir} was made with another tower (sha "
                        f"{str(info.get('tower_sha256'))[:12]} vs {expected['tower_sha256'][:12]}) "
                        f"or preprocessing; {hint}")
    changed = _changed_source_file(info.get("source_stats") or {})
    if changed is not None:
        raise UserError(f"feature cache {split_dir} is older than its source: {changed} changed "
                        f"since it was embedded; {hint}")
    damaged = damaged_shard(split_dir, info.get("shard_sha256"))
    if damaged is not None:
        raise UserError(f"feature cache {split_dir}: {damaged}; {hint}")
    return info


def damaged_shard(split_dir: Path, recorded: dict | None) -> str | None:
    """What is wrong with a feature shard whose bytes differ from those embed wrote, or None (a
    cache whose embed.json records no hashes cannot be checked)."""
    for name, sha256 in (recorded or {}).items():
        path = split_dir / name
        if not path.is_file():
            return f"its shard {name} is missing"
        if file_sha256(path) != sha256:
            return f"its shard {name} is not the one embed wrote (damaged or replaced since)"
    return None


def source_stats(urls: list[str]) -> dict:
    """{resolved path: [size, mtime_ns, ctime_ns]} of each local source shard
    (`shards.file_identity`: a same-size edit whose mtime was put back still changes the ctime),
    {url: None} of a remote one (it cannot be stat'ed): what embed.json records, a rerun compares
    and `check_feature_cache` checks."""
    stats = {}
    for url in urls:
        if is_local_url(url):
            path, *identity = file_identity(url)
            stats[path] = identity
        else:
            stats[url] = None
    return stats


def _changed_source_file(source_stats: dict) -> str | None:
    """A source shard rewritten since embedding, if any. Deleted sources are fine: dropping the
    images once their features are cached is a reason to cache (and remote sources cannot be
    checked)."""
    for path, recorded in source_stats.items():
        if recorded is None:  # remote
            continue
        try:
            _, *identity = file_identity(path)
        except OSError:
            continue
        if identity != recorded:
            return path
    return None


# ---------------------------------------------------------------------------------- samples

def npy_rows(embeddings: np.ndarray) -> list[bytes]:
    """`npy_bytes` of each row of (B, width): np.save's header depends on the dtype and shape alone,
    so it is made once a batch and each row's bytes appended (np.save row by row cost more than the
    rest of the loop)."""
    row_bytes = embeddings.shape[1] * embeddings.itemsize
    first = npy_bytes(embeddings[0])
    header = first[:len(first) - row_bytes]
    return [header + row.tobytes() for row in embeddings]


def feature_sample(key: str, npy: bytes, caption: str | None, cls: bytes | None) -> dict:
    """One feature-shard sample: its source key, `.npy`, and `.txt` / `.cls` where the source had
    them."""
    sample = {"__key__": key, "npy": npy}
    if caption is not None:
        sample["txt"] = caption.encode("utf-8")
    if cls is not None:
        sample["cls"] = cls
    return sample


def feature_samples(keys: list[str], captions: list, classes: list, embeddings: np.ndarray,
                    bad: dict[str, int]) -> list[dict]:
    """A batch's feature samples (`embeddings`: (B, width), row i for keys[i]); a non-finite
    embedding (fp16 overflow, a NaN from the tower) or an unsafe key (`../x`, `/abs/x` from a
    hostile source) is never written: counted in `bad` by reason instead."""
    finite = np.isfinite(embeddings).all(axis=1)  # checked over the whole batch at once
    samples = []
    for key, caption, cls, npy, good in zip(keys, captions, classes, npy_rows(embeddings), finite):
        reason = ("nonfinite_embedding" if not good
                  else "unsafe_key" if not is_safe_key(key) else None)
        if reason:
            bad[reason] = bad.get(reason, 0) + 1
            continue
        samples.append(feature_sample(key, npy, caption, cls))
    return samples


def embedding_caption_sample(embedding: np.ndarray | torch.Tensor,
                             caption: str) -> dict[str, bytes]:
    """One (embedding, caption) sample as shard members: `.npy` (float32 array) + `.txt` (UTF-8).

    The format the embedding pipeline reads; pass these dicts to `shards.write_split`.
    """
    if isinstance(embedding, torch.Tensor):
        embedding = embedding.detach().cpu().float().numpy()
    npy = npy_bytes(np.asarray(embedding, dtype=np.float32))
    return {"npy": npy, "txt": caption.encode("utf-8")}


# ----------------------------------------------------------------------------------
# detecting a cache

def feature_split_dirs(spec: str | Path) -> list[Path]:
    """The split folders of feature shards (written by `lit-softmoe embed`, which leaves embed.json
    in each) that `spec` names: a split folder, a brace pattern or several joined with `::`, as the
    shard reader takes them; [] for image shards. Parts of both kinds cannot share one loader."""
    if not str(spec).strip():
        return []
    if Path(spec).is_dir():
        return [Path(spec)] if (Path(spec) / EMBED_FILE).is_file() else []
    urls = shard_urls(str(spec))
    folders = list(dict.fromkeys(Path(url).parent for url in urls if is_local_url(url)))
    cached = [folder for folder in folders if (folder / EMBED_FILE).is_file()]
    if cached and (len(cached) < len(folders) or not all(map(is_local_url, urls))):
        raise UserError(f"{spec} mixes feature shards of `lit-softmoe embed` ({cached[0]}) with "
                        "other shards; give only feature caches, or only image shards")
    return cached


def is_feature_cache(split: str | Path) -> bool:
    """Feature shards (written by `lit-softmoe embed`): a split folder holding embed.json, or a
    pattern or `::` list of such splits."""
    return bool(feature_split_dirs(split))


def refuse_feature_shards(spec: str, urls: list[str], first_members: set[str],
                          shards_setting: str = "shards") -> None:
    """UserError where the shards `spec` names are feature shards (our own output) given as a source
    of images: the embed.json beside them, or `.npy` samples without an image (`first_members`:
    those of the first sample, `tar_reading.first_sample_members`). Every sample would be counted as
    missing_image, and the bad-fraction message would send the user the wrong way. The message calls
    the source `shards_setting`, the caller's name for it (embed's --shards)."""
    first = urls[0]
    local = "://" not in first and not first.startswith("pipe:")
    info = read_embed_json(Path(first).parent) if local else None
    if info is None:
        if "npy" not in first_members or first_members & set(IMAGE_EXTENSIONS):
            return
        info = {}
    source = f" (these came from {shards_setting} {info['source']})" if info.get("source") else ""
    raise UserError(f"{spec} holds feature shards written by `lit-softmoe embed`, not images; pass "
                    f"the image shards to embed{source}")


def check_feature_caches(spec: str | Path, tower_dir, remake: RemakeHint = remake_words) -> None:
    """check_feature_cache for every split `spec` names (a stale one in a `::` list is refused
    too)."""
    for split_dir in feature_split_dirs(spec):
        check_feature_cache(split_dir, tower_dir, remake)


# ----------------------------------------------------------------------------------
# dataset metadata

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


def refuse_other_metadata(source_dir: Path | None, out_dir: Path, split: str,
                          out_setting: str = "out_dir") -> None:
    """Refuse to replace classnames.txt & co. in `out_dir` while other feature splits there still
    use them: embedding a second dataset into the same folder would rename the first one's classes.
    The message calls `out_dir` `out_setting`, the caller's name for it (embed's --out)."""
    others = splits_beside(out_dir, exclude={split})
    for name in METADATA_FILES if source_dir is not None and others else ():
        source, target = source_dir / name, out_dir / name
        if (source.is_file() and target.is_file()
                and source.read_text(encoding="utf-8") != target.read_text(encoding="utf-8")):
            raise UserError(f"{target} differs from {source} and the feature split(s) "
                            f"{', '.join(others)} in {out_dir} use it; embed another dataset into "
                            f"its own {out_setting} folder, or delete {target} to take the new one")


# ------------------------------------------------------------------------------- a finished cache

def finished_cache(split_dir: Path, wanted: dict) -> dict | None:
    """The embed.json of the finished cache in `split_dir` when it holds every key of `wanted` with
    the same value and its shards are the ones written, else None (another tower, other source
    files, a cache without source_stats, a damaged shard: all embedded again)."""
    done = read_embed_json(split_dir)
    if done is not None and all(done.get(key) == value for key, value in wanted.items()) \
            and damaged_shard(split_dir, done.get("shard_sha256")) is None:
        return done
    return None
