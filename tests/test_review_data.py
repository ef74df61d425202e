"""Review of the data commands as a user meets them: odd file names, bad arguments, broken inputs."""
import gzip
import io
import shutil
import unicodedata

import numpy as np
import PIL.Image
import pytest

from lit_softmoe.data.fashion_mnist import find_fashion_mnist, read_idx, write_fashion_mnist_shards
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError

from data_files import _png


def test_non_ascii_file_names_keep_their_own_samples(tmp_path):
    # A folder of Japanese, Chinese, Korean or accented file names: each name is a sample of its own,
    # not a duplicate of the first one (every non-ASCII name used to become the key "_").
    src = tmp_path / "photos"
    src.mkdir()
    names = ["日本語", "中文", "한국어", "café", "naïve", "cafe\u0301x"]  # the last one decomposed (macOS)
    for seed, name in enumerate(names):
        (src / f"{name}.png").write_bytes(_png(seed))
        (src / f"{name}.txt").write_text(f"caption of {name}", encoding="utf-8")
    summary = write_folder_shards(src, tmp_path / "out")
    assert summary.samples == len(names) and not summary.skipped

    loader = create_shard_loader(ShardDataConfig(urls=str(tmp_path / "out" / "train"), workers=0, shuffle=False,
                                                 exact_epoch=True), "image-caption")
    batch = next(iter(loader))
    assert len(set(batch["key"])) == len(names)
    # Each image with its own caption (captions are stored NFC-normalized).
    expected = {unicodedata.normalize("NFC", name): _png(seed) for seed, name in enumerate(names)}
    for key, caption, image in zip(batch["key"], batch["caption"], batch["image"]):
        name = caption.removeprefix("caption of ")
        assert key == name
        assert np.array_equal(image[0].numpy(), np.asarray(PIL.Image.open(io.BytesIO(expected[name]))))


def test_non_ascii_class_folders_keep_every_image(tmp_path):
    src = tmp_path / "classes"
    for label, classname in enumerate(["猫", "犬"]):
        (src / classname).mkdir(parents=True)
        (src / classname / "1.png").write_bytes(_png(label))
    summary = write_folder_shards(src, tmp_path / "out", layout="classes")
    assert summary.samples == 2 and not summary.skipped


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


def test_out_equal_to_the_source_is_not_read_back(tmp_path):
    # `from-folder photos --out photos`: the rerun read photos/train/nshards.txt as a caption without
    # an image (skipped 1) and, that file being rewritten each time, never found the output complete.
    src = tmp_path / "photos"
    src.mkdir()
    for seed in range(3):
        (src / f"{seed}.png").write_bytes(_png(seed))
        (src / f"{seed}.txt").write_text(f"caption {seed}")
    first = write_folder_shards(src, src)
    again = write_folder_shards(src, src)
    assert first.samples == again.samples == 3 and not first.skipped and not again.skipped
    assert again.already_complete


@pytest.mark.parametrize("width", [5, 6])
def test_split_folder_with_padded_shard_names(tmp_path, width):
    # img2dataset names its shards 00000.tar (5 digits), webdataset's ShardWriter 000000.tar (6).
    from lit_softmoe.data.shards import shard_urls, write_split
    write_split([{"png": _png(i), "txt": b"x"} for i in range(4)], tmp_path, "train", samples_per_shard=2)
    split = tmp_path / "train"
    for index in range(2):
        (split / f"{index}.tar").rename(split / f"{index:0{width}d}.tar")
    assert shard_urls(split) == [str(split / f"{index:0{width}d}.tar") for index in range(2)]


def test_from_table_given_a_folder_points_to_from_folder(tmp_path, capsys):
    from lit_softmoe.cli import main
    (tmp_path / "photos").mkdir()
    code = main(["data", "from-table", str(tmp_path / "photos"), "--image-col", "path", "--caption-col", "text",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a folder" in err[0] and "data from-folder" in err[0]
    assert not (tmp_path / "out").exists()
