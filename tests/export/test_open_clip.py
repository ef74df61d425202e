"""An export as open_clip loads it: `open_clip.create_model_and_transforms("local-dir:EXPORT")` and
`open_clip.get_tokenizer` build a model that embeds as ours does (lit_softmoe/export/open_clip.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from launch import python_command
from lit_runs import CAPTIONS, make_run
from lit_softmoe.export import export_pair
from lit_softmoe.hub import load_pretrained

open_clip = pytest.importorskip("open_clip")
pytest.importorskip("timm")
import lit_softmoe.integrations.timm  # noqa: E402,F401 (open_clip's timm tower must know our towers)


def _open_clip_pair(export):
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    return model.eval(), preprocess, open_clip.get_tokenizer(f"local-dir:{export}")


@pytest.mark.parametrize("loss, rgb, image_head", [("softmax", False, False), ("sigmoid", True, True)])
def test_open_clip_builds_the_export_and_embeds_as_ours(tmp_path, loss, rgb, image_head):
    out = export_pair(make_run(tmp_path / "run", loss, rgb=rgb, image_head=image_head), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["open_clip"]["config"] == "open_clip_config.json"
    ours, our_preprocess, our_tokenizer = load_pretrained(out)
    theirs, preprocess, tokenizer = _open_clip_pair(out)
    assert type(theirs).__name__ == "CustomTextCLIP"
    # The tower timm built from the config's name: ours, with 3 input channels and no class head.
    assert theirs.visual.trunk.cfg == replace(ours.image_tower.cfg, in_channels=3, num_classes=0)

    ids = tokenizer(CAPTIONS)
    assert torch.equal(ids, our_tokenizer(CAPTIONS))  # open_clip's SimpleTokenizer at our context length
    channels = ours.image_tower.cfg.in_channels
    pixels = torch.randn(5, channels, 28, 28, generator=torch.Generator().manual_seed(1))
    rgb_pixels = pixels.expand(-1, 3, -1, -1)  # a gray tower's input, as open_clip's RGB transforms give it
    with torch.no_grad():
        for normalize in (True, False):
            torch.testing.assert_close(theirs.encode_image(rgb_pixels, normalize=normalize),
                                       ours.encode_image(pixels, normalize=normalize), rtol=0, atol=1e-5)
            torch.testing.assert_close(theirs.encode_text(ids, normalize=normalize),
                                       ours.encode_text(ids, normalize=normalize), rtol=0, atol=1e-5)
        got, expected = theirs(rgb_pixels, ids), ours(pixels, ids)
        assert len(got) == len(expected) == (4 if loss == "sigmoid" else 3)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert float(theirs.logit_scale.detach()) == pytest.approx(2.7)
    # Their transform and ours on an image of the tower's size (nothing to resize): the same pixels, normalized in
    # float32 two ways. open_clip divides by 255 where ours multiplies by 1/255 (torchvision's ToDtype): an ulp
    # apart at values <= 1 (6e-8), which (x - mean) / std with std >= 0.229 scales by 4.4, plus each side's last
    # roundings at values up to 4.4 (2.4e-7 each): ~1e-6 at most (7e-7 measured). One gray level is 1 / (255 std)
    # >= 0.011, four orders above the tolerance.
    image = PIL.Image.fromarray(np.random.RandomState(0).randint(0, 256, (28, 28, 3), dtype=np.uint8))
    image = image if rgb else image.convert("L")
    expected = our_preprocess(image)  # (C, 28, 28)
    torch.testing.assert_close(preprocess(image), expected.expand(3, -1, -1), rtol=0, atol=1e-5)


def test_a_gray_towers_patch_embedding_takes_rgb_by_luma_weights(run, tmp_path):
    """On colour images the widened gray tower sees PIL's convert("L"), up to its integer rounding."""
    out = export_pair(run, tmp_path / "export")
    ours, our_preprocess, _ = load_pretrained(out)
    theirs, preprocess, _ = _open_clip_pair(out)
    weights = load_file(out / "open_clip_model.safetensors")
    ours_patch = ours.image_tower.patch_embed.weight.detach()  # (d, 1, p, p)
    assert weights["visual.trunk.patch_embed.weight"].shape[1] == 3
    torch.testing.assert_close(weights["visual.trunk.patch_embed.weight"].sum(dim=1, keepdim=True), ours_patch)
    assert not any(key.startswith("visual.trunk.head.") for key in weights)  # the pretraining class head stays out
    colour = PIL.Image.fromarray(np.random.RandomState(1).randint(0, 256, (28, 28, 3), dtype=np.uint8))
    with torch.no_grad():
        got = theirs.encode_image(preprocess(colour)[None], normalize=True)
        expected = ours.encode_image(our_preprocess(colour)[None])
    # PIL rounds L to whole levels: within half a level per pixel, a small change of the embedding.
    assert (got - expected).abs().max() < 2e-2 and torch.nn.functional.cosine_similarity(got, expected).item() > 0.999


def test_no_open_clip_leaves_the_files_out_and_says_so(run, tmp_path):
    from lit_softmoe import cli
    assert cli.main(["export", str(run), "--out", str(tmp_path / "export"), "--no-open-clip"]) == 0
    names = {p.name for p in (tmp_path / "export").iterdir()}
    assert "open_clip_config.json" not in names and "open_clip_model.safetensors" not in names
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "--no-open-clip" in config["open_clip"]["skipped"]


def test_open_clips_config_names_the_tower_for_timm(run, tmp_path):
    """The gray soft-test-4e tower with 3 classes: registered as soft_moe_test_4e, built with 3 channels."""
    out = export_pair(run, tmp_path / "export")
    cfg = json.loads((out / "open_clip_config.json").read_text())
    vision, text = cfg["model_cfg"]["vision_cfg"], cfg["model_cfg"]["text_cfg"]
    assert vision["timm_model_name"].startswith("soft_moe_test_4e.cfg-")
    assert vision["timm_proj"] == "none" and vision["timm_pool"] == "avg"
    assert (text["width"], text["layers"], text["heads"], text["context_length"]) == (32, 1, 2, 16)
    assert cfg["preprocess_cfg"] == {"size": 28, "mode": "RGB", "mean": [0.286] * 3, "std": [0.353] * 3,
                                     "interpolation": "bilinear", "resize_mode": "shortest"}


def test_without_our_registration_open_clip_fails_as_the_config_note_says(run, tmp_path):
    """A Soft MoE export in a process that never imports lit_softmoe: open_clip ends in timm's Unknown model, as
    open_clip_config.json's note (and the model card) say, naming the import that fixes it."""
    import os
    import subprocess
    out = export_pair(run, tmp_path / "export")
    note = json.loads((out / "open_clip_config.json").read_text())["note"]
    assert "import lit_softmoe" in note and "RuntimeError: Unknown model" in note and "clip-benchmark" in note
    assert "lit_softmoe.integrations.timm" in (out / "README.md").read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([*python_command("torch"), "-c", "import open_clip, sys; "
                             f"open_clip.create_model_and_transforms('local-dir:{out}')"],
                            capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode != 0 and "RuntimeError: Unknown model" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("family, pool", [("resnet", "avg"), ("convnext", "avg"), ("efficientnet", "avg"),
                                          ("swin", "avg"), ("vit-registers", "avg"), ("vit-attention-pool", "map"),
                                          ("eva", "avg")])
def test_a_timm_towers_pooling_is_named_as_its_constructor_takes_it(family, pool):
    """open_clip's `timm_pool` is passed to `timm.create_model(..., global_pool=...)`: the model's own pooling,
    whether it is a string attribute (ViT, Swin, EVA) or a pooling module's type (ResNet, ConvNeXt's head)."""
    from lit_softmoe.export.open_clip import open_clip_skip_reason, timm_pool
    from lit_softmoe.models.lit import LiTModel
    from lit_softmoe.models.text import TextTowerConfig, create_text_tower
    from timm_families import TIMM_FAMILIES, random_timm_tower

    with torch.device("meta"):
        tower = random_timm_tower(TIMM_FAMILIES[family])
    assert timm_pool(tower) == pool
    text = create_text_tower(TextTowerConfig(width=32, layers=1, heads=2, context_length=16), embed_dim=tower.embed_dim)
    assert open_clip_skip_reason(LiTModel(tower, text)) is None


def test_a_timm_tower_whose_pooling_has_no_name_gets_no_open_clip_files():
    """Gemma 3n's MobileNetV5 encoder has no global pooling open_clip could ask timm for: the export says so
    (its card and config.json carry the reason) rather than write a config that builds another model."""
    from lit_softmoe.export.open_clip import open_clip_skip_reason, timm_pool
    from lit_softmoe.models.lit import LiTModel
    from lit_softmoe.models.text import TextTowerConfig, create_text_tower
    from timm_families import random_timm_tower

    with torch.device("meta"):  # 294M parameters: no memory, no init
        tower = random_timm_tower("mobilenetv5_300m_enc")
        text = create_text_tower(TextTowerConfig(width=32, layers=1, heads=2, context_length=16),
                                 embed_dim=tower.embed_dim)
    assert timm_pool(tower) is None
    assert "pooling has no name its constructor takes" in open_clip_skip_reason(LiTModel(tower, text))
