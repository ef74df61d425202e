"""A raw shard sample's fields decoded for training (`sample_decoder`): the image through its transform
(seeded per sample, so augmentation is reproducible), the caption, the class, the cached embedding. A
field that does not decode raises `SampleSkip` with its reason, which the readers count."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torchvision.transforms.v2 import functional as TF

from lit_softmoe.data.feature_cache import read_npy
from lit_softmoe.data.images import open_image
from lit_softmoe.data.samples import SampleSkip, decode_label, image_extension
from lit_softmoe.data.transforms import decode_min_side


def _decode_image(sample: dict, transform: Callable | None, min_side: int | None = None,
                  seed: int | None = None, defer: Callable[[str, bytes], Any] | None = None) -> torch.Tensor:
    """`min_side`: the transform's `decode_min_side` (JPEGs decoded at a reduced scale keeping it).
    `seed`: the transform's random draws come from torch's generator seeded with it (and the
    caller's generator state is left as it was). `defer(key, bytes)`: what stands for an image that is
    decoded later, elsewhere (`gpu_jpeg.DeferToGpu`), or None to decode it here."""
    extension = image_extension(sample)
    if extension is None:
        raise SampleSkip("missing_image")
    if defer is not None and (deferred := defer(sample["__key__"], sample[extension])) is not None:
        return deferred
    try:
        image = open_image(sample[extension], min_side)  # decoded now: a truncated file fails here
    except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError… for broken files
        raise SampleSkip("bad_image", f"{type(exn).__name__}: {exn}") from None
    if transform is None:
        return TF.pil_to_tensor(image)  # (C, H, W) uint8
    try:
        if seed is None:
            return transform(image)
        # torchvision's random transforms draw from torch's default CPU generator. Its own methods, not
        # torch.manual_seed / fork_rng: those take a stack trace each call, costing more than a crop.
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return transform(image)
        finally:
            generator.set_state(state)
    except Exception as exn:  # counted apart from bad files: a transform that fails on everything is a bug
        raise SampleSkip("bad_transform", f"{type(exn).__name__}: {exn}") from None


def _decode_caption(sample: dict) -> str:
    if "txt" not in sample:
        raise SampleSkip("missing_txt")
    try:
        caption = sample["txt"].decode("utf-8").strip()
    except UnicodeDecodeError as exn:
        raise SampleSkip("bad_txt", f"not UTF-8: {exn}") from None
    if not caption:
        raise SampleSkip("bad_txt", "empty caption")
    return caption


def _decode_embedding(sample: dict, expected_shape: list) -> torch.Tensor:
    if "npy" not in sample:
        raise SampleSkip("missing_npy")
    try:
        array = read_npy(sample["npy"])
    except ValueError as exn:
        raise SampleSkip("bad_npy", str(exn)) from None
    if expected_shape and tuple(array.shape) != expected_shape[0]:
        raise SampleSkip("bad_npy", f"shape {array.shape} differs from the stream's {expected_shape[0]}")
    expected_shape[:1] = [tuple(array.shape)]  # the first good embedding fixes the shape
    return torch.from_numpy(array)


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """The seed of one sample's random transform in an epoch: a function of the three alone."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{epoch}/{key}".encode(), digest_size=8).digest(), "little") >> 1


def sample_decoder(kind: str, transform: Callable | None = None, seed_of: Callable[[str], int] | None = None,
                   num_classes: int = 0, defer: Callable[[str, bytes], Any] | None = None) -> Callable[[dict], tuple]:
    """The decode stage of a `kind` stream: raw sample dict → (key, input, target), raising `SampleSkip`.

    The cheap target is checked first, so a sample missing its caption or class costs no image decode.
    `seed_of(key)`: the seed of the sample's random transform (`sample_seed`); None: torch's generator
    as it is. `num_classes`: class indices from it on are skipped as bad_cls (0: no check). `defer`: see
    `_decode_image`.
    """

    min_side = decode_min_side(transform)  # the transform's decode setting ("reduced": JPEGs at a DCT scale)

    def image(s: dict) -> torch.Tensor:
        return _decode_image(s, transform, min_side, None if seed_of is None else seed_of(s["__key__"]), defer)

    def image_caption(s: dict) -> tuple:
        caption = _decode_caption(s)
        return s["__key__"], image(s), caption

    def image_class(s: dict) -> tuple:
        label = decode_label(s, num_classes)
        return s["__key__"], image(s), label

    shape: list = []  # filled by the first good embedding

    def embedding_caption(s: dict) -> tuple:
        caption = _decode_caption(s)
        return s["__key__"], _decode_embedding(s, shape), caption

    def embedding_class(s: dict) -> tuple:  # cached features of a class split (zero-shot eval)
        label = decode_label(s, num_classes)
        return s["__key__"], _decode_embedding(s, shape), label

    return {"image-caption": image_caption, "image-class": image_class,
            "embedding-caption": embedding_caption, "embedding-class": embedding_class}[kind]
