"""lit_softmoe.integrations.timm: our towers through `timm.create_model`, as timm builds its own
(timm's `tests/test_models.py` runs on them in `make timm-tests`; these check what it cannot: the
same outputs as `create_image_tower`, timm's kwargs honoured, and the tower folder's weights)."""
from __future__ import annotations

import json

import pytest
import timm
import torch

from lit_softmoe.integrations.timm import timm_model_names
from lit_softmoe.models.registry import create_image_tower, list_image_towers
from lit_softmoe.models.timm_config import timm_name
from lit_softmoe.models.tower_folder import TOWER_CONFIG, TOWER_WEIGHTS, save_tower
from towers import images, tiny

PREPROCESS = {"image_size": 28, "mean": [0.286], "std": [0.353]}


def test_names_are_the_dense_and_soft_moe_towers_only():
    names = timm_model_names()
    assert "soft_moe_s16_128e" in names and "lit_softmoe_vit_b16" in names and "soft_moe_test_4e" in names
    assert set(timm.list_models("soft_moe_*")) | set(timm.list_models("lit_softmoe_vit_*")) == set(names)
    # Tokens Choice (its balancing loss would be dropped by timm's loop) and Experts Choice are not registered.
    assert not [n for n in list_image_towers() if n.startswith(("tc-", "ec-")) and timm_name(n)]
    assert len(names) == len([n for n in list_image_towers() if n.startswith(("soft-", "vit-"))])


def test_timm_tower_equals_ours_given_the_same_weights():
    ours = tiny(num_classes=5)
    theirs = timm.create_model("soft_moe_test_4e", num_classes=5).eval()
    theirs.load_state_dict(ours.state_dict())
    x = images(ours.cfg)
    assert torch.equal(theirs(x), ours(x))
    assert torch.equal(theirs.forward_features(x), ours.forward_features(x))
    assert theirs.cfg == ours.cfg
    assert not torch.equal(timm.create_model("soft_moe_test_4e").forward_features(x), ours.forward_features(x))


def test_timm_kwargs_are_honoured():
    tower = timm.create_model("soft_moe_test_4e", num_classes=7, in_chans=3, img_size=56, global_pool="")
    assert (tower.num_classes, tower.in_chans, tower.cfg.image_size, tower.global_pool) == (7, 3, 56, "")
    assert tower(torch.randn(2, 3, 56, 56)).shape == (2, 64, 7)  # unpooled: (B, N, classes)
    cfg = tower.pretrained_cfg
    assert (cfg["input_size"], cfg["mean"], cfg["crop_pct"]) == ((1, 28, 28), (0.5,), 1.0)
    with pytest.raises(TypeError, match="not_a_model_arg"):
        timm.create_model("soft_moe_test_4e", not_a_model_arg=1)


def test_pretrained_cfg_overlay_file_loads_a_tower_folder(tmp_path):
    ours = tiny(num_classes=0)
    save_tower(tmp_path / "tower", ours, extra={"preprocess": PREPROCESS})
    theirs = timm.create_model("soft_moe_test_4e", pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(tmp_path / "tower" / TOWER_WEIGHTS))).eval()
    x = images(ours.cfg)
    assert torch.equal(theirs(x), ours(x))


def test_local_dir_round_trip(tmp_path):
    # A tower that no registered name matches (3 experts): "model_args" carries its whole config.
    ours = create_image_tower("soft-test-4e", num_classes=3, num_experts=3).eval()
    save_tower(tmp_path / "tower", ours, extra={"preprocess": PREPROCESS})
    meta = json.loads((tmp_path / "tower" / TOWER_CONFIG).read_text())
    assert meta["tower"] == ours.cfg.to_dict() and meta["preprocess"] == PREPROCESS  # ours, beside timm's keys
    theirs = timm.create_model(f"local-dir:{tmp_path / 'tower'}", pretrained=True).eval()
    assert theirs.cfg == ours.cfg
    cfg = theirs.pretrained_cfg
    assert tuple(cfg["mean"]) == (0.286,) and tuple(cfg["input_size"]) == (1, 28, 28)
    x = images(ours.cfg)
    assert torch.equal(theirs.forward_features(x), ours.forward_features(x))  # the head starts at zero: not it
    assert torch.equal(theirs.head.bias, ours.head.bias)


def test_registered_name_of_a_tower_folder_is_its_architecture(tmp_path):
    save_tower(tmp_path / "tower", tiny(), extra={"preprocess": PREPROCESS})
    assert json.loads((tmp_path / "tower" / TOWER_CONFIG).read_text())["architecture"] == "soft_moe_test_4e"


def test_tokens_choice_tower_folder_is_refused(tmp_path):
    save_tower(tmp_path / "tower", create_image_tower("tc-test-4e-k1"), extra={"preprocess": PREPROCESS})
    with pytest.raises(ValueError, match="balancing loss"):
        timm.create_model(f"local-dir:{tmp_path / 'tower'}")


def test_pretrained_cfg_takes_one_mean_for_all_channels_or_one_per_channel():
    from lit_softmoe.models.registry import image_tower_config
    from lit_softmoe.models.timm_config import timm_pretrained_cfg
    rgb = image_tower_config("soft-test-4e", in_channels=3)
    scalar = timm_pretrained_cfg(rgb, {"image_size": 28, "mean": 0.25, "std": 0.5})
    assert scalar["mean"] == (0.25, 0.25, 0.25) and scalar["std"] == (0.5, 0.5, 0.5)
    listed = timm_pretrained_cfg(rgb, {"image_size": 28, "mean": [0.1, 0.2, 0.3], "std": [1, 2, 3]})
    assert listed["mean"] == (0.1, 0.2, 0.3) and listed["std"] == (1, 2, 3)
    one = timm_pretrained_cfg(rgb, {"image_size": 28, "mean": [0.5], "std": [0.5]})  # as convert/upcycle write
    assert one["mean"] == (0.5, 0.5, 0.5) and one["std"] == (0.5, 0.5, 0.5)


def test_a_config_tag_builds_any_tower_config():
    """`timm_model_spec` names a registered config plainly and any other as the nearest registered name with
    a tag of the fields that differ; timm hands the tag to our entry point, which builds that config."""
    from dataclasses import replace

    from lit_softmoe.models.registry import image_tower_config
    from lit_softmoe.models.timm_config import timm_model_spec
    assert timm_model_spec(image_tower_config("soft-s16-128e", num_classes=1000)) == "soft_moe_s16_128e"
    wanted = image_tower_config("soft-test-4e", in_channels=3, image_size=32, patch_size=8, moe_layers=(0, 1))
    name = timm_model_spec(wanted)
    assert name.startswith("soft_moe_test_4e.cfg-") and ":" not in name and "/" not in name
    tower = timm.create_model(name)
    assert tower.cfg == wanted and tower.pretrained_cfg["input_size"] == (3, 32, 32)
    assert timm.create_model(name, num_classes=7, in_chans=1).cfg == replace(wanted, num_classes=7, in_channels=1)
    with pytest.raises(ValueError, match="no lit-softmoe config tag"):
        timm.create_model("soft_moe_test_4e.cfg-%%%")


def test_features_only_gives_the_block_maps_of_forward_intermediates():
    """`features_only=True` as for timm's ViTs: its FeatureGetterNet over our forward_intermediates, blocks
    after the last index pruned; by default the last 3 blocks."""
    ours = tiny("soft-tiny-p7-16e")  # 6 blocks, 28 px in patches of 7: 4x4 maps
    x = images(ours.cfg)
    with torch.no_grad():
        taps = ours.forward_intermediates(x, intermediates_only=True)
    for out_indices, blocks in ((None, [3, 4, 5]), ((0, -2), [0, 4])):
        kwargs = {} if out_indices is None else dict(out_indices=out_indices)
        features = timm.create_model("soft_moe_tiny_p7_16e", features_only=True, **kwargs).eval()
        kept = features.model.state_dict()  # pruned: no blocks after the last index, no final norm
        features.model.load_state_dict({k: v for k, v in ours.state_dict().items() if k in kept})
        assert type(features).__name__ == "FeatureGetterNet" and len(features.model.blocks) == blocks[-1] + 1
        assert features.feature_info.module_name() == [f"blocks.{i}" for i in blocks]
        assert features.feature_info.channels() == [ours.cfg.width] * len(blocks)
        assert features.feature_info.reduction() == [ours.cfg.patch_size] * len(blocks)
        with torch.no_grad():
            maps = features(x)
        assert len(maps) == len(blocks)
        for got, i in zip(maps, blocks):
            assert got.shape == (3, ours.cfg.width, 4, 4)
            torch.testing.assert_close(got, taps[i], rtol=0, atol=0)


def test_an_image_only_export_loads_through_local_dir_and_hf_hub(run, tmp_path, monkeypatch):
    """An image-only export's config.json carries timm's hub keys: timm builds the tower with the export's
    weights (`image_tower.*`, the prefix stripped by our filter) from the folder and from a Hub cache."""
    from hf_hub_cache import cache_repo, offline_hf_cache
    from lit_softmoe.export import export_pair
    from lit_softmoe.hub import load_image_tower
    out = export_pair(run.parent / "pre", tmp_path / "tower-export", onnx=False)
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "image" and config["architecture"] == "soft_moe_test_4e"
    assert config["pretrained_cfg"]["hf_hub_filename"] == "image_encoder.safetensors"
    ours, _ = load_image_tower(out)
    x = images(ours.cfg)
    cache_repo(offline_hf_cache(monkeypatch, tmp_path / "hf"), "org/tower", out)
    for spec in (f"local-dir:{out}", "hf-hub:org/tower"):
        theirs = timm.create_model(spec, pretrained=True).eval()
        assert theirs.cfg == ours.cfg and tuple(theirs.pretrained_cfg["mean"]) == (0.286,), spec
        with torch.no_grad():
            torch.testing.assert_close(theirs.forward_features(x), ours.forward_features(x), rtol=0, atol=1e-5)
            torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=1e-5)  # the pretraining head too


def test_checkpoint_filter_fn_takes_an_exports_tower_weights():
    from lit_softmoe.integrations.timm import checkpoint_filter_fn
    tower = tiny()
    state = tower.state_dict()
    assert checkpoint_filter_fn(state, tower) is state  # a tower folder's: the tower's own names
    export = {**{f"image_tower.{k}": v for k, v in state.items()}, "image_head.weight": torch.zeros(2, 2)}
    assert checkpoint_filter_fn(export, tower).keys() == state.keys()
