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
