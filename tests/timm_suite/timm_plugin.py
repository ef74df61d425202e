"""pytest plugin that runs timm's own model tests (`tests/test_models.py` of timm's sdist) on our towers.

`make timm-tests` downloads the sdist of the installed timm and runs
`pytest -p timm_plugin tests/test_models.py` in it, with this folder on PYTHONPATH. Loaded as a
plugin, this module imports our registration before timm's test module parametrizes over
`timm.list_models()`, then keeps only the tests that apply to our names (docs/interoperability.md, "timm"):

- test_model_forward, test_model_backward: as they are.
- test_model_default_cfgs: timm splits it by name pattern; ViTs (`vit_*`, `deit*`, ... in its
  NON_STD_FILTERS) run `test_model_default_cfgs_non_std`, whose body takes the same arguments, since
  their features are tokens (B, N, C), not NCHW maps. Our names match no such pattern, so their
  items run that body under its own name.
- everything else (features_only / forward_intermediates / TorchScript / FX / pretrained-weight
  tests, and the tests of named timm models) is deselected; docs/interoperability.md ("timm tests
  that do not apply") says why for each.

Towers above LIT_SOFTMOE_TIMM_MAX_PARAMS parameters (default 400M: dense H and the paper's Soft MoE
towers, 922M to 54B) are deselected too: on a CPU machine they cost minutes each, and from
soft_moe_b16_128e (3.7B) up their fp32 weights and gradients do not fit 24 GB.
"""
from __future__ import annotations

import os

import pytest
import torch

from lit_softmoe.integrations.timm import _OURS, timm_model_names
from lit_softmoe.models.registry import create_image_tower

APPLY = {"test_model_forward", "test_model_backward", "test_model_default_cfgs_non_std"}
AS_NON_STD = "test_model_default_cfgs"
MAX_PARAMS = int(float(os.environ.get("LIT_SOFTMOE_TIMM_MAX_PARAMS", "4e8")))


def _small_enough(name: str) -> bool:
    tower = create_image_tower(_OURS[name], device="meta")
    return sum(p.numel() for p in tower.parameters()) <= MAX_PARAMS


OURS = {n for n in timm_model_names() if _small_enough(n)}


def _as_non_std(item: pytest.Function) -> pytest.Function:
    target = "test_model_default_cfgs_non_std"
    return pytest.Function.from_parent(
        item.parent, name=item.name.replace(AS_NON_STD, target, 1), callspec=item.callspec,
        callobj=getattr(item.module, target), fixtureinfo=item._fixtureinfo, originalname=target,
        keywords=dict(item.keywords))


def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("model_name") if callspec else None
        if name in OURS and item.originalname in APPLY:
            keep.append(item)
        elif name in OURS and item.originalname == AS_NON_STD:
            keep.append(_as_non_std(item))
        else:
            drop.append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
    torch.manual_seed(0)
