"""A table of images and captions as samples (`lit-softmoe data from-table`): CSV, TSV, JSONL or
Parquet, with an image column (paths relative to the table, or bytes embedded as img2dataset's and
Hugging Face datasets' Parquet files hold them) and a caption column, a class column
(`data.table_classes`), or both; its other columns go to each sample's `.json`. A malformed line is
skipped and counted (bad_row), not the end of the run."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from lit_softmoe.data.listing import (
    Candidate,
    Listing,
    drop_duplicate_keys,
    files_fingerprint,
    in_shuffled_order,
    is_utf8_text,
    sample_key,
)
from lit_softmoe.data.table_classes import class_cell, load_classnames_file, resolve_classes
from lit_softmoe.data.tar_reading import BadSampleCounter
from lit_softmoe.errors import UserError, setting

TABLE_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl",
                  ".ndjson": "jsonl", ".parquet": "parquet"}


def _table_kind(table: Path) -> str:
    kind = TABLE_SUFFIXES.get(table.suffix.lower())
    if kind is None:
        raise UserError(f"cannot tell the format of {table} from its extension; name it .csv, "
                        ".tsv, .jsonl or .parquet")
    return kind


def _csv_rows(table: Path, delimiter: str,
              counter: BadSampleCounter) -> tuple[list[str], Iterator[dict]]:
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
                    counter.skip("bad_row", f"{table} line {reader.line_num}: {len(cells)} fields, "
                                            f"the header has {len(header)}")
                elif not all(is_utf8_text(cell) for cell in cells):
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
                    counter.skip("bad_row", f"{table} line {line_number}: a {type(row).__name__}, "
                                            "not an object")

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
    """Refuse a column of `needed` ({the setting naming it: column}) that the table lacks."""
    columns = list(columns)
    for name, column in needed.items():
        if column not in columns:
            listed = ", ".join(map(str, columns)) or "none"
            raise UserError(f"{table} has no column {column!r} (its columns: {listed}); "
                            f"pass {name} with one of them")


def _table_image(cell: Any, table_dir: Path,
                 root: Path | None) -> tuple[Path | bytes | None, str, str | None]:
    """(image file or bytes, the name the table gives it, a reason to skip or None). With `root`, a
    path that resolves outside it (`../`, absolute, through a link) is skipped as outside_root."""
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
    path = Path(name) if Path(name).is_absolute() else table_dir / name
    if root is not None and not path.resolve().is_relative_to(root):
        return None, name, "outside_root"
    return path, name, None


def list_table(table: str | Path, image_col: str, caption_col: str | None,
               key_col: str | None = None, root: str | Path | None = None,
               class_col: str | None = None,
               classnames_file: str | Path | None = None, *,
               setting_names: Mapping[str, str] | None = None) -> Listing:
    """The rows of a CSV / TSV / JSONL / Parquet table as samples, in row order.

    `caption_col` gives each sample a `.txt` caption, `class_col` a `.cls` label and the listing its
    class names (sorted, or those of `classnames_file` in its order: see `data.table_classes`); at
    least one of the two is needed.

    Image paths are relative to the table's folder, or absolute: a table reads any file its user can
    read. `root` confines them: a path resolving outside that folder is skipped (outside_root).

    The key is `key_col`'s value, else the image path without its extension (so two rows naming
    one image are a duplicate_key: give `key_col` to keep several captions per image), else the
    row number for embedded bytes. Columns other than these go to `.json` as "extra".

    `setting_names`: what messages call the parameters, {parameter: the caller's name}
    (`errors.setting`; the CLI passes its flags, {"class_col": "--class-col", ...}).
    """
    table, names = Path(table), setting_names
    if caption_col is None and class_col is None:
        raise UserError(f"a table gives captions, classes or both; pass "
                        f"{setting(names, 'caption_col', 'COL')}, "
                        f"{setting(names, 'class_col', 'COL')}, or both")
    if classnames_file is not None and class_col is None:
        file_setting = setting(names, "classnames_file")
        raise UserError(f"{file_setting} {classnames_file} names the classes of a class column; "
                        f"pass {setting(names, 'class_col', 'COL')} too, or leave {file_setting} "
                        "out")
    if root is not None:
        root = Path(root).resolve()
        if not root.is_dir():
            raise UserError(f"{setting(names, 'root')} {root} is not a folder; give the folder the "
                            "table's images must lie in")
    if table.is_dir():
        raise UserError(f"{table} is a folder; `data from-table` reads one .csv, .tsv, .jsonl or "
                        ".parquet file (for a folder of images with .txt captions or class "
                        "subfolders, use `data from-folder`)")
    if not table.is_file():
        raise UserError(f"table {table} not found; pass a .csv, .tsv, .jsonl or .parquet file")
    kind = _table_kind(table)
    file_names = None if classnames_file is None else load_classnames_file(classnames_file, names)
    counter = BadSampleCounter()
    needed = {"image_col": image_col, "caption_col": caption_col, "key_col": key_col,
              "class_col": class_col}
    needed = {setting(names, parameter): column for parameter, column in needed.items() if column}
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
        candidate = _table_candidate(row, index, table, image_col, caption_col, key_col, class_col,
                                     counter, root)
        if candidate is not None:
            candidates.append(candidate)
    if columns is None and seen_columns:
        _require_columns(table, seen_columns, needed)
    if not seen_columns and not counter.total:
        raise UserError(f"{table} holds no rows; pass a table with one row per image")
    image_files = [(c.source, c.image) for c in candidates if isinstance(c.image, Path)]
    fingerprint = files_fingerprint([(table.name, table), *image_files])
    classnames, note = None, None
    if class_col is not None:
        source = f"column {class_col!r} of {table}"
        candidates, classnames, note = _label(candidates, file_names, source, counter, names)
    candidates = drop_duplicate_keys(candidates, counter)
    if class_col is not None:  # tables are often sorted by class: see `in_shuffled_order`
        candidates = in_shuffled_order(candidates)
    return Listing(candidates, counter, fingerprint, classnames, classnames_note=note)


def _label(candidates: list[Candidate], file_names: list[str] | None, source: str,
           counter: BadSampleCounter, names: Mapping[str, str] | None
           ) -> tuple[list[Candidate], list[str], str | None]:
    """The candidates whose class is known, labelled; the class names; a line to print or None.
    Known only once every row is read: the column's values decide the class numbers."""
    values = [c.meta.pop("class") for c in candidates]
    labels, classnames, note = resolve_classes(values, file_names, source, counter, names)
    labelled = []
    for candidate, label in zip(candidates, labels):
        if label is not None:
            candidate.label, candidate.meta["class"] = label, classnames[label]
            labelled.append(candidate)
    return labelled, classnames, note


def _table_candidate(row: dict, index: int, table: Path, image_col: str, caption_col: str | None,
                     key_col: str | None, class_col: str | None, counter: BadSampleCounter,
                     root: Path | None) -> Candidate | None:
    """The candidate of one row, or None after counting why the row is skipped. Its class cell, if
    any, is left in meta["class"] for `_label`."""
    image, name, problem = _table_image(row.get(image_col), table.parent, root)
    caption = None  # without a caption column (a class table): no .txt
    if caption_col is not None:
        caption = row.get(caption_col)
        if caption is None:
            caption = ""  # counted as empty_caption when written, like a blank cell
        elif not isinstance(caption, str) and not problem:
            problem = "bad_caption"  # a number or a list where a caption belongs
    meta = {}
    if class_col is not None and not problem:
        meta["class"], problem = class_cell(row.get(class_col))
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
    extra = {column: value for column, value in row.items()
             if column not in (image_col, caption_col, key_col, class_col)}
    if extra:
        meta["extra"] = extra
    return Candidate(key, name or f"row {index}", image, caption, meta=meta)
