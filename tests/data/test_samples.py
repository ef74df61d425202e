"""lit_softmoe.data.samples: one reading of a sample's `.cls` and image member for every reader (the
training stream, a class split read whole, LiT's eval labels, the zero-shot suite's shards)."""
from __future__ import annotations

import numpy as np
import pytest

from data_files import png_bytes
from lit_softmoe.data.class_batches import split_labels
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.samples import (
    SampleSkip,
    class_index,
    decode_label,
    image_extension,
    read_class_members,
    read_labels,
)
from lit_softmoe.data.shards import shard_urls, write_split
from lit_softmoe.evals.readers import read_wds


@pytest.mark.parametrize("raw, expected", [
    (b"3", 3), (b" 3\n", 3), (b"\t12\r\n", 12),
    (b"007", 7),  # leading zeros: every reader took them as the number
    (b"+3", None),  # int() took it as 3; LiT's eval labels (bytes.isdigit) refused it
    (b"-0", None),  # int() took it as 0; isdigit refused it
    (b"1_0", None),  # int() took it as class 10
    (b"-1", None), (b"dog", None), (b"", None), (b"3 4", None), (b"\xd9\xa3", None), (b"\xff", None),
])
def test_class_index_is_ascii_digits_alone(raw, expected):
    assert class_index(raw) == expected


def test_class_index_of_too_many_digits_is_none_not_an_error():
    # int() refuses text past 4300 digits with a ValueError, which LiT's eval setup did not catch.
    assert class_index(b"9" * 5000) is None


def test_decode_label_says_why():
    assert decode_label({"cls": b"4"}) == 4
    for sample, reason in (({}, "missing_cls"), ({"cls": b"+4"}, "bad_cls"), ({"cls": b"4"}, "bad_cls")):
        with pytest.raises(SampleSkip) as skip:
            decode_label(sample, num_classes=4)
        assert skip.value.reason == reason


def test_image_extension_takes_the_first_known_member():
    assert image_extension({"cls": b"1", "webp": b"", "jpg": b""}) == "jpg"
    assert image_extension({"jpeg": b""}) == "jpeg"
    assert image_extension({"cls": b"1", "txt": b""}) is None


def test_every_reader_gives_the_same_labels(tmp_path):
    """The streamed split, the split read whole, LiT's eval labels and the zero-shot suite keep the
    same samples with the same classes: "+2", "-0" and "1_0" were class 2, 0 and 10 to three of them."""
    good = png_bytes(np.zeros((8, 8), np.uint8))
    classes = ["1", "+2", " 3\n", "1_0", "-0", "007", "-1"]
    write_split([{"png": good, "cls": cls} for cls in classes], tmp_path, "test")
    (tmp_path / "classnames.txt").write_text("".join(f"c{i}\n" for i in range(8)))
    expected = [1, 3, 7]
    assert split_labels(str(tmp_path / "test")).tolist() == expected
    assert load_class_split(tmp_path / "test", cache=False)[1].tolist() == expected
    assert read_labels(shard_urls(tmp_path / "test"), log=False) == expected  # LiT's eval labels
    suite = read_wds(tmp_path, "test", lambda image: image)
    assert [target for _, image, target in suite.dataset if image is not None] == expected


def test_an_upper_case_cls_member_is_read_by_the_label_only_pass_too(tmp_path):
    # Webdataset lowercases extensions: the decoding readers saw x.CLS as "cls", while the label-only
    # pass selected members ending in ".cls" and lost it, shifting the positions shots are drawn at.
    good = png_bytes(np.zeros((8, 8), np.uint8))
    write_split([{"png": good, "cls": b"1"}, {"png": good, "CLS": b"2"}, {"png": good, "cls": b"3"}], tmp_path, "t")
    assert load_class_split(tmp_path / "t", cache=False)[1].tolist() == [1, 2, 3]
    assert split_labels(str(tmp_path / "t")).tolist() == [1, 2, 3]
    assert sorted(read_class_members(shard_urls(tmp_path / "t")).values()) == [b"1", b"2", b"3"]
