"""lit_softmoe.data.samples: one reading of a sample's `.cls` and image member for every reader (the
training stream, a class split read whole, LiT's eval labels, the zero-shot suite's shards)."""
from __future__ import annotations

import io

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
    npy_bytes,
    read_class_members,
    read_labels,
    read_npy,
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


def _npy_version(array: np.ndarray, version: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version)
    return buffer.getvalue()


@pytest.mark.parametrize("array", [
    np.linspace(-2, 2, 384, dtype=np.float16),  # what embed writes
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) / 7),  # column-major: another order
    np.arange(5, dtype=">f4"),  # big-endian
], ids=["float16", "float32-2d", "float64-fortran", "big-endian"])
def test_read_npy_is_np_load_as_float32(array):
    """read_npy parses a header once and reads the next members sharing it straight from their bytes: each
    layout reads as np.load reads it, as a writable float32 array, and twice the same (the second from the
    parsed header)."""
    for data in (npy_bytes(array), _npy_version(array, (2, 0)), npy_bytes(array)):
        read = read_npy(data)
        assert read.dtype == np.float32 and read.flags.writeable
        assert np.array_equal(read, np.load(io.BytesIO(data)).astype(np.float32))


@pytest.mark.parametrize("data, reason", [
    (npy_bytes(np.arange(3)), "expected a float array, got int64 with shape (3,)"),
    (npy_bytes(np.float32(2.0)), "expected a float array, got float32 with shape ()"),
    (npy_bytes(np.ones(8, np.float32))[:-3], "ValueError: EOF: reading array data, expected 32 bytes got 29"),
    (npy_bytes(np.array([1.0, np.inf], np.float32)), "holds NaN or infinity (as float32)"),
    (npy_bytes(np.array([1e300])), "holds NaN or infinity (as float32)"),
])
def test_read_npy_refuses_what_is_not_a_whole_finite_float_array(data, reason):
    read_npy(npy_bytes(np.ones(8, np.float32)))  # the header of the cut-short member, parsed already
    with pytest.raises(ValueError) as refusal:
        read_npy(data)
    assert str(refusal.value) == reason
