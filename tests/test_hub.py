"""lit_softmoe.hub: load_pretrained / load_image_tower: preprocessing for the tower, and a tower or export that is
not the one the run was trained against, or is damaged, is one UserError."""
from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from lit_runs import _make_run, _one_error_line
from lit_softmoe import cli
from lit_softmoe.hub import load_pretrained


def test_preprocess_converts_rgb_to_the_towers_gray(run):
    _, preprocess, _ = load_pretrained(run)
    rgb = PIL.Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
    assert preprocess(rgb).shape == (1, 28, 28) and preprocess(rgb).dtype == torch.float32


def test_a_tower_rewritten_since_training_is_refused(tmp_path, capsys):
    import json

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = _make_run(tmp_path)
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same width (the pair still builds), other architecture: a dense tower saved over the Soft MoE one.
    save_tower(tower_dir, create_image_tower("vit-test", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against" in line and "moe_layers" in line, line
    with pytest.raises(UserError, match="not the one the run was trained against"):
        load_pretrained(run)
    # Other preprocessing is refused too.
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={**{k: v for k, v in meta.items() if k != "tower"},
                      "preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "differs in preprocess" in line, line
    assert not (tmp_path / "out").exists()


def test_a_retrained_tower_of_the_same_architecture_is_refused(tmp_path, capsys):
    import json

    import torch

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = _make_run(tmp_path)
    assert json.loads((run / "model" / "config.json").read_text())["image_tower_sha256"]
    load_pretrained(run)  # the tower the run recorded: accepted
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same tower name, config and preprocessing, other weights: only the recorded sha256 can tell.
    torch.manual_seed(1)
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    with pytest.raises(UserError, match="differs in its weights"):
        load_pretrained(run)
    # A training checkpoint records the tower's sha256 too.
    line = _one_error_line(capsys, cli.main(["export", str(run / "checkpoints" / "step_00000010"),
                                             "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    assert not (tmp_path / "out").exists()


def test_an_export_copied_in_part_is_one_line(run, tmp_path):
    import shutil

    from lit_softmoe import load_image_tower, load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.export import export_pair
    out = export_pair(run, tmp_path / "export")
    missing, truncated = tmp_path / "missing", tmp_path / "truncated"
    shutil.copytree(out, missing)
    (missing / "text_encoder.safetensors").unlink()
    shutil.copytree(out, truncated)
    with open(truncated / "image_encoder.safetensors", "r+b") as file:
        file.truncate(1000)
    with pytest.raises(UserError, match="text_encoder.safetensors .*incomplete or damaged"):
        load_pretrained(missing)
    for load in (load_pretrained, load_image_tower):
        with pytest.raises(UserError, match="image_encoder.safetensors .*incomplete or damaged"):
            load(truncated)
