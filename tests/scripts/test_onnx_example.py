"""scripts/onnx_example.py: the example of docs/export.md embeds an export with onnxruntime + numpy + PIL +
tokenizers and never imports torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from lit_runs import EXAMPLE
from lit_softmoe.hub import load_pretrained

ROOT = Path(__file__).resolve().parents[2]


def _example_block(text: str) -> str:
    start, end = text.index("# --- example start\n"), text.index("# --- example end")
    return text[start + len("# --- example start\n"):end]


def test_readme_example_is_the_script(run):
    page = (ROOT / "docs" / "export.md").read_text()
    assert _example_block(EXAMPLE.read_text()).strip() in page


@pytest.mark.parametrize("shape", [(28, 28), (70, 56), (45, 90, 3)])
def test_example_embeds_without_torch(run, onnx_export, tmp_path, shape):
    """The example in a Python where importing torch or lit_softmoe fails: PyTorch's pixels to one gray level, and
    PyTorch's embeddings of its pixels to the export's own 1e-4 (onnxruntime against PyTorch).

    The pixels: PIL's bilinear resize computes in fixed point, torchvision's uint8 one in float except in torch's
    AVX2 kernel, which rounds as PIL does; elsewhere (ATEN_CPU_CAPABILITY=default, other CPUs) a value within
    rounding of .5 lands on the other level. One level is 1/255 before the normalization, 1/(255 std) after."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    # None in sys.modules makes `import torch` raise ImportError; at exit we check nobody got it anyway.
    (blocker / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "for name in ('torch', 'torchvision', 'lit_softmoe', 'open_clip', 'transformers'):\n"
        "    sys.modules[name] = None\n"
        "atexit.register(lambda: sys.stderr.write('TORCH-IMPORTED\\n') "
        "if any(sys.modules.get(n) is not None for n in ('torch', 'lit_softmoe')) else None)\n")
    image_file = tmp_path / "image.png"
    pixels = np.random.RandomState(sum(shape)).randint(0, 256, shape, dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(image_file)
    caption, saved = "a photo of an ankle boot", tmp_path / "embeddings.npz"
    env = {**os.environ, "PYTHONPATH": str(blocker), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLE), str(onnx_export), str(image_file), caption, str(saved)],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TORCH-IMPORTED" not in result.stderr and result.stdout.startswith("cosine similarity:")
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0  # the guard really blocks torch

    model, preprocess, tokenizer = load_pretrained(onnx_export)
    embeddings = np.load(saved)
    theirs, ours = embeddings["pixels"], preprocess(PIL.Image.open(image_file)).numpy()
    one_level = 1 / (255 * np.asarray(json.loads((onnx_export / "config.json").read_text())["preprocess"]["std"]))
    assert theirs.shape == ours.shape and (np.abs(theirs - ours) <= 1.01 * one_level[:, None, None]).all()
    with torch.no_grad():
        image = model.encode_image(torch.from_numpy(theirs)[None])
        text = model.encode_text(tokenizer([caption]))
    assert np.abs(embeddings["image"] - image.numpy()).max() < 1e-4
    assert np.abs(embeddings["text"] - text.numpy()).max() < 1e-4
    cosine = float(result.stdout.split(":")[1])
    assert cosine == pytest.approx(float(image[0] @ text[0]), abs=1e-4)


def test_onnx_example_on_an_export_without_onnx_says_how_to_make_one(run, tmp_path):
    import subprocess
    import sys

    from lit_softmoe.export import export_pair
    out = export_pair(run, tmp_path / "export")  # no --onnx
    PIL = pytest.importorskip("PIL.Image")
    PIL.new("L", (28, 28)).save(tmp_path / "x.png")
    for args in ([out, tmp_path / "x.png", "a cat"], [out]):
        result = subprocess.run([sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert ("--onnx" in result.stderr) if len(args) == 3 else ("usage:" in result.stderr)
