"""timm's door to our towers: `import lit_softmoe.integrations.timm`, then `timm.create_model(...)`.

Registers the dense and Soft MoE towers of `models.registry` under identifier names
(`soft-s16-128e` → `soft_moe_s16_128e`, `vit-b16` → `lit_softmoe_vit_b16`; `models.timm_config`),
each with a default cfg (mean/std, input size, crop) from the tower's preprocessing, the way timm's
own model files do (`timm/models/vision_transformer.py`: `default_cfgs`, `register_model`,
`build_model_with_cfg`). timm's kwargs map onto the tower config: `num_classes`, `in_chans`,
`img_size` (square), `global_pool` ("avg" or ""), plus any `ViTConfig` field (what a tower folder's
"model_args" carries for `timm.create_model("local-dir:TOWER")`, or an image-only export's);
`features_only=True` with `out_indices` (default: the last 3 blocks) gives the blocks' feature
maps, as for timm's ViTs.
`pretrained=True` with `pretrained_cfg_overlay=dict(file="TOWER/model.safetensors")` loads a tower
folder's weights. A name with a config tag (`models.timm_config.timm_model_spec`) builds a tower of
any config.

Tokens Choice towers are refused: timm's training loop knows no `moe_aux_loss()` and would drop
their balancing loss silently. Importing timm costs seconds, which is why `import lit_softmoe` does
not register (docs/interoperability.md).
"""
from __future__ import annotations

from dataclasses import fields

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from lit_softmoe.models.registry import image_tower_config, list_image_towers
from lit_softmoe.models.timm_config import config_tag_fields, timm_name, timm_pretrained_cfg
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig

_OURS = {timm_name(n): n for n in list_image_towers() if timm_name(n)}  # timm name → registry name
_FIELDS = {f.name for f in fields(ViTConfig)}


def _tower(registry_name: str, num_classes: int | None = None, in_chans: int | None = None,
           img_size: int | tuple[int, int] | None = None, global_pool: str = "avg", device=None,
           dtype=None, **tower_options) -> VisionTransformer:
    """The tower `registry_name` with timm's kwargs mapped onto its config
    (TypeError for unknown ones)."""
    unknown = sorted(set(tower_options) - _FIELDS)
    if unknown:
        raise TypeError(f"{registry_name} got unexpected keyword arguments {unknown}")
    if img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if h != w:
            raise ValueError(f"img_size {img_size}: the towers are square "
                             "(other sizes run; build it square)")
        tower_options["image_size"] = h
    if in_chans is not None:
        tower_options["in_channels"] = in_chans
    if num_classes is not None:
        tower_options["num_classes"] = num_classes
    cfg = image_tower_config(registry_name, **tower_options)
    if cfg.moe_type == "tokens_choice" and cfg.moe_layers:
        raise ValueError("Tokens Choice towers are not built through timm: its training loop "
                         "would drop their balancing loss (tower.moe_aux_loss()) silently; use "
                         "lit_softmoe.create_image_tower")
    return VisionTransformer(cfg, device=device, dtype=dtype, global_pool=global_pool)


# an export's image_encoder.safetensors: the tower under LiTModel's names
EXPORT_PREFIX = "image_tower."


def checkpoint_filter_fn(state_dict: dict, model: VisionTransformer) -> dict:
    """A checkpoint's weights in the tower's names, its source recognized by its keys as timm's
    filters do: an export's image weights (`image_tower.*`) lose the prefix, and a pair's
    `image_head.*` (LiT's projection, no part of the tower) stays out; a tower folder's weights
    are the tower's own."""
    if any(k.startswith(EXPORT_PREFIX) for k in state_dict):
        return {k[len(EXPORT_PREFIX):]: v for k, v in state_dict.items()
                if k.startswith(EXPORT_PREFIX)}
    return state_dict


def _create(name: str, pretrained: bool = False, **kwargs) -> VisionTransformer:
    # `name.cfg-...` (an export's open_clip config names such towers): the tag's fields
    # over the registered config; kwargs given explicitly still win. timm's pretrained cfg
    # then describes them.
    fields = config_tag_fields(kwargs.get("pretrained_cfg"))
    if fields is not None:
        kwargs = {**fields, **kwargs}
        kwargs["pretrained_cfg"] = timm_pretrained_cfg(image_tower_config(_OURS[name], **fields))
    # `features_only=True` as for timm's ViTs: its FeatureGetterNet calls the tower's
    # forward_intermediates and prunes the blocks after the last index; by default the last 3
    # blocks' (B, D, H/p, W/p) maps.
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(_tower, name, pretrained, registry_name=_OURS[name],
                                pretrained_filter_fn=checkpoint_filter_fn,
                                feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
                                **kwargs)


default_cfgs = generate_default_cfgs({n: timm_pretrained_cfg(image_tower_config(ours))
                                      for n, ours in _OURS.items()})


def _entrypoint(name: str):
    def create(pretrained: bool = False, **kwargs) -> VisionTransformer:
        return _create(name, pretrained, **kwargs)
    create.__name__ = create.__qualname__ = name
    create.__doc__ = f"lit-softmoe's `{_OURS[name]}` tower (`lit_softmoe.create_image_tower`)."
    return create


for _name in _OURS:
    register_model(_entrypoint(_name))


def timm_model_names() -> list[str]:
    """The names this module registers with timm, sorted."""
    return sorted(_OURS)
