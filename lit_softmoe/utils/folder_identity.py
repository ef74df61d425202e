"""One id for the files of a folder that are read together (a tower's config.json and weights, a
LiT model's, a checkpoint's state.json and tensors): each file carries it (JSON as a key,
safetensors in its metadata), so a file copied in from another folder of the same kind, which
would read as this folder's, is found. Files that cannot carry it (an export's tokenizer, card and
ONNX graphs) are named by their sha256 in the folder's config.json instead
(`model_folders.FILES_SHA256`)."""
from __future__ import annotations

import uuid
from pathlib import Path

from safetensors import SafetensorError, safe_open

from lit_softmoe.errors import UserError

FOLDER_ID = "folder_id"  # the key, in a folder's JSON and in its safetensors files' metadata


def new_folder_id() -> str:
    """A fresh id, drawn for each folder written (never from the run's random generators)."""
    return uuid.uuid4().hex


def _metadata(path: str | Path) -> dict | None:
    """A safetensors file's metadata ({} without any); None when it does not read (its loader
    names that)."""
    try:
        with safe_open(str(path), framework="pt") as file:
            return file.metadata() or {}
    except (OSError, SafetensorError):
        return None


def check_same_folder(config: dict, config_file: Path, weights_file: Path) -> None:
    """One UserError line when `weights_file` was not written with `config` (read from
    `config_file`): another folder's weights copied in. A config without an id (an older folder's,
    or one written by hand) is not checked."""
    expected, metadata = config.get(FOLDER_ID), _metadata(weights_file)
    if expected is None or metadata is None or metadata.get(FOLDER_ID) == expected:
        return
    carries = f"another {FOLDER_ID}" if FOLDER_ID in metadata else f"no {FOLDER_ID}"
    raise UserError(f"{weights_file} was not written with the {Path(config_file).name} beside it "
                    f"(it carries {carries}: a file copied in from another folder); copy the whole "
                    "folder again, or write it anew")
