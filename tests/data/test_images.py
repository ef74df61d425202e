"""lit_softmoe.data.images: one image decoding everywhere: what `lit-softmoe data` writes into shards, what the
streaming pipeline, in-memory splits, eval and a loaded model's `preprocess` read from a raw file, and what
the no-torch `scripts/onnx_example.py` computes are the same pixels (16-bit gray scaled, not clipped
white; transparency on white; EXIF orientation applied); and how images are re-encoded."""
import io
import json
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from data_files import _encode, _pixels, _rng_image
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.images import prepare_image
from lit_softmoe.data.shards import write_split
from lit_softmoe.data.transforms import eval_transform, to_l_or_rgb

EXAMPLE = Path(__file__).resolve().parents[2] / "scripts" / "onnx_example.py"
RAMP8 = np.tile(np.linspace(0, 255, 16).round().astype(np.uint8), (12, 1))  # (12, 16): every 17th level


def _rotated_by_exif():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    return _encode(PIL.Image.fromarray(np.stack([RAMP8, RAMP8[::-1], RAMP8.T[:12, :12].repeat(2, 1)[:, :16]], -1)),
                   exif=exif.tobytes())


def _transparent_color():  # transparent black around an opaque red square, half-transparent corner
    rgba = np.zeros((12, 16, 4), np.uint8)
    rgba[3:9, 4:12] = (200, 30, 30, 255)
    rgba[0, 0] = (0, 0, 0, 128)
    return _encode(PIL.Image.fromarray(rgba, "RGBA"))


def _transparent_palette():
    palette = PIL.Image.fromarray(np.arange(12 * 16).reshape(12, 16).astype(np.uint8) % 4, "P")
    palette.putpalette([0, 0, 0, 200, 100, 50, 10, 200, 10, 0, 0, 255] + [0] * 756)
    return _encode(palette, transparency=0)  # index 0 (black) transparent


RAW = {
    "16bit": _encode(PIL.Image.fromarray(RAMP8.astype(np.uint16) * 257)),  # the ramp at 16 bits
    "gray_alpha": _encode(PIL.Image.fromarray(np.stack([RAMP8, RAMP8[::-1]], -1), "LA")),
    "alpha": _transparent_color(),
    "palette_alpha": _transparent_palette(),
    "exif_rotated": _rotated_by_exif(),
}


def _open(data):
    image = PIL.Image.open(io.BytesIO(data))
    image.load()
    return image


def test_16bit_gray_is_scaled_not_clipped_white():
    sixteen = _open(RAW["16bit"])
    assert sixteen.mode == "I;16"
    assert np.array_equal(np.asarray(to_l_or_rgb(sixteen)), RAMP8)
    for channels in (1, 3):
        transform = eval_transform(16, channels)
        assert torch.equal(transform(sixteen), transform(PIL.Image.fromarray(RAMP8)))


def _onnx_example_image(tmp_path, data, mode):
    """The PIL image the no-torch example feeds its resize: its own lines, run up to the resize."""
    code = EXAMPLE.read_text().split("# --- example start\n")[1].split("short, long =")[0]
    (tmp_path / "config.json").write_text(json.dumps({"preprocess": {"image_size": 8, "mode": mode}}))
    (tmp_path / "image.png").write_bytes(data)
    argv, sys.argv = sys.argv, ["onnx_example.py", str(tmp_path), str(tmp_path / "image.png"), "a caption"]
    try:
        scope = {}
        exec(code, scope)
    finally:
        sys.argv = argv
    return scope["image"]


@pytest.mark.parametrize("name", sorted(RAW))
def test_training_eval_and_onnx_example_decode_a_raw_image_alike(tmp_path, name):
    raw = _open(RAW[name])
    prepared = prepare_image(RAW[name])  # what `lit-softmoe data` writes (lossless png here)
    assert prepared.changes == (name.replace("gray_", "").replace("palette_", ""),)
    written = to_l_or_rgb(_open(prepared.data))  # what training decodes from the shard
    inferred = to_l_or_rgb(raw)  # what eval and load_pretrained's preprocess decode from the file
    assert written.mode == inferred.mode and np.array_equal(np.asarray(written), np.asarray(inferred))
    for channels, mode in ((1, "L"), (3, "RGB")):
        transform = eval_transform(16, channels)
        assert torch.equal(transform(written), transform(raw))
        example = _onnx_example_image(tmp_path, RAW[name], mode)
        assert np.array_equal(np.asarray(example), np.asarray(inferred.convert(mode)))
    if name in ("alpha", "palette_alpha"):
        assert np.asarray(inferred)[0, 4].tolist() == [255, 255, 255]  # transparent → white, not black
    if name == "exif_rotated":
        assert inferred.size == (12, 16)  # upright


def test_in_memory_split_decodes_like_the_pipeline(tmp_path):
    """Shards written by another tool may hold raw 16-bit or transparent images."""
    write_split([{"png": RAW["16bit"], "cls": "0"}, {"png": RAW["gray_alpha"], "cls": "1"}], tmp_path, "a")
    images, labels, _ = load_class_split(tmp_path / "a", cache=False)
    assert images.shape == (2, 1, 12, 16) and labels.tolist() == [0, 1]
    for image, name in zip(images, ("16bit", "gray_alpha")):
        assert np.array_equal(image[0].numpy(), np.asarray(to_l_or_rgb(_open(RAW[name]))))
    assert np.array_equal(images[0, 0].numpy(), RAMP8)


def test_prepare_image_keeps_the_file_bytes_when_nothing_changes():
    png = _encode(_rng_image(0))
    prepared = prepare_image(png)
    assert (prepared.extension, prepared.data, prepared.reencoded, prepared.changes) == ("png", png, False, ())
    jpeg = _encode(_rng_image(1), "JPEG", quality=80)
    assert prepare_image(jpeg, "jpg").data == jpeg and prepare_image(jpeg).extension == "jpg"


def test_prepare_image_normalizes_modes_exactly():
    rgba = PIL.Image.fromarray(np.array([[[0, 0, 255, 255], [255, 0, 0, 0], [0, 0, 0, 128]]], np.uint8), "RGBA")
    prepared = prepare_image(_encode(rgba))
    # Opaque stays, transparent becomes white, half-transparent black becomes the mid gray on white.
    assert prepared.changes == ("alpha",) and prepared.extension == "png"
    assert _pixels(prepared.data).tolist() == [[[0, 0, 255], [255, 255, 255], [127, 127, 127]]]

    sixteen = PIL.Image.fromarray(np.array([[0, 257, 65535, 32896]], np.uint16))
    assert sixteen.mode == "I;16"
    prepared = prepare_image(_encode(sixteen))
    assert prepared.changes == ("16bit",) and _pixels(prepared.data).tolist() == [[0, 1, 255, 128]]

    palette = _rng_image(2).convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=16)
    prepared = prepare_image(_encode(palette))
    assert prepared.changes == ("palette",)
    assert np.array_equal(_pixels(prepared.data), np.asarray(palette.convert("RGB")))

    gray_alpha = PIL.Image.fromarray(np.array([[[10, 255], [10, 0]]], np.uint8), "LA")
    prepared = prepare_image(_encode(gray_alpha))
    assert prepared.changes == ("alpha",) and _pixels(prepared.data).tolist() == [[10, 255]]  # stays gray (L)

    cmyk = PIL.Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # pure red in CMYK
    prepared = prepare_image(_encode(cmyk, "JPEG", quality=100))
    assert prepared.changes == ("cmyk",) and prepared.extension == "jpg"
    assert np.abs(_pixels(prepared.data).astype(int) - [255, 0, 0]).max() <= 3


def test_prepare_image_converts_formats_and_shrinks_large_images():
    image = _rng_image(3, size=(100, 40))
    png = _encode(image)
    as_webp = prepare_image(png, "webp")
    assert as_webp.extension == "webp" and as_webp.reencoded
    assert PIL.Image.open(io.BytesIO(as_webp.data)).format == "WEBP"
    as_jpg = prepare_image(png, "jpg", max_size=50)
    assert as_jpg.changes == ("resized",) and as_jpg.source_size == (100, 40)
    assert PIL.Image.open(io.BytesIO(as_jpg.data)).size == (50, 20)
    # Lossless and not too large: re-encoding a BMP to PNG keeps every pixel.
    from_bmp = prepare_image(_encode(image, "BMP"))
    assert from_bmp.extension == "png" and np.array_equal(_pixels(from_bmp.data), np.asarray(image))
    assert prepare_image(png, "png", max_size=100).data == png  # not larger than max_size: untouched
    # Encoding is deterministic: the same input gives the same bytes.
    assert prepare_image(png, "jpg", max_size=50).data == as_jpg.data


def test_prepare_image_applies_exif_orientation():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    prepared = prepare_image(_encode(_rng_image(4, size=(12, 8)), "JPEG", exif=exif.tobytes()))
    assert prepared.changes == ("exif_rotated",) and prepared.source_size == (12, 8)
    assert PIL.Image.open(io.BytesIO(prepared.data)).size == (8, 12)


def test_a_palette_png_with_transparency_converts_without_a_warning(tmp_path):
    """Clip art is often a palette PNG whose transparency is a bytes table, which PIL warns about when
    such an image is converted straight to RGB. Every path here composites it through RGBA, on white,
    without a warning (warnings are errors in this test)."""
    import warnings
    image = PIL.Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) % 3, "P")
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    buffer = io.BytesIO()
    image.save(buffer, "PNG", transparency=bytes([0, 128, 255]))
    data = buffer.getvalue()
    assert isinstance(PIL.Image.open(io.BytesIO(data)).info["transparency"], bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = prepare_image(data)
        converted = to_l_or_rgb(PIL.Image.open(io.BytesIO(data)))
        tensor = eval_transform(8, 3, 0.0, 1.0)(PIL.Image.open(io.BytesIO(data)))
    assert prepared.changes == ("alpha",) and converted.mode == "RGB"
    pixels = np.asarray(converted)
    assert pixels[0, 0].tolist() == [255, 255, 255]  # index 0: fully transparent red → white
    assert pixels[0, 1].tolist() == [127, 255, 127]  # index 1: green at alpha 128 on white
    assert pixels[0, 2].tolist() == [0, 0, 255]  # index 2: opaque blue
    assert torch.equal((tensor * 255).round().to(torch.uint8), torch.from_numpy(pixels).permute(2, 0, 1))
