"""pytest plugin that runs timm's own model tests (`tests/test_models.py` of timm's sdist) on our towers.

`make timm-sdist` downloads the sdist of the installed timm and copies its `tests/test_models.py` into a folder
of its own (the Makefile says why); `make test` runs it in the same pytest session as our suite
(`pytest -p timm_plugin tests SDIST/model_tests/test_models.py`, with this folder on PYTHONPATH), `make
timm-tests` alone. Loaded as a plugin, this module imports our registration (in each process that collects)
before timm's test module parametrizes over `timm.list_models()`, then keeps only the tests that apply to our names
(docs/interoperability.md, "timm"); our suite's tests it leaves as they are:

- test_model_forward, test_model_backward: as they are.
- test_model_default_cfgs: timm splits it by name pattern; ViTs (`vit_*`, `deit*`, ... in its
  NON_STD_FILTERS) run `test_model_default_cfgs_non_std`, whose body takes the same arguments, since
  their features are tokens (B, N, C), not NCHW maps. Our names match no such pattern, so their
  items run that body under its own name.
- the feature tests (FEATURES: features_only, forward_intermediates, prune_intermediate_layers), on
  towers of 3 blocks or more: timm's tests want at least 3 feature levels, and features_only takes the
  last 3 blocks by default; the prune contract on towers up to PRUNE_MAX_PARAMS. All but
  test_model_forward_features take the models of the modules named in timm's FEAT_INTER_FILTERS; timm
  files ours under module "timm" (`lit_softmoe.integrations.timm`), so `pytest_generate_tests` adds our
  names to their `model_name` parametrization.
- everything else (TorchScript / FX / pretrained-weight tests, and the tests of named timm models) is
  left out (`pytest_generate_tests` cuts each `model_name` list to ours first; what remains is deselected);
  docs/interoperability.md ("timm tests that do not apply") says why for each.

Towers above LIT_SOFTMOE_TIMM_MAX_PARAMS parameters (default 400M: dense H and the paper's Soft MoE
towers, 922M to 54B) are left out too: on a CPU machine they cost minutes each, and from
soft_moe_b16_128e (3.7B) up their fp32 weights and gradients do not fit 24 GB.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

OUR_TESTS = Path(__file__).resolve().parents[1]
sys.path.append(str(OUR_TESTS))  # tests/, for the helpers below (after timm's own)
# Before torch: the run's TMPDIR and torch.compile cache (pytest loads this plugin before our conftest).
import run_folders  # noqa: E402  # isort: skip

import pytest  # noqa: E402

from worker_cores import share_cores_among_workers  # noqa: E402

APPLY = {"test_model_forward", "test_model_backward", "test_model_default_cfgs_non_std"}
AS_NON_STD = "test_model_default_cfgs"
PRUNE_CONTRACT = "test_prune_intermediate_layers_contract"
BY_MODULE = {"test_model_forward_intermediates", "test_model_forward_intermediates_features", PRUNE_CONTRACT}
FEATURES = BY_MODULE | {"test_model_forward_features"}
MIN_FEATURE_BLOCKS = 3
MAX_PARAMS = int(float(os.environ.get("LIT_SOFTMOE_TIMM_MAX_PARAMS", "4e8")))
# The prune contract copies the tower twice per block (timm keeps it out of its CI for that): above
# 30M parameters (B and L) it costs minutes a tower on a CPU; it runs on the Ti, S and tiny towers.
PRUNE_MAX_PARAMS = 30_000_000
# Our towers by what applies to them, filled by `_register_our_towers` (a process that collects: pytest-xdist's
# controller collects nothing and so imports neither torch nor lit_softmoe).
PARAMS: dict[str, int] = {}
OURS: set[str] = set()
WITH_FEATURES: set[str] = set()
PRUNED: set[str] = set()


def pytest_configure(config):
    share_cores_among_workers()  # `make timm-tests` runs on pytest-xdist's workers too
    run_folders.remove_at_end(config)  # `make timm-tests` loads no conftest of ours
    if not _xdist_controller(config):
        _register_our_towers()


def _xdist_controller(config) -> bool:
    """pytest-xdist's controller: it hands the tests to its workers and collects none itself. Not
    `xdist.is_xdist_controller`: that takes a session (pytest_configure has only the config) and counts a
    `--collect-only -n N` run, which xdist does not distribute and which collects in this process, as one."""
    return (not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
            and bool(config.getoption("tx", None)) and not config.getoption("collectonly"))


def _register_our_towers() -> None:
    """Our towers registered with timm, before timm's test module parametrizes over `timm.list_models()`, and
    sorted by what applies to them."""
    from lit_softmoe.integrations.timm import _OURS, timm_model_names
    from lit_softmoe.models.registry import create_image_tower, image_tower_config

    for name in timm_model_names():
        PARAMS[name] = sum(p.numel() for p in create_image_tower(_OURS[name], device="meta").parameters())
    OURS.update(n for n in PARAMS if PARAMS[n] <= MAX_PARAMS)
    WITH_FEATURES.update(n for n in OURS if image_tower_config(_OURS[n]).depth >= MIN_FEATURE_BLOCKS)
    PRUNED.update(n for n in WITH_FEATURES if PARAMS[n] <= PRUNE_MAX_PARAMS)


def _applies(name: str | None, test: str) -> bool:
    """Whether timm's `test` is kept for our tower `name` (None: not one of ours, or no model test)."""
    if test == PRUNE_CONTRACT:
        return name in PRUNED
    if test in FEATURES:
        return name in WITH_FEATURES
    return name in OURS and test in APPLY


def _kept(name: str, test: str) -> bool:
    """Whether timm's `test` on model `name` stays: it applies, or it runs under timm's other name for it."""
    return _applies(name, test) or (name in OURS and test == AS_NON_STD)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """The `model_name` list of each of timm's tests cut to our towers that it applies to, before pytest's own
    hook parametrizes from the markers (replaced on this test's definition only): timm lists its ~1,500 models,
    and pytest made ~18,000 items in each worker to deselect all but ours. The feature tests that timm selects
    by module get our names added."""
    if not _timms(metafunc.definition):
        return
    test = metafunc.function.__name__
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args[0] == "model_name" and "ids" not in mark.kwargs:
            names = [*mark.args[1], *(sorted(WITH_FEATURES) if test in BY_MODULE else [])]
            markers[i] = pytest.mark.parametrize(
                "model_name", [n for n in names if _kept(n, test)], **mark.kwargs).mark


def _as_non_std(item: pytest.Function) -> pytest.Function:
    target = "test_model_default_cfgs_non_std"
    return pytest.Function.from_parent(
        item.parent, name=item.name.replace(AS_NON_STD, target, 1), callspec=item.callspec,
        callobj=getattr(item.module, target), fixtureinfo=item._fixtureinfo, originalname=target,
        keywords=dict(item.keywords))


def _timms(item: pytest.Item) -> bool:
    """Whether `item` is one of timm's model tests (`make test` collects them with our suite)."""
    return OUR_TESTS not in item.path.parents


def pytest_collection_modifyitems(session, config, items):
    ours, timms = [], []
    for item in items:
        (timms if _timms(item) else ours).append(item)
    keep, drop = [], []
    for item in timms:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("model_name") if callspec else None
        if _applies(name, item.originalname):
            keep.append(item)
        elif _kept(name, item.originalname):
            keep.append(_as_non_std(item))
        else:
            drop.append(item)
    # The largest towers first: pytest-xdist's workers then end on the small ones, not one on an L/14 while the
    # other waits (a stable sort: one tower's tests keep timm's order).
    keep.sort(key=lambda item: -PARAMS[item.callspec.params["model_name"]])
    items[:] = ours + keep
    config.hook.pytest_deselected(items=drop)
    import torch

    torch.manual_seed(0)
