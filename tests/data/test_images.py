"""lit_softmoe.data.images: one image decoding everywhere: what `lit-softmoe data` writes into shards, what the
streaming pipeline, in-memory splits, eval and a loaded model's `preprocess` read from a raw file, and what
the no-torch `scripts/onnx_example.py` computes are the same pixels (16-bit gray scaled, not clipped
white; transparency on white; EXIF orientation applied); and how images are re-encoded."""
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from data_files import encode_image, pixels_of, rng_image
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.images import (
    REDUCED_DECODE_FACTOR,
    jpeg_min_side,
    l_or_rgb_mode,
    open_image,
    prepare_image,
    upright_l_or_rgb,
    upright_shape,
)
from lit_softmoe.data.shards import write_split
from lit_softmoe.data.transforms import (
    decode_min_side,
    eval_transform,
    image_transform,
    to_l_or_rgb,
    train_transform,
)
from lit_softmoe.models.preprocess import Preprocess

EXAMPLE = Path(__file__).resolve().parents[2] / "scripts" / "onnx_example.py"
RAMP8 = np.tile(np.linspace(0, 255, 16).round().astype(np.uint8), (12, 1))  # (12, 16): every 17th level


def _rotated_by_exif():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    return encode_image(PIL.Image.fromarray(np.stack([RAMP8, RAMP8[::-1], RAMP8.T[:12, :12].repeat(2, 1)[:, :16]], -1)),
                   exif=exif.tobytes())


def _transparent_color():  # transparent black around an opaque red square, half-transparent corner
    rgba = np.zeros((12, 16, 4), np.uint8)
    rgba[3:9, 4:12] = (200, 30, 30, 255)
    rgba[0, 0] = (0, 0, 0, 128)
    return encode_image(PIL.Image.fromarray(rgba, "RGBA"))


def _transparent_palette():
    palette = PIL.Image.fromarray(np.arange(12 * 16).reshape(12, 16).astype(np.uint8) % 4, "P")
    palette.putpalette([0, 0, 0, 200, 100, 50, 10, 200, 10, 0, 0, 255] + [0] * 756)
    return encode_image(palette, transparency=0)  # index 0 (black) transparent


RAW = {
    "16bit": encode_image(PIL.Image.fromarray(RAMP8.astype(np.uint16) * 257)),  # the ramp at 16 bits
    "gray_alpha": encode_image(PIL.Image.fromarray(np.stack([RAMP8, RAMP8[::-1]], -1), "LA")),
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


def _onnx_example_image(tmp_path, data, mode, **preprocess):
    """The PIL image the no-torch example feeds its resize: its own lines, run up to the resize."""
    code = EXAMPLE.read_text().split("# --- example start\n")[1].split("short, long =")[0]
    (tmp_path / "config.json").write_text(json.dumps({"preprocess": {"image_size": 8, "mode": mode, **preprocess}}))
    (tmp_path / "image.png").write_bytes(data)  # PIL reads the format from the bytes, not the name
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


def _exif_rotated_jpeg():
    exif = PIL.Image.Exif()
    exif[0x0112] = 8  # "rotate 90° counterclockwise to display"
    return encode_image(PIL.Image.new("L", (20, 10), 90), "JPEG", exif=exif.tobytes())


def _one_bit_with_transparency():
    one_bit = PIL.Image.fromarray(np.arange(12 * 16).reshape(12, 16) % 2 == 0).convert("1")
    return encode_image(one_bit, transparency=0)


HEADER_CASES = {
    **RAW,
    "gray_jpeg": encode_image(PIL.Image.new("L", (16, 12), 120), "JPEG"),
    "rgb_jpeg": encode_image(PIL.Image.new("RGB", (16, 12), (10, 200, 30)), "JPEG"),
    "cmyk_jpeg": encode_image(PIL.Image.new("CMYK", (16, 12), (10, 20, 30, 40)), "JPEG"),
    "exif_rotated_jpeg": _exif_rotated_jpeg(),
    "palette": encode_image(PIL.Image.new("P", (16, 12), 3)),
    "one_bit": encode_image(PIL.Image.new("1", (16, 12), 1)),
    "one_bit_alpha": _one_bit_with_transparency(),
    "gray_transparent_color": encode_image(PIL.Image.new("L", (16, 12), 7), transparency=7),
    "gif": encode_image(PIL.Image.new("L", (16, 12), 50), "GIF"),
    "webp": encode_image(PIL.Image.new("RGBA", (16, 12), (1, 2, 3, 100)), "WEBP"),
}


@pytest.mark.parametrize("name", HEADER_CASES)
def test_upright_shape_is_the_decoded_shape_read_from_the_header_alone(name, monkeypatch):
    """What data.loader=auto decides by before decoding a split (`class_split.holds_images_of`): the
    channels, height and width `upright_l_or_rgb` gives, from an opened file whose pixels are not read."""
    opened = PIL.Image.open(io.BytesIO(HEADER_CASES[name]))
    loads = []
    monkeypatch.setattr(type(opened), "load", lambda self, *args: loads.append(self))
    shape, mode = upright_shape(opened), l_or_rgb_mode(opened)
    assert loads == [], "the header alone was read"
    monkeypatch.undo()
    decoded = upright_l_or_rgb(_open(HEADER_CASES[name]))
    assert mode == decoded.mode and shape == (len(decoded.getbands()), decoded.height, decoded.width)


def test_in_memory_split_decodes_like_the_pipeline(tmp_path):
    """Shards written by another tool may hold raw 16-bit or transparent images."""
    write_split([{"png": RAW["16bit"], "cls": "0"}, {"png": RAW["gray_alpha"], "cls": "1"}], tmp_path, "a")
    images, labels, _ = load_class_split(tmp_path / "a", cache=False)
    assert images.shape == (2, 1, 12, 16) and labels.tolist() == [0, 1]
    for image, name in zip(images, ("16bit", "gray_alpha")):
        assert np.array_equal(image[0].numpy(), np.asarray(to_l_or_rgb(_open(RAW[name]))))
    assert np.array_equal(images[0, 0].numpy(), RAMP8)


def test_prepare_image_keeps_the_file_bytes_when_nothing_changes():
    png = encode_image(rng_image(0))
    prepared = prepare_image(png)
    assert (prepared.extension, prepared.data, prepared.reencoded, prepared.changes) == ("png", png, False, ())
    jpeg = encode_image(rng_image(1), "JPEG", quality=80)
    assert prepare_image(jpeg, "jpg").data == jpeg and prepare_image(jpeg).extension == "jpg"


def test_prepare_image_normalizes_modes_exactly():
    rgba = PIL.Image.fromarray(np.array([[[0, 0, 255, 255], [255, 0, 0, 0], [0, 0, 0, 128]]], np.uint8), "RGBA")
    prepared = prepare_image(encode_image(rgba))
    # Opaque stays, transparent becomes white, half-transparent black becomes the mid gray on white.
    assert prepared.changes == ("alpha",) and prepared.extension == "png"
    assert pixels_of(prepared.data).tolist() == [[[0, 0, 255], [255, 255, 255], [127, 127, 127]]]

    sixteen = PIL.Image.fromarray(np.array([[0, 257, 65535, 32896]], np.uint16))
    assert sixteen.mode == "I;16"
    prepared = prepare_image(encode_image(sixteen))
    assert prepared.changes == ("16bit",) and pixels_of(prepared.data).tolist() == [[0, 1, 255, 128]]

    palette = rng_image(2).convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=16)
    prepared = prepare_image(encode_image(palette))
    assert prepared.changes == ("palette",)
    assert np.array_equal(pixels_of(prepared.data), np.asarray(palette.convert("RGB")))

    gray_alpha = PIL.Image.fromarray(np.array([[[10, 255], [10, 0]]], np.uint8), "LA")
    prepared = prepare_image(encode_image(gray_alpha))
    assert prepared.changes == ("alpha",) and pixels_of(prepared.data).tolist() == [[10, 255]]  # stays gray (L)

    cmyk = PIL.Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # pure red in CMYK
    prepared = prepare_image(encode_image(cmyk, "JPEG", quality=100))
    assert prepared.changes == ("cmyk",) and prepared.extension == "jpg"
    assert np.abs(pixels_of(prepared.data).astype(int) - [255, 0, 0]).max() <= 3


def test_prepare_image_converts_formats_and_shrinks_large_images():
    image = rng_image(3, size=(100, 40))
    png = encode_image(image)
    as_webp = prepare_image(png, "webp")
    assert as_webp.extension == "webp" and as_webp.reencoded
    assert PIL.Image.open(io.BytesIO(as_webp.data)).format == "WEBP"
    as_jpg = prepare_image(png, "jpg", max_size=50)
    assert as_jpg.changes == ("resized",) and as_jpg.source_size == (100, 40)
    assert PIL.Image.open(io.BytesIO(as_jpg.data)).size == (50, 20)
    # Lossless and not too large: re-encoding a BMP to PNG keeps every pixel.
    from_bmp = prepare_image(encode_image(image, "BMP"))
    assert from_bmp.extension == "png" and np.array_equal(pixels_of(from_bmp.data), np.asarray(image))
    assert prepare_image(png, "png", max_size=100).data == png  # not larger than max_size: untouched
    # Encoding is deterministic: the same input gives the same bytes.
    assert prepare_image(png, "jpg", max_size=50).data == as_jpg.data


def test_prepare_image_applies_exif_orientation():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    prepared = prepare_image(encode_image(rng_image(4, size=(12, 8)), "JPEG", exif=exif.tobytes()))
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


# ---- reduced JPEG decoding (issue 18) --------------------------------------------------------

def _large_jpeg(size=(1100, 900), mode="RGB", **settings) -> bytes:
    """A photo-like JPEG of `size`: foolbox's first ImageNet photo upscaled, else a smooth gradient
    with noise (the decode paths are compared with each other, so any content does)."""
    from evalkit import FOOLBOX_DATA

    photos = sorted(FOOLBOX_DATA.glob("imagenet_*.jpg")) if FOOLBOX_DATA.is_dir() else []
    if photos:
        image = PIL.Image.open(photos[0]).convert("RGB").resize(size, PIL.Image.Resampling.BICUBIC)
    else:
        y, x = np.mgrid[0:size[1], 0:size[0]]
        noise = np.random.default_rng(0).normal(0, 12, (size[1], size[0], 3))
        base = np.stack([x / size[0] * 255, y / size[1] * 255, 128 + 100 * np.sin(x / 37) * np.cos(y / 23)], -1)
        image = PIL.Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    return encode_image(image.convert(mode), "JPEG", quality=90, **settings)


def test_jpeg_min_side_of_each_decode_setting():
    assert jpeg_min_side("full", 224) is None
    assert jpeg_min_side("reduced", 224) == REDUCED_DECODE_FACTOR * 224
    with pytest.raises(ValueError, match="full, reduced"):
        jpeg_min_side("fast", 224)


@pytest.mark.parametrize(("min_side", "scale"), [(64, 8), (112, 8), (200, 4), (300, 2), (450, 2), (451, 1)])
def test_a_large_jpeg_is_decoded_at_the_smallest_dct_scale_keeping_the_shorter_side(min_side, scale):
    data = _large_jpeg((1100, 900))
    image = open_image(data, min_side)
    assert image.size == (-(-1100 // scale), -(-900 // scale))  # libjpeg rounds up
    assert min(image.size) >= min_side and image.mode == "RGB"
    if scale == 1:  # no scale fits: the very pixels of a full decode
        assert np.array_equal(np.asarray(image), np.asarray(open_image(data)))


def test_small_jpegs_and_other_formats_decode_exactly_as_in_full():
    small = _large_jpeg((400, 300))  # shorter side under 2 × 224: no DCT scale would keep it ≥ 224
    png = encode_image(PIL.Image.open(io.BytesIO(_large_jpeg())), "PNG")
    for data in (small, png, RAW["alpha"], RAW["exif_rotated"]):
        assert np.array_equal(np.asarray(open_image(data, 224)), np.asarray(open_image(data)))
    assert open_image(png, 224).size == (1100, 900)


def test_reduced_decode_keeps_exif_orientation_cmyk_and_gray():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    rotated = open_image(_large_jpeg((1100, 900), exif=exif.tobytes()), 200)
    assert rotated.size == (225, 275) and rotated.mode == "RGB"  # 1/4 scale, then upright
    cmyk = open_image(_large_jpeg((1100, 900), "CMYK"), 200)
    assert cmyk.mode == "RGB" and cmyk.size == (275, 225)
    gray = open_image(_large_jpeg((1100, 900), "L"), 200)
    assert gray.mode == "L" and gray.size == (275, 225)
    # The same pixels as a lazily opened file handed to a transform (a loaded model's preprocess).
    data = _large_jpeg((1100, 900), "CMYK")
    assert torch.equal(eval_transform(100, decode="reduced")(PIL.Image.open(io.BytesIO(data))),
                       eval_transform(100)(open_image(data, 200)))


def test_a_transform_says_how_readers_must_decode_for_it():
    assert decode_min_side(eval_transform(224)) is None
    assert decode_min_side(eval_transform(224, decode="reduced")) == 448
    assert decode_min_side(eval_transform(28, 1, decode="reduced")) == 56
    assert decode_min_side(lambda image: image) is None  # not ours: decoded in full
    # A random crop of ≥ 35% of the area, upscaled to 224, keeps 2 × 224 px over its own shorter side.
    assert decode_min_side(train_transform(224, decode="reduced")) == 2 * math.ceil(224 / math.sqrt(0.35 * 0.75))
    assert decode_min_side(train_transform(224, random_resized_crop=False, decode="reduced")) == 448
    assert decode_min_side(train_transform(224)) is None


def test_preprocess_dicts_without_a_decode_key_decode_in_full():
    data = _large_jpeg()
    old = {"image_size": 64, "mean": [0.5], "std": [0.5]}  # a tower folder written before the setting
    def transform(settings: dict):
        return image_transform(Preprocess.from_settings(settings, 3, "test"))

    assert decode_min_side(transform(old)) is None
    assert decode_min_side(transform({**old, "decode": "reduced"})) == 128
    lazy = lambda: PIL.Image.open(io.BytesIO(data))  # noqa: E731
    full, reduced = transform(old)(lazy()), transform({**old, "decode": "reduced"})(lazy())
    assert torch.equal(full, eval_transform(64, 3, 0.5, 0.5)(open_image(data)))
    assert torch.equal(reduced, eval_transform(64, 3, 0.5, 0.5)(open_image(data, 128)))
    assert not torch.equal(full, reduced)  # the reduced decode was used
    # …and close to it: a 1100 × 900 photo at 1/4 scale (275 × 225 px) resized to 64.
    assert (full - reduced).abs().mean() < 0.02


def test_the_onnx_example_decodes_a_large_jpeg_as_the_export_says(tmp_path):
    data = _large_jpeg((1100, 900))
    for min_side in (None, 200):
        example = _onnx_example_image(tmp_path, data, "RGB", decode="reduced" if min_side else "full",
                                      jpeg_min_side=min_side)
        assert example.size == ((275, 225) if min_side else (1100, 900))
        assert np.array_equal(np.asarray(example), np.asarray(open_image(data, min_side)))
