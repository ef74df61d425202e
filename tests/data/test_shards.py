"""lit_softmoe.data.shards: the shard layout (nshards.txt, sizes.json), shard urls, writing splits, and
reading class samples back with their bad samples skipped and counted."""
from __future__ import annotations

import io
import json
import logging
import pathlib
import re
import tarfile

import numpy as np
import PIL.Image
import pytest
import torch

from data_files import LIMIT, _png, _png_bytes, _read_split
from lit_softmoe.data.class_split import iter_class_samples, load_class_split
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import BadSampleCounter, num_samples, read_classnames, shard_urls, write_split
from lit_softmoe.errors import UserError
from lit_softmoe.utils import atomic


def test_nshards_sizes_and_urls(fmnist_shards):
    out, summary, _ = fmnist_shards
    split = out / "train"
    # 200 samples at 64 per shard: 64 + 64 + 64 + 8, named as CLIP_benchmark expands {0..N-1}.tar.
    assert (split / "nshards.txt").read_text() == "4\n"
    assert json.loads((split / "sizes.json").read_text()) == {"0.tar": 64, "1.tar": 64, "2.tar": 64, "3.tar": 8}
    assert summary["shards"] == {"train": 4, "test": 4}
    assert num_samples(split) == LIMIT
    urls = [str(split / f"{i}.tar") for i in range(4)]
    assert shard_urls(split) == urls
    assert shard_urls(f"{split}/{{0..3}}.tar") == urls
    assert shard_urls(f"{split}/{{0..1}}.tar::{split}/{{2..3}}.tar") == urls
    assert shard_urls([urls[0], f"{split}/{{1..3}}.tar"]) == urls


def test_decoded_cache_matches_decoding(fmnist_shards):
    out, _, _ = fmnist_shards
    cached_images, cached_labels, _ = load_class_split(out / "train")  # warmed by the writer
    assert list((out / "train").glob(".decoded-*.npz"))
    images, labels, _ = load_class_split(out / "train", cache=False)
    assert torch.equal(cached_images, images) and torch.equal(cached_labels, labels)
    first, first_labels, _ = load_class_split(out / "train", max_samples=10)
    assert torch.equal(first, images[:10]) and torch.equal(first_labels, labels[:10])


def test_write_split_rolls_over_by_count_and_bytes(tmp_path):
    samples = [{"png": _png_bytes(np.full((8, 8), i, np.uint8)), "cls": i} for i in range(7)]
    assert write_split(samples, tmp_path, "train", samples_per_shard=3) == {"0.tar": 3, "1.tar": 3, "2.tar": 1}
    # Byte cap checked before each sample: every shard takes one 2 kB sample, then rolls over.
    big = [{"bin": bytes(2000), "cls": i} for i in range(3)]
    assert write_split(big, tmp_path, "big", max_bytes=1000) == {"0.tar": 1, "1.tar": 1, "2.tar": 1}
    with tarfile.open(tmp_path / "train" / "2.tar") as tar:
        assert tar.getnames() == ["s0000006.cls", "s0000006.png"]
        info = tar.getmember("s0000006.png")
        assert (info.mtime, info.uname, info.mode) == (0, "lit-softmoe", 0o644)
        assert not info.pax_headers  # an int mtime keeps members at one header block


def test_write_split_killed_midway_leaves_no_final_shard(tmp_path):
    def samples():
        for i in range(5):
            if i == 4:
                raise KeyboardInterrupt  # as if the run were killed here
            yield {"cls": i}

    write_split([{"cls": 0}], tmp_path, "train")  # an earlier complete run
    with pytest.raises(KeyboardInterrupt):
        write_split(samples(), tmp_path, "train", samples_per_shard=3)
    split = tmp_path / "train"
    # The first shard (3 samples) was complete and published; the half one was deleted; the markers
    # are gone, so the split is not mistaken for complete.
    assert sorted(p.name for p in split.iterdir()) == ["0.tar"]
    with pytest.raises(UserError, match="no nshards.txt"):
        shard_urls(split)
    with pytest.raises(UserError, match="no sizes.json"):
        num_samples(split)


def test_bad_samples_and_truncated_shard_are_skipped_and_counted(tmp_path, caplog):
    good = _png_bytes(np.arange(64, dtype=np.uint8).reshape(8, 8))
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
    good = _png_bytes(np.zeros((8, 8), np.uint8))
    write_split([{"png": good, "cls": "1"}, {"png": good, "cls": "-1"}, {"png": good, "cls": "0"}], tmp_path, "a")
    images, labels, counts = load_class_split(tmp_path / "a", cache=False)
    assert labels.tolist() == [1, 0] and dict(counts) == {"bad_cls": 1}


def test_first_n_samples_count_only_their_own_bad_samples_cached_or_not(tmp_path):
    """`max_samples` from the decoded cache counts the bad samples among the first N, as decoding
    the first N does, not the whole split's."""
    good = _png_bytes(np.zeros((8, 8), np.uint8))
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


def test_missing_shards_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(UserError, match=f"shards not found: {tmp_path}/nope.*nshards.txt"):
        shard_urls(tmp_path / "nope")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "nshards.txt").write_text("2\n")
    with pytest.raises(UserError, match="pass .*/test"):  # the dataset folder instead of a split
        shard_urls(tmp_path)
    with pytest.raises(UserError, match="says 2 shards but 2 are missing"):
        shard_urls(tmp_path / "test")
    with pytest.raises(UserError, match="classnames.txt"):
        read_classnames(tmp_path)


def test_write_split_keep_keys_rejects_unusable_keys(tmp_path):
    assert write_split([{"__key__": "a/b", "cls": b"1"}], tmp_path, "ok", keep_keys=True) == {"0.tar": 1}
    assert list(_read_split(tmp_path / "ok")) == ["a/b"]
    for keys in (["x.y"], ["a", "a"]):
        with pytest.raises(ValueError):
            write_split([{"__key__": key, "cls": b"1"} for key in keys], tmp_path, "bad", keep_keys=True)
    # Each refused for its own reason (a bare ValueError is met by any crash on the way).
    for keys, reason in ((["x.y"], "'x.y' is not a non-empty str without a dot"), (["a", "a"], "'a' repeats"),
                         ([7], "7 is not a non-empty str"), ([""], "'' is not a non-empty str")):
        with pytest.raises(ValueError, match=re.escape(f"sample key {reason}")):
            write_split([{"__key__": key, "cls": b"1"} for key in keys], tmp_path, "bad", keep_keys=True)


def test_split_folders_joined_with_double_colon(tmp_path):
    # The documented `::` list works for split folders too (two datasets in one stream), with the
    # epoch length from both sizes.json; it used to end in "shards not found: DIR/train".
    from lit_softmoe.data.shards import shard_urls, write_split
    for name, count in (("a", 5), ("b", 7)):
        write_split([{"png": _png(i), "txt": f"{name} {i}".encode()} for i in range(count)], tmp_path / name,
                    "train", samples_per_shard=3)
    spec = f"{tmp_path / 'a' / 'train'}::{tmp_path / 'b' / 'train'}"
    assert len(shard_urls(spec)) == 2 + 3
    assert shard_urls(spec + "::") == shard_urls(spec)  # a trailing separator adds nothing
    assert shard_urls(f"{tmp_path / 'a' / 'train'}::") == shard_urls(tmp_path / "a" / "train")
    with pytest.raises(UserError, match="no shards"):
        shard_urls("::")
    loader = create_shard_loader(ShardDataConfig(urls=spec, workers=0, batch_size=4), "image-caption")
    assert loader.num_samples == 12
    exact = create_shard_loader(ShardDataConfig(urls=spec, workers=0, exact_epoch=True), "image-caption")
    captions = [caption for batch in exact for caption in batch["caption"]]
    assert sorted(captions) == sorted([f"a {i}" for i in range(5)] + [f"b {i}" for i in range(7)])


@pytest.mark.parametrize("width", [5, 6])
def test_split_folder_with_padded_shard_names(tmp_path, width):
    # img2dataset names its shards 00000.tar (5 digits), webdataset's ShardWriter 000000.tar (6).
    from lit_softmoe.data.shards import shard_urls, write_split
    write_split([{"png": _png(i), "txt": b"x"} for i in range(4)], tmp_path, "train", samples_per_shard=2)
    split = tmp_path / "train"
    for index in range(2):
        (split / f"{index}.tar").rename(split / f"{index:0{width}d}.tar")
    assert shard_urls(split) == [str(split / f"{index:0{width}d}.tar") for index in range(2)]


def test_a_stale_decoded_cache_in_a_read_only_split_does_not_stop_the_load(tmp_path, monkeypatch):
    # A split cached by an older version (another cache name), then mounted read-only: removing the
    # stale cache raised PermissionError outside the "not writable" guard, after the whole decode.
    write_split([{"png": _png_bytes(np.full((8, 8), i, np.uint8)), "cls": str(i)} for i in range(3)], tmp_path, "a")
    stale = tmp_path / "a" / ".decoded-0123456789abcdef.npz"
    stale.write_bytes(b"an older version's cache")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    monkeypatch.setattr(atomic.tempfile, "mkstemp", read_only)  # the new cache's temporary file
    images, labels, counts = load_class_split(tmp_path / "a")
    assert labels.tolist() == [0, 1, 2] and images[:, 0, 0, 0].tolist() == [0, 1, 2] and not counts
    assert stale.is_file() and len(list((tmp_path / "a").glob(".decoded-*"))) == 1
