import io
import re

import PIL.Image
import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.preprocess import Preprocess, per_channel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower


def test_one_value_is_given_to_every_channel_and_a_list_per_channel_is_kept():
    assert per_channel(0.5, 3) == (0.5, 0.5, 0.5)
    assert per_channel([0.25], 3) == (0.25, 0.25, 0.25)
    assert per_channel([0.1, 0.2, 0.3], 3) == (0.1, 0.2, 0.3)
    gray = Preprocess.from_settings({"image_size": 28, "mean": [0.286], "std": 0.353}, 1, "t")
    assert gray == Preprocess(28, 1, (0.286,), (0.353,), "full")  # no "decode": decoded in full
    rgb = Preprocess.from_settings({"image_size": 32, "mean": 0.5, "std": [0.2, 0.25, 0.3],
                                    "decode": "reduced"}, 3, "t")
    assert (rgb.mean, rgb.std, rgb.decode, rgb.mode) == ((0.5,) * 3, (0.2, 0.25, 0.3), "reduced", "RGB")


@pytest.mark.parametrize("settings, words", [
    ({"image_size": 0, "mean": 0.5, "std": 0.5}, "image_size is 0, not a whole number"),
    ({"image_size": 28, "mean": [0.5, 0.5], "std": 0.5}, "mean has 2 values, but the tower takes 3"),
    ({"image_size": 28, "mean": 0.5, "std": [0.0]}, "std is [0.0]: each must be above 0"),
    ({"image_size": 28, "mean": "gray", "std": 0.5}, "mean is 'gray', not a number"),
])
def test_a_bad_value_is_one_line_naming_the_key(settings, words):
    with pytest.raises(UserError, match=re.escape(words)) as caught:
        Preprocess.from_settings(settings, 3, "TOWER/config.json")
    assert str(caught.value).startswith("TOWER/config.json: preprocess.")


def _gray_png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("L", (28, 28), 128).save(buffer, "PNG")
    return buffer.getvalue()


def _reader(name: str, tower_dir, tmp_path):
    """Run one of the commands that read a tower's images with the tower at `tower_dir`."""
    if name == "embed":
        from lit_softmoe.data.shards import write_split
        from lit_softmoe.train.embed import embed_shards
        write_split([{"png": _gray_png(), "txt": b"a gray square"}], tmp_path / "shards", "train")
        return embed_shards(tower_dir, str(tmp_path / "shards" / "train"), tmp_path / "features")
    if name == "inspect-routing":
        from lit_softmoe.evals.routing import inspect_routing
        (tmp_path / "image.png").write_bytes(_gray_png())
        return inspect_routing(tower_dir, tmp_path / "image.png", tmp_path / "routing.png")
    if name == "load_image_tower":
        from lit_softmoe.hub import load_image_tower
        return load_image_tower(tower_dir)
    from lit_softmoe.export.pair import export_pair
    return export_pair(tower_dir, tmp_path / "export")


@pytest.mark.parametrize("reader", ["embed", "inspect-routing", "load_image_tower", "export"])
def test_a_tower_without_its_preprocessing_is_the_same_line_in_every_reader(tmp_path, reader):
    """A tower folder whose config.json lacks "preprocess" cannot have its images prepared as it was
    trained; each command that reads images through it says so in the one same line."""
    torch.manual_seed(0)
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    with pytest.raises(UserError) as caught:
        _reader(reader, tmp_path / "tower", tmp_path)
    assert str(caught.value) == (
        f"{tmp_path / 'tower' / 'config.json'} has no \"preprocess\" with image_size, mean and std, so its "
        "images cannot be prepared as the tower was trained; save the tower as pretraining does "
        "(save_tower(..., extra={\"preprocess\": {...}}))")
