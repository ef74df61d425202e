"""lit_softmoe.data.listing: sample keys made from file names (any script, NFC-normalized)."""
import io
import unicodedata

import numpy as np
import PIL.Image

from data_files import seeded_png
from lit_softmoe.data.listing import sample_key
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.writers import write_folder_shards


def test_sample_keys_are_safe_webdataset_keys():
    assert sample_key("a b/x.y") == "a_b/x_y"
    assert sample_key("../images/./IMG 01") == "images/IMG_01"


def test_non_ascii_file_names_keep_their_own_samples(tmp_path):
    # A folder of Japanese, Chinese, Korean or accented file names: each name is a sample of its own,
    # not a duplicate of the first one (every non-ASCII name used to become the key "_").
    src = tmp_path / "photos"
    src.mkdir()
    names = ["日本語", "中文", "한국어", "café", "naïve", "cafe\u0301x"]  # the last one decomposed (macOS)
    for seed, name in enumerate(names):
        (src / f"{name}.png").write_bytes(seeded_png(seed))
        (src / f"{name}.txt").write_text(f"caption of {name}", encoding="utf-8")
    summary = write_folder_shards(src, tmp_path / "out")
    assert summary.samples == len(names) and not summary.skipped

    loader = create_shard_loader(ShardDataConfig(urls=str(tmp_path / "out" / "train"), workers=0, shuffle=False,
                                                 exact_epoch=True), "image-caption")
    batch = next(iter(loader))
    assert len(set(batch["key"])) == len(names)
    # Each image with its own caption (captions are stored NFC-normalized).
    expected = {unicodedata.normalize("NFC", name): seeded_png(seed) for seed, name in enumerate(names)}
    for key, caption, image in zip(batch["key"], batch["caption"], batch["image"]):
        name = caption.removeprefix("caption of ")
        assert key == name
        assert np.array_equal(image[0].numpy(), np.asarray(PIL.Image.open(io.BytesIO(expected[name]))))


def test_non_ascii_class_folders_keep_every_image(tmp_path):
    src = tmp_path / "classes"
    for label, classname in enumerate(["猫", "犬"]):
        (src / classname).mkdir(parents=True)
        (src / classname / "1.png").write_bytes(seeded_png(label))
    summary = write_folder_shards(src, tmp_path / "out", layout="classes")
    assert summary.samples == 2 and not summary.skipped
