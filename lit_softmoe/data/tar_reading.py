"""Reading tar shards: their samples (`tar_samples`), what is bad in them (`BadSampleCounter`), and
how many samples they hold (`listed_sizes`, `count_samples`) or lost (`is_damaged_tar`).

Reading follows open_clip's `get_wds_dataset`: explicit webdataset stages, and a handler that skips
and counts a bad shard instead of ending the run (`BadSampleCounter`); a bad *sample* is skipped and
counted too. The shard layout itself (split folders, nshards.txt, sizes.json) is `data.shards`'.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import webdataset as wds
from webdataset.tariterators import base_plus_ext

from lit_softmoe.data.shards import (
    SIZES_FILE,
    STATS_SUFFIX,
    file_identity,
    is_local_url,
    read_sizes_file,
    shard_urls,
    split_dir_urls,
)
from lit_softmoe.errors import UserError

logger = logging.getLogger(__name__)
# The tar members webdataset skips (tariterators.tar_file_iterator's `skip_meta` and `meta_prefix`).
_WDS_META_MEMBER = re.compile(r"__[^/]*__($|/)")


def listed_sizes(urls: Iterable[str]) -> dict[str, int] | None:
    """{url: samples} of local shards; None if any shard is remote (it cannot be stat'ed or counted
    without streaming it whole).

    Each shard's count comes from the first of: the sizes.json beside it (ours); img2dataset's
    `NNNNN_stats.json` beside `NNNNN.tar` ("successes": the samples the tar holds, failed downloads
    being rows of the .parquet only); else one count of the tar's samples (`count_samples`). The
    listed counts also say when a tar holds fewer samples than it should (`tar_samples`).
    """
    urls = list(urls)
    if not all(is_local_url(url) for url in urls):
        return None
    tables: dict[str, dict | None] = {}
    sizes = {}
    for url in urls:
        folder, name = os.path.split(url)
        if folder not in tables:
            tables[folder] = read_sizes_file(Path(folder) / SIZES_FILE)
        table = tables[folder]
        if table is not None and name in table:
            sizes[url] = int(table[name])
            continue
        listed = img2dataset_successes(url)
        sizes[url] = listed if listed is not None else count_samples(url)
    return sizes


def img2dataset_successes(url: str) -> int | None:
    """"successes" of the `NNNNN_stats.json` img2dataset wrote beside `NNNNN.tar`: the samples of
    the tar. None where there is none, or it does not hold a count (then the tar is counted
    instead)."""
    if not url.endswith(".tar"):
        return None
    path = Path(url[: -len(".tar")] + STATS_SUFFIX)
    if not path.is_file():
        return None
    try:
        successes = json.loads(path.read_text()).get("successes")
    except (OSError, ValueError, AttributeError):
        successes = None
    if isinstance(successes, int) and not isinstance(successes, bool) and successes >= 0:
        return successes
    logger.warning("%s holds no \"successes\" count; counting the samples of %s instead", path, url)
    return None


def count_samples(url: str) -> int:
    """The samples of a local tar as webdataset groups them (consecutive members sharing a key),
    read from its member headers alone (no member's data); those before the damage of a damaged tar.

    Remembered per file identity (path, size, mtime, ctime) for the life of the process: the train
    loader, the eval set and a progress bar each ask, and a rewritten tar is counted again. Not
    written to disk: it is a fallback for tars that list no count (img2dataset writes its
    _stats.json, `write_split` its sizes.json), and their folder may be read-only or shared.
    """
    try:
        identity = file_identity(url)
    except OSError:  # gone or unreadable: the reading pass counts it as a bad shard
        return 0
    return _walk_tar(identity)[0]


def is_damaged_tar(url: str) -> bool:
    """Whether a local tar ends inside a member or a header (cut short, or garbage after its
    members): its readers lose what follows the damage. Read from the member headers alone, as
    `count_samples` (the same walk, remembered per file identity); a file that cannot be read counts
    as damaged."""
    try:
        identity = file_identity(url)
    except OSError:
        return True
    return _walk_tar(identity)[1]


def is_tar_archive(url: str) -> bool:
    """Whether a local file starts as a tar archive does: a first header block whose checksum holds
    (an empty file, a text file or an HTML error page saved under a shard's name does not)."""
    try:
        with open(url, "rb") as stream:
            tarfile.TarInfo.frombuf(stream.read(tarfile.BLOCKSIZE), "utf-8", "surrogateescape")
    except (OSError, tarfile.TarError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _walk_tar(identity: tuple[str, int, int, int]) -> tuple[int, bool]:
    """(samples, damaged) of a local tar, from its member headers."""
    path, size = identity[0], identity[1]
    count, previous, end = 0, None, 0
    try:
        with tarfile.open(path, "r:*") as tar:  # a random-access tar skips each member's data
            for member in tar:
                end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                if not member.isreg() or _WDS_META_MEMBER.match(member.name):
                    continue
                # webdataset's own split: its samples are counted
                key, _ = base_plus_ext(member.name)
                if key is not None and key != previous:
                    count, previous = count + 1, key
    except (tarfile.TarError, OSError, EOFError):
        return count, True  # the samples before the damage
    # tarfile takes a file cut inside a member's data, or inside the next header, for the archive's
    # end.
    return count, end > size or _has_data_after(path, end)


def _has_data_after(path: str, offset: int) -> bool:
    """Whether anything but the end-of-archive zero blocks follows `offset` (a header cut short)."""
    with open(path, "rb") as stream:
        stream.seek(offset)
        while chunk := stream.read(1 << 20):
            if chunk.strip(b"\0"):
                return True
    return False


def tar_samples(url: str, counter: BadSampleCounter, listed: int | None = None,
                select_files: Callable[[str], bool] | None = None) -> Iterator[dict]:
    """The raw samples ({"__key__", "__url__", extension: bytes}) of one tar shard.

    A shard that fails to open or read is counted by `counter.handler` and its samples before the
    damage are kept; one that ends before the `listed` samples of its sizes.json is counted as
    truncated (`BadSampleCounter.shard_ended`). One webdataset tar stage per shard: webdataset ends
    a shard's last sample at an end-of-shard marker that a damaged shard never sends, and the next
    shard's first files would join that sample.
    """
    counter.shard = url  # for the handler's message
    read = 0
    if _is_local_tar(url):
        files = _local_tar_files(url, counter.handler, select_files)
        # webdataset's own grouping
        samples = wds.tariterators.group_by_keys(files, handler=counter.handler)
    else:  # pipe:, http(s), compressed tars: webdataset's opener and stream reader
        samples = wds.tarfile_to_samples(handler=counter.handler,
                                         select_files=select_files)(iter([{"url": url}]))
    for sample in samples:
        read += 1
        yield sample
    counter.shard_ended(url, read, listed)


def _is_local_tar(url: str) -> bool:
    return url.endswith(".tar") and "://" not in url and not url.startswith("pipe:")


def _local_tar_files(url: str, handler: Callable[[Exception], bool],
                     select_files: Callable[[str], bool] | None = None) -> Iterator[dict]:
    """The regular files of a local uncompressed tar as webdataset's tar stage gives them
    ({"fname", "data", "__url__"}, then {} at the end of the shard), read faster
    (scripts/bench_data.py).

    Webdataset reads a tar as a stream (`tarfile` mode "r|*") and copies each member through an
    extract-file object, a cost of the order of decoding and cropping a small JPEG. A local file can
    be read at random instead, each member's bytes taken at its offset (`_member_headers`). A member
    cut short by the file's end, or a header that fails, goes to `handler` with the files before it
    kept, as webdataset's reader does.
    """
    try:
        with open(url, "rb") as stream:
            for name, offset, size in _member_headers(stream):
                if _WDS_META_MEMBER.match(name):
                    continue
                if select_files is not None and not select_files(name):
                    continue
                stream.seek(offset)
                data = stream.read(size)
                if len(data) < size:
                    raise tarfile.ReadError(f"unexpected end of data in {name}")
                yield {"fname": name, "data": data, "__url__": url}
    except (tarfile.TarError, OSError, EOFError) as exn:
        handler(exn)
    yield {}  # the end of the shard: its last sample is complete


def _member_headers(stream) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file of the tar open in `stream`, in order.

    A plain ustar header (what webdataset's and our writers write for every name of up to 100
    characters; 255 with the ustar prefix) is read here, in a few slices: parsed by `tarfile`, such
    a header cost more than decoding the embedding it precedes. At the first header of any other
    kind (pax and GNU long names, links, a bad checksum, the archive's end), `tarfile` reads the
    rest of the file from that header on, as it read all of it before.
    """
    offset = 0
    while True:
        stream.seek(offset)
        header = stream.read(tarfile.BLOCKSIZE)
        member = _plain_member(header)
        if member is None:
            break
        name, size, regular = member
        offset += tarfile.BLOCKSIZE
        if regular:  # tarfile skips the data blocks of files alone (a directory has none)
            yield name, offset, size
            offset += -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    if offset and not header:  # as tarfile checks: the file ends inside the last member's blocks
        stream.seek(offset - 1)
        if not stream.read(1):
            raise tarfile.ReadError("unexpected end of data")
    stream.seek(offset)
    # a TarFile opened here starts reading at the stream's position
    with tarfile.open(fileobj=stream, mode="r:") as tar:
        while (info := tar.next()) is not None:
            tar.members.clear()  # a TarFile keeps every header read; a shard can hold 100,000
            if info.isreg():
                yield info.name, info.offset_data, info.size


_CHECKSUM = slice(148, 156)  # the header's checksum field
# mode, uid, gid, mtime, devmajor, devminor
_OTHER_NUMBERS = (slice(100, 108), slice(108, 116), slice(116, 124), slice(136, 148),
                  slice(329, 337), slice(337, 345))


_LOW_BITS = int.from_bytes(b"\1" * tarfile.BLOCKSIZE, "little")  # bit 0 of every byte
_LARGEST_SUM = 255 * tarfile.BLOCKSIZE  # 130,560: under twice Adler-32's modulus, 65,521


def _is_unsigned_checksum(header: bytes, checksum: int) -> bool:
    """Whether `checksum` is the header's bytes summed, its checksum field counted as 8 spaces
    (256): what every writer but old Sun and NeXT tars records. `sum(header)` takes 2.2 us a
    header, once per member of every shard read; zlib's Adler-32 holds the sum + 1 modulo 65,521 in
    0.2 us, and two sums of 512 bytes that leave the same remainder differ by 65,521, an odd number,
    so the sum's parity (the count of odd bytes) tells them apart. (`tarfile.calc_chksums` also
    computes the signed-char sum those old tars wrote: 4x the time.)"""
    total = checksum - 256 + sum(header[_CHECKSUM])
    if not 0 <= total <= _LARGEST_SUM:
        return False
    odd_bytes = (int.from_bytes(header, "little") & _LOW_BITS).bit_count()
    return zlib.adler32(header) & 0xFFFF == (1 + total) % 65521 and odd_bytes % 2 == total % 2


# The number fields as tarfile, webdataset and GNU tar write them (octal digits, then NUL; the
# checksum 6 digits, NUL, space), from mode to checksum (100-156), and the device numbers (329-345,
# or NULs): one match each reads what tarfile.nti reads field by field (3.9 us a header, 8 calls).
_WRITTEN_NUMBERS = re.compile(rb"(?:[0-7]{7}\0){3}([0-7]{11})\0[0-7]{11}\0([0-7]{6})\0 ")
_WRITTEN_DEVICES = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")


def _plain_member(header: bytes) -> tuple[str, int, bool] | None:
    """(name, size, whether a regular file) of a plain ustar header of a file or a directory, read
    as `TarInfo.frombuf` reads it, minus the TarInfo; None for every other block (tarfile then
    reads it)."""
    kind = header[156:157]
    if len(header) != tarfile.BLOCKSIZE or kind not in (b"0", b"\0", b"5"):
        return None
    written = _WRITTEN_NUMBERS.match(header, 100, 156)
    if written and _WRITTEN_DEVICES.match(header, 329, 345):
        size, checksum = int(written[1], 8), int(written[2], 8)
    else:  # another spelling (spaces, base-256): tarfile's readers, on every number frombuf reads
        try:
            size, checksum = tarfile.nti(header[124:136]), tarfile.nti(header[_CHECKSUM])
            for field in _OTHER_NUMBERS:
                tarfile.nti(header[field])
        except tarfile.InvalidHeaderError:
            return None
    if not _is_unsigned_checksum(header, checksum) and checksum not in tarfile.calc_chksums(header):
        return None
    name = tarfile.nts(header[0:100], tarfile.ENCODING, "surrogateescape")
    prefix = tarfile.nts(header[345:500], tarfile.ENCODING, "surrogateescape")
    regular = kind == b"0" or (kind == b"\0" and not name.endswith("/"))  # V7: a folder ends in /
    return (prefix + "/" + name if prefix else name), size, regular


def first_sample_members(url: str) -> set[str]:
    """The members ("cls", "txt", "png"…) of the first sample of a shard, reading that sample alone:
    what kind of split it is. A shard that cannot be read gives none (the main pass over it counts
    it)."""
    samples = tar_samples(url, _QuietCounter())
    with contextlib.closing(samples):  # the rest of the shard is left unread, its file closed now
        first = next(samples, None)
    return {key for key in first if not key.startswith("__")} if first is not None else set()


def require_class_labels(split: str, setting: str) -> None:
    """One UserError line when the samples of `split` carry no class (`.cls`), judged by its first
    sample (none for an unreadable shard: its reader counts it). `setting` is what the caller calls
    the split."""
    members = first_sample_members(shard_urls(split)[0])
    if members and "cls" not in members:
        raise UserError(f"{setting} {split} holds no class labels (its samples have "
                        f"{', '.join(sorted(members))}, no .cls); point {setting} to a split of "
                        "labelled images or their features, as `lit-softmoe data` and `embed` "
                        f"write them, or unset it ({setting}=)")


def num_samples(split_dir: str | Path) -> int:
    """Number of samples in a split folder: from its sizes.json (`write_split`), img2dataset's
    _stats.json, or a count of its tars (`listed_sizes`)."""
    return sum(listed_sizes(split_dir_urls(Path(split_dir))).values())


class BadSampleCounter:
    """Counts skipped samples and shards by reason; logs the first of each reason only.

    `counts` is a Counter (a reason never seen reads 0). Sample reasons: "missing_image",
    "missing_cls", "bad_image", "bad_cls"…, and "missing_samples": the samples a shard's sizes.json
    lists that the shard no longer holds. Shard reasons (`SHARD_REASONS`), counted once per shard:
    "bad_shard" (a corrupt tar, or one cut inside a member; the samples before the damage are kept),
    "unreadable_shard" (the file cannot be opened) and "truncated_shard" (a tar that ends cleanly
    before the samples its sizes.json lists: cut at a sample boundary).
    """

    SHARD_REASONS = ("bad_shard", "unreadable_shard", "truncated_shard")

    def __init__(self, log: bool = True) -> None:
        # False in all but one of several readers of the same shards (each would warn alike)
        self.log = log
        self.counts: collections.Counter[str] = collections.Counter()
        self.shard: str | None = None  # the shard being read, set by `tar_samples`
        self._bad_shards: set[tuple[str, str | None]] = set()

    def skip(self, reason: str, detail: str, count: int = 1) -> None:
        if self.counts[reason] == 0 and self.log:
            logger.warning("skipping %s: %s (further ones are counted, not logged)", reason, detail)
        self.counts[reason] += count

    def handler(self, exn: Exception) -> bool:
        """Webdataset handler for a shard that fails to open or read: count it, go on.

        Webdataset may report one truncated tar twice (once per member read, once from the
        stream), so a shard is counted once per reason.
        """
        reason = "unreadable_shard" if isinstance(exn, OSError) else "bad_shard"
        if (reason, self.shard) not in self._bad_shards:
            self._bad_shards.add((reason, self.shard))
            first_arg = exn.args[0] if exn.args else ""
            self.skip(reason, f"{self.shard}: {type(exn).__name__}: {first_arg}")
        return True

    def shard_ended(self, url: str, read: int, listed: int | None) -> None:
        """A shard read to its end gave `read` samples where its sizes.json lists `listed`: count
        what is missing. A tar cut at a sample boundary reads as a complete, shorter archive;
        without this, a third of a split read as the whole of it."""
        if listed is None or read >= listed:
            return
        where = f"{url}: {read} of the {listed} samples its {SIZES_FILE} lists"
        if not any(shard == url for _, shard in self._bad_shards):  # a damaged tar is counted once
            self._bad_shards.add(("truncated_shard", url))
            self.skip("truncated_shard", where)
        self.skip("missing_samples", where, count=listed - read)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __repr__(self) -> str:
        return f"BadSampleCounter({dict(self.counts)})"


class _QuietCounter(BadSampleCounter):
    """Counts and logs nothing: for a side pass whose shards the main pass counts."""

    def skip(self, reason: str, detail: str, count: int = 1) -> None:
        pass
