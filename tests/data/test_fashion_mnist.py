"""lit_softmoe.data.fashion_mnist: reading the real Fashion-MNIST files and writing them as shards: exact,
reproducible, with captions and metadata; missing or damaged files are one clear UserError."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch

from data_files import LIMIT, gray_png, read_split
from lit_softmoe.cli import main
from lit_softmoe.data import fashion_mnist as sources
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.fashion_mnist import find_fashion_mnist, read_fashion_mnist, read_idx, write_fashion_mnist_shards
from lit_softmoe.data.shards import read_classnames
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lock_holders import in_thread, lock_held_by_another_process


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


@pytest.mark.parametrize("compressed", [True, False])
def test_a_limited_read_is_the_head_of_the_whole_and_reads_no_further(tmp_path, compressed):
    folder = find_fashion_mnist(allow_download=False)
    whole = read_idx(folder / "t10k-images-idx3-ubyte.gz")
    assert read_fashion_mnist("test", allow_download=False, limit=7)[0].shape == (7, 28, 28)
    # The first 300 images of a copy cut off after image 1000: what the whole file holds, and no complaint about
    # the damage that lies past them; a limit beyond the cut, or none, finds it.
    data = gzip.decompress((folder / "t10k-images-idx3-ubyte.gz").read_bytes())[:16 + 1000 * 784]
    path = tmp_path / ("images.gz" if compressed else "images")
    path.write_bytes(gzip.compress(data) if compressed else data)
    assert np.array_equal(read_idx(path, limit=300), whole[:300])
    assert np.array_equal(read_idx(path, limit=1000), whole[:1000])
    for limit in (1001, None):
        with pytest.raises(UserError, match="truncated"):
            read_idx(path, limit=limit)


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


@pytest.mark.parametrize("limit", [0, -5])
def test_fashion_mnist_limit_below_one_is_refused(tmp_path, limit):
    # --limit 0 wrote empty shards; --limit -5 silently dropped the last five images of each split.
    with pytest.raises(UserError, match="limit"):
        write_fashion_mnist_shards(tmp_path / "fm", limit=limit, allow_download=False)
    assert not (tmp_path / "fm").exists()


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_damaged_gzip_idx_file_is_a_user_error(tmp_path, damage):
    original = find_fashion_mnist(allow_download=False) / "t10k-labels-idx1-ubyte.gz"
    broken = tmp_path / "t10k-labels-idx1-ubyte.gz"
    if damage == "truncated":
        broken.write_bytes(original.read_bytes()[:-40])
    else:
        broken.write_bytes(b"garbage, not gzip")
    with pytest.raises(UserError, match="reinstall"):
        read_idx(broken)


def test_gzip_check_uses_a_real_gzip(tmp_path):
    # Sanity for the test above: an intact copy reads fine.
    original = find_fashion_mnist(allow_download=False) / "t10k-labels-idx1-ubyte.gz"
    shutil.copy(original, tmp_path / "labels.gz")
    assert read_idx(tmp_path / "labels.gz").shape == (10_000,)
    assert gzip.decompress(original.read_bytes())[:4] == b"\0\0\x08\x01"


@pytest.mark.parametrize("header", [b"\0\0\x08\x03\0\0", b"\0\0\x08\x03"])
def test_idx_file_cut_inside_its_header_is_a_user_error(tmp_path, header):
    # numpy's "buffer is smaller than requested size" ValueError came out as a traceback.
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(header)
    with pytest.raises(UserError, match="truncated.*reinstall"):
        read_idx(path)


def test_fashion_mnist_does_not_rename_the_classes_of_another_split(tmp_path, capsys):
    # `data fashion-mnist` wrote its classnames.txt over that of a class split already in --out, so
    # val's ant/bee samples read as t-shirt/trousers (the other way round was already refused).
    for classname in ("ant", "bee"):
        gray_png(tmp_path / "src" / classname / "0.png", 0)
    assert main(["data", "from-folder", str(tmp_path / "src"), "--layout", "classes", "--split", "val",
                 "--out", str(tmp_path / "out")]) == 0
    fmnist = str(find_fashion_mnist(allow_download=False))
    for overwrite in ([], ["--overwrite"]):  # --overwrite replaces train/ and test/, not val's names
        assert main(["data", "fashion-mnist", "--source", fmnist, "--limit", "2", "--out", str(tmp_path / "out"),
                     *overwrite]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "for the split(s) val; write Fashion-MNIST to another --out" in error
    assert read_classnames(tmp_path / "out") == ["ant", "bee"]
    assert not (tmp_path / "out" / "train").exists()


def test_a_second_fashion_mnist_writer_waits_for_the_folders_lock(tmp_path):
    """`data fashion-mnist` and `data from-folder` with one --out wrote at once; now each takes the dataset
    folder's lock, and waits while another process holds it."""
    out = tmp_path / "data"
    with lock_held_by_another_process(out):
        thread, outcome = in_thread(write_fashion_mnist_shards, out, samples_per_shard=8, limit=20,
                                    allow_download=False)
        thread.join(1.5)
        assert thread.is_alive() and [p.name for p in out.iterdir()] == [".lit-softmoe.lock"]
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome
    assert outcome["result"]["samples"] == {"train": 20, "test": 20}
    assert len(read_split(out / "train")) == 20
