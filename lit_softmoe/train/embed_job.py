"""`embed`'s job protocol: how its processes write feature shards into a work folder, meet through
it, and put the finished split in place (the cache's format itself is `data.feature_cache`'s).

Feature shards are written into a work folder beside the split (`.SPLIT.work-<key>`, keyed by the
tower and the sources: `work_folder`), by a thread of their own (`FeatureShardWriter`):
`{index}.tar` and then its record `{index}.json`, so a killed run's finished shards are kept
(`finished_shard`). A process that stops on an error leaves `.error-RANK` (`report_failure`), which
tells the others why; rank 0 waits for every shard (`wait_for_shards`) and puts the split in place
from there whole (`write_feature_split`).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import webdataset as wds

from lit_softmoe.data.feature_cache import EMBED_FILE
from lit_softmoe.data.shards import NSHARDS_FILE, SIZES_FILE
from lit_softmoe.data.tar_reading import BadSampleCounter
from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import replacing, write_folder_atomically, write_text_atomic
from lit_softmoe.utils.hashing import cache_key, file_sha256


def work_folder(out_dir: Path, split: str, wanted: dict) -> Path:
    """Where a split's feature shards are written until all are there, keyed by `wanted` (the tower
    and the source files): a killed run's finished shards are kept there for a rerun of the same."""
    work_key = cache_key(wanted)
    return out_dir / f".{split}.work-{work_key}"


def remove_leftovers(out_dir: Path, split: str, keep: Path) -> None:
    # A run killed mid-write leaves its temporary split folder (write_folder_atomically's naming),
    # and the work folder of a run of another tower or other sources, which will never be resumed.
    for leftover in [*out_dir.glob(f".{split}.tmp-*"), *out_dir.glob(f".{split}.work-*")]:
        if leftover != keep:
            shutil.rmtree(leftover, ignore_errors=True)


# ------------------------------------------------------------------------------ feature shards

def write_feature_shard(work_dir: Path, index: int, samples: list[dict], record: dict) -> dict:
    """Write one feature shard and then its record ({index}.json: counts, bytes, sha256), each
    atomically.

    The record is written last: a shard counts as finished (a rerun skips it) only once both exist.
    The same samples give the same bytes (fixed mtime, owner and mode, as `shards.write_split`).
    """
    tar_path = work_dir / f"{index}.tar"
    with replacing(tar_path) as temporary:
        with open(temporary, "wb") as stream, wds.TarWriter(stream, user="lit-softmoe",
                                                            group="lit-softmoe", mode=0o644,
                                                            mtime=0) as writer:
            for sample in samples:
                writer.write(sample)
    record = {**record, "num_samples": len(samples), "bytes": tar_path.stat().st_size,
              "sha256": file_sha256(tar_path)}
    write_text_atomic(work_dir / f"{index}.json", json.dumps(record) + "\n")
    return record


class FeatureShardWriter:
    """Feature shards written by a thread of their own (`write_feature_shard`: tar, sha256, fsync)
    while the caller goes on embedding, in the order they are handed over; each written shard's
    record is appended to `finished`, oldest first. A failed write (a full disk) is raised by the
    next `write`, or on leaving the `with` block, which waits for every write; leaving it on an
    error waits too, keeping no record."""

    def __init__(self, work_dir: Path, finished: list[dict]):
        self.work_dir, self.finished = work_dir, finished
        # Handed to the thread, oldest first, not yet in `finished`.
        self._writes: deque[Future] = deque()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-shard-writer")

    def write(self, index: int, samples: list[dict], record: dict) -> None:
        self._writes.append(self._thread.submit(write_feature_shard, self.work_dir, index, samples,
                                                record))
        self._collect(wait=False)  # a failed write ends the run now, not at the end

    def _collect(self, wait: bool) -> None:
        while self._writes and (wait or self._writes[0].done()):
            self.finished.append(self._writes.popleft().result())

    def __enter__(self) -> FeatureShardWriter:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            if error_type is None:
                self._collect(wait=True)
        finally:
            self._thread.shutdown(wait=True)


def finished_shard(work_dir: Path, index: int) -> dict | None:
    """The record of a feature shard a killed run finished, or None when it must be embedded
    (again)."""
    try:
        record = json.loads((work_dir / f"{index}.json").read_text())
        return record if (work_dir / f"{index}.tar").stat().st_size == record["bytes"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def seen_and_bad(records: Iterable[dict]) -> tuple[int, int, dict[str, int]]:
    """(samples read or lost, samples skipped, skips by reason) over shard records; as the loader
    counts: a damaged shard and the samples it lost count as read."""
    bad: dict[str, int] = {}
    read = 0
    for record in records:
        read += record["read"]
        for reason, count in record["bad"].items():
            bad[reason] = bad.get(reason, 0) + count
    lost_reasons = (*BadSampleCounter.SHARD_REASONS, "missing_samples")
    lost = sum(bad.get(reason, 0) for reason in lost_reasons)
    by_reason = {reason: count for reason, count in sorted(bad.items()) if count}
    return read + lost, sum(bad.values()), by_reason


# ------------------------------------------------------------------------------ the processes

def report_failure(work_dir: Path, rank: int, message: str) -> None:
    """Leave `.error-RANK` in the work folder: it ends the other processes' `wait_for_shards` with
    `message`."""
    write_text_atomic(work_dir / f".error-{rank}", f"{message}\n")


def clear_failure(work_dir: Path, rank: int) -> None:
    (work_dir / f".error-{rank}").unlink(missing_ok=True)


def wait_for_shards(work_dir: Path, num_shards: int, started: float,
                    waiting: Callable[[int], None] = lambda found: None) -> list[dict]:
    """The records of all `num_shards` feature shards, once the other processes have written theirs.

    Through the file system, not a collective: processes that finish their shards early would
    otherwise sit in a barrier until the process group's timeout (30 minutes) while a slower one
    works. A process that stops on an error leaves `.error-RANK` (`report_failure`) after `started`
    (time.time()), which ends the wait with its message. `waiting(found)` is called before each
    pause.
    """
    # Found so far: a finished shard's record is read once, not at every look.
    records: dict[int, dict] = {}
    # Looked for again after 0.05 s, doubling up to a second: a process a moment behind is not
    # waited for a whole second.
    pause = 0.05
    while True:
        for index in range(num_shards):
            if index not in records and (record := finished_shard(work_dir, index)) is not None:
                records[index] = record
        if len(records) == num_shards:
            return [records[index] for index in range(num_shards)]
        for error in work_dir.glob(".error-*"):
            if error.stat().st_mtime >= started:
                raise UserError(f"another embed process stopped: {error.read_text().strip()}")
        waiting(len(records))
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


# ------------------------------------------------------------------------------ the split in place

def write_feature_split(work_dir: Path, split_dir: Path, records: list[dict], info: dict) -> None:
    """Put the split in place whole from the work folder's shards (`records`, shard by shard): the
    shards, nshards.txt, sizes.json and `info` with each shard's sha256 as embed.json, in one
    rename; then remove the work folder."""
    # The cache's own bytes: a shard damaged or replaced since is refused, not trained on.
    shard_sha256 = {f"{index}.tar": record["sha256"] for index, record in enumerate(records)}
    info = {**info, "shard_sha256": shard_sha256}

    def write(tmp_dir: Path) -> None:
        # Hard links: the work folder stays whole until the split is in place.
        for index in range(len(records)):
            _link_or_copy(work_dir / f"{index}.tar", tmp_dir / f"{index}.tar")
        write_text_atomic(tmp_dir / NSHARDS_FILE, f"{len(records)}\n")
        sizes = {f"{index}.tar": record["num_samples"] for index, record in enumerate(records)}
        write_text_atomic(tmp_dir / SIZES_FILE, json.dumps(sizes, indent=1) + "\n")
        # Last: inside the folder that is renamed into place, so it is never beside partial shards.
        write_text_atomic(tmp_dir / EMBED_FILE, json.dumps(info, indent=1) + "\n")

    write_folder_atomically(split_dir, write)
    shutil.rmtree(work_dir, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)
