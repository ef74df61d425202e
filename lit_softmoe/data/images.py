"""One conversion of a decoded PIL image into what a tower reads: upright, in mode "L" or "RGB".

Every path goes through `upright_l_or_rgb` — writing shards (`writers.normalize_image`), the
streaming pipeline, in-memory splits (`shards.load_class_split`), the eval readers and the
`preprocess` of an exported or loaded model (`transforms.to_l_or_rgb`) — so a model sees at
inference the pixels it was trained on. `scripts/onnx_example.py` repeats it in a few PIL lines
(it must run without torch or this package); keep the two equal.

Only numpy and PIL here: `writers` imports this without torch.
"""
from __future__ import annotations

import numpy as np
import PIL.Image
import PIL.ImageOps

_EXIF_ORIENTATION = 0x0112


def exif_orientation(image: PIL.Image.Image) -> int:
    if "exif" not in image.info and not hasattr(image, "tag_v2") and "Raw profile type exif" not in image.info:
        return 1  # no EXIF block (most PNGs): skip getexif's parse, a third of a small PNG's decode time
    try:
        return int(image.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: the pixels are still good, so treat it as upright
        return 1


def upright(image: PIL.Image.Image) -> PIL.Image.Image:
    """`image` with its EXIF orientation applied (a viewer rotates it so; re-encoding drops the tag)."""
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
        return flat.convert("L" if mode in ("L", "LA", "La") else "RGB"), "alpha"
    if mode in ("L", "RGB"):
        return image, None
    if mode == "P":
        return image.convert("RGB"), "palette"
    if mode == "CMYK":
        return image.convert("RGB"), "cmyk"
    return image.convert("L" if mode in ("1", "F") else "RGB"), "other_mode"


def upright_l_or_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """`image` upright (EXIF applied) and in mode "L" or "RGB", transparent pixels on white."""
    return l_or_rgb(upright(image))[0]
