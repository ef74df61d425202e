"""An export as open_clip reads it: `open_clip_config.json` + `open_clip_model.safetensors`.

open_clip's `local-dir:` and `hf-hub:` loaders (`open_clip.create_model_and_transforms`,
`open_clip.get_tokenizer`) read `model_cfg` and `preprocess_cfg` from `open_clip_config.json` and
the weights from `open_clip_model.safetensors` (the first name
`open_clip.factory._find_checkpoint_in_dir` prefers), loaded strictly. That file is the export's
one copy of the weights; the few tensors open_clip's model has no place for go beside it under our
names (models.export_weights, which reads both back). The model they build is open_clip's
`CustomTextCLIP`:

- `visual`: open_clip's `TimmModel` around `timm.create_model(vision_cfg.timm_model_name)`, our
  tower once `lit_softmoe.integrations.timm` registered it (`models.timm_config.timm_model_spec`
  names any config); global average pooling as ours; `timm_proj` "none" (LiT's default, no image
  head) or "linear" with a bias (our `image_head`). A timm tower (`image_tower: timm:NAME`) is
  named by its own timm name with its own pooling: stock open_clip and timm build it, with no
  `import lit_softmoe`.
- `text`: open_clip's `TextTransformer`, the class our "transformer" text tower is, with its shape.
- `preprocess_cfg`: resize of the shorter side (bilinear) + center crop + mean/std, as our eval
  transform.

Gray towers: open_clip's transforms always give RGB (`PreprocessCfg` asserts mode "RGB"), so the
patch embedding is widened to 3 channels with the ITU-R 601-2 luma weights (0.299, 0.587, 0.114)
that PIL's `convert("L")`, our gray conversion, uses. They sum to 1, so on gray content (R = G = B)
the tower computes what it computes on the gray image; on colour images PIL's integer rounding
aside. The tower's own 1-channel weights are kept too (image_tower_extra.safetensors): the widened
ones are rounded products, from which they cannot be recovered bit for bit.

Not written (the reason goes into config.json and the model card): text towers from Hugging Face
(open_clip's `HFTextEncoder` loads the encoder by hub name, tokenizes with its own `HFTokenizer` and
pools differently at padding, and has no last-token pooling: its embeddings would not be ours),
Tokens Choice towers (not registered with timm: its training loop would drop their balancing loss),
and image-only exports (open_clip builds pairs; `timm.create_model("local-dir:...")` takes a tower).
"""
from __future__ import annotations

import inspect
from dataclasses import replace

import torch

from lit_softmoe.models.export_weights import IMAGE_EXTRA_WEIGHTS, OPEN_CLIP_WEIGHTS, open_clip_name
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.preprocess import per_channel
from lit_softmoe.models.text import OpenClipTextTower
from lit_softmoe.models.timm_config import timm_model_spec
from lit_softmoe.models.timm_tower import TimmTower

OPEN_CLIP_CONFIG = "open_clip_config.json"
LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # PIL's convert("L"): L = R·299/1000 + G·587/1000 + B·114/1000


def open_clip_skip_reason(model: LiTModel | None) -> str | None:
    """Why open_clip cannot load this export as our model, or None when it can."""
    if model is None:
        return ("an image tower alone: open_clip builds image-text pairs (timm's local-dir: loads "
                "a tower)")
    if not isinstance(model.text_tower, OpenClipTextTower):
        return ("a Hugging Face text tower: open_clip's HFTextEncoder tokenizes and pools "
                "differently from ours (and has no last-token pooling), so its embeddings would "
                "not be this model's")
    if isinstance(model.image_tower, TimmTower):
        if model.image_tower.cfg.model_args:
            return ("a timm tower built with model arguments (a hub config's): open_clip's "
                    "timm_model_name takes a name alone")
        if timm_pool(model.image_tower) is None:
            return ("a timm model whose pooling has no name its constructor takes (`global_pool`): "
                    "open_clip's TimmModel could not pool it alike")
    elif model.image_tower.cfg.moe_type == "tokens_choice" and model.image_tower.cfg.moe_layers:
        return ("a Tokens Choice tower: not registered with timm, whose training loop would drop "
                "its balancing loss")
    return None


def timm_pool(tower: TimmTower) -> str | None:
    """The timm model's global pooling as its `global_pool` argument names it (what open_clip's
    `timm_pool` passes to `timm.create_model`): the model's own string (a ViT, Swin, EVA), else the
    `pool_type` of its pooling module (a ResNet's `global_pool`, a ConvNeXt's `head.global_pool`, a
    MambaOut's `head`); None when it has none of these or its class takes no `global_pool`
    argument."""
    pool = getattr(tower, "global_pool", None)
    if not isinstance(pool, str):
        pools = (getattr(m, "pool_type", None) for name, m in tower.named_modules()
                 if name.rpartition(".")[2] in ("global_pool", "head"))
        pool = next((p for p in pools if isinstance(p, str)), None)
    return pool if isinstance(pool, str) and _takes_global_pool(type(tower).__mro__[2]) else None


def _takes_global_pool(model_class: type) -> bool:
    """Whether the class (or, where it passes its arguments on as *args/**kwargs, its base) takes
    `global_pool`."""
    for cls in model_class.__mro__:
        if cls is torch.nn.Module or "__init__" not in vars(cls):
            continue
        params = inspect.signature(cls.__init__).parameters
        if "global_pool" in params:
            return True
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return False
    return False


def open_clip_config(model: LiTModel, preprocess: dict) -> dict:
    """`open_clip_config.json`: the `model_cfg` that rebuilds `model` and the `preprocess_cfg` of
    its tower."""
    tower, text_cfg = model.image_tower, model.text_tower.cfg
    if isinstance(tower, TimmTower):
        # timm's own model, pooled as it pools (open_clip passes `global_pool`)
        name, pool = tower.cfg.timm_model_name, timm_pool(tower)
        if tower.cfg.model_args:
            # open_clip_skip_reason
            raise ValueError("a timm tower built with model_args has no open_clip name")
    else:  # ours: the mean over the tokens after the final norm
        name, pool = timm_model_spec(_rgb(tower.cfg)), "avg"
    vision = {"image_size": tower.cfg.image_size, "timm_model_name": name,
              "timm_model_pretrained": False, "timm_pool": pool,
              "timm_proj": "linear" if isinstance(model.image_head, torch.nn.Linear) else "none",
              "timm_proj_bias": True}
    text = {"context_length": text_cfg.context_length, "vocab_size": text_cfg.vocab_size,
            "width": text_cfg.width, "heads": text_cfg.heads, "layers": text_cfg.layers,
            "mlp_ratio": text_cfg.mlp_ratio, "pool_type": "argmax", "proj_type": "linear",
            "proj_bias": False}
    model_cfg = {"embed_dim": model.text_tower.embed_dim, "custom_text": True, "quick_gelu": False,
                 "init_logit_scale": float(model.logit_scale.detach()), "vision_cfg": vision,
                 "text_cfg": text}
    if model.logit_bias is not None:
        model_cfg["init_logit_bias"] = float(model.logit_bias.detach())

    preprocess_cfg = {"size": preprocess["image_size"], "mode": "RGB",  # a gray tower's: RGB → luma
                      "mean": list(per_channel(preprocess["mean"], 3)),
                      "std": list(per_channel(preprocess["std"], 3)),
                      "interpolation": "bilinear", "resize_mode": "shortest"}
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
    if not isinstance(tower, TimmTower):
        # open_clip reads the two keys above and passes over any other
        config["note"] = (f"vision_cfg.timm_model_name {name} is lit-softmoe's tower: timm knows "
                          "it once `import lit_softmoe` (or `import "
                          "lit_softmoe.integrations.timm`) registered it, and without that "
                          "open_clip ends in timm's `RuntimeError: Unknown model`; `lit-softmoe "
                          "clip-benchmark -- eval ...` runs CLIP_benchmark with it registered")
    return config


def open_clip_weights(state: dict[str, torch.Tensor], in_channels: int,
                      class_head: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """A LiTModel state dict (the export's own key names) as the export's weights files in
    open_clip's layout: {OPEN_CLIP_WEIGHTS: every tensor open_clip's CustomTextCLIP has, under its
    names, IMAGE_EXTRA_WEIGHTS: the rest under ours (left out when there is none)}; each tensor in
    one file, but a gray tower's patch embedding (its widened form in open_clip's, its own in ours).
    `class_head`: the tower's `head.*` is our pretraining class head (a timm tower, built without a
    classifier, may keep pre-logits layers there: ConvNeXt's norm)."""
    theirs, extra = {}, {}
    for key, value in state.items():
        if class_head and key.startswith("image_tower.head."):
            extra[key] = value  # the pretraining class head: open_clip's trunk is built without one
            continue
        if key == "image_tower.patch_embed.weight" and in_channels == 1:
            extra[key] = value
            luma = torch.tensor(LUMA_WEIGHTS, dtype=torch.float32).view(1, 3, 1, 1)
            value = (value.float() * luma).to(value.dtype)  # (d, 1, p, p) → (d, 3, p, p)
        theirs[open_clip_name(key)] = value.contiguous()
    return {OPEN_CLIP_WEIGHTS: theirs, **({IMAGE_EXTRA_WEIGHTS: extra} if extra else {})}


def _rgb(cfg):
    """The tower open_clip builds: 3 input channels (see the module docstring)."""
    return replace(cfg, in_channels=3) if cfg.in_channels == 1 else cfg
