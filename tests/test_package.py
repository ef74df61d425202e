"""The package's public surface: every public name imports, and importing them loads no training code.

`import lit_softmoe` is lazy (PEP 562): each public name is imported on first use, so a user who
wants the layer or a loader does not pay for accelerate, webdataset or the recipes.
"""
import json
import subprocess
import sys

import lit_softmoe
from launch import python_command

HEAVY = ("accelerate", "webdataset", "lit_softmoe.train", "timm")  # timm: seconds to import


def _loaded_after(code: str) -> list[str]:
    """Module names in sys.modules after running `code` in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_import_lit_softmoe_loads_nothing_heavy():
    loaded = _loaded_after("import lit_softmoe")
    assert "torch" not in loaded
    assert not [name for name in loaded if name.startswith(HEAVY)]


def test_the_layer_and_the_loaders_load_no_training_code():
    loaded = _loaded_after("from lit_softmoe import SoftMoE, load_pretrained, load_image_tower, create_image_tower")
    assert "lit_softmoe.hub" in loaded and "lit_softmoe.nn.soft_moe" in loaded
    assert not [name for name in loaded if name.startswith(HEAVY)]


def test_every_public_name_resolves_to_its_module():
    assert sorted(lit_softmoe.__all__) == sorted(lit_softmoe._PUBLIC)
    for name in lit_softmoe.__all__:
        value = getattr(lit_softmoe, name)
        assert value.__module__.startswith(lit_softmoe._PUBLIC[name]), name
        assert name in dir(lit_softmoe)


def test_an_unknown_name_is_an_attribute_error():
    try:
        lit_softmoe.load_trainer  # noqa: B018 (the attribute access is the test)
    except AttributeError as err:
        assert "load_trainer" in str(err)
    else:
        raise AssertionError("lit_softmoe.load_trainer resolved")


def test_timm_knows_our_towers_whichever_is_imported_first():
    """`import lit_softmoe` does not import timm, yet once timm is imported (before or after) it builds ours."""
    # transformers asks importlib whether timm is installed without importing it: the hook must stay.
    for code in ("import lit_softmoe, timm", "import timm, lit_softmoe",
                 "import lit_softmoe, importlib.util; importlib.util.find_spec('timm'); import timm"):
        script = (f"{code}\nimport sys\nassert 'lit_softmoe.integrations.timm' in sys.modules\n"
                  "print(type(timm.create_model('soft_moe_test_4e')).__module__)")
        # a fresh interpreter but for torch, which the server had imported (neither timm nor lit_softmoe)
        done = subprocess.run([*python_command("torch"), "-c", script], capture_output=True, text=True, timeout=300,
                              check=True)
        assert done.stdout.strip() == "lit_softmoe.models.vit", code
    assert "lit_softmoe.integrations.timm" not in _loaded_after("import timm")  # without us, timm is timm
