"""Data layer on real Fashion-MNIST: shards round-trip exactly, are reproducible and atomic, bad
samples and shards are skipped and counted, a missing dataset is one clear UserError, and the
transforms give the values they promise."""
import hashlib
import io
import json
import logging
import tarfile

import numpy as np
import PIL.Image
import pytest
import torch

from lit_softmoe.data import fashion_mnist as sources
from lit_softmoe.data.fashion_mnist import find_fashion_mnist, read_fashion_mnist, read_idx, write_fashion_mnist_shards
from lit_softmoe.data.shards import (BadSampleCounter, iter_class_samples, load_class_split, num_samples,
                                     read_classnames, shard_urls, write_split)
from lit_softmoe.data.transforms import batch_augment, eval_transform, match_channels, normalize_batch, train_transform
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES

from data_files import LIMIT, _png_bytes


# ---------------------------------------------------------------------------------------- sources


def test_read_fashion_mnist_shapes_and_labels():
    images, labels = read_fashion_mnist("test", allow_download=False)
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10_000,) and np.bincount(labels).tolist() == [1000] * 10
    # The first test labels of the official release: ankle boot, pullover, trousers, trousers, shirt.
    assert labels[:5].tolist() == [9, 2, 1, 1, 6]


def test_read_idx_rejects_a_truncated_file(tmp_path):
    folder = find_fashion_mnist(allow_download=False)
    raw = read_idx(folder / "t10k-labels-idx1-ubyte.gz")
    broken = tmp_path / "labels-idx1-ubyte"
    broken.write_bytes(b"\0\0\x08\x01" + (len(raw)).to_bytes(4, "big") + raw.tobytes()[:-3])
    with pytest.raises(UserError, match="truncated"):
        read_idx(broken)


def test_shards_round_trip_exactly(fmnist_shards):
    out, summary, source = fmnist_shards
    assert summary["samples"] == {"train": LIMIT, "test": LIMIT} and not summary["skipped"]
    for split in ("train", "test"):
        images, labels, counts = load_class_split(out / split, cache=False)
        assert images.shape == (LIMIT, 1, 28, 28) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64 and sum(counts.values()) == 0
        assert torch.equal(images[:, 0], torch.from_numpy(source[split][0][:LIMIT].copy()))
        assert torch.equal(labels, torch.from_numpy(source[split][1][:LIMIT].astype(np.int64)))


def test_samples_hold_caption_and_metadata(fmnist_shards):
    out, _, source = fmnist_shards
    with tarfile.open(out / "test" / "0.tar") as tar:
        names = tar.getnames()
        assert names[:4] == ["s0000000.cls", "s0000000.json", "s0000000.png", "s0000000.txt"]
        member = {name: tar.extractfile(name).read() for name in names[:8]}
    assert member["s0000000.cls"] == b"9"
    assert member["s0000000.txt"].decode() == "a photo of the ankle boot."
    assert json.loads(member["s0000001.json"]) == {"index": 1, "source": "fashion-mnist", "split": "test"}
    assert FASHION_MNIST_CLASSNAMES[int(source["test"][1][1])] in member["s0000001.txt"].decode()
    assert read_classnames(out) == list(FASHION_MNIST_CLASSNAMES)
    assert read_classnames(out / "test") == list(FASHION_MNIST_CLASSNAMES)  # a split folder works too
    templates = (out / "zeroshot_classification_templates.txt").read_text().splitlines()
    assert templates and all("{c}" in t for t in templates)
    from lit_softmoe.data.fashion_mnist import CAPTION_TEMPLATES
    assert not set(templates) & set(CAPTION_TEMPLATES)  # zero-shot prompts are never training captions
    assert (out / "dataset_type.txt").read_text().strip() == "classification"


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


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_rerun_is_byte_identical_and_skips_when_complete(fmnist_shards, tmp_path):
    out, _, _ = fmnist_shards
    again = write_fashion_mnist_shards(tmp_path, samples_per_shard=64, limit=LIMIT, allow_download=False)
    assert not again["skipped"]
    for split in ("train", "test"):
        for i in range(4):
            assert _sha256(tmp_path / split / f"{i}.tar") == _sha256(out / split / f"{i}.tar")
    before = (tmp_path / "train" / "0.tar").stat().st_mtime_ns
    third = write_fashion_mnist_shards(tmp_path, samples_per_shard=64, limit=LIMIT, allow_download=False)
    assert third["skipped"] and third["samples"] == {"train": LIMIT, "test": LIMIT}
    assert (tmp_path / "train" / "0.tar").stat().st_mtime_ns == before
    # Other arguments are another set: it is rewritten, and the old extra shards are removed.
    fourth = write_fashion_mnist_shards(tmp_path, samples_per_shard=100, limit=LIMIT, allow_download=False)
    assert not fourth["skipped"] and fourth["shards"] == {"train": 2, "test": 2}
    assert sorted(p.name for p in (tmp_path / "train").glob("*.tar")) == ["0.tar", "1.tar"]


def test_decoded_cache_matches_decoding(fmnist_shards):
    out, _, _ = fmnist_shards
    cached_images, cached_labels, _ = load_class_split(out / "train")  # warmed by the writer
    assert list((out / "train").glob(".decoded-*.npz"))
    images, labels, _ = load_class_split(out / "train", cache=False)
    assert torch.equal(cached_images, images) and torch.equal(cached_labels, labels)
    first, first_labels, _ = load_class_split(out / "train", max_samples=10)
    assert torch.equal(first, images[:10]) and torch.equal(first_labels, labels[:10])


# ---------------------------------------------------------------------------------------- writing


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


# ---------------------------------------------------------------------------------------- bad data


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


def test_missing_fashion_mnist_is_a_user_error_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="apt-get install -y dataset-fashion-mnist"):
        find_fashion_mnist(tmp_path / "nowhere", allow_download=False)
    monkeypatch.setenv("LIT_SOFTMOE_DATA", str(tmp_path / "empty"))
    monkeypatch.setattr(sources, "SYSTEM_DIR", tmp_path / "no-system")
    monkeypatch.setattr(sources, "CACHE_DIR", tmp_path / "no-cache")
    with pytest.raises(UserError) as caught:
        write_fashion_mnist_shards(tmp_path / "out", allow_download=False)
    message = str(caught.value)
    assert str(tmp_path / "empty") in message and "LIT_SOFTMOE_DATA=DIR" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_fashion_mnist_found_through_env(tmp_path, monkeypatch):
    real = find_fashion_mnist(allow_download=False)
    (tmp_path / "fashion-mnist").mkdir()
    for file in real.iterdir():
        if "idx" in file.name:
            (tmp_path / "fashion-mnist" / file.name).symlink_to(file)
    monkeypatch.setenv("LIT_SOFTMOE_DATA", str(tmp_path))
    assert find_fashion_mnist(allow_download=False) == tmp_path / "fashion-mnist"


# ---------------------------------------------------------------------------------------- transforms


def test_eval_transform_shapes_values_and_channels():
    array = np.arange(28 * 28, dtype=np.int64).reshape(28, 28).astype(np.uint8)
    image = PIL.Image.fromarray(array)
    gray = eval_transform(28, in_channels=1, mean=0.5, std=0.25)(image)
    assert gray.shape == (1, 28, 28) and gray.dtype == torch.float32
    assert torch.allclose(gray[0], (torch.from_numpy(array).float() / 255 - 0.5) / 0.25, atol=1e-6)
    rgb = eval_transform(28, in_channels=3, mean=(0.5, 0.5, 0.5), std=0.5)(image)
    assert rgb.shape == (3, 28, 28)
    assert torch.equal(rgb[0], rgb[1]) and torch.equal(rgb[1], rgb[2])
    assert torch.allclose(rgb[0], torch.from_numpy(array).float() / 127.5 - 1, atol=1e-6)
    # RGB → 1 channel, and a resize + center crop of a non-square image.
    color = PIL.Image.fromarray(np.zeros((40, 60, 3), np.uint8))
    assert eval_transform(32, in_channels=1)(color).shape == (1, 32, 32)
    with pytest.raises(ValueError, match="2 values for 3 channels"):
        eval_transform(28, in_channels=3, mean=(0.1, 0.2))


def test_train_transform_crops_within_padding():
    image = PIL.Image.fromarray(np.full((28, 28), 255, np.uint8))
    torch.manual_seed(0)
    transform = train_transform(28, in_channels=1, mean=0.0, std=1.0, crop_padding=4)
    outputs = torch.stack([transform(image) for _ in range(20)])
    assert outputs.shape == (20, 1, 28, 28)
    # The white square moved by up to 4 px: at least one border row or column is zero padding,
    # and the center is always white.
    assert (outputs == 0).any() and torch.all(outputs[:, :, 4:24, 4:24] == 1)
    assert train_transform(24, in_channels=3)(image).shape == (3, 24, 24)


def test_batch_augment_is_deterministic_and_shifts_and_flips():
    images = torch.randint(1, 256, (64, 1, 28, 28), dtype=torch.uint8)  # no zeros: padding is visible
    first = batch_augment(images, torch.Generator().manual_seed(7), padding=2)
    again = batch_augment(images, torch.Generator().manual_seed(7), padding=2)
    other = batch_augment(images, torch.Generator().manual_seed(8), padding=2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == images.shape and first.dtype == torch.uint8

    # Replay the draws to check each sample against its definition.
    generator = torch.Generator().manual_seed(7)
    offsets = torch.randint(0, 5, (2, 64), generator=generator)
    flips = torch.rand(64, generator=generator) < 0.5
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for n in range(64):
        dy, dx = offsets[:, n].tolist()
        expected = padded[n, :, dy:dy + 28, dx:dx + 28]
        assert torch.equal(first[n], torch.flip(expected, dims=[-1]) if flips[n] else expected)
    assert flips.any() and (~flips).any() and (offsets != 2).any()
    unshifted = (offsets == 2).all(0)
    assert torch.equal(first[unshifted & ~flips], images[unshifted & ~flips])
    assert torch.equal(first[unshifted & flips], torch.flip(images[unshifted & flips], dims=[-1]))

    # RGB batches and no-flip mode: with hflip off, nothing is mirrored.
    rgb = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    out = batch_augment(rgb, torch.Generator().manual_seed(0), padding=0, hflip=False)
    assert torch.equal(out, rgb)


def test_normalize_batch_values_and_channels():
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    out = normalize_batch(images, mean=0.2, std=0.5)
    assert out.dtype == torch.float32
    assert torch.allclose(out.flatten(), torch.tensor([-0.4, 0.0, 1.6]), atol=1e-6)
    rgb = normalize_batch(images, mean=(0.2, 0.0, 0.2), std=(0.5, 1.0, 0.5), in_channels=3)
    assert rgb.shape == (1, 3, 1, 3) and torch.allclose(rgb[0, 0], rgb[0, 2])
    assert torch.allclose(rgb[0, 1].flatten(), torch.tensor([0.0, 0.2, 1.0]), atol=1e-6)
    color = torch.tensor([255, 0, 0], dtype=torch.uint8).view(1, 3, 1, 1)
    assert match_channels(color, 1).item() == round(0.299 * 255)
