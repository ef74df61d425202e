"""Third review of the data package: each test failed before the fix it names."""
from __future__ import annotations

import os

import PIL.Image
import pytest
import torchvision

from lit_softmoe.data.shards import iter_class_samples, read_classnames
from lit_softmoe.data.sources import read_idx
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError


def _gray_png(path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.new("L", (8, 8), value).save(path)


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
