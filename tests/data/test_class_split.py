"""lit_softmoe.data.class_split: a classification split read whole (`iter_class_samples`) and decoded into
memory (`load_class_split`) with its bad samples skipped and counted, a shard cut short counted as
truncated, and the decoded cache beside the split: keyed by the shards' identities (ctime included)
and never trusted when its arrays do not match its digest."""
from __future__ import annotations

import io
import logging
import os
import pathlib
import shutil
import time

import numpy as np
import PIL.Image
import pytest
import torch

from data_files import copy_split, cut_at_sample, png_bytes
from lit_softmoe.data.class_split import MixedSizesError, iter_class_samples, load_class_split
from lit_softmoe.data.shards import shard_urls, write_split
from lit_softmoe.data.tar_reading import BadSampleCounter
from lit_softmoe.utils import atomic


def test_decoded_cache_matches_decoding(fmnist_shards):
    out, _, _ = fmnist_shards
    cached_images, cached_labels, _ = load_class_split(out / "train")  # warmed by the writer
    assert list((out / "train").glob(".decoded-*.npz"))
    images, labels, _ = load_class_split(out / "train", cache=False)
    assert torch.equal(cached_images, images) and torch.equal(cached_labels, labels)
    first, first_labels, _ = load_class_split(out / "train", max_samples=10)
    assert torch.equal(first, images[:10]) and torch.equal(first_labels, labels[:10])


def test_bad_samples_and_truncated_shard_are_skipped_and_counted(tmp_path, caplog):
    good = png_bytes(np.arange(64, dtype=np.uint8).reshape(8, 8))
    samples = [
        {"png": good, "cls": "3"},
        {"png": b"\x89PNG\r\n\x1a\n not really a png", "cls": "1"},  # undecodable image
        {"png": good},  # no .cls
        {"cls": "2", "txt": "a caption but no image"},
        {"png": good, "cls": "seven"},  # label is not a number
        {"png": good, "cls": "5"},
    ]
    write_split(samples, tmp_path, "a", samples_per_shard=6)
    write_split([{"png": good, "cls": str(i)} for i in range(10)], tmp_path, "b", samples_per_shard=5)
    second = tmp_path / "b" / "1.tar"
    second.write_bytes(second.read_bytes()[:3000])  # truncated inside its first samples
    urls = shard_urls(tmp_path / "a") + shard_urls(tmp_path / "b")

    counter = BadSampleCounter()
    with caplog.at_level(logging.WARNING, logger="lit_softmoe.data.shards"):
        got = list(iter_class_samples(urls, counter))
    # From b/1.tar, whatever precedes the cut is kept; the last partial sample is counted.
    assert [label for _, label in got][:7] == [3, 5, 0, 1, 2, 3, 4]
    assert all(np.array_equal(np.asarray(image), np.asarray(PIL.Image.open(io.BytesIO(good)))) for image, _ in got)
    assert counter.counts["bad_image"] == 1 and counter.counts["missing_cls"] == 1
    assert counter.counts["missing_image"] >= 1 and counter.counts["bad_cls"] == 1
    assert counter.counts["bad_shard"] == 1  # counted once, though webdataset reports it twice
    assert len(got) + counter.counts["missing_image"] + counter.counts["missing_cls"] <= 16
    assert sum(1 for r in caplog.records if "bad_shard" in r.getMessage()) == 1

    images, labels, counts = load_class_split(tmp_path / "a", cache=False)
    assert labels.tolist() == [3, 5] and images.shape == (2, 1, 8, 8)
    assert dict(counts) == {"bad_image": 1, "missing_cls": 1, "missing_image": 1, "bad_cls": 1}


def test_negative_class_index_is_a_bad_sample(tmp_path):
    good = png_bytes(np.zeros((8, 8), np.uint8))
    write_split([{"png": good, "cls": "1"}, {"png": good, "cls": "-1"}, {"png": good, "cls": "0"}], tmp_path, "a")
    images, labels, counts = load_class_split(tmp_path / "a", cache=False)
    assert labels.tolist() == [1, 0] and dict(counts) == {"bad_cls": 1}


def test_first_n_samples_count_only_their_own_bad_samples_cached_or_not(tmp_path):
    """`max_samples` from the decoded cache counts the bad samples among the first N, as decoding
    the first N does, not the whole split's."""
    good = png_bytes(np.zeros((8, 8), np.uint8))
    # 100 samples: bad at reading positions 3 (image), 50 (image), 70 (no .cls) and 99 (image, last).
    samples = [{"png": b"not a png" if i in (3, 50, 99) else good, **({} if i == 70 else {"cls": str(i % 5)})}
               for i in range(100)]
    write_split(samples, tmp_path, "a", samples_per_shard=40)
    expected = {n: load_class_split(tmp_path / "a", n, cache=False) for n in (3, 4, 10, 60, 96, 97, None)}
    assert not list((tmp_path / "a").glob(".decoded-*.npz"))
    assert dict(expected[3][2]) == {} and dict(expected[4][2]) == {"bad_image": 1}
    assert dict(expected[60][2]) == {"bad_image": 2}
    assert dict(expected[96][2]) == {"bad_image": 2, "missing_cls": 1}
    assert dict(expected[None][2]) == {"bad_image": 3, "missing_cls": 1}
    load_class_split(tmp_path / "a")  # the full decode writes the cache
    assert list((tmp_path / "a").glob(".decoded-*.npz"))
    for n, (images, labels, counts) in expected.items():
        cached_images, cached_labels, cached_counts = load_class_split(tmp_path / "a", n)
        assert torch.equal(cached_images, images) and torch.equal(cached_labels, labels)
        assert cached_counts == counts, n


def test_a_stale_decoded_cache_in_a_read_only_split_does_not_stop_the_load(tmp_path, monkeypatch):
    # A split cached by an older version (another cache name), then mounted read-only: removing the
    # stale cache raised PermissionError outside the "not writable" guard, after the whole decode.
    write_split([{"png": png_bytes(np.full((8, 8), i, np.uint8)), "cls": str(i)} for i in range(3)], tmp_path, "a")
    stale = tmp_path / "a" / ".decoded-0123456789abcdef.npz"
    stale.write_bytes(b"an older version's cache")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    monkeypatch.setattr(atomic.tempfile, "mkstemp", read_only)  # the new cache's temporary file
    images, labels, counts = load_class_split(tmp_path / "a")
    assert labels.tolist() == [0, 1, 2] and images[:, 0, 0, 0].tolist() == [0, 1, 2] and not counts
    assert stale.is_file() and len(list((tmp_path / "a").glob(".decoded-*"))) == 1


# ---------------------------------------------------------------------------------- truncated shards


def test_a_shard_cut_at_a_sample_boundary_is_counted_as_truncated(fmnist_shards, tmp_path):
    """A tar cut at a member boundary is a valid, shorter archive: the 44 samples lost from shard 1
    went uncounted, and pretraining trained on what was left as if it were the whole split."""
    out, _, source = fmnist_shards
    split = copy_split(out / "train", tmp_path / "train")  # 64 + 64 + 64 + 8 samples
    cut_at_sample(split / "1.tar", 20)
    kept = np.r_[0:64 + 20, 128:200]  # the source positions the cut shards still hold
    source_images, source_labels = source["train"]

    counter = BadSampleCounter()
    labels = [label for _, label in iter_class_samples(split, counter)]
    assert labels == source_labels[kept].tolist()
    assert dict(counter.counts) == {"truncated_shard": 1, "missing_samples": 44}

    for _ in ("decoded", "from the decoded cache"):  # the cache keeps the counts
        images, labels, counts = load_class_split(split)
        assert torch.equal(labels, torch.from_numpy(source_labels[kept].astype(np.int64)))
        assert torch.equal(images[:, 0], torch.from_numpy(source_images[kept]))
        assert dict(counts) == {"truncated_shard": 1, "missing_samples": 44}
    assert len(list(split.glob(".decoded-*.npz"))) == 1


def test_a_shard_cut_inside_a_sample_is_one_bad_shard_and_its_lost_samples(fmnist_shards, tmp_path):
    """A tar cut inside a member is a damaged shard (bad_shard, counted once, not truncated_shard as
    well): the 6th sample, read in part, is a bad sample, and the 2 its sizes.json lists after it are
    counted as missing: 3 lost, 3 counted."""
    out, _, source = fmnist_shards
    split = copy_split(out / "train", tmp_path / "train")
    cut_at_sample(split / "3.tar", 5, into=600)  # 5 of the last shard's 8 samples, then a cut inside a member
    _, labels, counts = load_class_split(split, cache=False)
    assert labels.tolist() == source["train"][1][:192 + 5].tolist()
    assert dict(counts) == {"bad_shard": 1, "missing_image": 1, "missing_samples": 2}


# ---------------------------------------------------------------------------------- the decoded cache


def _labelled_split(root, name, labels):
    """Sample i an 8×8 image of value i (whatever the labels) with class `labels[i]`, 4 a shard: splits
    of equal length and one-digit labels have shards of equal sizes."""
    samples = [{"png": png_bytes(np.full((8, 8), i, np.uint8)), "cls": str(label)} for i, label in enumerate(labels)]
    write_split(samples, root, name, samples_per_shard=4)
    return root / name


def test_shards_replaced_by_a_copy_with_the_same_names_sizes_and_mtimes_miss_the_cache(tmp_path):
    """`cp -a` and `rsync -a` keep a file's name, size and mtime, which were all the cache was keyed by:
    the labels of the replaced shards were served from the cache. The ctime a copy cannot keep tells."""
    split = _labelled_split(tmp_path, "a", [1, 2, 3, 4, 5, 6])
    assert load_class_split(split)[1].tolist() == [1, 2, 3, 4, 5, 6]  # and cached
    assert len(list(split.glob(".decoded-*.npz"))) == 1
    other = _labelled_split(tmp_path, "b", [7, 8, 9, 7, 8, 9])
    time.sleep(0.05)  # past the kernel's timestamp granularity: the copies get another ctime
    for url in shard_urls(split):
        before = os.stat(url)
        shutil.copyfile(other / os.path.basename(url), url)
        os.utime(url, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -a does
        after = os.stat(url)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        assert after.st_ctime_ns != before.st_ctime_ns
    images, labels, counts = load_class_split(split)
    assert labels.tolist() == [7, 8, 9, 7, 8, 9] and not counts
    assert images[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]


def _garbage(cache):
    cache.write_bytes(b"not a zip file, whatever its name says" * 50)


def _cut(cache):
    cache.write_bytes(cache.read_bytes()[:-200])


def _altered_labels(cache):
    """A valid .npz of the right arrays, one label changed: only the digest inside tells."""
    with np.load(cache) as cached:
        arrays = dict(cached)
    arrays["labels"][2] = 9
    np.savez(cache, **arrays)


@pytest.mark.parametrize("damage", [_garbage, _cut, _altered_labels], ids=lambda damage: damage.__name__[1:])
def test_a_damaged_decoded_cache_is_named_in_a_warning_and_rebuilt(tmp_path, caplog, damage):
    """A damaged cache ended pretraining in a traceback (garbage bytes, a cut zip), or was trusted over
    its shards (other arrays in a valid zip)."""
    split = _labelled_split(tmp_path, "a", [1, 2, 3, 4, 5, 6])
    fresh_images, fresh_labels, _ = load_class_split(split, cache=False)
    load_class_split(split)
    (cache,) = split.glob(".decoded-*.npz")
    damage(cache)
    with caplog.at_level(logging.WARNING, logger="lit_softmoe.data.class_split"):
        images, labels, counts = load_class_split(split)
    assert torch.equal(images, fresh_images) and torch.equal(labels, fresh_labels) and not counts
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"ignoring the decoded cache {cache} (")
    assert warnings[0].endswith("decoding the shards again")
    # Rebuilt: the next load is served from it without a warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_softmoe.data.class_split"):
        images, labels, _ = load_class_split(split)
    assert torch.equal(images, fresh_images) and torch.equal(labels, fresh_labels) and not caplog.records
    with np.load(cache) as cached:
        assert cached["labels"].tolist() == fresh_labels.tolist()


def test_holds_images_of_answers_as_the_load_would_without_decoding_a_pixel(tmp_path, monkeypatch):
    """What data.loader=auto decides by before decoding: the (channels, size) the in-memory load would give,
    from the images' headers (stopping at the first image that rules it out), or from the decoded cache's
    array header once there is one."""
    import PIL.PngImagePlugin

    from lit_softmoe.data import class_split
    from lit_softmoe.data.class_split import holds_images_of
    gray, wide = png_bytes(np.full((8, 8), 7, np.uint8)), png_bytes(np.full((8, 10), 7, np.uint8))
    color = png_bytes(np.full((8, 8, 3), 9, np.uint8))
    splits = {"gray": [gray] * 4, "gray_then_color": [gray, gray, color], "gray_then_wide": [gray, wide, gray]}
    for name, images in splits.items():
        write_split([{"png": image, "cls": "0"} for image in images], tmp_path, name)
    questions = [(name, channels, size, limit) for name in splits for channels in (1, 3) for size in (8, 10)
                 for limit in (None, 1, 2)]

    def loaded_shape(name, limit):  # (C, H, W) of the load, None where it refuses mixed sizes
        try:
            return tuple(load_class_split(tmp_path / name, limit, cache=False)[0].shape[1:])
        except MixedSizesError:
            return None

    loaded = {(name, limit): loaded_shape(name, limit) for name in splits for limit in (None, 1, 2)}
    expected = [loaded[name, limit] == (channels, size, size) for name, channels, size, limit in questions]
    assert expected.count(True) == 7 and not list(tmp_path.glob("*/.decoded-*.npz"))

    def no_decoding(self, *args):
        raise AssertionError("a pixel was decoded")

    with monkeypatch.context() as patched:
        patched.setattr(PIL.PngImagePlugin.PngImageFile, "load", no_decoding)
        assert [holds_images_of(tmp_path / name, channels, size, limit)
                for name, channels, size, limit in questions] == expected

    for name in ("gray", "gray_then_color"):
        load_class_split(tmp_path / name)  # the full decode writes the cache
    monkeypatch.setattr(class_split, "iter_class_samples", lambda *args, **kwargs: iter(()))  # not read again
    full = [(name, channels, size, limit) for name, channels, size, limit in questions
            if limit is None and name != "gray_then_wide"]
    assert [holds_images_of(tmp_path / name, channels, size) for name, channels, size, _ in full] == \
        [loaded[name, None] == (channels, size, size) for name, channels, size, _ in full]
