"""A classification split read whole: (image, class) samples from image + `.cls` shards, and the
split decoded into memory (`load_class_split`), cached beside its shards so the next load skips
decoding. For small sets that pretraining keeps in memory (Fashion-MNIST's 60k × 28×28 is 47 MB).
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np
import PIL.Image
import torch

from lit_softmoe.data.images import open_image, open_undecoded, upright_shape
from lit_softmoe.data.samples import SampleSkip, decode_label, image_extension
from lit_softmoe.data.shards import (
    DECODED_CACHE_PREFIX,
    NSHARDS_FILE,
    file_identity,
    is_local_url,
    shard_urls,
    split_dir_urls,
)
from lit_softmoe.data.tar_reading import BadSampleCounter, listed_sizes, tar_samples
from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import replacing
from lit_softmoe.utils.hashing import cache_key

logger = logging.getLogger(__name__)

# 2: bad samples with their positions; negative labels skipped.
# 3: images decoded by images.upright_l_or_rgb (16-bit scaled, alpha on white, EXIF applied).
# 4: samples missing from truncated shards counted; a digest of the arrays; ctime in the key.
_DECODED_CACHE_VERSION = 4


class MixedSizesError(UserError):
    """A split whose images differ in size (it cannot be held as one array; the stream resizes
    them)."""


def _decode_class_sample(sample: dict, counter: BadSampleCounter,
                         decode: bool = True) -> tuple[PIL.Image.Image, int] | None:
    # The image is checked before the class (the stream checks the class first): a sample with
    # neither is counted as missing_image here, as it always was.
    where = f"{sample['__key__']} in {sample.get('__url__')}"
    image_key = image_extension(sample)
    if image_key is None:
        counter.skip("missing_image", where)
        return None
    try:
        label = decode_label(sample)
    except SampleSkip as skip:
        counter.skip(skip.reason, f"{where}: {skip}" if str(skip) else where)
        return None
    try:
        image = open_image(sample[image_key]) if decode else open_undecoded(sample[image_key])
    except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError… for broken files
        counter.skip("bad_image", f"{where}: {type(exn).__name__}: {exn}")
        return None
    return image, label


def iter_class_samples(
    urls: str | Path | list[str], counter: BadSampleCounter | None = None, decode: bool = True
) -> Iterator[tuple[PIL.Image.Image, int]]:
    """Yield (PIL image, class index) from image + `.cls` shards, in shard order; the image
    decoded as every reader decodes it (`images.open_image`: upright, in mode L or RGB).

    Args:
        urls: anything `shard_urls` accepts (a split folder, a brace pattern, a list).
        counter: receives the counts of skipped samples and shards; pass one to read them after.
        decode: False yields each image opened, not decoded: its header (size, mode) read, its
            pixels not (an image whose pixels turn out broken is then not skipped).

    A sample without an image or a `.cls`, or whose image does not decode, is skipped and counted;
    a damaged or unreadable tar is counted and reading goes on with the next shard, and a shard that
    holds fewer samples than its sizes.json lists is counted as truncated
    (`tar_reading.tar_samples`).
    """
    counter = counter if counter is not None else BadSampleCounter()
    shards = shard_urls(urls)
    listed = listed_sizes(shards) or {}
    for url in shards:
        for sample in tar_samples(url, counter, listed.get(url)):
            decoded = _decode_class_sample(sample, counter, decode)
            if decoded is not None:
                yield decoded


def _decoded_cache_path(split_dir: str | Path) -> Path | None:
    """Where a split folder's decoded arrays are cached; None for a pattern or url list.

    The name carries a hash of every shard's name, size, mtime and ctime (`shards.file_identity`):
    rewritten shards miss it, and so do copied ones, whose ctime is new whatever `cp -a` keeps.
    """
    if not (is_local_url(str(split_dir)) and (Path(split_dir) / NSHARDS_FILE).is_file()):
        return None
    stats = [(Path(url).name, *file_identity(url)[1:]) for url in split_dir_urls(Path(split_dir))]
    key = cache_key([_DECODED_CACHE_VERSION, stats])
    return Path(split_dir) / f"{DECODED_CACHE_PREFIX}{key}.npz"


def cache_decoded_split(split_dir: str | Path, images: torch.Tensor, labels: torch.Tensor,
                        bad: list[tuple[int, str, int]] | None = None) -> Path | None:
    """Save what `load_class_split` returns for `split_dir`, so the next load skips decoding.

    Called by `load_class_split` itself, and by writers that still hold the arrays they just
    encoded losslessly. `bad` lists the skipped samples as (good samples read before them,
    reason, count), so a load of the first N samples counts only the bad ones among those.
    Returns the cache path, or None where the folder is not writable.
    """
    path = _decoded_cache_path(split_dir)
    if path is None:
        return None
    try:
        images, labels = images.numpy(), labels.numpy()
        bad_json = json.dumps([list(event) for event in bad or []])
        with replacing(path) as temporary:
            # Str arrays, not a dict: np.load then needs no pickle. The digest is checked on load.
            np.savez(temporary, images=images, labels=labels, bad=np.array(bad_json),
                     digest=np.array(_digest(images, labels, bad_json)))
        # Inside the guard: a read-only folder may still hold the cache of older shards or versions.
        for stale in path.parent.glob(f"{DECODED_CACHE_PREFIX}*.npz"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as exn:  # a read-only dataset folder: decode each time instead
        logger.info("not caching decoded %s: %s", split_dir, exn)
        return None
    return path


def _digest(images: np.ndarray, labels: np.ndarray, bad_json: str) -> str:
    digest = hashlib.sha256()
    for part in (images.tobytes(), labels.tobytes(), str(images.shape).encode(), bad_json.encode()):
        digest.update(part)
    return digest.hexdigest()


def _read_decoded_cache(path: Path) -> tuple[torch.Tensor, torch.Tensor, list] | None:
    """(images, labels, bad events) from a decoded cache whose digest matches its arrays, else None
    (said in a warning; the split is decoded again and the cache rewritten)."""
    try:
        with np.load(path, allow_pickle=False) as cached:
            images, labels, bad_json = cached["images"], cached["labels"], str(cached["bad"])
            if str(cached["digest"]) != _digest(images, labels, bad_json):
                raise ValueError("its digest does not match its arrays")
        return torch.from_numpy(images), torch.from_numpy(labels), json.loads(bad_json)
    except Exception as err:  # noqa: BLE001 — a damaged zip, a missing array,
        # other bytes: never trusted
        logger.warning("ignoring the decoded cache %s (%s: %s); decoding the shards again", path,
                       type(err).__name__, err)
        return None


def holds_images_of(split_dir: str | Path, channels: int, size: int,
                    max_samples: int | None = None) -> bool:
    """Whether `load_class_split(split_dir, max_samples)` would give (N, `channels`, `size`, `size`)
    images, found without decoding a pixel: from the decoded cache's array header where there is
    one, else from each image's header (`images.upright_shape`: size, mode, EXIF orientation),
    stopping at the first image that rules it out (another size; color for a gray `channels`). True
    also where no image is readable: the load then says so. What `data.loader=auto` decides by
    before a split is decoded."""
    cache_path = _decoded_cache_path(split_dir)
    shape = (_cached_images_shape(cache_path) if cache_path is not None and cache_path.is_file()
             else None)
    if shape is not None:
        return tuple(shape[1:]) == (channels, size, size)
    color, count = False, 0
    for image, _ in iter_class_samples(split_dir, decode=False):
        image_channels, height, width = upright_shape(image)
        # one color image makes the split RGB, as the load reads it
        color = color or image_channels == 3
        if (height, width) != (size, size) or (color and channels != 3):
            return False
        count += 1
        if max_samples is not None and count >= max_samples:
            break
    return count == 0 or (3 if color else 1) == channels


def _cached_images_shape(path: Path) -> tuple[int, ...] | None:
    """The shape of a decoded cache's images array, from its .npy header (the array is not read);
    None where the file cannot say (the load then decodes or reads it as before)."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open("images.npy") as stream:
            version = np.lib.format.read_magic(stream)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            return tuple(read_header(stream)[0]) if read_header is not None else None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None


def load_class_split(
    split_dir: str | Path,
    max_samples: int | None = None,
    counter: BadSampleCounter | None = None,
    cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, collections.Counter[str]]:
    """Decode a whole classification split into memory.

    For small sets (Fashion-MNIST: 60k × 28×28 is 47 MB) that pretraining keeps in memory and
    augments per batch. Grayscale images give C=1; if any image is in color, all become RGB (C=3).
    Decoding goes through Python's tarfile and PIL, sample by sample, so a split folder's full
    decode is cached beside its shards (`.decoded-<hash>.npz`, one array read) unless `cache` is
    False.

    Returns:
        images: (N, C, H, W) uint8; labels: (N,) int64; counts: skipped samples by reason.
    """
    counter = counter if counter is not None else BadSampleCounter()
    cache_path = _decoded_cache_path(split_dir) if cache else None
    cached = (_read_decoded_cache(cache_path) if cache_path is not None and cache_path.is_file()
              else None)
    if cached is not None:
        images, labels, bad = cached
        # Count what decoding the first `max_samples` would have met: the bad samples read before
        # the last good one kept, not the whole split's (all of them when the split is read to its
        # end).
        reads_all = max_samples is None or max_samples > len(labels)
        for position, reason, count in bad:
            if reads_all or position < max_samples:
                counter.counts[reason] += count
        return images[:max_samples], labels[:max_samples], counter.counts

    arrays: list[np.ndarray] = []  # each (H, W) for grayscale or (H, W, 3) for color
    labels_list: list[int] = []
    bad: list[tuple[int, str, int]] = []  # (good samples before them, reason, count), for the cache
    seen = collections.Counter(counter.counts)  # a caller's counter may hold counts of other splits

    def note_bad() -> None:
        if counter.total != sum(seen.values()):
            bad.extend((len(labels_list), reason, count)
                       for reason, count in (counter.counts - seen).items())
            seen.update(counter.counts - seen)

    for image, label in iter_class_samples(split_dir, counter):
        note_bad()
        arrays.append(np.asarray(image))
        labels_list.append(label)
        if max_samples is not None and len(labels_list) >= max_samples:
            break
    note_bad()  # the bad samples after the last good one
    if not arrays:
        raise UserError(f"no readable image+cls samples in {split_dir} "
                        f"(skipped: {dict(counter.counts)}); "
                        "check that its shards hold an image and a .cls per sample")
    shapes = {array.shape[:2] for array in arrays}
    if len(shapes) > 1:
        raise MixedSizesError(f"images in {split_dir} have {len(shapes)} different sizes (e.g. "
                              f"{sorted(shapes)[:2]}); loading a split into memory needs one size: "
                              "set data.loader=stream (it resizes every image) or resize the "
                              "images when writing the shards")
    color = sum(array.ndim == 3 for array in arrays)
    if color:
        if color < len(arrays):
            logger.warning("%d of the %d images of %s are in color and the rest gray: the split is "
                           "read as RGB", color, len(arrays), split_dir)
        arrays = [array if array.ndim == 3 else np.repeat(array[:, :, None], 3, axis=2)
                  for array in arrays]
        images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W)
    else:
        images = torch.from_numpy(np.stack(arrays)).unsqueeze(1)  # (N, 1, H, W)
    labels = torch.tensor(labels_list, dtype=torch.int64)
    if cache_path is not None and max_samples is None:
        cache_decoded_split(split_dir, images, labels, bad)
    return images, labels, counter.counts
