"""Class labels from a table's class column (`lit-softmoe data from-table --class-col`): each row's
cell becomes the sample's `.cls` and `.json` "class", and the classes become `classnames.txt`, as
`data from-folder --layout classes` writes them, so pretraining and zero-shot evaluation read both.

Without a class-names file the cells are names: the classes are the names met, numbered in sorted
order as class folders are (a whole number is a name too: `7` is the class "7"). With one (one
name per line, in label order), the file fixes the classes and their order: a column of whole
numbers is read as indices into it, any other as names from it. Numbers are indices only then,
because a column of numbers alone says nothing of the names the text tower and the zero-shot
prompts need, nor of how many classes there are.

A row whose class is empty (`empty_class`), not a name or a whole number (`bad_class`: a list, a
fraction, a name with a line break, which classnames.txt cannot hold) or not among the file's
classes (`unknown_class`) is skipped and counted, as the table's other bad rows are.
"""
from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path
from typing import Any, Mapping

from lit_softmoe.data.shards import class_name_difference, class_name_key, read_classnames_file
from lit_softmoe.data.tar_reading import BadSampleCounter
from lit_softmoe.errors import UserError, setting

_WHOLE_NUMBER = re.compile(r"[+-]?\d+")


def class_cell(cell: Any) -> tuple[str | int | None, str | None]:
    """(the class a cell names: a name or a whole number, None) or (None, the reason to skip its
    row)."""
    # Parquet's null, pandas' NaN
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return None, "empty_class"
    if isinstance(cell, bool):
        return None, "bad_class"
    if isinstance(cell, int):
        return cell, None
    if isinstance(cell, float):  # an integer column with a null in it, as pandas writes it
        return (int(cell), None) if cell.is_integer() else (None, "bad_class")
    if not isinstance(cell, str):
        return None, "bad_class"
    # NFC: `café` typed on two systems (composed and decomposed) is one class, as it is one caption
    # word.
    name = unicodedata.normalize("NFC", cell).strip()
    if not name:
        return None, "empty_class"
    if any(unicodedata.category(char) in ("Cc", "Zl", "Zp") for char in name):
        # one name per line of classnames.txt: a line break would shift the rest
        return None, "bad_class"
    return name, None


def load_classnames_file(path: str | Path,
                         setting_names: Mapping[str, str] | None = None) -> list[str]:
    """The class names of a class-names file, one per line in label order
    (`shards.read_classnames_file`). Messages call the file as `setting_names` calls
    `classnames_file` (`errors.setting`; the CLI passes --classnames)."""
    path, what = Path(path), setting(setting_names, "classnames_file")
    hint = "give a text file with one class name per line, in label order"
    if path.is_dir() or not path.exists():
        raise UserError(f"{what} {path} is {'a folder' if path.is_dir() else 'not found'}; {hint}")
    try:
        names = read_classnames_file(path)
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {what} {path} ({err}); {hint}") from None
    if not names:
        raise UserError(f"{what} {path} holds no class names; {hint}")
    return [unicodedata.normalize("NFC", name) for name in names]  # as the table's cells are read


def resolve_classes(values: list[str | int], file_names: list[str] | None, source: str,
                    counter: BadSampleCounter, setting_names: Mapping[str, str] | None = None
                    ) -> tuple[list[int | None], list[str], str | None]:
    """(each value's label, None where its row is skipped as unknown_class; the class names in label
    order; a line to print where the reading may surprise, else None). `source` names the column and
    the file in messages; `setting_names` what they call the class-names file
    (`classnames_file`)."""
    if file_names is None:
        names = [str(value) for value in values]
        classnames = sorted(set(names))
        seen: dict[str, str] = {}
        for name in classnames:
            other = seen.setdefault(class_name_key(name), name)
            if other != name:
                raise UserError(f"{source}: the classes {other!r} and {name!r} are one name "
                                f"{class_name_difference(other, name)}, which would be two classes "
                                "with the same prompts; write the name one way in every row")
        label_of = {name: label for label, name in enumerate(classnames)}
        note = None
        if names and all(_WHOLE_NUMBER.fullmatch(name) for name in names):
            note = (f"{source} holds whole numbers, read as class names sorted as text (\"1\", "
                    f"\"10\", \"2\" …); pass {setting(setting_names, 'classnames_file', 'FILE')} "
                    "to read them as indices into FILE's names")
        return [label_of[name] for name in names], classnames, note
    if all(isinstance(value, int) or _WHOLE_NUMBER.fullmatch(value) for value in values):
        labels = [int(value) for value in values]
        labels = [label if 0 <= label < len(file_names) else None for label in labels]
        for value, label in zip(values, labels):
            if label is None:
                counter.skip("unknown_class",
                             f"{source}: index {value} is outside 0…{len(file_names) - 1}")
        return labels, file_names, None
    label_of: dict[str, int] = {}
    repeated = set()
    for label, name in enumerate(file_names):
        if name in label_of:
            repeated.add(name)
        label_of.setdefault(name, label)
    labels = []
    for value in map(str, values):
        if value in repeated:
            raise UserError(f"{source}: the class {value!r} is listed twice in the class-names "
                            "file, so its name cannot tell the two classes apart; give the table a "
                            "column of class indices, or make the file's names unique")
        label = label_of.get(value)
        if label is None:
            counter.skip("unknown_class", f"{source}: {value!r} is not in the class-names file")
        labels.append(label)
    return labels, file_names, None
