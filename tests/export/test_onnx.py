"""lit_softmoe.export.onnx: ONNX graphs that agree with PyTorch, and a failed or mismatched ONNX export as
one line that leaves nothing."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_errors import one_error_line
from lit_runs import CAPTIONS, embed_pair, pair_inputs, run_cli, snapshot_files
from lit_softmoe import cli
from lit_softmoe.errors import UserError
from lit_softmoe.export import export_pair
from lit_softmoe.hub import load_pretrained


def test_onnx_matches_torch_with_a_dynamic_batch(run, onnx_export):
    import onnxruntime as ort
    config = json.loads((onnx_export / "config.json").read_text())
    for side in ("image", "text"):
        assert config["onnx"][side]["max_abs_diff"] < 1e-4
        assert config["onnx"][side]["exporter"] in ("dynamo", "torchscript")
    model, _, tokenizer = load_pretrained(run)
    image_session = ort.InferenceSession(str(onnx_export / "image_encoder.onnx"))
    text_session = ort.InferenceSession(str(onnx_export / "text_encoder.onnx"))
    for batch in (1, 3):
        pixels, ids = pair_inputs(batch, seed=batch), tokenizer(CAPTIONS[:batch])
        image, text = embed_pair(model, tokenizer, pixels, CAPTIONS[:batch])
        onnx_image = image_session.run(None, {"pixels": pixels.numpy()})[0]
        onnx_text = text_session.run(None, {"ids": ids.numpy()})[0]
        assert onnx_image.shape == (batch, 32) and onnx_text.shape == (batch, 32)
        assert np.abs(onnx_image - image.numpy()).max() < 1e-4
        assert np.abs(onnx_text - text.numpy()).max() < 1e-4


def test_onnx_failure_is_one_line_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def broken_export(*args, **kwargs):
        raise RuntimeError("unsupported operator aten::soft_moe_magic\nlong traceback text")

    monkeypatch.setattr(torch.onnx, "export", broken_export)
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(out), "--onnx", "--overwrite"]))
    assert "ONNX export of the image tower failed" in line and "aten::soft_moe_magic" in line
    assert snapshot_files(out) == {Path("keep.txt"): b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_onnx_mismatch_is_refused_with_the_difference(run, tmp_path, capsys, monkeypatch):
    import onnxruntime
    real = onnxruntime.InferenceSession

    class Off:  # onnxruntime answers 0.01 off: the check must catch it
        def __init__(self, *args, **kwargs):
            self.session = real(*args, **kwargs)

        def run(self, *args, **kwargs):
            return [out + 0.01 for out in self.session.run(*args, **kwargs)]

    monkeypatch.setattr(onnxruntime, "InferenceSession", Off)
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out"), "--onnx"]))
    assert "differs from PyTorch by 0.01" in line
    assert not any(tmp_path.iterdir())


def test_onnx_failure_of_a_tokens_choice_tower_prints_one_line(tmp_path):
    import torch

    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    torch.manual_seed(0)
    # Tokens Choice's sort has no ONNX export in torch 2.14: both exporters fail, and the TorchScript
    # one prints its whole graph from C++ on the way (past sys.stdout).
    save_tower(tmp_path / "tower", create_image_tower("tc-test-4e-k1", num_classes=3),
               extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]}})
    code, stdout, stderr = run_cli("export", tmp_path / "tower", "--out", tmp_path / "out", "--onnx")
    if code == 0:
        pytest.skip("this torch exports Tokens Choice towers to ONNX")
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, (stdout[:500], stderr[:500])
    assert "ONNX export of the image tower failed" in stderr and "\x1b[" not in stderr
    assert not (tmp_path / "out").exists()


# ---- an --overwrite export over an export of the same model -----------------------------------------

GRAPHS = {"image": "image_encoder.onnx", "text": "text_encoder.onnx"}


def _exporting(monkeypatch) -> list[str]:
    """torch's exporter replaced by one that records which file it was asked for and fails."""
    asked = []

    def refused(module, args, file, *more, **kwargs):
        asked.append(Path(file).name)
        raise RuntimeError("the exporter was called")
    monkeypatch.setattr(torch.onnx, "export", refused)
    return asked


def test_an_overwrite_of_the_same_model_copies_its_graphs_and_checks_them(run, onnx_export, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(onnx_export, out)
    before = {side: (out / name).read_bytes() for side, name in GRAPHS.items()}
    asked = _exporting(monkeypatch)
    assert cli.main(["export", str(run), "--out", str(out), "--onnx", "--overwrite"]) == 0
    assert asked == []
    onnx = json.loads((out / "config.json").read_text())["onnx"]
    first = json.loads((onnx_export / "config.json").read_text())["onnx"]
    for side, name in GRAPHS.items():
        assert onnx[side]["reused"] and (out / name).read_bytes() == before[side]
        assert onnx[side]["graph_key"] == first[side]["graph_key"] and not first[side]["reused"]
        assert onnx[side]["max_abs_diff"] == first[side]["max_abs_diff"]  # checked again, on the same input


def test_a_graph_changed_since_its_export_is_exported_again(run, onnx_export, tmp_path, monkeypatch):
    """Its bytes no longer those config.json records: the text graph is exported again (here the exporter
    refuses, which shows it was asked), the image graph beside it is still copied."""
    out = tmp_path / "out"
    shutil.copytree(onnx_export, out)
    damaged = bytearray((out / GRAPHS["text"]).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (out / GRAPHS["text"]).write_bytes(bytes(damaged))
    asked = _exporting(monkeypatch)
    with pytest.raises(UserError, match="ONNX export of the text tower failed"):
        export_pair(run, out, onnx=True, overwrite=True)
    assert set(asked) == {GRAPHS["text"]}


def test_the_graph_key_follows_the_weights_the_layers_the_input_and_the_versions(monkeypatch):
    from lit_softmoe.export import onnx
    from lit_softmoe.utils.hashing import weights_sha256

    def graph_key(module, example, output="out"):  # as write_onnx keys a graph: its module's weights hashed
        return onnx._graph_key(module, weights_sha256(module.state_dict()), example, "pixels", output)

    layer, pixels = torch.nn.Linear(4, 2), torch.zeros(2, 4)
    key = graph_key(layer, pixels)
    assert graph_key(copy.deepcopy(layer), pixels) == key  # the same weights elsewhere
    moved = copy.deepcopy(layer)
    with torch.no_grad():
        moved.bias[0] += 1e-6
    others = [graph_key(moved, pixels),
              graph_key(torch.nn.Sequential(layer), pixels),
              graph_key(layer, torch.zeros(3, 4)),
              graph_key(layer, pixels, "embedding")]
    monkeypatch.setattr(onnx, "distribution_version", lambda package: "0.0-other")
    others.append(graph_key(layer, pixels))
    assert len({key, *others}) == 6
