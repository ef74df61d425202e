"""Review of `lit-softmoe export`, `load_pretrained` and `inspect-routing` as a user meets them: --overwrite
aimed at a folder the export reads from, --out paths that cannot be written, routing figures with a
suffix matplotlib cannot write."""
from __future__ import annotations

import pytest

from lit_runs import EXAMPLE


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
