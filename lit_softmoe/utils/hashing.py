"""sha256s: of a file's bytes, and of a set of weights (the one identity of a tower's weights).

`weights_sha256` is the identity lit-softmoe records for weights (`image_tower_sha256`, a
tower folder's `tower_sha256`): a hash of the tensors themselves, so the same weights have the
same key whether they are in memory, in a tower folder's model.safetensors or in an export.
`safetensors_weights_sha256` gives the same value from a file, one tensor at a time. `file_sha256`
is for a file's integrity (a written file still the one written), not for the identity of weights.
`cache_key` names a cache entry by what it depends on (a JSON-able description).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from lit_softmoe.errors import UserError


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too: a rewritten file is hashed again, an unchanged one once per
    # process (a 27B-parameter tower is 55 GB, tens of seconds to hash).
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of the file's bytes."""
    path = Path(path).resolve()
    stat = os.stat(path)
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


def _update(digest, name: str, tensor: torch.Tensor) -> None:
    # One JSON line per tensor (JSON escapes newlines, so a name cannot run into the next field),
    # then its raw bytes: their length follows from the dtype and shape, so nothing else is
    # needed to parse it.
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    digest.update((json.dumps([name, dtype, list(tensor.shape)]) + "\n").encode())
    # raw bytes, any dtype, in memory order
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy())


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        _update(digest, name, tensor)
    return digest.hexdigest()


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """The hex sha256 of a set of weights: every tensor's name, dtype, shape and bytes,
    in name order.

    The same tensors give the same value wherever they are held (any device, any storage layout);
    another dtype is other weights (a bf16 copy of fp32 weights has a key of its own), and so is a
    renamed, reshaped or changed tensor. `safetensors_weights_sha256` computes it from a file."""
    return _digest((name, state[name]) for name in sorted(state))


@functools.lru_cache(maxsize=8)
def _safetensors_sha256(path: str, size: int, mtime_ns: int, prefix: str) -> str:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as file:
        names = sorted(name for name in file.keys() if name.startswith(prefix))
        # One tensor in memory at a time: a large tower is never held whole (nor twice).
        return _digest((name[len(prefix):], file.get_tensor(name)) for name in names)


def safetensors_weights_sha256(path: str | Path, prefix: str = "") -> str:
    """`weights_sha256` of the tensors a safetensors file holds, read one at a time;
    with `prefix`, of those whose names start with it, under their names without it
    (an export's `image_tower.*` are the tower's own weights). Computed once per file version in a
    process, as `file_sha256` is."""
    from safetensors import SafetensorError
    path = Path(path).resolve()
    try:
        stat = os.stat(path)
        return _safetensors_sha256(str(path), stat.st_size, stat.st_mtime_ns, prefix)
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}: {err}); the folder is "
                        "incomplete or damaged: copy it again or write it anew") from None


def cache_key(description, length: int = 16) -> str:
    """A short name for a cache entry: the sha256 of `description` as canonical JSON
    (keys sorted; what JSON cannot hold, as its str), its first `length` hex digits."""
    text = (description if isinstance(description, str)
            else json.dumps(description, sort_keys=True, default=str))
    return hashlib.sha256(text.encode()).hexdigest()[:length]
