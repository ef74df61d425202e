"""The tower folder: an image tower on disk as `model.safetensors` + `config.json`, nothing pickled.

    TOWER/
        model.safetensors   the VisionTransformer's state dict
        config.json         {"tower": ViTConfig as a dict,
                             "preprocess": {"image_size", "mean", "std"},
                             ...what its writer adds: "classnames", "pretrain", "upcycled_from",
                             ..., and timm's hub keys beside ours: "architecture", "num_classes",
                             "num_features", "pretrained_cfg", "model_args" (models.timm_config), so
                             that `timm.create_model("local-dir:TOWER")` builds it}

Pretraining, `upcycle` and `convert` write it; LiT, `embed`, `eval`, `export` and `inspect-routing`
read it. A timm model named `timm:NAME` (models.timm_tower) is written into one on first use: its
"tower" is a `TimmTowerConfig`, its weights the timm model's, and the readers here take either. It
is written into a temporary sibling folder and renamed into place, so a run killed mid-write never
leaves a half-written tower under the final name.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from lit_softmoe.errors import UserError
from lit_softmoe.models.preprocess import Preprocess, check_settings, require_settings
from lit_softmoe.models.timm_config import timm_hub_keys
from lit_softmoe.models.timm_tower import (
    TimmTower,
    TimmTowerConfig,
    build_timm_tower,
    fill_computed_buffers,
    folder_for,
    is_timm_spec,
    is_timm_tower_config,
    pretrained_timm_tower,
    timm_hub_config,
)
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig
from lit_softmoe.nn.expert_parallel import split_experts
from lit_softmoe.utils.atomic import recover, write_folder_atomically, write_text_atomic
from lit_softmoe.utils.folder_identity import FOLDER_ID, check_same_folder, new_folder_id
from lit_softmoe.utils.hashing import safetensors_weights_sha256
from lit_softmoe.utils.paths import check_writable

TOWER_WEIGHTS, TOWER_CONFIG = "model.safetensors", "config.json"
_log = logging.getLogger(__name__)


def contiguous_state(module: torch.nn.Module,
                     skip_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """`module`'s state dict as safetensors takes it: it refuses shared or non-contiguous storage,
    so a tensor that is either is copied; the others are written as they are (a paper-scale tower is
    not held twice)."""
    state, storages = {}, set()
    for name, value in module.state_dict().items():
        if name.startswith(skip_prefixes):
            continue
        value = value.detach()
        storage = value.untyped_storage().data_ptr()
        if not value.is_contiguous() or storage in storages:
            value = value.contiguous().clone()
        storages.add(value.untyped_storage().data_ptr())
        state[name] = value
    return state


def save_tower(out_dir: str | Path, tower: VisionTransformer | TimmTower,
               extra: dict | None = None) -> Path:
    """Save a tower (ours or a timm model's) as safetensors + config.json: its config under "tower",
    `extra` (which a timm tower's must give "preprocess"), and timm's hub keys, so that timm's
    `local-dir:` builds it."""
    extra = extra or {}
    if isinstance(tower, TimmTower):
        hub_keys = timm_hub_config(tower, extra["preprocess"])
    else:
        hub_keys = timm_hub_keys(tower.cfg, extra.get("preprocess"))
    meta = {"tower": tower.cfg.to_dict(), **extra, **hub_keys, FOLDER_ID: new_folder_id()}

    def write(tmp: Path):
        save_file(contiguous_state(tower), tmp / TOWER_WEIGHTS,
                  metadata={FOLDER_ID: meta[FOLDER_ID]})
        (tmp / TOWER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")

    return write_folder_atomically(out_dir, write)


def tower_folder(path: str | Path) -> Path:
    """The folder a tower setting names: a folder as given, or a `timm:` spec's cached folder
    (written on first use)."""
    return _timm_folder(path) if is_timm_spec(path) else Path(path)


def _timm_folder(spec: str) -> Path:
    """The tower folder of a `timm:` spec, written into the cache on first use (atomically: two
    processes that race write the same folder, and the second keeps the first's). A cached folder
    whose files do not belong together (one copied in from another) is said in a warning and written
    again, as every cache is."""
    folder = folder_for(spec)
    complete = (folder / TOWER_CONFIG).is_file() and (folder / TOWER_WEIGHTS).is_file()
    if complete:
        try:
            check_same_folder(json.loads((folder / TOWER_CONFIG).read_text()),
                              folder / TOWER_CONFIG, folder / TOWER_WEIGHTS)
        except (UserError, ValueError, AttributeError) as err:
            _log.warning("the cached tower of %s is damaged (%s); writing it again", spec, err)
            complete = False
    if not complete:
        tower, preprocess = pretrained_timm_tower(spec)
        save_tower(folder, tower, extra={"preprocess": preprocess, "source": spec})
    return folder


def update_tower_meta(tower_dir: str | Path, updates: dict) -> None:
    """Merge `updates` into a saved tower's config.json (rewritten atomically; weights
    untouched)."""
    path = Path(tower_dir) / TOWER_CONFIG
    write_text_atomic(path,
                      json.dumps({**json.loads(path.read_text()), **updates}, indent=2) + "\n")


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                     skip_prefixes: tuple[str, ...] = ()) -> None:
    """Raise UserError naming every missing, unexpected or mis-shaped key (a loud, pure loader)."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(skip_prefixes)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = key_problems(missing, unexpected=unexpected)
    if mismatched:
        problems.append(f"{len(mismatched)} shapes differ, checkpoint vs tower (e.g. "
                        f"{'; '.join(mismatched[:2])})")
    if problems:
        raise UserError(f"{source} does not fit the tower: {'; '.join(problems)}; "
                        "use the tower name and options the checkpoint was trained with")


def key_problems(missing: list[str], unexpected: list[str] = (),
                 unused: list[str] = ()) -> list[str]:
    """What a checkpoint and a model disagree on, in words: how many keys of each kind, and the
    first few."""
    kinds = (("missing {} keys", missing), ("unexpected {} keys", unexpected),
             ("{} keys left unused", unused))
    return [f"{words.format(len(keys))} (e.g. {', '.join(keys[:3])})"
            for words, keys in kinds if keys]


def load_weights(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                 rows: dict[str, slice] | None = None) -> dict[str, torch.Tensor]:
    """A safetensors file, or one UserError line naming it when it is missing or damaged (a folder
    copied only in part, a truncated download). `dtype`: its floating tensors cast to it one at a
    time as they are read, so that only the cast weights are ever held whole. `rows`: of the
    tensors it names, only these rows (of their first axis) are read."""
    rows = rows or {}
    device = torch.device(device)
    # safetensors refuses "cpu:0" (accelerate's, in DDP)
    device = device.type if device.type == "cpu" else str(device)
    try:
        if dtype is None and not rows:
            return load_file(path, device=device)
        with safe_open(path, framework="pt", device=device) as file:
            return {name: _cast(file.get_slice(name)[rows[name]] if name in rows
                                else file.get_tensor(name), dtype) for name in file.keys()}
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}: {err}); the folder is "
                        "incomplete or damaged: copy it again or write it anew") from None


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def read_tower_meta(path: str | Path) -> dict:
    """A tower folder's (or `timm:` spec's) config.json, or one UserError line saying why `path` is
    no tower folder."""
    path = tower_folder(path)
    config_file = path / TOWER_CONFIG
    if not config_file.is_file() or not (path / TOWER_WEIGHTS).is_file():
        raise UserError(f"{path} is not a tower checkpoint (needs {TOWER_CONFIG} and "
                        f"{TOWER_WEIGHTS}); point to the `tower` folder of a finished pretraining "
                        "run")
    try:
        meta = json.loads(config_file.read_text())
    except ValueError as err:
        raise UserError(f"{config_file} is not valid JSON ({err}); "
                        "the tower folder is damaged: save or copy it again") from None
    if not isinstance(meta, dict):
        raise UserError(f"{config_file} holds a JSON {type(meta).__name__}, not a tower's "
                        "settings; the tower folder is damaged: save or copy it again")
    if "preprocess" in meta:
        tower = meta.get("tower") if isinstance(meta.get("tower"), dict) else {}
        check_settings(meta["preprocess"], tower.get("in_channels"), config_file)
    # not another tower's weights copied in
    check_same_folder(meta, config_file, path / TOWER_WEIGHTS)
    return meta


def tower_preprocess(path: str | Path, tower: VisionTransformer | TimmTower,
                     meta: dict) -> Preprocess:
    """The preprocessing the tower folder at `path` (or a `timm:` spec's) records for `tower`, from
    its config.json's contents `meta`; one UserError line naming that file when it has none."""
    return Preprocess.from_settings(meta.get("preprocess"), tower.cfg.in_channels,
                                    tower_folder(path) / TOWER_CONFIG)


def resolution_change(tower: VisionTransformer | TimmTower, preprocess: dict) -> str | None:
    """Words for a start line when `preprocess` resizes images to another size than the tower was
    built for (a ViT's position embeddings are then resampled to the new patch grid); None when the
    two agree."""
    built, size = getattr(tower.cfg, "image_size", None), preprocess.get("image_size")
    if built is None or size is None or built == size:
        return None
    return (f"images at {size} px (preprocess.image_size), not the {built} px the tower was built "
            "for")


def load_tower(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
               expert_mesh=None) -> tuple[VisionTransformer | TimmTower, dict]:
    """Load a tower folder written by `save_tower` (or a `timm:` spec's) onto `device`, its floating
    weights in `dtype` (None: as stored; cast as they are read, see `load_weights`); returns (tower,
    its config.json contents).

    `expert_mesh`: an expert group's 1-D DeviceMesh. The tower comes with its MoE layers' experts
    split over it (`nn.expert_parallel.place_experts`), and only this process's chunk of them is
    read from the file: no process reads, or holds, the whole tower."""
    path = tower_folder(path)
    if not path.exists():
        try:
            recover(path)  # a save killed mid-replace, on a system without an atomic exchange
        except OSError:  # e.g. a read-only folder: say below that there is no tower
            pass
    meta = read_tower_meta(path)
    tower = tower_skeleton(meta.get("tower") if isinstance(meta, dict) else None, path)
    chunks = {} if expert_mesh is None else _split_experts(tower, expert_mesh)
    state = load_weights(path / TOWER_WEIGHTS, device, dtype,
                         rows={name: rows for name, (rows, _) in chunks.items()})
    for name, (_, template) in chunks.items():  # this process's rows, as the placed DTensor
        state[name] = DTensor.from_local(state[name], template.device_mesh, template.placements,
                                         run_check=False, shape=template.shape,
                                         stride=template.stride())
    check_state_dict(tower, state, str(path / TOWER_WEIGHTS))
    tower.load_state_dict(state, assign=True)
    return fill_computed_buffers(tower), meta


def _split_experts(tower: torch.nn.Module, expert_mesh) -> dict[str, tuple[slice, DTensor]]:
    """Place the (meta) tower's experts over `expert_mesh`; {name: (the rows of the file this
    process reads, the placed parameter)} for every expert weight."""
    split_experts(tower, expert_mesh)
    index = expert_mesh.get_local_rank()
    chunks = {}
    for name, param in tower.named_parameters():
        if isinstance(param, DTensor):
            held = param.to_local().shape[0]
            chunks[name] = (slice(index * held, (index + 1) * held), param)
    return chunks


def tower_skeleton(tower_cfg: dict | None,
                   path: str | Path = "the tower folder") -> VisionTransformer | TimmTower:
    """The tower a config.json's "tower" entry describes (ours, or a timm model's), on the meta
    device (no memory, no weights); after loading its weights, `fill_computed_buffers` gives it the
    buffers they lack."""
    try:
        if is_timm_tower_config(tower_cfg):
            return build_timm_tower(TimmTowerConfig.from_dict(tower_cfg))
        return VisionTransformer(ViTConfig.from_dict(tower_cfg), device="meta")
    except (KeyError, TypeError, ValueError, RuntimeError, UserError) as err:
        raise UserError(f"{Path(path) / TOWER_CONFIG} has no valid tower config: {err}") from None


def tower_fingerprint(tower_dir: str | Path) -> dict:
    """What a tower's outputs depend on: its weights, its config and its preprocessing.

    Returns {"tower_sha256", "tower", "preprocess"} (caches of its embeddings are keyed by it),
    where "tower_sha256" is the weights' identity (`utils.hashing.weights_sha256` of its
    model.safetensors); raises UserError if `tower_dir` is not a tower folder or its config.json has
    no preprocessing (a cache would not know how the images were resized and normalized).
    """
    tower_dir = tower_folder(tower_dir)
    meta = read_tower_meta(tower_dir)
    preprocess = meta.get("preprocess")
    require_settings(preprocess, tower_dir / TOWER_CONFIG)
    return {"tower_sha256": safetensors_weights_sha256(tower_dir / TOWER_WEIGHTS),
            "tower": meta.get("tower"), "preprocess": preprocess}


def check_tower_out(out_dir: str | Path, record_key: str, record: dict, overwrite: bool,
                    source: str | Path, out_setting: str = "out_dir",
                    overwrite_setting: str = "overwrite=True") -> None:
    """Refuse, before any work, an `out_dir` that saving a tower there would destroy.

    Saving replaces the whole folder, so a non-empty one (a run, a dataset, another tower) needs
    `overwrite`, as export's --out does. A tower this same command wrote (config.json's
    `record_key` entry holds `record`) is replaced without it: a rerun gives the same tower.
    Never, even with `overwrite`: the folder the tower is read from, or one holding it.
    Messages name the folder `out_setting` and the override `overwrite_setting`, as the caller
    knows them (the CLI passes its flags, "--out" and "--overwrite").
    """
    out_dir = Path(out_dir)
    check_writable(out_dir, out_setting, folder=True)
    target, source = out_dir.resolve(), Path(source).resolve()
    if target == source or target in source.parents:
        raise UserError(f"{out_setting} {out_dir} holds the input {source}; pick another folder")
    if (source / TOWER_CONFIG).is_file() and source in target.parents:
        # Saving the source tower again (a pretraining rerun) replaces its folder whole, with this
        # one.
        raise UserError(f"{out_setting} {out_dir} is inside the input tower folder {source}; "
                        "pick a folder outside it")
    if overwrite or not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    try:
        written = json.loads((out_dir / TOWER_CONFIG).read_text()).get(record_key) or {}
    except (OSError, ValueError, AttributeError):
        written = {}
    own_files = {p.name for p in out_dir.iterdir()} <= {TOWER_CONFIG, TOWER_WEIGHTS}
    if not (own_files and isinstance(written, dict)
            and all(written.get(k) == v for k, v in record.items())):
        raise UserError(f"{out_setting} {out_dir} exists and is not empty; pass "
                        f"{overwrite_setting} to replace it, or pick another folder")
