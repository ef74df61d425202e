"""Any timm image model as a locked tower: `image_tower: timm:NAME` in LiT configs and
`embed --tower`.

LiT's usual starting point is a pretrained backbone someone else trained (an augreg ViT, DINOv2,
SigLIP's image tower, EVA), and a dense tower is the baseline a Soft MoE tower is measured against;
open_clip (`TimmModel`) and big_vision lock any backbone. A spec names the model and where its
weights come from, as `timm.create_model` takes them:

    timm:vit_base_patch16_224.augreg_in21k        timm's pretrained tag (downloaded by timm)
    timm:hf-hub:timm/vit_base_patch16_224.augreg_in21k
    timm:vit_tiny_patch16_224?file=/data/vit_tiny.safetensors   a local checkpoint (timm's
                                                  `pretrained_cfg_overlay=dict(file=...)`)

The first use writes the model into a tower folder in the cache (`models.tower_folder`): timm's own
hub layout (`config.json` with "architecture", "num_classes", "pretrained_cfg", "model_args", and
the model's `model.safetensors`), plus our "tower" and "preprocess" entries. Every later step (the
feature cache and its fingerprint, LiT, eval, export, `load_pretrained`) reads that folder as it
reads our towers', and `timm.create_model("local-dir:FOLDER")` builds the same model.

The tower is the timm model built with `num_classes=0` (`TimmTower` mixed into its class); its
features are timm's pre-logits (`forward_head(forward_features(x), pre_logits=True)`: the model's
own pooling and norm), as open_clip's `TimmModel` (`timm_proj: none`) takes them. Preprocessing: the
model's mean, std and input size from timm's data config; resized and cropped as our towers are
(shorter side to the size, bilinear, center crop), so that embed, LiT, eval and every export
preprocess alike.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import parse_qs

import torch
from torch import nn

from lit_softmoe.errors import UserError, first_line
from lit_softmoe.models.tower_layers import tower_layers
from lit_softmoe.utils.hashing import cache_key
from lit_softmoe.utils.paths import cache_root

TIMM_PREFIX = "timm:"


def is_timm_spec(spec: str | os.PathLike) -> bool:
    return isinstance(spec, str) and spec.startswith(TIMM_PREFIX)


@dataclass
class TimmTowerConfig:
    """What rebuilds a timm tower without its weights (config.json's "tower" for a timm tower)."""
    timm_model_name: str  # timm's architecture, e.g. vit_tiny_patch16_224
    image_size: int
    in_channels: int
    width: int  # the pre-logits features' size: timm's head_hidden_size
    # keywords the model was built with (a hub config's)
    model_args: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TimmTowerConfig":
        return cls(**d)


def is_timm_tower_config(tower: dict | None) -> bool:
    return isinstance(tower, dict) and "timm_model_name" in tower


class TimmTower:
    """The tower interface on a timm model, mixed into its class (`as_tower`), as FSDP2 mixes
    FSDPModule into the modules it shards: the model's parameters keep their names (its state dict
    is timm's, in the tower folder and under `image_tower.` in a pair), and everything else it
    offers is untouched.

    What LiT, embed and the memory plan use of a tower, answered from timm's own API so that no
    layout is assumed (a ViT's `blocks`, a ResNet's `layer1`, a Swin's `layers`): `cfg` (image_size,
    in_channels, width), `embed_dim`, `forward_pooled` (the pre-logits features (B, width): the
    model's own pooling and norm), `layer_ids` (from `group_matcher`, see models.tower_layers) and
    `no_weight_decay`."""
    cfg: TimmTowerConfig

    @property
    def embed_dim(self) -> int:
        return self.cfg.width

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x), pre_logits=True)  # (B, width)

    def layer_ids(self) -> dict[str, int]:
        """Each parameter's layer, as timm's `param_groups_layer_decay` numbers them
        (`models.tower_layers`)."""
        return tower_layers(self).layer_ids

    def no_weight_decay(self) -> set[str]:
        """timm's rule (`param_groups_weight_decay`): every parameter of at most one dimension
        (biases, norms) and those the model's own `no_weight_decay` names, where it has one (names
        or fnmatch patterns, as timm matches them)."""
        own = getattr(super(), "no_weight_decay", None)
        patterns = set(own()) if own is not None else set()
        return {name for name, p in self.named_parameters()
                if p.ndim <= 1 or any(fnmatch(name, pattern) for pattern in patterns)}


_TOWER_CLASSES: dict[type, type] = {}


def as_tower(model: nn.Module, cfg: TimmTowerConfig) -> nn.Module:
    """`model` (a timm model built with num_classes=0) as a tower, in place."""
    cls = type(model)
    if cls not in _TOWER_CLASSES:
        _TOWER_CLASSES[cls] = type(f"TimmTower{cls.__name__}", (TimmTower, cls), {})
    model.__class__ = _TOWER_CLASSES[cls]
    model.cfg = cfg
    return model


def build_timm_tower(cfg: TimmTowerConfig, device="meta") -> nn.Module:
    """The tower of `cfg` without weights (on the meta device by default: no memory, no download).
    Buffers computed from the config rather than stored (relative-position indices, rotary tables)
    stay on the meta device until `fill_computed_buffers` after loading."""
    import timm

    with torch.device(device):
        model = timm.create_model(cfg.timm_model_name, pretrained=False, num_classes=0,
                                  **cfg.model_args)
    return as_tower(model, cfg)


def fill_computed_buffers(model: nn.Module) -> nn.Module:
    """After a tower built on the meta device was loaded (`load_state_dict(assign=True)`): the
    buffers no state dict holds (non-persistent: Swin's relative-position indices, EVA's rotary
    tables) are made on the device of the weights and computed as timm computes them after a load
    (`init_non_persistent_buffers`); one that no such hook fills is taken from the tower built on
    that device (a timm tower's `cfg` says how)."""
    empty = {name for name, buffer in model.named_buffers() if buffer.is_meta}
    if not empty:
        return model
    device = next((t.device for t in (*model.parameters(), *model.buffers()) if not t.is_meta),
                  torch.device("cpu"))
    for name in empty:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        module.register_buffer(attr, torch.empty_like(getattr(module, attr), device=device),
                               persistent=False)
    for module in model.modules():
        if hasattr(module, "init_non_persistent_buffers"):
            module.init_non_persistent_buffers()
    hooked = {f"{prefix}.{name}".lstrip(".") for prefix, module in model.named_modules()
              if hasattr(module, "init_non_persistent_buffers")
              for name, _ in module.named_buffers(recurse=False)}
    unfilled = empty - hooked
    if unfilled:
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, TimmTowerConfig):
            raise ValueError(f"buffers {sorted(unfilled)[:3]} have no values and no config to "
                             "compute them from")
        built = dict(build_timm_tower(cfg, device=device).named_buffers())
        for name in unfilled:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, built[name])
    return model


def parse_timm_spec(spec: str) -> tuple[str, str | None]:
    """`timm:NAME[?file=PATH]` → (NAME, PATH or None); one UserError line for anything else."""
    name, _, query = spec[len(TIMM_PREFIX):].partition("?")
    options = parse_qs(query, keep_blank_values=True) if query else {}
    unknown = sorted(set(options) - {"file"})
    if not name or unknown or any(len(v) != 1 or not v[0] for v in options.values()):
        raise UserError(f"image tower {spec!r} is not a timm spec; write timm:NAME (timm's "
                        "pretrained weights), timm:hf-hub:ORG/NAME, "
                        "or timm:NAME?file=PATH (a local checkpoint)")
    file = options.get("file", [None])[0]
    if file is not None and not Path(file).is_file():
        raise UserError(f"image tower {spec!r}: {file} is not a file; give the checkpoint's path")
    return name, file


def folder_for(spec: str) -> Path:
    """Where `spec`'s tower folder is cached. A local file's path, size and modification time are
    part of the name: a rewritten checkpoint makes another folder, never the old one's weights."""
    name, file = parse_timm_spec(spec)
    key = spec
    if file is not None:
        stat = Path(file).stat()
        key = f"{spec}|{Path(file).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cache_root() / "towers" / "timm" / f"{slug}-{cache_key(key, 12)}"


def _pretrained_model(spec: str) -> tuple[nn.Module, str, dict]:
    """(the model with its weights, its architecture, the keywords it was built with)."""
    import timm

    name, file = parse_timm_spec(spec)
    model_args: dict = {}
    architecture = name
    if name.startswith("hf-hub:"):  # the hub's config.json names the architecture and its keywords
        from timm.models._hub import load_model_config_from_hf

        _, architecture, model_args = load_model_config_from_hf(name[len("hf-hub:"):])
        model_args = dict(model_args or {})
    overlay = {"pretrained_cfg_overlay": {"file": str(Path(file).resolve())}} if file else {}
    from safetensors import SafetensorError

    if file is not None:
        _check_checkpoint_file(spec, file)
    try:
        with _missing_keys_reported() as missing:
            model = timm.create_model(name, pretrained=True, num_classes=0, **overlay)
    except (RuntimeError, OSError, ValueError, KeyError, SafetensorError) as err:
        raise UserError(f"timm cannot build {spec!r} ({first_line(err)}); check the model name "
                        "(timm.list_models()) and that its weights can be reached, "
                        "or that the file is its checkpoint") from None
    # timm loads without its class head non-strictly: what the file lacked would stay random
    if missing:
        raise UserError(f"image tower {spec!r}: the weights hold no {', '.join(missing[:3])}"
                        f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} of "
                        f"{architecture}, which would stay randomly initialized; "
                        "give a checkpoint of this architecture")
    return model.eval(), architecture.split(".")[0], model_args


@contextlib.contextmanager
def _missing_keys_reported():
    """The model keys timm's `load_pretrained` found missing from the weights, collected from its
    log record (it loads non-strictly once the class head is dropped, num_classes=0, and logs what
    the weights lacked)."""
    missing: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Missing keys \((.*)\) discovered", record.getMessage())
            if found:
                missing.extend(key.strip() for key in found.group(1).split(","))

    logger, handler = logging.getLogger("timm.models._builder"), Collect(level=logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    # the record is at INFO level: made only where the logger is enabled for it
    logger.setLevel(logging.INFO)
    try:
        yield missing
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def pretrained_timm_tower(spec: str) -> tuple[nn.Module, dict]:
    """The tower `spec` names, with its weights (timm's download or the local file), and its
    preprocessing {"image_size", "mean", "std"} from timm's data config. timm initializes the model
    randomly before loading the weights: under fork_rng, so that the caller's random numbers
    afterwards (a LiT run's text tower init) are those it would draw had the tower come from a
    folder instead."""
    with torch.random.fork_rng(devices=[]):
        model, architecture, model_args = _pretrained_model(spec)
    data = _data_config(model)
    channels, size, _ = data["input_size"]
    cfg = TimmTowerConfig(timm_model_name=architecture, image_size=int(size),
                          in_channels=int(channels), width=_pooled_width(model),
                          model_args=model_args)
    preprocess = {"image_size": int(size), "mean": list(data["mean"]), "std": list(data["std"])}
    return as_tower(model, cfg), preprocess


def _check_checkpoint_file(spec: str, file: str) -> None:
    """A local `.safetensors` checkpoint whose header or tensors do not read back (a copy cut short,
    a flipped byte) is one line naming it, before timm reads it."""
    from safetensors import SafetensorError, safe_open

    if not file.endswith(".safetensors"):
        return
    try:
        with safe_open(file, framework="pt") as checkpoint:
            for key in checkpoint.keys():
                # each tensor's place in the file, checked against its size
                checkpoint.get_slice(key)
    except (OSError, SafetensorError) as err:
        raise UserError(f"image tower {spec!r}: cannot read {file} ({first_line(err)}); the "
                        "checkpoint is damaged or incomplete: download or copy it again") from None


def _pooled_width(model: nn.Module) -> int:
    """The size of the pre-logits features: timm's `head_hidden_size` (a pre-logits MLP's width
    where the model has one, as ConvNeXt's and MobileNetV3's heads may), else `num_features`."""
    return int(getattr(model, "head_hidden_size", None) or model.num_features)


def _data_config(model: nn.Module) -> dict:
    from timm.data import resolve_data_config

    return resolve_data_config({}, model=model)


def timm_hub_config(tower: TimmTower, preprocess: dict) -> dict:
    """timm's hub keys for the model (`timm.create_model("local-dir:FOLDER")` reads them), with our
    preprocessing as its pretrained cfg's mean, std and input size (crop 1.0, bilinear: ours)."""
    cfg = dict(tower.pretrained_cfg)
    cfg.update(input_size=(tower.cfg.in_channels, preprocess["image_size"],
                           preprocess["image_size"]),
               mean=tuple(preprocess["mean"]), std=tuple(preprocess["std"]), crop_pct=1.0,
               crop_mode="center", interpolation="bilinear", num_classes=0)
    cfg.pop("file", None)  # a local path: not part of what the folder is
    for key in ("url", "hf_hub_id", "hf_hub_filename"):
        cfg.pop(key, None)
    return {"architecture": tower.cfg.timm_model_name, "num_classes": 0,
            "num_features": tower.num_features,
            "pretrained_cfg": json.loads(json.dumps(cfg, default=list)),
            "model_args": tower.cfg.model_args}
