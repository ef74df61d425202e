"""One shard sample: what it holds and how each of its fields decodes, the same for every reader
(training streams, a class split read whole, embed, LiT's eval labels, the zero-shot suite).

A raw sample is webdataset's {"__key__", "__url__", extension: bytes}, extensions lowercased
(`tar_reading.tar_samples` reads them). Fields:
- the image: the first of `IMAGE_EXTENSIONS` the sample holds (`image_extension`), decoded by
  `images.open_image` and then the stream's transform, seeded per sample (`sample_seed`), so
  augmentation is reproducible;
- the caption: `.txt`, UTF-8, not empty once stripped;
- the class: `.cls`, a class index written as ASCII digits, surrounding whitespace allowed
  (`class_index`, `decode_label`). A sign, an underscore or any other character makes it no
  class index: "+3", "-0" and "1_0" are what Python's `int` would read, and none is what a
  writer writes. A split's labels alone come from its `.cls` members, no image read
  (`read_labels`);
- the cached embedding: `.npy`, a finite float array (`read_npy`; `npy_bytes` writes one), what
  `train.embed` writes into a feature cache (`feature_cache`).

`sample_decoder` turns a raw sample into a stream's (key, input, target). A sample a reader cannot
use raises `SampleSkip`, whose reason is the name it is counted under.
"""
from __future__ import annotations

import functools
import hashlib
import io
import re
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torchvision.transforms.v2 import functional as TF

from lit_softmoe.data.images import open_image
from lit_softmoe.data.tar_reading import BadSampleCounter, tar_samples
from lit_softmoe.data.transforms import decode_min_side

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
_CLASS_INDEX = re.compile(rb"[0-9]+")
_ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"


class SampleSkip(Exception):
    """A sample that cannot be used, with the reason it is counted under ("missing_cls",
    "bad_image"…)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason = reason


def image_extension(sample: dict) -> str | None:
    """The member holding the sample's image (its extension), or None if it has none."""
    return next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)


# ------------------------------------------------------------------------------ the class

def is_class_member(name: str) -> bool:
    """Whether a tar member is a sample's `.cls` (a `select_files` for reading labels alone)."""
    return name.lower().endswith(".cls")


def class_index(raw: bytes) -> int | None:
    """The class index a `.cls` member holds; None when it holds none ("dog", "-1", "+3",
    b"\\xff")."""
    digits = raw.strip(_ASCII_WHITESPACE)
    if not _CLASS_INDEX.fullmatch(digits):
        return None
    try:
        return int(digits)
    except ValueError:  # past Python's limit on the digits of an int read from text
        return None


def decode_label(sample: dict, num_classes: int = 0) -> int:
    """The sample's class index; `SampleSkip` ("missing_cls", "bad_cls") when it has no usable one.
    `num_classes`: an index from it on is bad_cls too (0: no check)."""
    if "cls" not in sample:
        raise SampleSkip("missing_cls")
    label = class_index(sample["cls"])
    if label is None:
        raise SampleSkip("bad_cls", f"{sample['cls'][:20]!r} is not a class index")
    if num_classes and label >= num_classes:
        raise SampleSkip("bad_cls", f"class {label} is past the {num_classes} class names")
    return label


def _class_member_samples(urls: list[str], counter: BadSampleCounter) -> Iterator[dict]:
    """Every sample of the shards with its `.cls` member alone: tar members that are not `.cls` are
    skipped unread, so this costs the I/O of one pass and no image decoding."""
    for url in urls:
        yield from tar_samples(url, counter, select_files=is_class_member)


def read_labels(urls: list[str], num_classes: int = 0, log: bool = True) -> list[int]:
    """The class index of every sample of the shards that has a usable one (`decode_label`), in
    shard order, from the `.cls` members alone. `log`: False for a side pass whose shards another
    pass counts (a bad shard is then passed over quietly)."""
    labels = []
    for sample in _class_member_samples(urls, BadSampleCounter(log=log)):
        try:
            labels.append(decode_label(sample, num_classes))
        except SampleSkip:  # not counted: the pass that decodes the sample counts it
            continue
    return labels


def read_class_members(urls: list[str]) -> dict[str, bytes]:
    """{key: raw .cls bytes, stripped} of every sample, from the `.cls` members alone: what `embed`
    copies into a feature shard as it is. A bad shard is passed over quietly (the main pass over the
    shards counts it)."""
    samples = _class_member_samples(urls, BadSampleCounter(log=False))
    return {sample["__key__"]: sample["cls"].strip() for sample in samples if "cls" in sample}


# ------------------------------------------------------------------------------ the embedding

def npy_bytes(embedding: np.ndarray) -> bytes:
    """An embedding as a `.npy` member, in its own dtype (embed writes float16); `read_npy` reads
    it back."""
    buffer = io.BytesIO()
    np.save(buffer, embedding, allow_pickle=False)
    return buffer.getvalue()


_NPY_MAGIC = b"\x93NUMPY"


def _npy_header_end(data: bytes) -> int | None:
    """Where a `.npy` member's header ends (format 1.0: a 2-byte length; 2.0 and 3.0: 4 bytes), or
    None for anything else (np.load then says what is wrong)."""
    if data[:6] != _NPY_MAGIC or len(data) < 12:
        return None
    if data[6] == 1:
        return 10 + int.from_bytes(data[8:10], "little")
    return 12 + int.from_bytes(data[8:12], "little") if data[6] in (2, 3) else None


@functools.lru_cache(maxsize=64)
def _npy_float_layout(header: bytes) -> tuple[np.dtype, tuple, str] | None:
    """(dtype, shape, order) of a float array's `.npy` header, parsed by numpy's own reader once
    per distinct header: a feature shard's members all share one, and parsing it (a Python literal)
    cost as much as the rest of the sample's decode. None for any other header."""
    stream = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(stream)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                np.lib.format.read_array_header_2_0)  # 3.0: 2.0's layout, its text UTF-8
        shape, fortran, dtype = read(stream)
    except Exception:  # np.load, on the slow path, gives the reason
        return None
    if dtype.kind != "f" or not shape or stream.tell() != len(header):
        return None
    return dtype, shape, "F" if fortran else "C"


def read_npy(data: bytes) -> np.ndarray:
    """A `.npy` member's embedding as float32; ValueError, saying why, for anything but a finite
    float array."""
    end = _npy_header_end(data)
    layout = _npy_float_layout(data[:end]) if end is not None else None
    if layout is not None:
        dtype, shape, order = layout
        count = int(np.prod(shape))
        if len(data) - end == count * dtype.itemsize:  # else cut short or padded: np.load says
            array = np.frombuffer(data, dtype, count, offset=end).reshape(shape, order=order)
            with np.errstate(over="ignore"):  # a copy: torch gets a writable array
                return _finite_float32(array.astype(np.float32))
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exn:  # ValueError, OSError, EOFError… for a damaged .npy
        # numpy's message for an object array names allow_pickle: a pickle is never loaded from a
        # shard.
        pickled = "allow_pickle" in str(exn)
        detail = "holds Python objects, which are never unpickled" if pickled else exn
        raise ValueError(f"{type(exn).__name__}: {detail}") from None
    if array.dtype.kind != "f" or array.ndim == 0:
        raise ValueError(f"expected a float array, got {array.dtype} with shape {array.shape}")
    with np.errstate(over="ignore"):  # a float64 value past float32's range becomes inf: see below
        return _finite_float32(array.astype(np.float32, copy=False))


def _finite_float32(array: np.ndarray) -> np.ndarray:
    # Checked after the cast: what trains is float32, and an overflow to inf there is as bad as a
    # NaN.
    if not np.isfinite(array).all():
        raise ValueError("holds NaN or infinity (as float32)")
    return array


# ------------------------------------------------------------------------------ a stream's decode

def _decode_image(sample: dict, transform: Callable | None, min_side: int | None = None,
                  seed: int | None = None,
                  defer: Callable[[str, bytes], Any] | None = None) -> torch.Tensor:
    """`min_side`: the transform's `decode_min_side` (JPEGs decoded at a reduced scale keeping it).
    `seed`: the transform's random draws come from torch's generator seeded with it (and the
    caller's generator state is left as it was). `defer(key, bytes)`: what stands for an image that
    is decoded later, elsewhere (`gpu_jpeg.DeferToGpu`), or None to decode it here."""
    extension = image_extension(sample)
    if extension is None:
        raise SampleSkip("missing_image")
    deferred = None if defer is None else defer(sample["__key__"], sample[extension])
    if deferred is not None:
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
        # torchvision's random transforms draw from torch's default CPU generator. Its own methods,
        # not torch.manual_seed / fork_rng: those take a stack trace each call, costing more than a
        # crop.
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return transform(image)
        finally:
            generator.set_state(state)
    except Exception as exn:  # counted apart from bad files: a transform failing on all is a bug
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
        raise SampleSkip("bad_npy",
                         f"shape {array.shape} differs from the stream's {expected_shape[0]}")
    expected_shape[:1] = [tuple(array.shape)]  # the first good embedding fixes the shape
    return torch.from_numpy(array)


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """The seed of one sample's random transform in an epoch: a function of the three alone."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_decoder(kind: str, transform: Callable | None = None,
                   seed_of: Callable[[str], int] | None = None, num_classes: int = 0,
                   defer: Callable[[str, bytes], Any] | None = None) -> Callable[[dict], tuple]:
    """The decode stage of a `kind` stream: raw sample dict → (key, input, target), raising
    `SampleSkip`.

    The cheap target is checked first, so a sample missing its caption or class costs no image
    decode. `seed_of(key)`: the seed of the sample's random transform (`sample_seed`); None: torch's
    generator as it is. `num_classes`: class indices from it on are skipped as bad_cls (0: no
    check). `defer`: see `_decode_image`.
    """

    # The transform's decode setting ("reduced": JPEGs at a DCT scale).
    min_side = decode_min_side(transform)

    def image(s: dict) -> torch.Tensor:
        seed = None if seed_of is None else seed_of(s["__key__"])
        return _decode_image(s, transform, min_side, seed, defer)

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
