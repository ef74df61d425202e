"""What a source of samples lists before any file is read: candidates with their keys, the problems
found listing them, and a fingerprint of the inputs. Folders (`data.folders`) and tables
(`data.tables`) produce a `Listing`; `data.writers` writes it as shards."""
from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from lit_softmoe.data.tar_reading import BadSampleCounter

# \w is Unicode-aware: 日本語.jpg keeps its own key (ASCII-only keys turned every such name
# into "_").
_UNSAFE_KEY_CHARACTERS = re.compile(r"[^\w-]+")


@dataclass(slots=True)
class Candidate:
    """One sample as the source names it, before its files are read (slots: a listing holds one per
    sample, so each costs as little as it can)."""

    key: str
    source: str                    # the image as the source names it (a relative path): for .json
                                   # and messages
    image: Path | bytes            # a file to read, or bytes embedded in a table
    caption: Path | str | None     # a caption file, the caption, or None where no caption is wanted
    label: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # more .json fields: "class", "extra"


@dataclass
class Listing:
    """A source's candidates in write order, the problems found listing them, and its identity.
    Labelled sources (with `classnames`) are in `in_shuffled_order`, others in the source's
    order."""

    candidates: list[Candidate]
    counter: BadSampleCounter
    fingerprint: str               # sha256 over the name, size and mtime of every input file
    classnames: list[str] | None = None
    # the `{c}` templates captions were written from (classes layout)
    templates: list[str] | None = None
    # one line on where the class names came from, where not the obvious place
    classnames_note: str | None = None


def sample_key(path: str | PurePosixPath) -> str:
    """A webdataset key from a relative path without its extension: `a b/x.y` → `a_b/x_y`.

    Parts keep their `/` (a key may name folders), `.` and `..` are dropped, and any run of
    characters other than letters, digits (in any script), `_` and `-` becomes `_` (a dot would
    end the key). Names are NFC-normalized first: macOS stores `é` as `e` + a combining accent.
    """
    parts = [part for part in PurePosixPath(path).parts if part not in (".", "..", "/")]
    return "/".join(_UNSAFE_KEY_CHARACTERS.sub("_", unicodedata.normalize("NFC", part))
                    for part in parts)


def drop_duplicate_keys(candidates: Iterable[Candidate],
                        counter: BadSampleCounter) -> list[Candidate]:
    """The first candidate of each key, in order; later ones are counted as duplicate_key."""
    kept: dict[str, Candidate] = {}
    for candidate in candidates:
        if not candidate.key:
            counter.skip("missing_key", candidate.source)
        elif candidate.key in kept:
            counter.skip("duplicate_key", f"{candidate.source} has the key {candidate.key!r} of "
                                          f"{kept[candidate.key].source}")
        else:
            kept[candidate.key] = candidate
    return list(kept.values())


# Labelled sources list one class after another (folders in path order, tables often sorted by
# class). Written so, each shard holds one or two classes, and a loader's shard shuffle plus a
# shuffle buffer of a few thousand samples cannot mix them again: a training batch sees a few
# classes (pretraining streamed from such shards lost 4 points of top-1 on Fashion-MNIST). So they
# are written in a seeded random order, as ImageNet shard writers do; the seed is fixed, so a rerun
# writes the same shards.
WRITE_ORDER_SEED = 0


def in_shuffled_order(candidates: list[Candidate], seed: int = WRITE_ORDER_SEED) -> list[Candidate]:
    """`candidates` in a random order fixed by `seed` (the same on every machine and Python)."""
    shuffled = list(candidates)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def is_utf8_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def files_fingerprint(files: Iterable[tuple[str, Path]]) -> str:
    """A hash of each (name, file)'s name, size and mtime: a changed input means a rewrite."""
    digest = hashlib.sha256()
    for name, path in files:
        try:
            stat = path.stat()
            identity = [name, stat.st_size, stat.st_mtime_ns]
        except OSError:  # a missing image is part of the input's identity too
            identity = [name, None, None]
        digest.update(json.dumps(identity).encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()
