"""`init_from`: a pretraining run that starts from a tower folder's weights instead of a random
init.

The second half of sparse upcycling (Komatsuzaki et al., ICLR 2023): `lit-softmoe upcycle` writes a
Soft MoE tower folder from a dense one, and `pretrain init_from=FOLDER` trains it on. Any tower
folder works: `upcycle`'s, `convert`'s, or the `tower/` of an earlier pretraining run.

- The config's `tower.name` and `tower.options` must describe the folder's tower (every field of its
  ViTConfig but the class count): the run's config.yaml then says what it trains, and a path to
  another tower is one line before any data is read, with the fix.
- The class head is kept when the folder's class names are data.train's (same names, same order),
  else replaced by a fresh one, initialized as at construction.
- Inputs are normalized with the folder's `preprocess` mean and std, the ones its weights were
  trained on (and what the saved tower records).
- The source's fingerprint (sha256 of its weights, its tower config and preprocessing) goes into
  every checkpoint: a resumed run restores its own weights from the checkpoint, and refuses a source
  that changed since (a source that is gone is only a warning: the checkpoint holds all it needs).
"""
from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import image_tower_config, list_image_towers
from lit_softmoe.models.tower_folder import (
    TOWER_CONFIG,
    TOWER_WEIGHTS,
    check_state_dict,
    load_weights,
    read_tower_meta,
    tower_fingerprint,
)
from lit_softmoe.models.vit_config import ViTConfig

_log = logging.getLogger(__name__)

# Fields that may differ between the folder and the config: the head is kept or replaced on its own,
# and shared_expert_init only chooses how experts are drawn at construction
# (the folder's are loaded).
_FREE_FIELDS = {"num_classes", "shared_expert_init"}


def _architecture(cfg: ViTConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(ViTConfig) if f.name not in _FREE_FIELDS}


def _same_architecture(path: Path, folder_cfg: ViTConfig, tower_name: str, tower_options: dict,
                       tower_cfg: ViTConfig) -> None:
    folder, config = _architecture(folder_cfg), _architecture(tower_cfg)
    differ = [key for key in folder if folder[key] != config[key]]
    if not differ:
        return
    registered = [name for name in list_image_towers()
                  if _architecture(image_tower_config(name)) == folder]
    if registered and tower_name not in registered:  # else the options are what differs
        fix = f"tower.name={registered[0]} (and no tower.options)"
    else:
        fix = " ".join(f"tower.options.{key}="
                       f"{list(folder[key]) if key == 'moe_layers' else folder[key]}"
                       for key in differ)
    shown = ", ".join(f"{key} {list(folder[key]) if key == 'moe_layers' else folder[key]} (config: "
                      f"{list(config[key]) if key == 'moe_layers' else config[key]})"
                      for key in differ[:4])
    options = f" with options {dict(tower_options)}" if tower_options else ""
    raise UserError(f"init_from {path} is not a {tower_name}{options} tower: {shown}"
                    f"{' and more' if len(differ) > 4 else ''}; set {fix} to train it")


def read_init_source(path: str, run_dir: str, tower_name: str, tower_options: dict,
                     tower_cfg: ViTConfig, resuming: bool) -> dict | None:
    """The source folder's fingerprint {"path", "tower_sha256", "tower", "preprocess",
    "classnames"}, checked against the config's tower before any data is read. None when a resumed
    run's source is gone (a warning: its checkpoint holds the weights)."""
    folder = Path(path)
    if folder.resolve() == (Path(run_dir) / "tower").resolve():
        raise UserError(f"init_from {path} is this run's own tower folder, which the run replaces "
                        "when it ends; keep the source elsewhere (e.g. upcycle --out towers/NAME) "
                        "or pass another run_dir=...")
    if not (folder / TOWER_CONFIG).is_file() or not (folder / TOWER_WEIGHTS).is_file():
        if resuming:
            _log.warning("init_from %s is gone; the run resumes from its checkpoint, which holds "
                         "the weights trained since (the source cannot be checked for changes)",
                         path)
            return None
        raise UserError(f"init_from {path} is not a tower folder (needs {TOWER_CONFIG} and "
                        f"{TOWER_WEIGHTS}); give the tower/ of a pretraining run or the --out of "
                        "`lit-softmoe upcycle` or `convert`")
    fingerprint = tower_fingerprint(folder)
    try:
        folder_cfg = ViTConfig.from_dict(fingerprint["tower"])
    except (KeyError, TypeError, ValueError, UserError) as err:
        raise UserError(f"{folder / TOWER_CONFIG} has no valid tower config: {err}") from None
    _same_architecture(folder, folder_cfg, tower_name, tower_options, tower_cfg)
    classnames = read_tower_meta(folder).get("classnames")
    return {"path": str(path), **fingerprint, "classnames": classnames}


def head_decision(source: dict, classnames: list[str]) -> tuple[bool, str]:
    """(keep the folder's class head?, why, in words for the run's output)."""
    folder_classes = source["tower"].get("num_classes", 0)
    names = source.get("classnames")
    if not folder_classes:
        return False, "the folder has no class head"
    if folder_classes != len(classnames):
        return False, (f"the folder's {folder_classes} classes are not data.train's "
                       f"{len(classnames)}")
    if names is None:
        return False, "the folder records no class names to compare with data.train's"
    if list(names) != list(classnames):
        first = next(i for i, (a, b) in enumerate(zip(names, classnames)) if a != b)
        return False, (f"the folder's class {first} is {names[first]!r}, data.train's is "
                       f"{classnames[first]!r}")
    return True, f"its {folder_classes} classes are data.train's"


def load_init_weights(tower: torch.nn.Module, source: dict, keep_head: bool) -> None:
    """The folder's weights into `tower` (built by the config, so of the same architecture); its
    head too when `keep_head`, else the tower keeps the fresh head it was built with."""
    weights = Path(source["path"]) / TOWER_WEIGHTS
    skip = () if keep_head else ("head.",)
    state = {k: v for k, v in load_weights(weights).items() if not (skip and k.startswith(skip))}
    check_state_dict(tower, state, str(weights), skip)
    tower.load_state_dict(state, strict=keep_head)


def check_unchanged(recorded: dict | None, source: dict | None) -> None:
    """Refuse to resume a run whose init_from folder changed since the run started from it."""
    if recorded is None or source is None:
        return
    changed = [key for key in ("tower_sha256", "tower", "preprocess")
               if recorded.get(key) != source.get(key)]
    if changed:
        what = {"tower_sha256": "weights", "tower": "tower config", "preprocess": "preprocessing"}
        raise UserError(f"init_from {source['path']} changed since this run started from it (its "
                        f"{' and '.join(what[key] for key in changed)}); restore that tower, or "
                        "start a new run with another run_dir=...")
