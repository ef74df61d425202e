"""Folders and tables of images → webdataset shards (`lit-softmoe data from-folder|from-table`).

Sources:
- a folder of images with a same-stem `.txt` caption beside each (img2dataset's output,
  `00000/000000001.jpg` + `00000/000000001.txt`; Tux Paint's saved drawings);
- a folder of class subfolders (torchvision's ImageFolder: `cat/1.jpg`, `dog/1.jpg`): writes `.cls`
  and `classnames.txt`, classes numbered in sorted folder-name order as ImageFolder numbers them;
- a table (CSV, TSV, JSONL, Parquet) with an image column (paths relative to the table, or bytes
  embedded as img2dataset's and Hugging Face datasets' Parquet files hold them) and a caption column;
  its other columns go to each sample's `.json`.

Output is shards.py's layout, written by `write_split` (rollover by sample count and by bytes, atomic
shards, fixed tar headers): `DIR/{split}/0.tar … N-1.tar`, `nshards.txt`, `sizes.json`. A sample
keeps its source's key (a file stem, as img2dataset's keys are) and holds the image, `.txt` and/or
`.cls`, and `.json` {"key", "path", "width", "height", "file_bytes", ["class"], ["extra"]}.

Bad input never ends a run (open_clip's log-and-continue handlers): a sample with a missing or
broken image, an empty or non-UTF-8 caption or a key already taken is skipped and counted by
reason; an image in RGBA, LA, P, 16-bit, CMYK or another mode is normalized to L or RGB and
counted. An image file's own bytes are kept when they are already in the requested format and need
no change; otherwise they are re-encoded with fixed settings and no metadata, so equal inputs give
byte-identical shards. A `manifest.json` in the split folder records the arguments, a fingerprint
of the inputs (name, size and mtime of every file read) and, written last, the summary: rerunning a
finished command writes nothing, and rerunning an interrupted one rewrites the same bytes. A split
that holds anything else (another source's shards, Fashion-MNIST) is refused unless `overwrite`.

Reasons a sample is skipped: missing_image, unreadable_image, bad_image (does not decode),
remote_image (a URL in a table), missing_caption, empty_caption, non_utf8_text, bad_caption (not a
string), bad_row (a malformed table line), duplicate_key, missing_key, outside_class_folder.
Changes counted among the re-encoded images: see `normalize_image`.
"""
from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import logging
import os
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import PIL.Image
from tqdm import tqdm

from lit_softmoe.data.images import l_or_rgb, upright
from lit_softmoe.data.shards import (CLASSNAMES_FILE, NSHARDS_FILE, SIZES_FILE, BadSampleCounter, splits_beside,
                                     write_split, write_text_atomic)
from lit_softmoe.errors import UserError, check_writable

logger = logging.getLogger(__name__)

IMAGE_FORMATS = ("keep", "jpg", "png", "webp")
LAYOUTS = ("auto", "captions", "classes")
# Files read as images; anything else in a folder (img2dataset's .json, a README) is not a sample.
SOURCE_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TABLE_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl",
                  ".parquet": "parquet"}
MANIFEST_FILE = "manifest.json"
# Beside the splits, describing them all (CLIP_benchmark's files; `data fashion-mnist`'s manifest).
DATASET_FILES = (CLASSNAMES_FILE, "zeroshot_classification_templates.txt", "dataset_type.txt", MANIFEST_FILE)
_FORMAT_VERSION = 2  # bump when the shard content changes, so old splits get rewritten (2: non-ASCII keys)
# PIL format → the extension readers know; a format not listed (BMP, GIF, TIFF) is re-encoded.
_KEPT_FORMATS = {"PNG": "png", "JPEG": "jpg", "MPO": "jpg", "WEBP": "webp"}
# Fixed encoder settings: equal pixels give equal bytes (PIL writes no timestamps).
_ENCODERS = {
    "png": ("PNG", {"compress_level": 6, "optimize": False}),
    "jpg": ("JPEG", {"quality": 95, "subsampling": "4:2:0", "optimize": False, "progressive": False}),
    "webp": ("WEBP", {"quality": 90, "method": 4, "lossless": False}),
}
# \w is Unicode-aware: 日本語.jpg keeps its own key (ASCII-only keys turned every such name into "_").
_UNSAFE_KEY_CHARACTERS = re.compile(r"[^\w-]+")


# ---------------------------------------------------------------------------------------- options

@dataclass(frozen=True)
class WriteOptions:
    """How a split is written; the same for folders and tables.

    Args:
        split: the split folder's name under the output folder, e.g. "train" or "test".
        image_format: "keep" (the file's own format: png, jpg or webp; others become png), or the
            format every image is stored in.
        max_size: shrink images whose longer side is larger to this many pixels (None: never).
        samples_per_shard: a new shard starts after this many samples …
        max_shard_bytes: … or once a shard holds this many bytes.
    """

    split: str = "train"
    image_format: str = "keep"
    max_size: int | None = None
    samples_per_shard: int = 10_000
    max_shard_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.image_format not in IMAGE_FORMATS:
            raise UserError(f"unknown image format {self.image_format!r}; "
                            f"choose one of {', '.join(IMAGE_FORMATS)}")
        if not self.split or self.split != Path(self.split).name or self.split.startswith("."):
            raise UserError(f"split {self.split!r} is not a plain folder name; pass e.g. --split train")
        for name in ("max_size", "samples_per_shard", "max_shard_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name.replace('_', '-')} must be at least 1, got {value}")


def parse_byte_size(text: str) -> int:
    """`"1G"`, `"500M"`, `"64k"` or a plain number of bytes → bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if match is None:
        raise UserError(f"cannot read {text!r} as a size in bytes; write e.g. 1G, 500M or 1048576")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


# ---------------------------------------------------------------------------------------- summary

@dataclass
class WriteSummary:
    """What a write did; `line()` is what the CLI prints."""

    split_dir: str
    sizes: dict[str, int]          # sizes.json: {shard: samples}
    skipped: dict[str, int]        # {reason: samples skipped}
    normalized: dict[str, int]     # {change: images changed}
    reencoded: int                 # images stored in other bytes than their file's own
    shard_bytes: dict[str, int] = field(default_factory=dict)  # {shard: file size}, for the rerun check
    already_complete: bool = False
    seconds: float = 0.0

    @property
    def samples(self) -> int:
        return sum(self.sizes.values())

    @property
    def shards(self) -> int:
        return len(self.sizes)

    def line(self) -> str:
        shards = f"{self.shards} shard{'' if self.shards == 1 else 's'}"
        if self.already_complete:
            head = f"{self.split_dir} already holds these {self.samples} samples in {shards}; nothing written"
        else:
            head = f"written {self.samples} samples in {shards} to {self.split_dir}"
        parts = [head]
        if self.reencoded:
            parts.append(f"{self.reencoded} images re-encoded{_reasons(self.normalized)}")
        parts.append(f"skipped {sum(self.skipped.values())}{_reasons(self.skipped)}")
        return "; ".join(parts)


def _reasons(counts: dict[str, int]) -> str:
    listed = ", ".join(f"{reason} {count}" for reason, count in sorted(counts.items()) if count)
    return f" ({listed})" if listed else ""


# ---------------------------------------------------------------------------------------- images

class BadImageError(Exception):
    """An image file that does not decode (truncated, not an image, unsupported)."""


@dataclass(frozen=True)
class PreparedImage:
    extension: str              # "png", "jpg" or "webp": the sample's image field
    data: bytes
    source_size: tuple[int, int]  # (width, height) of the file, before any change
    changes: tuple[str, ...]    # normalizations applied, e.g. ("alpha", "resized")
    reencoded: bool             # False: `data` is the file's own bytes


def prepare_image(data: bytes, image_format: str = "keep", max_size: int | None = None) -> PreparedImage:
    """Decode an image file's bytes fully, normalize it, and give the bytes to store.

    The file's own bytes are kept when its format is the one asked for (or `keep` and it is png,
    jpg or webp) and `normalize_image` changes nothing; otherwise the normalized image is encoded.
    Raises BadImageError for a file that does not decode, truncated ones included.
    """
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()  # decodes every pixel: a truncated file fails here, not in a training run
        source_extension = _KEPT_FORMATS.get(image.format or "")
        source_size = image.size
        image, changes = normalize_image(image, max_size)
        target = (source_extension or "png") if image_format == "keep" else image_format
        if not changes and target == source_extension:
            return PreparedImage(target, data, source_size, (), reencoded=False)
        return PreparedImage(target, encode_image(image, target), source_size, changes, reencoded=True)
    except PIL.UnidentifiedImageError as exn:
        raise BadImageError("not an image file PIL can read") from exn
    except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError, struct.error… for broken files
        raise BadImageError(f"{type(exn).__name__}: {exn}") from exn


def normalize_image(image: PIL.Image.Image,
                    max_size: int | None = None) -> tuple[PIL.Image.Image, tuple[str, ...]]:
    """Turn `image` upright, into mode L or RGB, and no larger than `max_size`; name each change.

    Changes: "exif_rotated" (an EXIF orientation other than upright is applied: re-encoding drops
    the tag that told viewers to rotate), the mode changes of `images.l_or_rgb` ("alpha",
    "palette", "16bit", "cmyk", "other_mode"), "resized". The conversion is the one training,
    eval and inference apply to raw images (`transforms.to_l_or_rgb`), so shards hold what a
    model later sees.
    """
    changes = []
    rotated = upright(image)
    if rotated is not image:
        image = rotated
        changes.append("exif_rotated")
    image, mode_change = l_or_rgb(image)
    if mode_change:
        changes.append(mode_change)
    if max_size is not None and max(image.size) > max_size:
        image = _shrink(image, max_size)
        changes.append("resized")
    return image, tuple(changes)


def _shrink(image: PIL.Image.Image, max_size: int) -> PIL.Image.Image:
    width, height = image.size
    scale = max_size / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return image.resize(size, PIL.Image.Resampling.LANCZOS)


def encode_image(image: PIL.Image.Image, extension: str) -> bytes:
    """`image` (mode L or RGB) as png / jpg / webp bytes, with fixed settings and no metadata."""
    pil_format, settings = _ENCODERS[extension]
    # Some encoders copy an ICC profile or EXIF from `info`; a converted image would then carry a
    # profile for colors it no longer has.
    image.info = {}
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **settings)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------- samples

@dataclass
class Candidate:
    """One sample as the source names it, before its files are read."""

    key: str
    source: str                    # the image as the source names it (a relative path): for .json and messages
    image: Path | bytes            # a file to read, or bytes embedded in a table
    caption: Path | str | None     # a caption file, the caption, or None where no caption is wanted
    label: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # more .json fields: "class", "extra"


@dataclass
class Listing:
    """A source's candidates in write order, the problems found listing them, and its identity."""

    candidates: list[Candidate]
    counter: BadSampleCounter
    fingerprint: str               # sha256 over the name, size and mtime of every input file
    classnames: list[str] | None = None


def sample_key(path: str | PurePosixPath) -> str:
    """A webdataset key from a relative path without its extension: `a b/x.y` → `a_b/x_y`.

    Parts keep their `/` (a key may name folders), `.` and `..` are dropped, and any run of
    characters other than letters, digits (in any script), `_` and `-` becomes `_` (a dot would
    end the key). Names are NFC-normalized first: macOS stores `é` as `e` + a combining accent.
    """
    parts = [part for part in PurePosixPath(path).parts if part not in (".", "..", "/")]
    return "/".join(_UNSAFE_KEY_CHARACTERS.sub("_", unicodedata.normalize("NFC", part)) for part in parts)


def _drop_duplicate_keys(candidates: Iterable[Candidate], counter: BadSampleCounter) -> list[Candidate]:
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


def _read_caption(caption: Path | str) -> tuple[str | None, str | None]:
    """(caption text, None) or (None, the reason to skip the sample)."""
    if isinstance(caption, Path):
        try:
            raw = caption.read_bytes()
        except OSError:
            return None, "missing_caption"
        try:
            caption = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            return None, "non_utf8_text"
    elif not _is_utf8_text(caption):  # a lone surrogate from a JSON escape or a CSV byte
        return None, "non_utf8_text"
    # NFC: the same words typed on two systems tokenize the same; \r\n from Windows editors goes.
    text = unicodedata.normalize("NFC", caption.replace("\r\n", "\n")).strip()
    return (text, None) if text else (None, "empty_caption")


def _is_utf8_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _read_image_file(image: Path | bytes) -> tuple[bytes | None, str | None]:
    if isinstance(image, bytes):
        return image, None
    try:
        return image.read_bytes(), None
    except FileNotFoundError:
        return None, "missing_image"
    except OSError:  # a folder, no permission, an I/O error
        return None, "unreadable_image"


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
class _ImageTally:
    changes: collections.Counter = field(default_factory=collections.Counter)  # {change: images}
    reencoded: int = 0


def _encoded_samples(candidates: Iterable[Candidate], options: WriteOptions, counter: BadSampleCounter,
                     tally: _ImageTally) -> Iterator[dict[str, Any]]:
    for candidate in candidates:
        sample = _encode_sample(candidate, options, counter, tally)
        if sample is not None:
            yield sample


def _encode_sample(candidate: Candidate, options: WriteOptions, counter: BadSampleCounter,
                   tally: _ImageTally) -> dict[str, Any] | None:
    """The sample to write for `candidate`, or None after counting why it is skipped."""
    caption = None
    if candidate.caption is not None:
        caption, problem = _read_caption(candidate.caption)
        if problem:
            counter.skip(problem, candidate.source)
            return None
    data, problem = _read_image_file(candidate.image)
    if problem:
        counter.skip(problem, candidate.source)
        return None
    try:
        prepared = prepare_image(data, options.image_format, options.max_size)
    except BadImageError as exn:
        counter.skip("bad_image", f"{candidate.source}: {exn}")
        return None
    tally.changes.update(prepared.changes)
    tally.reencoded += prepared.reencoded
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
    return sample


# ---------------------------------------------------------------------------------------- folders

def _walk_files(src: Path, exclude: Path | None) -> list[PurePosixPath]:
    """Every non-hidden file under `src` as a relative path, sorted by path parts (not by string:
    `a/x` comes before `a-b/y`, as a tree listing shows them).

    Linked folders are followed, as ImageFolder follows them (a class folder is often a link into a
    bigger dataset; skipping it dropped its images uncounted and renumbered the other classes); a
    link to a folder already on its own path would loop, so it is not entered.
    """
    found = []
    on_path = {src: {src.resolve()}}  # folder → the real folders from `src` down to it
    for root, dirs, files in os.walk(src, followlinks=True):
        root_path = Path(root)
        above = on_path.pop(root_path)
        kept = []
        for name in dirs:
            real = (root_path / name).resolve()
            if not name.startswith(".") and real != exclude and real not in above:
                on_path[root_path / name] = above | {real}
                kept.append(name)
        dirs[:] = kept
        relative_root = PurePosixPath(root_path.relative_to(src).as_posix())
        found.extend(relative_root / name for name in files if not name.startswith("."))
    return sorted(found, key=lambda path: path.parts)


def _fingerprint(files: Iterable[tuple[str, Path]]) -> str:
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


def _detect_layout(src: Path, images: list[PurePosixPath], caption_stems: set[PurePosixPath]) -> str:
    if any(image.with_suffix("") in caption_stems for image in images):
        return "captions"
    if any(len(image.parts) > 1 for image in images):
        return "classes"
    raise UserError(f"{src} holds {len(images)} images but no .txt caption beside any (x.jpg + x.txt) and no "
                    "class subfolders; add captions, sort the images into one folder per class, or use "
                    "`lit-softmoe data from-table` with a caption column")


def list_folder(src: str | Path, layout: str = "auto", exclude: str | Path | None = None) -> Listing:
    """The samples of a folder in path order; `layout` is "captions", "classes" or "auto".

    Captions layout: the key is the file stem (img2dataset's numbered subfolders only bucket
    unique keys), so the same stem in two subfolders is a duplicate_key; an image with no caption
    is missing_caption, a caption with no image is missing_image. Classes layout: the key is the
    path from the class folder down, so `cat/1.jpg` and `dog/1.jpg` are both kept; images lying
    beside the class folders are outside_class_folder.
    """
    src = Path(src)
    if not src.exists():
        raise UserError(f"source folder {src} not found; pass a folder of images")
    if not src.is_dir():
        raise UserError(f"{src} is not a folder; for a table use `lit-softmoe data from-table {src} …`")
    if layout not in LAYOUTS:
        raise UserError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    # The output folder may lie inside the source: its files are not inputs.
    exclude = Path(exclude).resolve() if exclude is not None else None
    files = _walk_files(src, exclude)  # compared to real paths: the output may lie behind a link
    images = [path for path in files if path.suffix.lower() in SOURCE_IMAGE_SUFFIXES]
    captions = {path.with_suffix(""): path for path in files if path.suffix.lower() == ".txt"}
    if not images:
        raise UserError(f"no image files ({', '.join(SOURCE_IMAGE_SUFFIXES)}) in {src}; "
                        "pass the folder holding them")
    if layout == "auto":
        layout = _detect_layout(src, images, set(captions))
    counter = BadSampleCounter()
    if layout == "captions":
        candidates, classnames = _caption_candidates(src, images, captions, counter), None
    else:
        # From the images, not the listing of `src`: an excluded output folder is not a class.
        classnames = sorted({image.parts[0] for image in images if len(image.parts) > 1})
        candidates = _class_candidates(src, images, classnames, counter)
    read = images + (list(captions.values()) if layout == "captions" else [])
    fingerprint = _fingerprint((str(path), src / path) for path in read)
    return Listing(_drop_duplicate_keys(candidates, counter), counter, fingerprint, classnames)


def _caption_candidates(src: Path, images: list[PurePosixPath], captions: dict[PurePosixPath, PurePosixPath],
                        counter: BadSampleCounter) -> list[Candidate]:
    candidates, captioned = [], set()
    for image in images:
        caption = captions.get(image.with_suffix(""))
        if caption is None:
            counter.skip("missing_caption", f"{image} has no {image.with_suffix('.txt').name} beside it")
            continue
        captioned.add(caption)
        candidates.append(Candidate(sample_key(image.stem), str(image), src / image, src / caption))
    for caption in captions.values():
        if caption not in captioned:
            counter.skip("missing_image", f"{caption} has no image beside it")
    return candidates


def _class_candidates(src: Path, images: list[PurePosixPath], classnames: list[str],
                      counter: BadSampleCounter) -> list[Candidate]:
    label_of = {name: label for label, name in enumerate(classnames)}
    candidates = []
    for image in images:
        if len(image.parts) == 1:
            counter.skip("outside_class_folder", f"{image} lies beside the class folders, not in one")
            continue
        classname = image.parts[0]
        candidates.append(Candidate(sample_key(image.with_suffix("")), str(image), src / image, None,
                                    label=label_of[classname], meta={"class": classname}))
    return candidates


# ---------------------------------------------------------------------------------------- tables

def _table_kind(table: Path) -> str:
    kind = TABLE_SUFFIXES.get(table.suffix.lower())
    if kind is None:
        raise UserError(f"cannot tell the format of {table} from its extension; name it .csv, .tsv, "
                        ".jsonl or .parquet")
    return kind


def _csv_rows(table: Path, delimiter: str, counter: BadSampleCounter) -> tuple[list[str], Iterator[dict]]:
    def open_table():
        # surrogateescape: a non-UTF-8 byte spoils its row only, which is then counted and skipped.
        return open(table, encoding="utf-8-sig", errors="surrogateescape", newline="")

    with open_table() as file:
        header = next(csv.reader(file, delimiter=delimiter), None)
    if not header:
        raise UserError(f"{table} has no header row; its first line must name the columns")

    def rows() -> Iterator[dict]:
        with open_table() as file:
            reader = csv.reader(file, delimiter=delimiter)
            next(reader)  # the header
            while True:
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as exn:
                    counter.skip("bad_row", f"{table} line {reader.line_num}: {exn}")
                    continue
                if not cells:
                    continue  # a blank line
                if len(cells) != len(header):
                    counter.skip("bad_row", f"{table} line {reader.line_num}: {len(cells)} fields, the header "
                                            f"has {len(header)}")
                elif not all(_is_utf8_text(cell) for cell in cells):
                    counter.skip("non_utf8_text", f"{table} line {reader.line_num}")
                else:
                    yield dict(zip(header, cells))

    return header, rows()


def _jsonl_rows(table: Path, counter: BadSampleCounter) -> tuple[None, Iterator[dict]]:
    def rows() -> Iterator[dict]:
        with open(table, "rb") as file:
            for line_number, raw in enumerate(file, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8-sig"))
                except UnicodeDecodeError:
                    counter.skip("non_utf8_text", f"{table} line {line_number}")
                    continue
                except ValueError as exn:
                    counter.skip("bad_row", f"{table} line {line_number}: {exn}")
                    continue
                if isinstance(row, dict):
                    yield row
                else:
                    counter.skip("bad_row", f"{table} line {line_number}: a {type(row).__name__}, not an object")

    return None, rows()  # JSONL has no header: the columns are checked after reading


def _parquet_rows(table: Path) -> tuple[list[str], Iterator[dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {table} needs pyarrow: pip install pyarrow") from None
    try:
        file = pq.ParquetFile(table)
    except Exception as exn:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet
        raise UserError(f"{table} is not a readable Parquet file ({exn}); check the file") from None

    def rows() -> Iterator[dict]:
        for batch in file.iter_batches(batch_size=1024):
            yield from batch.to_pylist()

    return file.schema_arrow.names, rows()


def _require_columns(table: Path, columns: Iterable[str], needed: dict[str, str]) -> None:
    columns = list(columns)
    for option, column in needed.items():
        if column not in columns:
            listed = ", ".join(map(str, columns)) or "none"
            raise UserError(f"{table} has no column {column!r} (its columns: {listed}); "
                            f"pass {option} with one of them")


def _table_image(cell: Any, table_dir: Path) -> tuple[Path | bytes | None, str, str | None]:
    """(image file or bytes, the name the table gives it, a reason to skip or None)."""
    data, name = None, None
    if isinstance(cell, dict):  # Hugging Face datasets' Image feature: {"bytes", "path"}
        data, name = cell.get("bytes"), cell.get("path")
    elif isinstance(cell, (bytes, bytearray)):
        data = cell
    elif isinstance(cell, str):
        name = cell
    if data:
        return bytes(data), name or "", None
    if not isinstance(name, str) or not name.strip():
        return None, "", "missing_image"
    name = name.strip()
    if "://" in name:  # downloading is img2dataset's job; its output is a folder this reads
        return None, name, "remote_image"
    path = Path(name)
    return (path if path.is_absolute() else table_dir / path), name, None


def list_table(table: str | Path, image_col: str, caption_col: str, key_col: str | None = None) -> Listing:
    """The rows of a CSV / TSV / JSONL / Parquet table as samples, in row order.

    The key is `key_col`'s value, else the image path without its extension (so two rows naming
    one image are a duplicate_key: give `key_col` to keep several captions per image), else the
    row number for embedded bytes. Columns other than these go to `.json` as "extra".
    """
    table = Path(table)
    if table.is_dir():
        raise UserError(f"{table} is a folder; `data from-table` reads one .csv, .tsv, .jsonl or .parquet file "
                        "(for a folder of images with .txt captions or class subfolders, use `data from-folder`)")
    if not table.is_file():
        raise UserError(f"table {table} not found; pass a .csv, .tsv, .jsonl or .parquet file")
    kind = _table_kind(table)
    counter = BadSampleCounter()
    needed = {"--image-col": image_col, "--caption-col": caption_col}
    if key_col:
        needed["--key-col"] = key_col
    if kind == "parquet":
        columns, rows = _parquet_rows(table)
    elif kind == "jsonl":
        columns, rows = _jsonl_rows(table, counter)
    else:
        columns, rows = _csv_rows(table, "," if kind == "csv" else "\t", counter)
    if columns is not None:
        _require_columns(table, columns, needed)

    candidates, seen_columns = [], {}
    for index, row in enumerate(rows):
        seen_columns.update(dict.fromkeys(row))
        candidate = _table_candidate(row, index, table, image_col, caption_col, key_col, counter)
        if candidate is not None:
            candidates.append(candidate)
    if columns is None and seen_columns:
        _require_columns(table, seen_columns, needed)
    if not seen_columns and not counter.total:
        raise UserError(f"{table} holds no rows; pass a table with one row per image")
    image_files = [(c.source, c.image) for c in candidates if isinstance(c.image, Path)]
    fingerprint = _fingerprint([(table.name, table), *image_files])
    return Listing(_drop_duplicate_keys(candidates, counter), counter, fingerprint)


def _table_candidate(row: dict, index: int, table: Path, image_col: str, caption_col: str, key_col: str | None,
                     counter: BadSampleCounter) -> Candidate | None:
    """The candidate of one row, or None after counting why the row is skipped."""
    image, name, problem = _table_image(row.get(image_col), table.parent)
    caption = row.get(caption_col)
    if caption is None:
        caption = ""  # counted as empty_caption when written, like a blank cell
    elif not isinstance(caption, str) and not problem:
        problem = "bad_caption"  # a number or a list where a caption belongs
    if problem:
        counter.skip(problem, f"{table} row {index}: {name}")
        return None
    if key_col:
        value = row.get(key_col)
        key = sample_key(str(value).replace("/", "_")) if value is not None else ""
    elif name:
        key = sample_key(re.sub(r"\.[^./]*$", "", name))  # the path without its extension
    else:
        key = f"row{index:07d}"
    extra = {column: value for column, value in row.items() if column not in (image_col, caption_col, key_col)}
    return Candidate(key, name or f"row {index}", image, caption, meta={"extra": extra} if extra else {})


# ---------------------------------------------------------------------------------------- writing

def write_folder_shards(src: str | Path, out_dir: str | Path, options: WriteOptions = WriteOptions(),
                        layout: str = "auto", progress: bool = False, overwrite: bool = False) -> WriteSummary:
    """Write a folder of captioned images or of class subfolders as `out_dir/{split}/` shards.

    The classes layout also writes `out_dir/classnames.txt`. See `list_folder` for the layouts
    and keys, and the module docstring for what is skipped, normalized and rewritten. A split
    holding other data is refused unless `overwrite` (see `_write_listing`).
    """
    # With --out SRC itself, the split folder written into it is what must not be read back.
    exclude = Path(out_dir) / options.split if Path(out_dir).resolve() == Path(src).resolve() else out_dir
    listing = list_folder(src, layout, exclude=exclude)
    arguments = {"source": "folder", "path": str(Path(src).resolve()), "layout": layout}
    return _write_listing(listing, Path(out_dir), options, arguments, progress, str(src), overwrite)


def write_table_shards(table: str | Path, out_dir: str | Path, image_col: str, caption_col: str,
                       options: WriteOptions = WriteOptions(), key_col: str | None = None,
                       progress: bool = False, overwrite: bool = False) -> WriteSummary:
    """Write the rows of a CSV / TSV / JSONL / Parquet table as `out_dir/{split}/` shards.

    Image paths are relative to the table's folder (or absolute); see `list_table` for keys and
    extra columns. A split holding other data is refused unless `overwrite`.
    """
    listing = list_table(table, image_col, caption_col, key_col)
    arguments = {"source": "table", "path": str(Path(table).resolve()), "image_col": image_col,
                 "caption_col": caption_col, "key_col": key_col}
    return _write_listing(listing, Path(out_dir), options, arguments, progress, str(table), overwrite)


def _write_listing(listing: Listing, out_dir: Path, options: WriteOptions, arguments: dict,
                   progress: bool, source_name: str, overwrite: bool = False) -> WriteSummary:
    """Write `listing` to `out_dir/{split}/`.

    A split this source wrote before (same `arguments`: finished, interrupted, or with other
    options or changed files) is rewritten in place, or skipped when already complete. A split
    holding anything else (another source's shards, Fashion-MNIST, features) is refused unless
    `overwrite`; then the new split is written beside it and swapped in whole, and the dataset
    files beside the splits (classnames.txt & co.) go too when no other split uses them.
    """
    start = time.perf_counter()
    split_dir = out_dir / options.split
    manifest = {"format": _FORMAT_VERSION, "pillow": PIL.__version__, "arguments": arguments,
                "options": asdict(options), "inputs": listing.fingerprint, "classnames": listing.classnames}
    finished = _finished_summary(split_dir, manifest)
    if finished is not None:
        logger.info("%s already holds these shards; nothing written", split_dir)
        finished.seconds = round(time.perf_counter() - start, 3)
        return finished
    check_writable(out_dir, "--out", folder=True)  # a file there, or no permission: one line, not a traceback
    if split_dir.exists() and not split_dir.is_dir():  # mkdir would raise FileExistsError
        raise UserError(f"{split_dir} is a file, not a split folder; move it away, or choose another --split or --out")
    if not listing.candidates:
        raise UserError(f"nothing to write from {source_name}: every sample was skipped"
                        f"{_reasons(dict(listing.counter.counts))}; fix the source and rerun")
    other = other_split_data(split_dir, lambda written: written.get("arguments") == arguments)
    if other and not overwrite:
        raise UserError(f"{split_dir} already holds {other}; pass --overwrite to replace that split, "
                        "or choose another --out or --split")
    other_splits = splits_beside(out_dir, exclude={options.split})
    _check_classnames(out_dir, options.split, listing.classnames)
    counter, tally = listing.counter, _ImageTally()

    def write(target: Path) -> WriteSummary:
        target.mkdir(parents=True, exist_ok=True)
        # Before any shard: tells a rerun that these shards are this source's (an interrupted run
        # is rewritten, not refused). Without its "summary" it does not mark the split complete.
        write_text_atomic(target / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
        candidates = tqdm(listing.candidates, desc=f"shards {split_dir}", disable=not progress)
        sizes = write_split(_encoded_samples(candidates, options, counter, tally), target.parent, target.name,
                            samples_per_shard=options.samples_per_shard, max_bytes=options.max_shard_bytes,
                            keep_keys=True)
        skipped = dict(sorted(counter.counts.items()))
        if sum(sizes.values()) == 0:
            raise UserError(f"no sample of {source_name} could be written: skipped {sum(skipped.values())}"
                            f"{_reasons(skipped)}; fix the source and rerun")
        summary = WriteSummary(str(split_dir), sizes, skipped, dict(sorted(tally.changes.items())), tally.reencoded,
                               {name: (target / name).stat().st_size for name in sizes})
        recorded = {k: v for k, v in asdict(summary).items() if k not in ("already_complete", "seconds")}
        write_text_atomic(target / MANIFEST_FILE, json.dumps({**manifest, "summary": recorded}, indent=1) + "\n")
        return summary

    if other:
        from lit_softmoe.train.checkpoint import write_folder_atomically
        results = []
        write_folder_atomically(split_dir, lambda tmp: results.append(write(tmp)))
        summary = results[0]
        if not other_splits:  # they described the data just replaced, and no other split
            for name in DATASET_FILES:
                (out_dir / name).unlink(missing_ok=True)
    else:
        summary = write(split_dir)
    if listing.classnames is not None:
        write_text_atomic(out_dir / CLASSNAMES_FILE, "".join(f"{name}\n" for name in listing.classnames))
    summary.seconds = round(time.perf_counter() - start, 3)
    return summary


def other_split_data(split_dir: Path, is_own: Callable[[dict], bool]) -> str | None:
    """What `split_dir` holds that a writer must not silently replace, in words; None when it is
    empty or missing, or its manifest.json (written before the first shard) passes `is_own`."""
    if not split_dir.is_dir():
        return None
    names = [p.name for p in split_dir.iterdir() if not p.name.startswith(".")]  # hidden: leftovers
    if not names:
        return None
    try:
        written = json.loads((split_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        written = None
    if isinstance(written, dict) and is_own(written):
        return None
    try:
        samples = f"{sum(json.loads((split_dir / SIZES_FILE).read_text()).values())} samples"
    except (OSError, ValueError, TypeError, AttributeError):
        samples = f"{len(names)} files"
    if "embed.json" in names:
        return f"{samples} of feature shards (written by `lit-softmoe embed`)"
    source = written.get("arguments", {}).get("path") if isinstance(written, dict) else None
    if written is None:  # `data fashion-mnist` keeps its manifest beside the splits, not in them
        try:
            source = json.loads((split_dir.parent / MANIFEST_FILE).read_text()).get("dataset")
        except (OSError, ValueError, AttributeError):
            pass
    return f"{samples} of {source}" if isinstance(source, str) else f"{samples} written from another source"


def _finished_summary(split_dir: Path, manifest: dict) -> WriteSummary | None:
    """The recorded summary if `split_dir` holds what `manifest` asks for, every file in place."""
    try:
        written = json.loads((split_dir / MANIFEST_FILE).read_text())
        recorded = written.pop("summary")
        if written != manifest or json.loads((split_dir / SIZES_FILE).read_text()) != recorded["sizes"]:
            return None
        if (split_dir / NSHARDS_FILE).read_text().strip() != str(len(recorded["sizes"])):
            return None
        if any((split_dir / name).stat().st_size != nbytes for name, nbytes in recorded["shard_bytes"].items()):
            return None
        classnames = manifest["classnames"]
        if classnames is not None and _read_lines(split_dir.parent / CLASSNAMES_FILE) != classnames:
            return None
        return WriteSummary(**{**recorded, "split_dir": str(split_dir)}, already_complete=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_lines(path: Path) -> list[str] | None:
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else None


def _check_classnames(out_dir: Path, split: str, classnames: list[str] | None) -> None:
    """Refuse to give this split other class numbers than the dataset's other splits have."""
    existing = _read_lines(out_dir / CLASSNAMES_FILE)
    if classnames is None or existing is None or existing == classnames:
        return
    others = splits_beside(out_dir, exclude={split})
    if others:
        raise UserError(f"{out_dir / CLASSNAMES_FILE} lists {len(existing)} classes for the split(s) "
                        f"{', '.join(others)}, but this folder has {len(classnames)} other ones; give every "
                        "split the same class folders, or write to another --out")
