"""What timm knows of our towers, as plain data (no timm import): names, pretrained cfgs, hub keys.

`lit_softmoe.integrations.timm` registers the towers with timm from these; the tower folder (and an
image-only export) writes `timm_hub_keys` into its config.json so that
`timm.create_model("local-dir:TOWER")` builds it (timm's `_hub.py` reads "architecture",
"num_classes", "pretrained_cfg" and "model_args").

A tower whose config is no registered one's is named by a registered name plus a *config tag*:
`soft_moe_tiny_p7_16e.cfg-<base64url JSON of the fields that differ>`. timm splits a name at its
first "." and hands the tag to the entry point as `pretrained_cfg` (as for `resnet50.a1_in1k`); ours
reads the fields from it. open_clip's timm towers (`vision_cfg.timm_model_name`) take a name and
nothing else, so this is how an export's open_clip config names a tower of any shape. base64url
because timm refuses names holding ":" or "/".
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import replace

from lit_softmoe.models.preprocess import per_channel
from lit_softmoe.models.vit_config import ViTConfig

# vmoe's input pipelines (and timm's vit_* weights) map pixels to [-1, 1]: mean = std = 0.5.
DEFAULT_MEAN_STD = 0.5
# Registry towers timm gets: dense and Soft MoE. Not Tokens Choice: timm's training loop would drop
# their balancing loss (`moe_aux_loss()`) silently. Not Experts Choice: its sparse twins are
# baselines only.
TIMM_PREFIXES = {"soft-": "soft_moe_", "vit-": "lit_softmoe_vit_"}


def timm_name(name: str) -> str | None:
    """Our registry name → timm's identifier (`soft-s16-128e` → `soft_moe_s16_128e`), None if not
    for timm."""
    for ours, theirs in TIMM_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours):].replace("-", "_")
    return None


def timm_pretrained_cfg(cfg: ViTConfig, preprocess: dict | None = None) -> dict:
    """timm's pretrained cfg of a tower: input size, mean/std and crop of its preprocessing (the
    evaluation transform resizes the shorter side to `image_size` and center-crops: crop_pct 1)."""
    preprocess = preprocess or {}
    size = int(preprocess.get("image_size", cfg.image_size))
    grid = size // cfg.patch_size
    mean, std = (per_channel(preprocess.get(key, DEFAULT_MEAN_STD), cfg.in_channels)
                 for key in ("mean", "std"))
    return dict(num_classes=cfg.num_classes, input_size=(cfg.in_channels, size, size),
                pool_size=(grid, grid), crop_pct=1.0, crop_mode="center", interpolation="bilinear",
                fixed_input_size=False, mean=mean, std=std, first_conv="patch_embed",
                classifier="head", license="apache-2.0")


def timm_hub_keys(cfg: ViTConfig, preprocess: dict | None = None,
                  weights_file: str | None = None) -> dict:
    """The keys of timm's hub config.json for a tower folder, beside ours. "model_args" carries the
    whole tower config (timm's names for classes, channels and size), so the architecture is a
    label. `weights_file`: the weights' file name where it is not timm's model.safetensors (timm's
    `hf-hub:` loader reads the pretrained cfg's "hf_hub_filename"; `local-dir:` takes a folder's one
    safetensors)."""
    same = [n for n, c in _registered().items() if c == replace(cfg, num_classes=0)]
    architecture = same[0] if same else ("soft_moe_s16_128e" if cfg.moe_layers
                                         else "lit_softmoe_vit_b16")
    args = cfg.to_dict()
    model_args = {"in_chans": args.pop("in_channels"), "img_size": args.pop("image_size"), **args}
    model_args.pop("num_classes")
    pretrained_cfg = timm_pretrained_cfg(cfg, preprocess)
    if weights_file is not None:
        pretrained_cfg["hf_hub_filename"] = weights_file
    return {"architecture": architecture, "num_classes": cfg.num_classes, "num_features": cfg.width,
            "pretrained_cfg": pretrained_cfg, "model_args": model_args}


def _registered() -> dict[str, ViTConfig]:
    # the registry imports vit too
    from lit_softmoe.models.registry import image_tower_config, list_image_towers
    return {timm_name(n): image_tower_config(n) for n in list_image_towers() if timm_name(n)}


CONFIG_TAG_PREFIX = "cfg-"


def timm_model_spec(cfg: ViTConfig) -> str:
    """The timm model name that builds `cfg` (its class head aside) once our towers are registered.

    A registered name whose config is `cfg`'s, else the registered tower that differs from it in the
    fewest fields, tagged with those fields (see the module docstring).
    """
    cfg = replace(cfg, num_classes=0)
    registered = _registered()
    for name, config in registered.items():
        if config == cfg:
            return name
    mine = cfg.to_dict()

    def differing(name: str) -> dict:
        theirs = registered[name].to_dict()
        return {key: value for key, value in mine.items() if theirs[key] != value}

    base = min(registered, key=lambda name: (len(differing(name)), name))
    fields = json.dumps(differing(base), sort_keys=True, separators=(",", ":")).encode()
    return f"{base}.{CONFIG_TAG_PREFIX}{base64.urlsafe_b64encode(fields).decode().rstrip('=')}"


def config_tag_fields(tag) -> dict | None:
    """The tower config fields a config tag holds; None for anything else (a real pretrained
    tag)."""
    if not isinstance(tag, str) or not tag.startswith(CONFIG_TAG_PREFIX):
        return None
    encoded = tag[len(CONFIG_TAG_PREFIX):]
    try:
        fields = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (binascii.Error, ValueError):
        raise ValueError(f"model tag {tag!r} is no lit-softmoe config tag (base64url JSON after "
                         f"{CONFIG_TAG_PREFIX!r}); copy the model name whole") from None
    if not isinstance(fields, dict):
        raise ValueError(f"model tag {tag!r} holds no tower config fields")
    if "moe_layers" in fields:
        fields["moe_layers"] = tuple(fields["moe_layers"])
    return fields
