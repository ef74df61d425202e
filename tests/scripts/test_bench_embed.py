"""scripts/bench_embed.py in its CPU mode: real photos as large JPEG shards, every one embedded, the
ceiling and the embed rate measured in the same run and their ratio reported; with --baseline, the loop as it
was before timed too and its feature shards byte-identical to embed's."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("foolbox") is None,
                    reason="the photos are foolbox's data files (make install adds foolbox)")
def test_cpu_run_embeds_every_photo_and_reports_the_ratio(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_embed", ROOT / "scripts" / "bench_embed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_embed"] = module
    spec.loader.exec_module(module)
    result = module.main(["--cpu", "--images", "24", "--unique", "6", "--baseline", "--json",
                          str(tmp_path / "embed.json")])
    assert json.loads((tmp_path / "embed.json").read_text()) == result
    assert result["images"] == 24 and result["tower"] == "soft-test-4e" and result["workers"] == 0
    assert result["ceiling_images_per_s"] > 0 and result["embed_images_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["embed_images_per_s"] / result["ceiling_images_per_s"], abs=1e-3)
    # 24 images in batches of 16: the steady rate counts the 8 after the first batch, the overall rate all
    # 24 over a time that also holds the tower's loading.
    assert 0 < result["startup_seconds"] and 0 < result["embed_overall_images_per_s"]
    assert result["decode"] == "reduced"
    assert result["normalization_on_device_bitwise"] is True and result["same_shards_as_before"] is True
    assert result["before_images_per_s"] > 0
    table = capsys.readouterr().out
    assert "| `embed` on the JPEG shards (decode + tower + write), after its first batch |" in table
    assert f"{result['ratio']:.2f} |" in table and "start-up included" in table
    assert "| `embed` before uint8 batches" in table and "byte-identical to the loop before: True" in table


def test_photo_jpegs_are_500_to_1200_px_jpegs():
    sys.path.insert(0, str(ROOT / "scripts"))
    import io

    import PIL.Image
    from benchlib import photo_jpegs
    if importlib.util.find_spec("foolbox") is None:
        pytest.skip("the photos are foolbox's data files (make install adds foolbox)")
    for data in photo_jpegs(5, seed=1):
        image = PIL.Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB"
        assert 500 <= min(image.size) and max(image.size) <= 1200
