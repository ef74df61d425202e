"""One listed candidate → the webdataset sample that `writers` stores (`encoded_samples`).

A candidate (`listing.Candidate`) names an image (a file, or bytes embedded in a table), maybe a
caption (a file or the table's text) and a class; encoding reads them, checks them and gives the
sample dict `shards.write_split` takes: `__key__`, the image under its extension (the file's own
bytes or a re-encoding, `images.prepare_image`), `.txt`, `.cls` and the `.json` metadata. As
open_clip's log-and-continue handlers do, a candidate that cannot be used is skipped and counted
in the listing's `BadSampleCounter`, never raised: missing_image, unreadable_file,
not_a_regular_file, too_large, bad_image, missing_caption, empty_caption, non_utf8_text (what each
means: `writers`' docstring, which lists every reason a write reports).
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import multiprocessing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from lit_softmoe.data.images import BadImageError, prepare_image
from lit_softmoe.data.listing import Candidate, is_utf8_text
from lit_softmoe.data.tar_reading import BadSampleCounter

# An input file larger than this is not read (a table row naming /dev/zero, a disk image among
# photos): counted as too_large. 256 MiB is far above any photo or caption.
MAX_INPUT_BYTES = 256 << 20


def _read_file(path: Path, missing: str) -> tuple[bytes | None, str | None]:
    """(the file's bytes, None) or (None, the reason to skip it). Only regular files are read: a
    FIFO would block forever and a device (/dev/zero) never end."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None, missing
    except OSError:  # no permission, a loop of links, an I/O error
        return None, "unreadable_file"
    if not S_ISREG(stat.st_mode):
        return None, "not_a_regular_file"
    if stat.st_size > MAX_INPUT_BYTES:
        return None, "too_large"
    try:
        with open(path, "rb") as file:
            return file.read(MAX_INPUT_BYTES + 1), None
    except OSError:
        return None, "unreadable_file"


def _read_caption(caption: Path | str) -> tuple[str | None, str | None]:
    """(caption text, None) or (None, the reason to skip the sample)."""
    if isinstance(caption, Path):
        raw, problem = _read_file(caption, "missing_caption")
        if problem:
            return None, problem
        try:
            caption = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            return None, "non_utf8_text"
    elif not is_utf8_text(caption):  # a lone surrogate from a JSON escape or a CSV byte
        return None, "non_utf8_text"
    # NFC: the same words typed on two systems tokenize the same; \r\n from Windows editors goes.
    text = unicodedata.normalize("NFC", caption.replace("\r\n", "\n")).strip()
    return (text, None) if text else (None, "empty_caption")


def _read_image_file(image: Path | bytes) -> tuple[bytes | None, str | None]:
    if isinstance(image, bytes):
        return image, None
    return _read_file(image, "missing_image")


def _jsonable(value: Any) -> Any:
    """Extra column values as JSON: bytes (an embedded blob) are summarized, not copied."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None  # JSON has no NaN
    return value


@dataclass
class ImageTally:
    """What encoding did to a write's images: `WriteSummary.normalized` and `.reencoded`."""

    changes: collections.Counter = field(default_factory=collections.Counter)  # {change: images}
    reencoded: int = 0


def encoded_samples(candidates: Iterable[Candidate], image_format: str, max_size: int | None,
                    counter: BadSampleCounter, tally: ImageTally, workers: int = 1,
                    done: Callable[[int], None] | None = None) -> Iterator[dict[str, Any]]:
    """The samples to write for `candidates`, in their order; the skipped ones counted in `counter`,
    the images' changes in `tally`. `image_format` and `max_size`: as in
    `write_options.WriteOptions`.

    `workers` > 1: candidates are read, decoded, resized and encoded in that many processes, a
    window of them at a time (two windows in flight, so memory stays flat however many there are),
    and their results taken back in the candidates' order: the samples, counts and skip messages are
    the ones a single process gives, whatever the number of workers. `done(n)`: called as each
    sample is taken."""
    encode = functools.partial(_encode_candidate, image_format=image_format, max_size=max_size)
    if workers <= 1:
        results: Iterator[_Encoded] = map(encode, candidates)
        yield from _taken(results, counter, tally, done)
        return
    # fork: the workers start at once with the listing's code loaded (spawn would import torch in
    # each).
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(workers) as pool:
        yield from _taken(_in_order(pool, encode, candidates, window=64 * workers),
                          counter, tally, done)


@dataclass(frozen=True)
class _Encoded:
    """One candidate's result, made in a worker and applied in the writing process."""
    sample: dict[str, Any] | None  # None: skipped
    skip: tuple[str, str] | None = None  # (reason, what to show) when skipped
    changes: tuple[str, ...] = ()
    reencoded: bool = False


def _taken(results: Iterable[_Encoded], counter: BadSampleCounter, tally: ImageTally,
           done: Callable[[int], None] | None) -> Iterator[dict[str, Any]]:
    for result in results:
        if done is not None:
            done(1)
        if result.skip is not None:
            counter.skip(*result.skip)
            continue
        tally.changes.update(result.changes)
        tally.reencoded += result.reencoded
        yield result.sample


def _in_order(pool, function: Callable, items: Iterable, window: int) -> Iterator:
    """`function` over `items` in `pool`, results in the items' order; at most two windows of
    `window` items submitted ahead of the one being taken."""
    items = iter(items)
    pending: collections.deque = collections.deque()

    def submit() -> None:
        batch = list(itertools.islice(items, window))
        if batch:
            pending.append(pool.map_async(function, batch, chunksize=max(1, window // 16)))

    submit()
    submit()
    while pending:
        results = pending.popleft().get()
        submit()
        yield from results


def _encode_candidate(candidate: Candidate, image_format: str, max_size: int | None) -> _Encoded:
    """The sample to write for `candidate`, or why it is skipped."""
    caption = None
    if candidate.caption is not None:
        caption, problem = _read_caption(candidate.caption)
        if problem:
            return _Encoded(None, (problem, candidate.source))
    data, problem = _read_image_file(candidate.image)
    if problem:
        return _Encoded(None, (problem, candidate.source))
    try:
        prepared = prepare_image(data, image_format, max_size)
    except BadImageError as exn:
        return _Encoded(None, ("bad_image", f"{candidate.source}: {exn}"))
    width, height = prepared.source_size
    meta = {"key": candidate.key, "path": candidate.source, "width": width, "height": height,
            "file_bytes": len(data), **_jsonable(candidate.meta)}
    sample = {
        "__key__": candidate.key,
        prepared.extension: prepared.data,
        # ASCII-escaped: a lone surrogate in an extra column cannot break the UTF-8 encoding.
        "json": json.dumps(meta, sort_keys=True, default=str).encode("ascii"),
    }
    if caption is not None:
        sample["txt"] = caption.encode("utf-8")
    if candidate.label is not None:
        sample["cls"] = str(candidate.label).encode("ascii")
    return _Encoded(sample, changes=prepared.changes, reencoded=prepared.reencoded)
