"""lit-softmoe: LiT-style image-text training on frozen Soft MoE image towers.

The names below are the library's public surface. Each is imported on first use (PEP 562), so
`import lit_softmoe` costs nothing and `from lit_softmoe import SoftMoE` loads the layers only; no
public name loads the training code, accelerate or webdataset.

Our towers are registered with timm (`lit_softmoe.integrations.timm`) as soon as timm is imported,
before or after `import lit_softmoe`: `timm.create_model("soft_moe_s16_128e")` and open_clip's
`local-dir:` loading of an export then work, and a user who never imports timm does not pay the
seconds it takes to import.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name → the module that defines it.
_PUBLIC = {
    "SoftMoE": "lit_softmoe.nn", "TokensChoiceMoE": "lit_softmoe.nn",
    "ExpertsChoiceMoE": "lit_softmoe.nn",
    "ViTConfig": "lit_softmoe.models", "VisionTransformer": "lit_softmoe.models",
    "create_image_tower": "lit_softmoe.models", "list_image_towers": "lit_softmoe.models",
    "TextTowerConfig": "lit_softmoe.models", "create_text_tower": "lit_softmoe.models",
    "LiTModel": "lit_softmoe.models",
    "load_pretrained": "lit_softmoe.hub", "load_image_tower": "lit_softmoe.hub",
    "create_model_from_pretrained": "lit_softmoe.hub", "get_tokenizer": "lit_softmoe.hub",
    "prepare_for_inference": "lit_softmoe.models.inference",
    "upcycle_tower": "lit_softmoe.models.upcycle",
}
__all__ = ["ExpertsChoiceMoE", "LiTModel", "SoftMoE", "TextTowerConfig", "TokensChoiceMoE",
           "ViTConfig", "VisionTransformer", "create_image_tower", "create_model_from_pretrained",
           "create_text_tower", "get_tokenizer", "list_image_towers", "load_image_tower",
           "load_pretrained", "prepare_for_inference", "upcycle_tower"]  # the keys of _PUBLIC

if TYPE_CHECKING:  # what editors and type checkers see
    from lit_softmoe.hub import (
        create_model_from_pretrained,
        get_tokenizer,
        load_image_tower,
        load_pretrained,
    )
    from lit_softmoe.models import (
        LiTModel,
        TextTowerConfig,
        VisionTransformer,
        ViTConfig,
        create_image_tower,
        create_text_tower,
        list_image_towers,
    )
    from lit_softmoe.models.inference import prepare_for_inference
    from lit_softmoe.models.upcycle import upcycle_tower
    from lit_softmoe.nn import ExpertsChoiceMoE, SoftMoE, TokensChoiceMoE


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lit_softmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


def _register_with_timm() -> None:
    try:
        importlib.import_module("lit_softmoe.integrations.timm")
    except Exception as err:  # a timm this version cannot work with must not break `import timm`
        warnings.warn("lit-softmoe could not register its towers with timm: "
                      f"{type(err).__name__}: {err}",
                      stacklevel=2)


class _RegisterWhenTimmLoads(importlib.abc.MetaPathFinder):
    """Finds timm as Python would, and has its module register our towers once it has run.

    Stays in `sys.meta_path` until timm is imported: libraries ask
    `importlib.util.find_spec("timm")` only to learn whether it is installed (transformers does),
    and that import may come later."""

    _finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "timm" or self._finding:
            return None
        self._finding = True  # the lookup below must not come back here
        try:
            spec = importlib.util.find_spec("timm")
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_timm = spec.loader.exec_module

            def exec_module(module):
                run_timm(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                _register_with_timm()
            spec.loader.exec_module = exec_module
        return spec


if "timm" in sys.modules:
    _register_with_timm()
elif not any(isinstance(finder, _RegisterWhenTimmLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTimmLoads())
