"""Webdataset shards: write a split, list its tars, and the metadata files beside them.

The on-disk layout is CLIP_benchmark's (clip_benchmark/datasets/builder.py, `build_wds_dataset`),
so its evaluator and ours read the same folders:

    dataset_dir/
        classnames.txt  zeroshot_classification_templates.txt  dataset_type.txt
        train/  0.tar 1.tar … N-1.tar  nshards.txt  sizes.json
        test/   …

Samples are keyed `s0000000`, `s0000001`, … across the whole split (writers of folders and tables
keep the source's own keys instead, see writers.py), and hold an image (`.png`,
`.jpg`, `.webp`) plus `.cls` (class index as ASCII digits) and/or `.txt` (caption). `sizes.json`
({tar name: sample count}) is ours: it gives the split length without reading the tars.
Shard names are unpadded (`0.tar`) because CLIP_benchmark expands `{0..N-1}.tar`.

img2dataset's webdataset output (rom1504/img2dataset, writer.py and logger.py) is read as it comes:

    out_folder/  00000.tar 00000.parquet 00000_stats.json  00001.tar …

with `.jpg` + `.txt` + `.json` per sample (the `.json`, its url and sizes, is read and ignored); a
failed download is a row of the `.parquet` and no sample of the tar. There is no nshards.txt and no
sizes.json: `NNNNN_stats.json` marks a finished shard (img2dataset writes it after closing the tar)
and its "successes" is the number of samples the tar holds.

Reading the tars, and counting what is bad in them, is `data.tar_reading`'s.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterable

import webdataset as wds
from webdataset.shardlists import expand_urls

# Re-exported: train.embed imports it from here.
from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import process_alive, write_text_atomic

logger = logging.getLogger(__name__)

NSHARDS_FILE = "nshards.txt"
SIZES_FILE = "sizes.json"
STATS_SUFFIX = "_stats.json"  # img2dataset's per-shard record: NNNNN.tar's is NNNNN_stats.json
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
_SHARD_NAME = re.compile(r"^(\d+)\.tar$")
_STATS_NAME = re.compile(r"^(\d+)_stats\.json$")
_PARTIAL_SUFFIX = ".partial"
DECODED_CACHE_PREFIX = ".decoded-"
_LAYOUT_HINT = (
    "a split folder holds nshards.txt and 0.tar … N-1.tar (CLIP_benchmark layout), or 00000.tar … "
    "with 00000_stats.json … beside them (img2dataset's output); or pass a brace pattern such as "
    "DIR/{0..9}.tar, or several patterns joined with '::'"
)


# ---------------------------------------------------------------------------------------- writing

def write_split(
    samples: Iterable[dict[str, Any]],
    out_dir: str | Path,
    split: str,
    samples_per_shard: int = 10_000,
    max_bytes: int = 1 << 30,
    keep_keys: bool = False,
    done: dict[str, int] | None = None,
    on_shard: Callable[[dict[str, int], bool], None] | None = None,
) -> dict[str, int]:
    """Write samples as `out_dir/split/{0..N-1}.tar` + `nshards.txt` + `sizes.json`.

    Args:
        samples: dicts of {extension: value}; bytes/str are stored as they are, other values go
            through webdataset's encoders (PIL image → png, int → cls, dict → json). Keys are
            assigned here (`s0000000`, …); a `__key__` in the sample is overwritten, unless
            `keep_keys`.
        out_dir: dataset folder; the split folder is created inside it.
        split: split name, e.g. "train" or "test".
        samples_per_shard: a new shard starts after this many samples.
        max_bytes: … or once a shard holds this many payload bytes (checked before each sample).
        keep_keys: keep each sample's own `__key__` (a source's file stem, say) instead of
            numbering them; keys must be unique and hold no dot in their last path part, since
            webdataset splits a tar member name into key and extension at that dot.
        done: shards 0 … k-1 that an interrupted run of the same samples finished ({name: count}):
            kept as they are, `samples` being the rest, from shard k's first sample on (a resume).
        on_shard: called with the shards in place so far each time one is renamed into place, and
            whether it was the last (False: it was closed because the sample being written starts
            the next one).

    Returns:
        {shard file name: sample count}, the content of sizes.json.

    The same samples give byte-identical tars (fixed mtime, owner and mode). Each shard is written
    under a hidden temporary name and renamed when complete, and the split's markers (nshards.txt,
    sizes.json) are removed first and rewritten last: a killed run leaves no half shard under a
    final name and no sizes.json describing shards that were not all written.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    split_dir = Path(out_dir) / split
    split_dir.mkdir(parents=True, exist_ok=True)
    for marker in (SIZES_FILE, NSHARDS_FILE):
        (split_dir / marker).unlink(missing_ok=True)
    for leftover in split_dir.glob(f"{DECODED_CACHE_PREFIX}*"):
        leftover.unlink()
    _remove_partial_shards(split_dir, stale_only=True)

    sizes: dict[str, int] = dict(done or {})
    failed, closing = False, False

    def publish(temporary_name: str) -> None:
        # ShardWriter calls this after closing each shard; `writer.count` is still that shard's
        # count.
        if failed:
            os.unlink(temporary_name)
            return
        # .3.tar.PID.partial → 3.tar
        final = split_dir / Path(temporary_name).name[1:].rsplit(".", 2)[0]
        os.replace(temporary_name, final)
        sizes[final.name] = writer.count
        if on_shard is not None:
            on_shard(dict(sizes), closing)

    # Temporary names carry the writer's pid: two writers of one split never delete each other's
    # shard.
    pattern = str(split_dir).replace("%", "%%") + f"/.%d.tar.{os.getpid()}{_PARTIAL_SUFFIX}"
    writer = wds.ShardWriter(
        pattern, maxcount=samples_per_shard, maxsize=max_bytes, post=publish, verbose=0,
        # An int mtime: a float one makes tarfile add a 1 KB pax header to every member.
        mtime=0, user="lit-softmoe", group="lit-softmoe", mode=0o644, start_shard=len(sizes),
    )
    seen_keys: set[str] = set()
    try:
        for index, sample in enumerate(samples, start=sum(sizes.values())):
            key = _checked_key(sample.get("__key__"), seen_keys) if keep_keys else f"s{index:07d}"
            writer.write({**sample, "__key__": key})
    except BaseException:
        failed = True  # the shard being written is deleted, not published
        try:
            writer.close()
        finally:  # a full disk fails the close too: this writer's partial shard goes all the same
            _remove_partial_shards(split_dir, stale_only=False)
        raise
    closing = True
    writer.close()

    # Shards of an earlier, longer run of this split would otherwise linger past N-1.
    for path in split_dir.glob("*.tar"):
        if _SHARD_NAME.match(path.name) and path.name not in sizes:
            path.unlink()
    write_text_atomic(split_dir / NSHARDS_FILE, f"{len(sizes)}\n")
    write_text_atomic(split_dir / SIZES_FILE, json.dumps(sizes, indent=1) + "\n")
    return sizes


def _remove_partial_shards(split_dir: Path, stale_only: bool) -> None:
    """Delete this process's temporary shards in `split_dir`, and (`stale_only`) only those of
    processes that are gone or of this one (a pid-less name is an older version's leftover)."""
    for path in split_dir.glob(f".*{_PARTIAL_SUFFIX}"):
        parts = path.name[1:].rsplit(".", 2)  # ["3.tar", "PID", "partial"]
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if pid == os.getpid() or (stale_only and (pid is None or not process_alive(pid))):
            path.unlink(missing_ok=True)


def is_safe_key(key: Any) -> bool:
    """Whether `key` can name a sample's tar members: a relative path of non-empty parts, none of
    them `..`, no control characters or backslashes, and no dot in its last part (webdataset splits
    a member name into key and extension at that dot). Keys read from someone else's shards can be
    `../x` or `/abs/x`, which an extracting tool would write outside its folder."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key:
        return False
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts) or "." in parts[-1]:
        return False
    return not any(ord(char) < 32 or ord(char) == 127 for char in key)


def _checked_key(key: Any, seen_keys: set[str]) -> str:
    """`key` if webdataset can read it back as one sample's key; ValueError otherwise."""
    if not is_safe_key(key):
        raise ValueError(f"sample key {key!r} is not a relative path of plain parts without a dot "
                         "in its last part")
    if key in seen_keys:
        raise ValueError(f"sample key {key!r} repeats an earlier sample's key")
    seen_keys.add(key)
    return key


# ---------------------------------------------------------------------------------------- listing

def is_local_url(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def file_identity(path: str | Path) -> tuple[str, int, int, int]:
    """(resolved path, size, mtime, ctime) of a file: what caches of its contents are keyed by.

    Not its bytes (reading every file of a benchmark would cost what the cache saves), but the
    ctime too: a file rewritten in place gets a new one, and so does a copy, whose mtime `cp -a`
    and `rsync -a` keep but whose ctime no tool can set.
    """
    stat = os.stat(path)
    return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def files_signature(paths) -> str:
    """A cheap identity of a set of files (`file_identity` of each). Remote shards (URLs, pipes)
    cannot be stat'ed and count by their name alone."""
    digest = hashlib.sha256()
    for path in sorted(str(p) for p in paths):
        identity = file_identity(path) if is_local_url(path) else (path,)
        digest.update(("|".join(map(str, identity)) + "\n").encode())
    return digest.hexdigest()


def split_dir_urls(split_dir: Path) -> list[str]:
    """The tars of a split folder: those its nshards.txt counts, or, in img2dataset's output (no
    nshards.txt), the finished shards (`img2dataset_urls`)."""
    nshards_path = split_dir / NSHARDS_FILE
    if not nshards_path.is_file():
        urls = img2dataset_urls(split_dir)
        if urls:
            return urls
        splits = sorted(p.parent.name for p in split_dir.glob(f"*/{NSHARDS_FILE}"))
        guess = (f" (it holds the splits {', '.join(splits)}: pass {split_dir}/{splits[0]})"
                 if splits else "")
        raise UserError(f"no {NSHARDS_FILE} in {split_dir}{guess}; {_LAYOUT_HINT}")
    try:
        nshards = int(nshards_path.read_text().strip())
    except ValueError:
        raise UserError(f"{nshards_path} does not hold a number; "
                        "rewrite the split's shards") from None
    if nshards < 1:  # no writer writes an empty split: a count below one is a damaged file
        raise UserError(f"{nshards_path} counts {nshards} shards, but a split holds at least one; "
                        "rewrite the split's shards")
    # CLIP_benchmark names shards 0.tar…; zero-padded names are read too, at the width the first
    # shard has (img2dataset's 00000.tar, webdataset's 000000.tar).
    width = next((width for width in range(1, 10)
                  if (split_dir / f"{0:0{width}d}.tar").exists()), 1)
    present = sum(1 for _ in split_dir.glob("*.tar"))
    # said before naming them all: a count of 10**20 made a list that filled the memory
    if nshards > present:
        first = next(split_dir / f"{index:0{width}d}.tar" for index in range(present + 1)
                     if not (split_dir / f"{index:0{width}d}.tar").is_file())
        raise UserError(f"{nshards_path} says {nshards} shards but {nshards - present} or more are "
                        f"missing (first: {first}); rewrite the split's shards")
    urls = [str(split_dir / f"{index:0{width}d}.tar") for index in range(nshards)]
    missing = [url for url in urls if not Path(url).is_file()]
    if missing:
        raise UserError(
            f"{nshards_path} says {nshards} shards but {len(missing)} are missing (first: "
            f"{missing[0]}); rewrite the split's shards"
        )
    # Shards that sizes.json lists but nshards.txt leaves out would never be read, their samples
    # never counted as missing: the split would pass for complete with part of it.
    listed = read_sizes_file(split_dir / SIZES_FILE) or {}
    unread = sorted((name for name in listed
                     if (match := _SHARD_NAME.match(name)) and int(match.group(1)) >= nshards),
                    key=lambda name: int(_SHARD_NAME.match(name).group(1)))
    if unread:
        raise UserError(f"{split_dir / SIZES_FILE} lists {len(listed)} shards, {nshards_path} "
                        f"counts {nshards}: {len(unread)} would not be read (first: {unread[0]}); "
                        "rewrite the split's shards")
    return urls


def read_sizes_file(path: Path) -> dict | None:
    """sizes.json as {shard name: samples}, None where there is none; one UserError line for one
    that is not such a mapping (it would turn off the check of every shard against its count)."""
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path} is not valid JSON; rewrite the split's shards or delete it "
                        "and set data.samples_per_epoch") from None
    counts = isinstance(table, dict) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in table.values())
    if not counts:
        raise UserError(f"{path} is not a mapping of shard names to sample counts; rewrite the "
                        "split's shards or delete it and set data.samples_per_epoch")
    return table


_warned_unfinished: set[tuple[str, ...]] = set()


def img2dataset_urls(split_dir: Path) -> list[str]:
    """The finished shards of an img2dataset output folder, in shard-number order; [] if the folder
    holds no `NNNNN_stats.json` (not img2dataset's output).

    The stats files list the shards, as nshards.txt does ours: img2dataset writes a shard's stats
    after closing its tar, so a tar without one is a shard still being written or cut short by a
    killed run (img2dataset's incremental mode downloads it again). Those are left out, with a
    warning. A numbered folder of tars without stats is not read as a split: a `write_split` killed
    midway leaves one too, and it must not pass for complete (a brace pattern reads such tars).
    """
    stats = {int(m.group(1)): m.group(1) for p in split_dir.glob(f"*{STATS_SUFFIX}")
             if (m := _STATS_NAME.match(p.name))}
    if not stats:
        return []
    tars = {int(m.group(1)): m.group(1) for p in split_dir.glob("*.tar")
            if (m := _SHARD_NAME.match(p.name))}
    missing = sorted(set(stats) - set(tars))
    if missing:
        first = stats[missing[0]]
        raise UserError(f"{split_dir / (first + STATS_SUFFIX)} describes a shard whose tar "
                        f"{first}.tar is missing ({len(missing)} such); restore the tars, or "
                        f"delete their {STATS_SUFFIX} files and rerun img2dataset with "
                        "--incremental_mode incremental")
    unfinished = tuple(str(split_dir / f"{tars[n]}.tar") for n in sorted(set(tars) - set(stats)))
    # once per process, not per loader built
    if unfinished and unfinished not in _warned_unfinished:
        _warned_unfinished.add(unfinished)
        logger.warning("%s: %d tar(s) have no %s, which img2dataset writes once a shard is "
                       "complete: left out as unfinished (first: %s); rerun img2dataset with "
                       "--incremental_mode incremental to finish them",
                       split_dir, len(unfinished), STATS_SUFFIX, unfinished[0])
    return [str(split_dir / f"{stats[number]}.tar") for number in sorted(stats)]


def is_split_folder(path: str | Path) -> bool:
    """A local folder `split_dir_urls` reads: nshards.txt (ours, CLIP_benchmark's) or img2dataset's
    stats."""
    path = Path(path)
    return ((path / NSHARDS_FILE).is_file()
            or any(_STATS_NAME.match(p.name) for p in path.glob(f"*{STATS_SUFFIX}")))


def shard_urls(spec: str | Path | list[str]) -> list[str]:
    """Expand a shard spec into a list of tar urls.

    `spec` is a split folder (its nshards.txt gives the tars), a brace pattern
    (`dir/{0..9}.tar`), several of those joined with `::`, or a list of them. Local paths must
    exist; remote urls (`https://…`, `pipe:…`) are passed through unchecked.
    """
    if isinstance(spec, (list, tuple)):
        return [url for part in spec for url in shard_urls(part)]
    spec = str(spec)
    # Split the `::` list here, not in webdataset's expand_urls: a part may be a split folder.
    parts = [part for part in spec.split("::") if part.strip()]
    if not parts:
        raise UserError(f"no shards named in {spec!r}; {_LAYOUT_HINT}")
    if len(parts) > 1:
        return shard_urls(parts)
    spec = parts[0]
    if is_local_url(spec) and Path(spec).is_dir():
        return split_dir_urls(Path(spec))
    urls = expand_urls(spec)
    missing = [url for url in urls if is_local_url(url) and not Path(url).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"shards not found: {missing[0]}{more}; {_LAYOUT_HINT}")
    return urls


def dataset_dir(spec: str | Path, urls: list[str] | None = None) -> Path | None:
    """The local folder holding a split folder, where classnames.txt and the templates lie: DATA/x
    for DATA/x/train, for a pattern DATA/x/train/{0..9}.tar, and for the first part of a '::' list
    of either; None for remote shards. `urls`: the spec's `shard_urls`, when the caller has them."""
    first = str(spec).split("::")[0]
    if is_local_url(first) and Path(first).is_dir():
        return Path(first).resolve().parent
    first_url = (urls or shard_urls(spec))[0]
    return Path(first_url).resolve().parent.parent if is_local_url(first_url) else None


def split_name(spec: str | Path, urls: list[str]) -> str:
    """The split folder's name ("train" for DATA/fashion-mnist/train or DATA/x/train/{0..9}.tar).
    `urls`: the spec's `shard_urls`."""
    if Path(str(spec)).is_dir():
        return Path(str(spec)).resolve().name
    return Path(os.path.dirname(urls[0])).name or "train"


def splits_beside(out_dir: str | Path, exclude: Iterable[str] = ()) -> list[str]:
    """The split folders (holding nshards.txt) in `out_dir` but `exclude`, sorted: the splits that
    classnames.txt & co. beside them describe, which a writer of another split must not rename."""
    return sorted(path.parent.name for path in Path(out_dir).glob(f"*/{NSHARDS_FILE}")
                  if path.parent.name not in exclude)


def read_lines(path: str | Path) -> list[str] | None:
    """The stripped, non-empty lines of a text file (templates, dataset_type.txt); None if it is
    absent. Class names, where a line's place is its class, are read by `read_classnames_file`."""
    lines = _stripped_lines(path)
    return None if lines is None else [line for line in lines if line]


def read_classnames_file(path: str | Path) -> list[str] | None:
    """Class names, one per line in label order (line n names class n-1), stripped; None if the file
    is absent. Every reader of class names (pretraining, LiT's eval set, the zero-shot suite, the
    writers) reads them here, so all number the classes alike.

    Blank lines at the end are dropped. A blank line before a name is a UserError: read as a class
    it has no name, skipped it moves every later name onto the class before it."""
    lines = _stripped_lines(path)
    if lines is None:
        return None
    while lines and not lines[-1]:
        lines.pop()
    if "" in lines:
        number = lines.index("") + 1
        raise UserError(f"{path} line {number} is blank: class names go one per line in label "
                        "order (line n names class n-1); "
                        f"write class {number - 1}'s name on it, or delete it")
    return lines


# The ways two class names can be one name, each step applied after the ones before it. Names that
# differ only so would be two classes with one set of prompts (classnames.txt's readers strip each
# line; CLIP's tokenizer lowercases and reads `ｃａｔ` as `cat`).
_SAME_NAME_STEPS = (
    ("in two Unicode forms", lambda name: unicodedata.normalize("NFC", name)),
    ("but for the spaces around it", str.strip),
    ("but for letter case or letter width",
     lambda name: unicodedata.normalize("NFKC", name).casefold()),
)


def class_name_difference(first: str, second: str) -> str | None:
    """How two class names are one name, in words (`_SAME_NAME_STEPS`), or None when they are two
    names."""
    if first == second:
        return None
    for words, step in _SAME_NAME_STEPS:
        first, second = step(first), step(second)
        if first == second:
            return words
    return None


def class_name_key(name: str) -> str:
    """What two names that `class_name_difference` takes for one have in common: every step
    applied."""
    for _, step in _SAME_NAME_STEPS:
        name = step(name)
    return name


def same_classnames(path: str | Path, classnames: list[str]) -> bool | None:
    """Whether the class-names file `path` names `classnames` as its readers read it; None if there
    is no such file. A file `read_classnames_file` refuses names other classes."""
    try:
        existing = read_classnames_file(path)
    except (UserError, OSError, UnicodeDecodeError):
        return False
    return None if existing is None else existing == [name.strip() for name in classnames]


def _stripped_lines(path: str | Path) -> list[str] | None:
    path = Path(path)
    if not path.is_file():
        return None
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]


def read_classnames(dataset_dir: str | Path) -> list[str]:
    """The class names of a dataset folder's `classnames.txt` (`read_classnames_file`).

    A split folder is accepted too: its parent holds the file in the CLIP_benchmark layout.
    """
    dataset_dir = Path(dataset_dir)
    for folder in (dataset_dir, dataset_dir.parent):
        names = read_classnames_file(folder / CLASSNAMES_FILE)
        if names is not None:
            return names
    raise UserError(f"no {CLASSNAMES_FILE} in {dataset_dir}: pass the dataset folder "
                    "(the one holding classnames.txt beside its split folders), "
                    "or write one class name per line there")




