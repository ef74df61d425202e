"""The folders that hold a model, recognized by the files in them.

    EXPORT/     `lit-softmoe export` (see lit_softmoe.export)
        config.json (with "format" and "weights")  the weights files it names  [tokenizer/ ...]
    RUN/        a LiT run (`lit-softmoe train`) or a pretraining run (`lit-softmoe pretrain`)
        config.yaml  results.json  metrics.jsonl  eval/
        model/    config.json + model.safetensors: the LiT pair
                  (config.json has "text" and "image_tower_config")
        tower/    config.json + model.safetensors: the pretrained image tower
                  (config.json has "tower")
        checkpoints/step_00000500/   state.safetensors + state.json (lit_softmoe.train.checkpoint)

`classify_folder` tells which one a path is; the loaders (lit_softmoe.hub), the export and the eval
suite's default output path all start from it.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from lit_softmoe.errors import UserError
from lit_softmoe.models.export_weights import IMAGE_WEIGHTS, OPEN_CLIP, OURS, TEXT_WEIGHTS
from lit_softmoe.models.tower_folder import TOWER_CONFIG, TOWER_WEIGHTS
from lit_softmoe.utils.folder_identity import FOLDER_ID
from lit_softmoe.utils.hashing import file_sha256

# An export folder's files.
EXPORT_FORMAT = 3  # config.json's "format": the one this version writes
# Format 2 held the weights twice (ours + open_clip's copy) and hashed only the weights files:
# it still loads (our copy), but push wants format 3 (every file hashed).
READ_FORMATS = (2, EXPORT_FORMAT)
EXPORT_CONFIG, MODEL_CARD = "config.json", "README.md"
IMAGE_ONNX, TEXT_ONNX = "image_encoder.onnx", "text_encoder.onnx"
TOKENIZER_JSON, TOKENIZER_DIR = "tokenizer.json", "tokenizer"
# A run folder's files.
RUN_CONFIG = "config.yaml"
STATE_TENSORS, STATE_META = "state.safetensors", "state.json"
# an export's config.json: {the path of every other file in the export: its sha256}
FILES_SHA256 = "files_sha256"
# an export's config.json: the sha256 of its own other keys (`export_config_sha256`)
CONFIG_SHA256 = "config_sha256"

_EXPECTED = ("an export folder (from `lit-softmoe export`), a LiT run folder, its model/ folder, "
             "a LiT checkpoint folder RUN/checkpoints/step_N, or (for the image tower alone) a "
             "pretraining run or its tower/ folder")


def read_json(path: Path) -> dict:
    """A JSON file of a model folder, or one UserError line naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({err}); is it a complete folder?") from None


# ---- a checkpoint folder's files (train.checkpoint writes them; eval and export read them too) ---

class DamagedCheckpoint(Exception):
    """A checkpoint whose files do not read back (truncated, garbage, a field of the wrong type),
    or do not agree with each other and with the folder's name (a file copied in from another
    step's checkpoint)."""


def save_step_tensors(tensors: dict[str, torch.Tensor], path: Path, info: dict,
                      rank: int | None = None) -> None:
    """A checkpoint's tensors, with what its state.json `info` says they are
    (the step, the checkpoint's `FOLDER_ID`) and, in a sharded checkpoint, the process whose shard
    they are, in the file's own metadata (`load_step_tensors` checks it)."""
    metadata = {"step": str(info["step"]),
                **({FOLDER_ID: info[FOLDER_ID]} if FOLDER_ID in info else {}),
                **({"rank": str(rank)} if rank is not None else {})}
    save_file(tensors, path, metadata=metadata)


def load_step_tensors(path: Path, info: dict, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors `save_step_tensors` wrote beside the state.json `info`; DamagedCheckpoint when
    the file does not read back, or is another checkpoint's (of another step, or with another id).
    A file without the metadata is taken as it is."""
    try:
        with safe_open(path, framework="pt") as file:
            written = file.metadata() or {}
        tensors = load_file(path)
    except (OSError, SafetensorError) as err:
        raise DamagedCheckpoint(f"{path.name}: {err}") from None
    step = written.get("step")
    if step is not None and step != str(info["step"]):
        raise DamagedCheckpoint(f"{path.name} is of step {step}, but {STATE_META} and "
                                f"the folder's name of step {info['step']} (a file "
                                "copied from another checkpoint)")
    if FOLDER_ID in written and written[FOLDER_ID] != info.get(FOLDER_ID):
        raise DamagedCheckpoint(f"{path.name} was written with another {STATE_META} than "
                                "the one beside it (a file copied from another checkpoint, "
                                "of another run or another step)")
    if rank is not None and written.get("rank", str(rank)) != str(rank):
        raise DamagedCheckpoint(f"{path.name} holds process {written['rank']}'s shard, not process "
                                f"{rank}'s (files renamed or swapped)")
    return tensors


def read_checkpoint_tensors(ckpt_dir: str | Path,
                            name: str = STATE_TENSORS) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state.json, the tensors file `name`) of a checkpoint folder, each checked against the other
    and against the folder's name; DamagedCheckpoint says what is wrong."""
    info = read_state_meta(ckpt_dir)
    return info, load_step_tensors(Path(ckpt_dir) / name, info)


def read_state_meta(ckpt_dir: str | Path) -> dict:
    """A checkpoint folder's state.json, checked (a step, optimizer groups, the step its folder's
    name says); DamagedCheckpoint says what is wrong. Sharded checkpoints have the same one."""
    ckpt_dir = Path(ckpt_dir)
    try:
        info = json.loads((ckpt_dir / STATE_META).read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{STATE_META}: {err}") from None
    step = info.get("step") if isinstance(info, dict) else None
    step_ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
    if not step_ok or not isinstance(info.get("param_groups"), list):
        raise DamagedCheckpoint(f"{STATE_META} holds no step number and optimizer groups")
    # The folder's name orders the checkpoints: one whose state is of another step is not
    # what it claims.
    named = re.fullmatch(r"step_(\d+)", ckpt_dir.name)
    if named and int(named.group(1)) != step:
        raise DamagedCheckpoint(f"{STATE_META} holds step {step}, "
                                f"the folder's name step {int(named.group(1))}")
    return info



def require_keys(record: dict, keys, source: Path | str, fix: str) -> dict:
    """`record` (what `source` holds) if it has every one of `keys`, else one UserError line
    naming those it lacks and `fix`: this version writes them all, so a file without one was
    written by another version."""
    missing = [key for key in keys if key not in record]
    if missing:
        raise UserError(f"{source} has no {', '.join(missing)} "
                        f"(written by another version of lit-softmoe); {fix}")
    return record


def export_config_sha256(config: dict) -> str:
    """The sha256 an export's config.json records of itself (`CONFIG_SHA256`): of its other keys
    as sorted JSON, the card's entry in `FILES_SHA256` left out (a card edited on purpose is
    recorded there by hand)."""
    body = {key: value for key, value in config.items() if key != CONFIG_SHA256}
    if isinstance(body.get(FILES_SHA256), dict):
        body[FILES_SHA256] = {name: sha for name, sha in body[FILES_SHA256].items()
                              if name != MODEL_CARD}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_export_config(folder: Path) -> dict:
    """An export's config.json, or one UserError line when it is of an export format this version
    does not read, or when it is not the file the export wrote: its contents do not give the sha256
    it records of itself (an export without the record is taken as it is). Every other file is
    checked against the config's `FILES_SHA256` where it is read."""
    config = read_json(folder / EXPORT_CONFIG)
    if not isinstance(config, dict):
        raise UserError(f"{folder / EXPORT_CONFIG} holds a JSON {type(config).__name__}, not an "
                        "export's settings; copy or download the export again")
    found = config.get("format")
    if isinstance(found, int) and not isinstance(found, bool) and found > EXPORT_FORMAT:
        raise UserError(f"{folder} has export format {found}, newer than this lit-softmoe reads "
                        f"({EXPORT_FORMAT}); upgrade lit-softmoe")
    if found not in READ_FORMATS:
        raise UserError(f"{folder} has export format {found}, which this lit-softmoe does "
                        f"not read (it reads {' and '.join(map(str, READ_FORMATS))}); export "
                        "the run again with this version")
    if CONFIG_SHA256 in config and config[CONFIG_SHA256] != export_config_sha256(config):
        raise UserError(f"{folder / EXPORT_CONFIG} is not the file the export wrote (its contents "
                        f"do not give the {CONFIG_SHA256} it records): it was changed or damaged "
                        "since; copy or download the export again, or export the run again")
    return config


def check_export_weights(folder: Path, config: dict, files: dict[str, str]) -> None:
    """The export's weights `files` are the ones it wrote: each file's sha256 as its
    config.json records it (`FILES_SHA256`; an export without the record is taken as it is).
    Checked where a whole export is read (`load_pretrained`, eval): a flipped bit would otherwise
    be scored without a word."""
    recorded = config.get(FILES_SHA256)
    if not isinstance(recorded, dict):
        return
    for name in files:  # a missing one is the loader's to name
        if name in recorded and (folder / name).is_file() \
                and file_sha256(folder / name) != recorded[name]:
            raise UserError(f"{folder / name} is not the file the export wrote (its sha256 differs "
                            f"from the one {EXPORT_CONFIG} records): it was changed or damaged; "
                            "copy or download the export again")


def export_weight_files(folder: Path, config: dict) -> dict[str, str]:
    """{weights file: the names it holds its tensors under} of the export at `folder`
    (models.export_weights): what its config.json records, or format 2's own files
    (its open_clip copy held the same tensors again)."""
    if config["format"] == 2:
        return {IMAGE_WEIGHTS: OURS,
                **({TEXT_WEIGHTS: OURS} if config.get("kind") == "pair" else {})}
    files = require_keys(config, ("weights",), folder / EXPORT_CONFIG,
                         "export the run again")["weights"]
    if not isinstance(files, dict) or not files or not set(files.values()) <= {OURS, OPEN_CLIP} \
            or any("/" in name or "\\" in name or name.startswith(".") for name in files):
        raise UserError(f"{folder / EXPORT_CONFIG}'s \"weights\" is not a {{file: {OURS!r} | "
                        f"{OPEN_CLIP!r}}} mapping of files beside it; export the run again")
    return files


def _holds_export(config: dict, path: Path) -> bool:
    """Whether a folder's config.json is an export's: it has a format, and names its weights
    (format 3) or sits beside format 2's image weights."""
    return "format" in config and ("weights" in config or (path / IMAGE_WEIGHTS).is_file())


def read_run_config(run_dir: Path) -> dict:
    """A run folder's config.yaml as a plain dict ({} when it holds no mapping)."""
    from omegaconf import OmegaConf
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(run_dir / RUN_CONFIG))
    except Exception as err:  # noqa: BLE001 — any YAML problem is the user's file,
        # named in one line
        raise UserError(f"cannot read {run_dir / RUN_CONFIG} ({err})") from None
    return loaded if isinstance(loaded, dict) else {}


def checkpoint_order(path: Path) -> tuple[int, str]:
    """Sort key of `step_N` folders by N, so that a name not zero-padded (step_5, made by hand)
    takes its step's place rather than its spelling's."""
    named = re.fullmatch(r"step_(\d+)", path.name)
    return (int(named.group(1)) if named else -1, path.name)


def checkpoints_newest_first(checkpoints_dir: str | Path) -> list[Path]:
    """The complete `step_*` folders, newest first. Temporary folders start with '.' and are
    ignored; so is a link at a step's name: the run writes its checkpoints itself, so a link there
    is someone else's (one into another run would continue that run's weights as this one's)."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    return sorted((p for p in checkpoints_dir.glob("step_*")
                   if not p.is_symlink() and (p / STATE_META).is_file()),
                  key=checkpoint_order, reverse=True)


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete `step_*` folder, or None."""
    return next(iter(checkpoints_newest_first(checkpoints_dir)), None)


def _missing_checkpoint(path: Path) -> str | None:
    """The line for a RUN/checkpoints/step_N that is not there while its run folder is
    (a training run keeps only its newest `keep_checkpoints`, and deletes older ones as it goes);
    None for other paths."""
    named = re.fullmatch(r"step_(\d+)", path.name)
    run_dir = path.parent.parent
    if not named or path.parent.name != "checkpoints" or path.is_symlink() \
            or not (run_dir / RUN_CONFIG).is_file():
        return None
    # a pretraining run's checkpoints are no model folder
    if "text" not in read_run_config(run_dir):
        return None
    newest = latest_checkpoint(path.parent)
    if newest is None:
        return (f"{path} does not exist, and the run {run_dir} holds no checkpoint now; point to "
                "the run folder once its training has finished")
    newer = re.fullmatch(r"step_(\d+)", newest.name)
    if newer and int(newer.group(1)) > int(named.group(1)):
        return (f"{path} was removed by its run, which keeps only its newest checkpoints "
                f"(keep_checkpoints); the newest is {newest}: point to that one, or to the run "
                "folder once its training has finished")
    return f"{path} does not exist (not written yet?); the newest checkpoint of its run is {newest}"


def is_export(path: Path) -> bool:
    try:
        return _holds_export(json.loads((path / EXPORT_CONFIG).read_text()), path)
    except (OSError, ValueError, TypeError):
        return False


@dataclass
class ModelFolder:
    kind: str  # "export" | "lit-model" | "checkpoint" | "tower"
    path: Path  # the export / model / checkpoint / tower folder itself
    # the run folder holding it (config.yaml, results.json, eval/), if any
    run_dir: Path | None = None


def classify_folder(path: str | Path) -> ModelFolder:
    """Recognize a folder by the files in it; a run folder that has not finished says how
    to finish it."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(_missing_checkpoint(path)
                        or f"{path} is not a folder; expected {_EXPECTED}")
    config = path / EXPORT_CONFIG
    if config.is_file() and _holds_export(read_json(config), path):
        return ModelFolder("export", path)
    if config.is_file() and (path / TOWER_WEIGHTS).is_file():
        meta = read_json(config)
        holder = path.parent if (path.parent / RUN_CONFIG).is_file() else None
        if "text" in meta and "image_tower_config" in meta:  # RUN/model, written by the LiT recipe
            return ModelFolder("lit-model", path, holder)
        if "tower" in meta:  # RUN/tower, written by pretraining
            return ModelFolder("tower", path, holder)
    if (path / "model" / EXPORT_CONFIG).is_file() and (path / "model" / TOWER_WEIGHTS).is_file():
        return ModelFolder("lit-model", path / "model", path)
    if (path / "tower" / TOWER_CONFIG).is_file() and (path / "tower" / TOWER_WEIGHTS).is_file():
        return ModelFolder("tower", path / "tower", path if (path / RUN_CONFIG).is_file() else None)
    # A LiT checkpoint describes the pair it holds (state.json's "model"); a pretraining
    # one does not.
    if (path / STATE_META).is_file() and (path / STATE_TENSORS).is_file() \
            and isinstance(read_json(path / STATE_META).get("model"), dict):
        return ModelFolder("checkpoint", path,
                           path.parent.parent if path.parent.name == "checkpoints" else None)
    if (path / RUN_CONFIG).is_file():
        run_config = read_run_config(path)
        if "text" in run_config:
            raise UserError(f"{path} is a LiT run whose training has not finished (no model/ "
                            f"folder); run `lit-softmoe train --config {path / RUN_CONFIG}` to "
                            "resume it, or point to one of its checkpoints "
                            f"({path / 'checkpoints'}/step_N)")
        if "tower" in run_config:
            raise UserError(f"{path} is a pretraining run that has not finished (no tower/ "
                            "folder); run `lit-softmoe pretrain --config "
                            f"{path / RUN_CONFIG}` to resume it")
    raise UserError(f"{path} is not a model folder lit-softmoe knows; expected {_EXPECTED}")
