"""Folders and tables of images → webdataset shards (`lit-softmoe data from-folder|from-table`).

Sources (listed by `data.folders` and `data.tables`):
- a folder of images with a same-stem `.txt` caption beside each (img2dataset's output,
  `00000/000000001.jpg` + `00000/000000001.txt`; Tux Paint's saved drawings);
- a folder of class subfolders (torchvision's ImageFolder: `cat/1.jpg`, `dog/1.jpg`): writes `.cls`
  and `classnames.txt`, classes numbered in sorted folder-name order as ImageFolder numbers them;
  with caption templates also a `.txt` caption from the class name (`data.captions`) and the
  templates as `zeroshot_classification_templates.txt`, so zero-shot evaluation prompts the same
  way;
- a table (CSV, TSV, JSONL, Parquet) with an image column (paths relative to the table, or bytes
  embedded as img2dataset's and Hugging Face datasets' Parquet files hold them) and a caption
  column, a class column (`.cls` and `classnames.txt`, as class folders give: `data.table_classes`)
  or both; its other columns go to each sample's `.json`.

Captioned sources are written in their own order; labelled ones (class folders, a class column) in a
seeded random order, so each shard holds every class (`data.listing.in_shuffled_order`).
Output is shards.py's layout, written by `write_split` (rollover by sample count and by bytes,
atomic shards, fixed tar headers): `DIR/{split}/0.tar … N-1.tar`, `nshards.txt`, `sizes.json`. A
sample keeps its source's key (a file stem, as img2dataset's keys are) and holds the image, `.txt`
and/or `.cls`, and `.json` {"key", "path", "width", "height", "file_bytes", ["class"], ["extra"]}.

Bad input never ends a run (open_clip's log-and-continue handlers; `sample_encoding` reads and
checks each sample's files): a sample with a missing or broken image, an empty or non-UTF-8 caption
or a key already taken is skipped and counted by reason; an image in RGBA, LA, P, 16-bit, CMYK or
another mode is normalized to L or RGB and counted. An image file's own bytes are kept when they are
already in the requested format and need no change; otherwise they are re-encoded with fixed
settings and no metadata, so equal inputs give byte-identical shards, whatever the number of worker
processes. A `manifest.json` in the split folder records the arguments, a fingerprint of the inputs
(name, size and mtime of every file read) and, written last, the summary: rerunning a finished
command writes nothing, and rerunning an interrupted one keeps the shards it finished
(`.progress.json`: where the next one starts, the counts so far) and writes the rest, to the same
bytes. A split that holds anything else (another source's shards, Fashion-MNIST) is refused unless
`overwrite`.

Reasons a sample is skipped: missing_image, unreadable_file, not_a_regular_file (a FIFO, a device:
never read), too_large (over `sample_encoding.MAX_INPUT_BYTES`), bad_image (does not decode),
remote_image (a URL in a table), outside_root (a table path outside --root), missing_caption,
empty_caption, non_utf8_text, bad_caption (not a string), bad_row (a malformed table line),
empty_class, bad_class, unknown_class (a table's class cell: `data.table_classes`), duplicate_key,
missing_key, outside_class_folder.
Changes counted among the re-encoded images: see `images.normalize_image`.
"""
from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import PIL.Image
from tqdm import tqdm

from lit_softmoe.data.folders import list_folder
from lit_softmoe.data.listing import Listing
from lit_softmoe.data.sample_encoding import ImageTally, encoded_samples
from lit_softmoe.data.shards import (
    CLASSNAMES_FILE,
    NSHARDS_FILE,
    SIZES_FILE,
    TEMPLATES_FILE,
    read_lines,
    same_classnames,
    splits_beside,
    write_split,
)
from lit_softmoe.data.tables import list_table
from lit_softmoe.data.write_options import WriteOptions
from lit_softmoe.errors import UserError, setting
from lit_softmoe.utils.atomic import write_folder_atomically, write_text_atomic
from lit_softmoe.utils.locks import folder_lock
from lit_softmoe.utils.paths import check_writable

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
# Rewritten as each shard is in place: where a killed write resumes (hidden: not part of the
# dataset).
PROGRESS_FILE = ".progress.json"
# Beside the splits, describing them all (CLIP_benchmark's files; `data fashion-mnist`'s manifest).
DATASET_FILES = (CLASSNAMES_FILE, TEMPLATES_FILE, "dataset_type.txt", MANIFEST_FILE)
# Bump when the shard content changes, so old splits get rewritten (2: non-ASCII keys; 3: JPEGs
# shrunk by --max-size are decoded at a reduced scale first).
_FORMAT_VERSION = 3


# ---------------------------------------------------------------------------------------- summary

@dataclass
class WriteSummary:
    """What a write did; `line()` is what the CLI prints."""

    split_dir: str
    sizes: dict[str, int]          # sizes.json: {shard: samples}
    skipped: dict[str, int]        # {reason: samples skipped}
    normalized: dict[str, int]     # {change: images changed}
    reencoded: int                 # images stored in other bytes than their file's own
    # {shard: file size}, for the rerun check
    shard_bytes: dict[str, int] = field(default_factory=dict)
    already_complete: bool = False
    seconds: float = 0.0
    classnames_note: str | None = None  # printed above `line()`: where the class names came from

    @property
    def samples(self) -> int:
        return sum(self.sizes.values())

    @property
    def shards(self) -> int:
        return len(self.sizes)

    def line(self) -> str:
        shards = f"{self.shards} shard{'' if self.shards == 1 else 's'}"
        parts = []
        if self.reencoded:
            parts.append(f"{self.reencoded} images re-encoded{_reasons(self.normalized)}")
        parts.append(f"skipped {sum(self.skipped.values())}{_reasons(self.skipped)}")
        if self.already_complete:  # what the write that made them did, not this run
            return (f"{self.split_dir} already holds these {self.samples} samples in {shards}; "
                    f"nothing written (when they were written: {'; '.join(parts)})")
        return "; ".join([f"written {self.samples} samples in {shards} to {self.split_dir}",
                          *parts])


def _reasons(counts: dict[str, int]) -> str:
    listed = ", ".join(f"{reason} {count}" for reason, count in sorted(counts.items()) if count)
    return f" ({listed})" if listed else ""


# ---------------------------------------------------------------------------------------- writing

def write_folder_shards(src: str | Path, out_dir: str | Path,
                        options: WriteOptions = WriteOptions(),
                        layout: str = "auto", progress: bool = False, overwrite: bool = False,
                        caption_templates: Sequence[str] | None = None, class_names: str = "auto",
                        workers: int = 1, *,
                        setting_names: Mapping[str, str] | None = None) -> WriteSummary:
    """Write a folder of captioned images or of class subfolders as `out_dir/{split}/` shards.

    The classes layout also writes `out_dir/classnames.txt`; with `caption_templates` (`{c}`
    templates, see `data.captions.load_caption_templates`) each sample gets a `.txt` caption from
    its class name too, and the templates go to `out_dir/zeroshot_classification_templates.txt`.
    Folders named by ImageNet wnids are named by ImageNet's class names unless `class_names` is
    "folders" (`data.imagenet_folders`). See `list_folder` for the layouts and keys, and the module
    docstring for what is skipped, normalized and rewritten. A split holding other data is refused
    unless `overwrite` (see `_write_listing`). `workers`: processes that read, decode and encode the
    images (the CLI's default: one per core this process may use); the shards are the same bytes for
    any number. `setting_names`: what messages call the parameters, {parameter: the caller's name}
    (`errors.setting`; the CLI passes its flags: {"out_dir": "--out", "split": "--split", ...}); the
    options' `split` is "split".
    """
    # With out_dir the source folder itself, the split folder written into it must not be read back.
    exclude = (Path(out_dir) / options.split if Path(out_dir).resolve() == Path(src).resolve()
               else out_dir)
    listing = list_folder(src, layout, exclude=exclude, caption_templates=caption_templates,
                          class_names=class_names, setting_names=setting_names)
    # class_names is not an argument: like the templates, other names rewrite this source's split
    # (the manifest records them), where another source's split is refused.
    arguments = {"source": "folder", "path": str(Path(src).resolve()), "layout": layout}
    summary = _write_listing(listing, Path(out_dir), options, arguments, progress, str(src),
                             overwrite, workers, setting_names)
    summary.classnames_note = listing.classnames_note
    return summary


def write_table_shards(table: str | Path, out_dir: str | Path, image_col: str,
                       caption_col: str | None, options: WriteOptions = WriteOptions(),
                       key_col: str | None = None, progress: bool = False, overwrite: bool = False,
                       root: str | Path | None = None, class_col: str | None = None,
                       classnames_file: str | Path | None = None, workers: int = 1, *,
                       setting_names: Mapping[str, str] | None = None) -> WriteSummary:
    """Write the rows of a CSV / TSV / JSONL / Parquet table as `out_dir/{split}/` shards.

    Image paths are relative to the table's folder (or absolute), confined to `root` if given; see
    `list_table` for keys and extra columns. With `class_col`, each sample also gets a `.cls` and
    `out_dir/classnames.txt` the class names: sorted, or those of `classnames_file` in its order
    (`data.table_classes`). A split holding other data is refused unless `overwrite`. `workers` and
    `setting_names`: as in `write_folder_shards`.
    """
    listing = list_table(table, image_col, caption_col, key_col, root, class_col, classnames_file,
                         setting_names=setting_names)
    arguments = {"source": "table", "path": str(Path(table).resolve()), "image_col": image_col,
                 "caption_col": caption_col, "key_col": key_col}
    # the file's names are in the manifest's classnames: other names rewrite
    if class_col is not None:
        arguments["class_col"] = class_col
    if root is not None:
        arguments["root"] = str(Path(root).resolve())
    summary = _write_listing(listing, Path(out_dir), options, arguments, progress, str(table),
                             overwrite, workers, setting_names)
    summary.classnames_note = listing.classnames_note
    return summary


def _write_listing(listing: Listing, out_dir: Path, options: WriteOptions, arguments: dict,
                   progress: bool, source_name: str, overwrite: bool = False, workers: int = 1,
                   names: Mapping[str, str] | None = None) -> WriteSummary:
    """Write `listing` to `out_dir/{split}/`.

    A split this source wrote before (same `arguments`: finished, interrupted, or with other
    options or changed files) is rewritten in place, or skipped when already complete. A split
    holding anything else (another source's shards, Fashion-MNIST, features) is refused unless
    `overwrite`; then the new split is written beside it and swapped in whole, and the dataset
    files beside the splits (classnames.txt & co.) go too when no other split uses them.
    Messages call the parameters by `names` (`errors.setting`).
    """
    start = time.perf_counter()
    if workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    split_dir = out_dir / options.split
    manifest = {"format": _FORMAT_VERSION, "pillow": PIL.__version__, "arguments": arguments,
                "options": asdict(options), "inputs": listing.fingerprint,
                "classnames": listing.classnames}
    # like the options, not the arguments: other templates rewrite the split
    if listing.templates is not None:
        manifest["caption_templates"] = listing.templates
    # labelled: shuffled, so a split written in path order is rewritten
    if listing.classnames is not None:
        manifest["order"] = "shuffled"
    finished = _finished_summary(split_dir, manifest)
    if finished is not None:
        logger.info("%s already holds these shards; nothing written", split_dir)
        finished.seconds = round(time.perf_counter() - start, 3)
        return finished
    out_setting, split_setting = setting(names, "out_dir"), setting(names, "split")
    # A file there, or no permission: one line, not a traceback.
    check_writable(out_dir, out_setting, folder=True)
    if split_dir.exists() and not split_dir.is_dir():  # mkdir would raise FileExistsError
        raise UserError(f"{split_dir} is a file, not a split folder; move it away, or choose "
                        f"another {split_setting} or {out_setting}")
    if not listing.candidates:
        raise UserError(f"nothing to write from {source_name}: every sample was skipped"
                        f"{_reasons(dict(listing.counter.counts))}; fix the source and rerun")
    _check_split_free(out_dir, split_dir, options.split, arguments, listing.classnames, overwrite,
                      names)
    # Writers of one dataset folder run one after the other, each seeing what the one before wrote:
    # two splits written at once renamed each other's classes, and one command run twice at once
    # deleted the other's shards. So the checks are made again under the lock.
    with folder_lock(out_dir):
        finished = _finished_summary(split_dir, manifest)  # the same command, finished meanwhile
        if finished is not None:
            finished.seconds = round(time.perf_counter() - start, 3)
            return finished
        other, other_splits = _check_split_free(out_dir, split_dir, options.split, arguments,
                                                listing.classnames, overwrite, names)
        tally = ImageTally()

        def write(target: Path) -> WriteSummary:
            return _write_into(target, listing, options, manifest, tally, split_dir, source_name,
                               workers, progress)

        # Still under the lock: the checks above hold only while nobody else writes.
        if other:
            results = []
            write_folder_atomically(split_dir, lambda tmp: results.append(write(tmp)))
            summary = results[0]
            if not other_splits:  # they described the data just replaced, and no other split
                for name in DATASET_FILES:
                    (out_dir / name).unlink(missing_ok=True)
        else:
            summary = write(split_dir)
        if listing.classnames is not None:
            write_text_atomic(out_dir / CLASSNAMES_FILE,
                              "".join(f"{name}\n" for name in listing.classnames))
        if listing.templates is not None:
            _write_templates(out_dir, listing.templates)
        summary.seconds = round(time.perf_counter() - start, 3)
        return summary


def _write_into(target: Path, listing: Listing, options: WriteOptions, manifest: dict,
                tally: ImageTally, split_dir: Path, source_name: str, workers: int,
                progress: bool) -> WriteSummary:
    """Write (or resume writing) `listing`'s samples as the split folder `target`, which becomes
    `split_dir`, with its progress record and, last, its manifest's summary."""
    counter = listing.counter
    target.mkdir(parents=True, exist_ok=True)
    resume = _resume_point(target, manifest)
    # Before any shard: tells a rerun that these shards are this source's (an interrupted
    # run is resumed, not refused). Without its "summary" it does not mark the split
    # complete.
    write_text_atomic(target / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    first = resume["next"] if resume else 0
    # found listing: counted again by every run
    listed = collections.Counter(counter.counts)
    if resume:
        counter.counts.update(resume["skipped"])
        tally.changes.update(resume["changes"])
        tally.reencoded += resume["reencoded"]
        logger.info("%s: resuming after its %d finished shards", split_dir,
                    len(resume["shards"]))
    # candidates taken so far, and the counts before the last one was applied
    taken = [first]
    before = [_progress({}, first, counter.counts - listed, tally)]
    processes = min(workers, len(listing.candidates) - first) or 1
    with tqdm(total=len(listing.candidates), initial=first, desc=f"shards {split_dir}",
              unit="img", disable=not progress) as bar:
        def done(count: int) -> None:
            before[0] = _progress({}, taken[0], counter.counts - listed, tally)
            taken[0] += count
            bar.update(count)
            if bar.n % 256 == 0:  # the bar's postfix redraws it: not on every image
                bar.set_postfix(skipped=sum(counter.counts.values()), refresh=False)

        def shard_done(shards: dict[str, int], last: bool) -> None:
            if last:  # the summary comes next; a kill before it redoes the last shard
                return
            # Closed mid-stream: the sample being written (the last taken) starts the next
            # shard, so a resume takes it again, with the counts from before it.
            record = {**before[0], "shards": shards,
                      "bytes": {name: (target / name).stat().st_size for name in shards}}
            write_text_atomic(target / PROGRESS_FILE, json.dumps(record) + "\n")

        samples = encoded_samples(listing.candidates[first:], options.image_format,
                                  options.max_size, counter, tally,
                                  workers=processes, done=done)
        sizes = write_split(samples, target.parent, target.name,
                            samples_per_shard=options.samples_per_shard,
                            max_bytes=options.max_shard_bytes, keep_keys=True,
                            done=resume["shards"] if resume else None, on_shard=shard_done)
    (target / PROGRESS_FILE).unlink(missing_ok=True)
    skipped = dict(sorted(counter.counts.items()))
    if sum(sizes.values()) == 0:
        raise UserError(f"no sample of {source_name} could be written: skipped "
                        f"{sum(skipped.values())}{_reasons(skipped)}; "
                        "fix the source and rerun")
    summary = WriteSummary(str(split_dir), sizes, skipped,
                           dict(sorted(tally.changes.items())), tally.reencoded,
                           {name: (target / name).stat().st_size for name in sizes})
    recorded = {k: v for k, v in asdict(summary).items()
                if k not in ("already_complete", "seconds", "classnames_note")}
    write_text_atomic(target / MANIFEST_FILE,
                      json.dumps({**manifest, "summary": recorded}, indent=1) + "\n")
    return summary


def _progress(shards: dict[str, int], next_candidate: int, skipped: collections.Counter,
              tally: ImageTally) -> dict:
    """What a resume needs: the shards in place, the candidate the next shard starts at, and what
    encoding the candidates before it counted (skips, image changes)."""
    return {"shards": shards, "next": next_candidate, "skipped": dict(skipped),
            "changes": dict(tally.changes), "reencoded": tally.reencoded}


def _resume_point(split_dir: Path, manifest: dict) -> dict | None:
    """The progress an interrupted write of this same `manifest` (the same inputs and options) left
    in `split_dir`, when every shard it records is in place, at its recorded size; None: write it
    all."""
    try:
        written = json.loads((split_dir / MANIFEST_FILE).read_text())
        record = json.loads((split_dir / PROGRESS_FILE).read_text())
        if written != manifest or not isinstance(record, dict):
            return None
        shards = record["shards"]
        if list(shards) != [f"{index}.tar" for index in range(len(shards))]:
            return None
        if any((split_dir / name).stat().st_size != record["bytes"][name] for name in shards):
            return None
        if not isinstance(record["next"], int):
            return None
        return record if shards else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_templates(out_dir: Path, templates: list[str]) -> None:
    """The caption templates become the dataset's zero-shot prompts; a different set already there
    (another split's captions, a file of the user's) is replaced, and said so."""
    try:
        existing = read_lines(out_dir / TEMPLATES_FILE)  # as the evaluation reads it
    except (OSError, ValueError):
        existing = None
    if existing is not None and existing != templates:
        logger.warning("%s held %d other templates; "
                       "replaced by the %d caption templates of this split",
                       out_dir / TEMPLATES_FILE, len(existing), len(templates))
    write_text_atomic(out_dir / TEMPLATES_FILE, "".join(f"{template}\n" for template in templates))


def _check_split_free(out_dir: Path, split_dir: Path, split: str, arguments: dict,
                      classnames: list[str] | None, overwrite: bool,
                      names: Mapping[str, str] | None) -> tuple[str | None, list[str]]:
    """Refuse a split holding other data (without `overwrite`) or other class names than the
    dataset's other splits; returns (what the split holds, the other splits)."""
    other = other_split_data(split_dir, lambda written: written.get("arguments") == arguments)
    if other and not overwrite:
        raise UserError(f"{split_dir} already holds {other}; pass "
                        f"{setting(names, 'overwrite', True)} to replace that split, or choose "
                        f"another {setting(names, 'out_dir')} or {setting(names, 'split')}")
    _check_classnames(out_dir, split, classnames, names)
    return other, splits_beside(out_dir, exclude={split})


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
    return (f"{samples} of {source}" if isinstance(source, str)
            else f"{samples} written from another source")


def _finished_summary(split_dir: Path, manifest: dict) -> WriteSummary | None:
    """The recorded summary if `split_dir` holds what `manifest` asks for, every file in place."""
    try:
        written = json.loads((split_dir / MANIFEST_FILE).read_text())
        recorded = written.pop("summary")
        if (written != manifest
                or json.loads((split_dir / SIZES_FILE).read_text()) != recorded["sizes"]):
            return None
        if (split_dir / NSHARDS_FILE).read_text().strip() != str(len(recorded["sizes"])):
            return None
        if any((split_dir / name).stat().st_size != nbytes
               for name, nbytes in recorded["shard_bytes"].items()):
            return None
        classnames = manifest["classnames"]
        if (classnames is not None
                and not same_classnames(split_dir.parent / CLASSNAMES_FILE, classnames)):
            return None
        templates = manifest.get("caption_templates")
        if templates is not None and read_lines(split_dir.parent / TEMPLATES_FILE) != templates:
            return None
        return WriteSummary(**{**recorded, "split_dir": str(split_dir)}, already_complete=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_classnames(out_dir: Path, split: str, classnames: list[str] | None,
                      names: Mapping[str, str] | None) -> None:
    """Refuse to give this split other class numbers than the dataset's other splits have."""
    if classnames is None or same_classnames(out_dir / CLASSNAMES_FILE, classnames) is not False:
        return
    others = splits_beside(out_dir, exclude={split})
    if others:
        existing = len(read_lines(out_dir / CLASSNAMES_FILE) or [])
        raise UserError(f"{out_dir / CLASSNAMES_FILE} lists {existing} classes for the split(s) "
                        f"{', '.join(others)}, but this folder has {len(classnames)} other ones; "
                        "give every split the same class folders, or write to another "
                        f"{setting(names, 'out_dir')}")
