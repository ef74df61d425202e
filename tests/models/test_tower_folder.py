"""lit_softmoe.models.tower_folder: saved towers load back exactly, and a folder that does not fit or is
damaged is one UserError."""
import json

import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower, save_tower


def test_tower_round_trip_is_exact(tmp_path):
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=10).eval()
    save_tower(tmp_path / "tower", tower, extra={"classnames": list("abcdefghij")})
    loaded, meta = load_tower(tmp_path / "tower")
    loaded.eval()
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(tower(x), loaded(x))
    assert meta["classnames"][0] == "a" and meta["tower"]["num_experts"] == 4
    assert sorted(p.name for p in (tmp_path / "tower").iterdir()) == ["config.json", "model.safetensors"]


def test_a_tower_read_in_bf16_is_the_stored_one_cast(tmp_path):
    """`dtype` casts the weights as they are read (what a locked tower is held in on a GPU): the same values as
    the fp32 tower cast after loading, and the same features."""
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=10).eval()
    save_tower(tmp_path / "tower", tower)
    read, _ = load_tower(tmp_path / "tower", device=torch.device("cpu", 0), dtype=torch.bfloat16)  # accelerate's DDP
    assert {t.dtype for t in read.state_dict().values()} == {torch.bfloat16}
    cast = tower.to(torch.bfloat16)
    assert all(torch.equal(read.state_dict()[k], v) for k, v in cast.state_dict().items())
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(read.eval().forward_pooled(x), cast.forward_pooled(x))


def test_checkpoint_that_does_not_fit_names_the_keys(tmp_path):
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    meta = json.loads((tmp_path / "tower" / "config.json").read_text())
    meta["tower"]["num_experts"] = 8  # the weights were trained with 4 experts
    (tmp_path / "tower" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"does not fit the tower.*experts\.w1 \(4, 32, 64\) vs \(8, 32, 64\)"):
        load_tower(tmp_path / "tower")
    with pytest.raises(UserError, match="not a tower checkpoint"):
        load_tower(tmp_path / "missing")


def test_a_damaged_tower_folder_is_one_user_error(tmp_path):
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    weights = tmp_path / "tower" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short
    with pytest.raises(UserError, match=r"cannot read .*model\.safetensors \(SafetensorError: .*incomplete or damaged"):
        load_tower(tmp_path / "tower")
    (tmp_path / "tower" / "config.json").write_text('{"tower": ')  # cut short too
    with pytest.raises(UserError, match=r"config\.json is not valid JSON"):
        load_tower(tmp_path / "tower")


@pytest.mark.parametrize("edit, says", [
    (lambda meta: [meta], r"config\.json holds a JSON list, not a tower's settings"),
    (lambda meta: {**meta, "preprocess": {"image_size": 28, "mean": [0.5, 0.5, 0.5], "std": [0.5]}},
     r"preprocess\.mean has 3 values, but the tower takes 1 channel\(s\)"),
    (lambda meta: {**meta, "preprocess": {"image_size": 28, "mean": [0.5], "std": [0]}},
     r"preprocess\.std is \[0\]: each must be above 0 \(pixels are divided by it\)"),
    (lambda meta: {**meta, "preprocess": {"image_size": "28", "mean": [0.5], "std": [0.5]}},
     r"preprocess\.image_size is '28', not a whole number of pixels"),
    (lambda meta: {**meta, "preprocess": {"image_size": 28, "mean": ["a"], "std": [0.5]}},
     r"preprocess\.mean is \['a'\], not a number or a list of numbers"),
], ids=["a list", "3 means for a gray tower", "std 0", "size as text", "mean not numbers"])
def test_a_tower_config_that_no_image_could_go_through_is_one_line_naming_the_key(tmp_path, capsys, edit, says):
    """A config.json holding a list ended in AttributeError, a gray tower's three means in a ValueError, and
    std [0] turned every embedding non-finite, blamed on the shards: each is now refused where the config is
    read, naming the file and the key (embed's command line shows it as users meet it)."""
    from lit_softmoe.cli import main
    from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards

    write_fashion_mnist_shards(tmp_path / "fm", samples_per_shard=10, limit=10, allow_download=False)
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10),
               extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    meta = json.loads((tmp_path / "tower" / "config.json").read_text())
    (tmp_path / "tower" / "config.json").write_text(json.dumps(edit(meta)))
    with pytest.raises(UserError, match=says):
        load_tower(tmp_path / "tower")
    assert main(["embed", "--tower", str(tmp_path / "tower"), "--shards", str(tmp_path / "fm" / "test"),
                 "--out", str(tmp_path / "features")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "tower" / "config.json") in err, err


@pytest.mark.parametrize("copied", ["model.safetensors", "config.json"])
def test_a_file_copied_in_from_another_tower_folder_is_one_line(tmp_path, capsys, copied):
    """Two towers of one architecture: either file copied over the other folder's was read as that tower (its
    weights with the other's preprocessing, classes and pretraining results), by every reader."""
    from lit_softmoe.cli import main
    from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
    from lit_softmoe.models.tower_folder import tower_fingerprint

    write_fashion_mnist_shards(tmp_path / "fm", samples_per_shard=10, limit=10, allow_download=False)
    for seed, name in ((0, "tower"), (1, "other")):
        torch.manual_seed(seed)
        save_tower(tmp_path / name, create_image_tower("soft-test-4e", num_classes=10),
                   extra={"preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    load_tower(tmp_path / "tower")  # each folder as written reads
    (tmp_path / "tower" / copied).write_bytes((tmp_path / "other" / copied).read_bytes())
    weights = tmp_path / "tower" / "model.safetensors"
    says = (f"{weights} was not written with the config.json beside it (it carries another folder_id: a file copied "
            "in from another folder); copy the whole folder again, or write it anew")
    for read in (load_tower, tower_fingerprint):
        with pytest.raises(UserError) as refused:
            read(tmp_path / "tower")
        assert str(refused.value) == says
    assert main(["embed", "--tower", str(tmp_path / "tower"), "--shards", str(tmp_path / "fm" / "test"),
                 "--out", str(tmp_path / "features")]) == 2
    assert capsys.readouterr().err.strip() == f"lit-softmoe embed: error: {says}"
    assert not (tmp_path / "features").exists()
