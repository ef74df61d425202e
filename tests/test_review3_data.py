"""Third review of the data package: each test failed before the fix it names."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import torchvision

from lit_softmoe.cli import main
from lit_softmoe.data.fashion_mnist import find_fashion_mnist, read_idx
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import iter_class_samples, load_class_split, read_classnames, write_split
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError
from lit_softmoe.utils import atomic

from data_files import _gray_png, _png_bytes


def test_linked_class_folders_are_read_and_numbered_like_imagefolder(tmp_path):
    # A class folder is often a link into a bigger dataset; os.walk did not enter it, so its images
    # were dropped without a count and the remaining classes were numbered differently from ImageFolder.
    for index in range(3):
        _gray_png(tmp_path / "elsewhere" / "cat" / f"{index}.png", 10 * index)
    _gray_png(tmp_path / "src" / "dog" / "0.png", 200)
    os.symlink(tmp_path / "elsewhere" / "cat", tmp_path / "src" / "cat")
    imagefolder = torchvision.datasets.ImageFolder(str(tmp_path / "src"))
    os.symlink(tmp_path / "src", tmp_path / "src" / "dog" / "loop")  # a link back up must not loop

    summary = write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")

    assert read_classnames(tmp_path / "out") == imagefolder.classes == ["cat", "dog"]
    assert summary.samples == 4 and sum(summary.skipped.values()) == 0
    labels = sorted(label for _, label in iter_class_samples(tmp_path / "out" / "train"))
    assert labels == sorted(imagefolder.targets) == [0, 0, 0, 1]


@pytest.mark.parametrize("header", [b"\0\0\x08\x03\0\0", b"\0\0\x08\x03"])
def test_idx_file_cut_inside_its_header_is_a_user_error(tmp_path, header):
    # numpy's "buffer is smaller than requested size" ValueError came out as a traceback.
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(header)
    with pytest.raises(UserError, match="truncated.*reinstall"):
        read_idx(path)


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


def test_a_file_where_the_split_folder_goes_is_one_line(tmp_path, capsys):
    # mkdir raised FileExistsError: a traceback instead of exit code 2.
    _gray_png(tmp_path / "src" / "x.png", 0)
    (tmp_path / "src" / "x.txt").write_text("a photo")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train").write_text("not a folder")
    fmnist = str(find_fashion_mnist(allow_download=False))
    for command in (["from-folder", str(tmp_path / "src")], ["fashion-mnist", "--source", fmnist, "--limit", "2"]):
        assert main(["data", *command, "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{tmp_path / 'out' / 'train'} is a file, not a split folder" in error
    assert (tmp_path / "out" / "train").read_text() == "not a folder"


def test_fashion_mnist_does_not_rename_the_classes_of_another_split(tmp_path, capsys):
    # `data fashion-mnist` wrote its classnames.txt over that of a class split already in --out, so
    # val's ant/bee samples read as t-shirt/trousers (the other way round was already refused).
    for classname in ("ant", "bee"):
        _gray_png(tmp_path / "src" / classname / "0.png", 0)
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


def test_world_size_set_alone_takes_the_rank_from_the_launcher(tmp_path, monkeypatch):
    # Setting data.world_size without data.rank gave rank 0 to every process: all read the same shards.
    samples = [{"png": _png_bytes(np.full((8, 8), i, np.uint8)), "txt": f"caption {i}".encode()} for i in range(8)]
    write_split(samples, tmp_path, "a", samples_per_shard=2)
    keys = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        cfg = ShardDataConfig(urls=str(tmp_path / "a"), batch_size=8, workers=0, shuffle=False, exact_epoch=True,
                              world_size=2)
        loader = create_shard_loader(cfg, "image-caption")
        keys[rank] = [key for batch in loader for key in batch["key"]]
        assert loader.rank == rank and loader.world_size == 2
    assert keys[0] == ["s0000000", "s0000001", "s0000004", "s0000005"]  # shards 0 and 2
    assert keys[1] == ["s0000002", "s0000003", "s0000006", "s0000007"]  # shards 1 and 3
