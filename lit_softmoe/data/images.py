"""Image files and pixels: one conversion of a decoded PIL image into what a tower reads (upright,
in mode "L" or "RGB"), and the re-encoding of an image file for a shard (`prepare_image`).

Every path goes through `upright_l_or_rgb` — writing shards (`normalize_image`), the
streaming pipeline, in-memory splits (`class_split.load_class_split`), the eval readers and the
`preprocess` of an exported or loaded model (`transforms.to_l_or_rgb`) — so a model sees at
inference the pixels it was trained on. `scripts/onnx_example.py` repeats it in a few PIL lines
(it must run without torch or this package); keep the two equal.

Opening a file (`open_undecoded`: its header alone, regular files only) and decoding it (`decode`;
the two in one: `open_image`) are shared the same way: the sample decoder (`samples`), a class
split read whole, embed's host decode, the eval readers and a transform given a lazily opened file
all call them, so a preprocessing's `decode` setting ("full" or "reduced", see `jpeg_min_side`)
gives the same pixels for the same bytes everywhere.

Only numpy and PIL here: `writers` and `sample_encoding` import this without torch.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageOps

_EXIF_ORIENTATION = 0x0112


def exif_orientation(image: PIL.Image.Image) -> int:
    if ("exif" not in image.info and not hasattr(image, "tag_v2")
            and "Raw profile type exif" not in image.info):
        # no EXIF block (most PNGs): skip getexif's parse, a third of a small PNG's decode time
        return 1
    try:
        return int(image.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: the pixels are still good, so treat it as upright
        return 1


def upright(image: PIL.Image.Image) -> PIL.Image.Image:
    """`image` with its EXIF orientation applied (a viewer rotates it so; re-encoding drops the
    tag)."""
    if exif_orientation(image) in range(2, 9):
        return PIL.ImageOps.exif_transpose(image)
    return image


def l_or_rgb(image: PIL.Image.Image) -> tuple[PIL.Image.Image, str | None]:
    """(`image` in mode "L" or "RGB", the change's name or None).

    Changes: "16bit" (I;16 / I → L, scaled from 0‥65535: PIL's own convert("L") clips at 255 and
    would turn most 16-bit images white), "alpha" (RGBA, LA, PA and transparent-color images
    composited on white; gray ones stay L), "palette" (P → RGB), "cmyk" (→ RGB), "other_mode"
    (1, F, YCbCr, LAB, HSV… → L or RGB by PIL's convert).
    """
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        # Before the alpha check: converting these to RGBA would clip too.
        values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        return PIL.Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L"), "16bit"
    if image.has_transparency_data:
        white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        flat = PIL.Image.alpha_composite(white, image.convert("RGBA"))
        return flat.convert(l_or_rgb_mode(image)), "alpha"
    if mode in ("L", "RGB"):
        return image, None
    if mode == "P":
        return image.convert("RGB"), "palette"
    if mode == "CMYK":
        return image.convert("RGB"), "cmyk"
    return image.convert(l_or_rgb_mode(image)), "other_mode"


def l_or_rgb_mode(image: PIL.Image.Image) -> str:
    """The mode, "L" or "RGB", that `l_or_rgb` gives `image`: known from its header (mode,
    transparency), before any pixel is decoded."""
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        return "L"
    if image.has_transparency_data:
        return "L" if mode in ("L", "LA", "La") else "RGB"
    return "L" if mode in ("L", "1", "F") else "RGB"


def upright_shape(image: PIL.Image.Image) -> tuple[int, int, int]:
    """(channels, height, width) of `upright_l_or_rgb(image)`, from an opened file's header alone
    (size, mode, transparency, EXIF orientation): nothing is decoded."""
    width, height = image.size
    if exif_orientation(image) in (5, 6, 7, 8):  # transposed or turned a quarter: the sides swap
        width, height = height, width
    return (1 if l_or_rgb_mode(image) == "L" else 3), height, width


def upright_l_or_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """`image` upright (EXIF applied) and in mode "L" or "RGB", transparent pixels on white."""
    return l_or_rgb(upright(image))[0]


# ---- decoding at the scale a transform needs -------------------------------------------------

DECODES = ("full", "reduced")
# "reduced" keeps a JPEG's shorter side at least this many times the side the transform resizes it
# to, as PIL's own `thumbnail` drafts (reducing_gap=2): the resize after the DCT scaling then still
# averages ≥ 2 pixels into one. On 500-1,200 px photos resized to 224, 2× keeps the pixels at 45 dB
# PSNR of a full decode's, 1× at 37 dB for more speed (docs/benchmarks.md, scripts/bench_data.py).
REDUCED_DECODE_FACTOR = 2


def jpeg_min_side(decode: str, side: int) -> int | None:
    """The shorter side a JPEG keeps when decoded for a transform resizing it to `side` px (None:
    full).

    A preprocessing without "decode" (a `convert`ed tower's) means "full".
    """
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
    return None if decode == "full" else REDUCED_DECODE_FACTOR * int(side)


def draft_jpeg(image: PIL.Image.Image, min_side: int | None) -> PIL.Image.Image:
    """Ask libjpeg to decode a not yet loaded JPEG at 1/2, 1/4 or 1/8 scale, the smallest keeping
    its shorter side ≥ `min_side` (PIL's `Image.draft`: the DCT is scaled, so the skipped pixels
    cost nothing). A no-op for other formats, loaded images, `min_side` None, or when no scale fits
    — so small JPEGs decode exactly as in full. The mode is kept: libjpeg's own YCbCr → L would
    differ from PIL's convert("L").
    """
    if not min_side or image.format not in ("JPEG", "MPO") or len(getattr(image, "tile", ())) != 1:
        return image
    if min(image.size) // min_side >= 2:
        # scale = min(w // min_side, h // min_side), floored to 8/4/2/1
        image.draft(image.mode, (min_side, min_side))
    return image


def decode(image: PIL.Image.Image, min_side: int | None = None) -> PIL.Image.Image:
    """An opened image file decoded (reduced if `draft_jpeg` applies), upright and in mode L or RGB.

    Images already loaded (arrays, a user's converted image) only go through `upright_l_or_rgb`.
    """
    draft_jpeg(image, min_side)
    image.load()  # decode now: PIL is lazy, and a truncated file fails only here
    return upright_l_or_rgb(image)


def open_undecoded(source: bytes | str | os.PathLike) -> PIL.Image.Image:
    """An image file's bytes or path opened, not decoded (PIL reads the header alone): `decode` then
    decodes it at the scale a transform asks for, or `upright_shape` reads its shape."""
    # A FIFO would block, a device never end.
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ValueError(f"{source} is not a regular file")
    return PIL.Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def open_image(source: bytes | str | os.PathLike, min_side: int | None = None) -> PIL.Image.Image:
    """`decode` of an image file's bytes or path: what every reader of shards and files decodes."""
    return decode(open_undecoded(source), min_side)


# ---- re-encoding an image file for a shard ---------------------------------------------------

IMAGE_FORMATS = ("keep", "jpg", "png", "webp")
# PIL format → the extension readers know; a format not listed (BMP, GIF, TIFF) is re-encoded.
_KEPT_FORMATS = {"PNG": "png", "JPEG": "jpg", "MPO": "jpg", "WEBP": "webp"}
# Fixed encoder settings: equal pixels give equal bytes (PIL writes no timestamps).
_ENCODERS = {
    "png": ("PNG", {"compress_level": 6, "optimize": False}),
    "jpg": ("JPEG", {"quality": 95, "subsampling": "4:2:0", "optimize": False,
                     "progressive": False}),
    "webp": ("WEBP", {"quality": 90, "method": 4, "lossless": False}),
}


class BadImageError(Exception):
    """An image file that does not decode (truncated, not an image, unsupported)."""


@dataclass(frozen=True)
class PreparedImage:
    extension: str              # "png", "jpg" or "webp": the sample's image field
    data: bytes
    source_size: tuple[int, int]  # (width, height) of the file, before any change
    changes: tuple[str, ...]    # normalizations applied, e.g. ("alpha", "resized")
    reencoded: bool             # False: `data` is the file's own bytes


def prepare_image(data: bytes, image_format: str = "keep",
                  max_size: int | None = None) -> PreparedImage:
    """Decode an image file's bytes fully, normalize it, and give the bytes to store.

    The file's own bytes are kept when its format is the one asked for (or `keep` and it is png,
    jpg or webp) and `normalize_image` changes nothing; otherwise the normalized image is encoded.
    Raises BadImageError for a file that does not decode, truncated ones included.
    """
    try:
        # Not `open_image`: the format and size are read before the decode, and a JPEG is drafted
        # for the shrink to `max_size` (`_draft_for_shrink`), not for a transform's side.
        image = open_undecoded(data)
        source_extension = _KEPT_FORMATS.get(image.format or "")
        source_size = image.size
        _draft_for_shrink(image, max_size)
        image.load()  # decodes the whole file: a truncated one fails here, not in a training run
        image, changes = normalize_image(image, max_size)
        target = (source_extension or "png") if image_format == "keep" else image_format
        if not changes and target == source_extension:
            return PreparedImage(target, data, source_size, (), reencoded=False)
        return PreparedImage(target, encode_image(image, target), source_size, changes,
                             reencoded=True)
    except PIL.UnidentifiedImageError as exn:
        raise BadImageError("not an image file PIL can read") from exn
    # PIL raises OSError, SyntaxError, ValueError, struct.error… for broken files
    except Exception as exn:
        raise BadImageError(f"{type(exn).__name__}: {exn}") from exn


def _draft_for_shrink(image: PIL.Image.Image, max_size: int | None) -> None:
    """A JPEG that `_shrink` will bring to `max_size` is decoded by libjpeg at the smallest of 1/2,
    1/4, 1/8 scale that keeps its longer side ≥ 2 × max_size (PIL's `Image.draft`, as its
    `thumbnail` does with reducing_gap=2): the resize still averages ≥ 2 pixels into one, and the
    skipped pixels cost nothing (a 1,200 px photo → 256 px decodes at 1/2). The whole file is still
    read, so a truncated one still fails. Other formats, and JPEGs needing no shrink, decode in
    full."""
    if max_size is None or image.format not in ("JPEG", "MPO") or max(image.size) <= max_size:
        return
    scale = 2 * max_size / max(image.size)
    if scale <= 0.5:  # else no DCT scale keeps the longer side ≥ 2 × max_size
        width, height = image.size
        image.draft(image.mode, (math.ceil(width * scale), math.ceil(height * scale)))


def normalize_image(image: PIL.Image.Image,
                    max_size: int | None = None) -> tuple[PIL.Image.Image, tuple[str, ...]]:
    """Turn `image` upright, into mode L or RGB, and no larger than `max_size`; name each change.

    Changes: "exif_rotated" (an EXIF orientation other than upright is applied: re-encoding drops
    the tag that told viewers to rotate), the mode changes of `images.l_or_rgb` ("alpha",
    "palette", "16bit", "cmyk", "other_mode"), "resized". The conversion is the one training,
    eval and inference apply to raw images (`transforms.to_l_or_rgb`), so shards hold what a
    model later sees.
    """
    changes = []
    rotated = upright(image)
    if rotated is not image:
        image = rotated
        changes.append("exif_rotated")
    image, mode_change = l_or_rgb(image)
    if mode_change:
        changes.append(mode_change)
    if max_size is not None and max(image.size) > max_size:
        image = _shrink(image, max_size)
        changes.append("resized")
    return image, tuple(changes)


def _shrink(image: PIL.Image.Image, max_size: int) -> PIL.Image.Image:
    width, height = image.size
    scale = max_size / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return image.resize(size, PIL.Image.Resampling.LANCZOS)


def encode_image(image: PIL.Image.Image, extension: str) -> bytes:
    """`image` (mode L or RGB) as png / jpg / webp bytes, with fixed settings and no metadata."""
    pil_format, settings = _ENCODERS[extension]
    # Some encoders copy an ICC profile or EXIF from `info`; a converted image would then carry a
    # profile for colors it no longer has.
    image.info = {}
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **settings)
    return buffer.getvalue()
