"""lit_softmoe.data.folders: what a source folder holds: class folders (links included) and folder mistakes."""
from __future__ import annotations

import os

import pytest
import torchvision

from data_files import _encode, _gray_png, _rng_image
from lit_softmoe.data.class_split import iter_class_samples
from lit_softmoe.data.folders import list_folder
from lit_softmoe.data.shards import read_classnames
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError


def test_folder_mistakes_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        list_folder(tmp_path / "nowhere")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat/a.png").write_bytes(_encode(_rng_image(0)))
    with pytest.raises(UserError, match="no .txt caption beside any"):
        list_folder(tmp_path / "flat")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no image files"):
        list_folder(tmp_path / "empty")
    (tmp_path / "flat/b.png").write_bytes(b"broken")
    (tmp_path / "flat/b.txt").write_text("a caption")
    with pytest.raises(UserError, match=r"could be written: skipped 2 \(bad_image 1, missing_caption 1\)"):
        write_folder_shards(tmp_path / "flat", tmp_path / "out")


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


@pytest.mark.parametrize("mark", ["\n", "\r", "\t", "\x1b", "\u2028"], ids=["newline", "return", "tab", "escape",
                                                                               "line separator"])
def test_a_class_folder_named_with_a_control_character_is_refused_in_one_line(tmp_path, mark):
    """classnames.txt holds a class name a line: a folder `cat<newline>tabby` gave it one line more than
    there are classes, and every class after it read the name of the one before."""
    _gray_png(tmp_path / "src" / f"cat{mark}tabby" / "0.png", 10)
    _gray_png(tmp_path / "src" / "dog" / "0.png", 200)
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    message = str(raised.value)
    assert message == (f"class folder {f'cat{mark}tabby'!r} in {tmp_path / 'src'} has a control character or "
                       "line break in its name, which classnames.txt (one class name per line) cannot hold; "
                       "rename the folder")
    assert len(message.splitlines()) == 1
    assert not (tmp_path / "out" / "classnames.txt").exists() and not (tmp_path / "out" / "train").exists()
    # Renamed, the same folder is written, its classes numbered in order.
    os.rename(tmp_path / "src" / f"cat{mark}tabby", tmp_path / "src" / "cat tabby")
    write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert read_classnames(tmp_path / "out") == ["cat tabby", "dog"]
