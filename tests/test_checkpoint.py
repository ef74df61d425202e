"""Checkpoints: exact round trips, loud shape checks, atomic writes, nothing pickled."""
import json

import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.vit import create_image_tower
from lit_softmoe.train.checkpoint import (latest_checkpoint, load_tower, load_training_state,
                                          prune_checkpoints, save_tower, save_training_state,
                                          write_folder_atomically)
from lit_softmoe.train.optim import create_optimizer
from lit_softmoe.config import OptimConfig


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


def test_checkpoint_that_does_not_fit_names_the_keys(tmp_path):
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    meta = json.loads((tmp_path / "tower" / "config.json").read_text())
    meta["tower"]["num_experts"] = 8  # the weights were trained with 4 experts
    (tmp_path / "tower" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"does not fit the tower.*experts\.w1 \(4, 32, 64\) vs \(8, 32, 64\)"):
        load_tower(tmp_path / "tower")
    with pytest.raises(UserError, match="not a tower checkpoint"):
        load_tower(tmp_path / "missing")


def test_failed_write_leaves_nothing_under_the_final_name(tmp_path):
    def write(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert list(tmp_path.iterdir()) == []
    # An older complete checkpoint survives a failed overwrite.
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "ok").write_text("1"))
    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert (tmp_path / "ckpt" / "ok").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_training_state_restores_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = create_image_tower("soft-test-4e", num_classes=10)
    opt = create_optimizer(model, OptimConfig(lr=1e-2))
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    save_training_state(tmp_path / "step_00000001", 1, model, opt)
    expected_draw = torch.rand(3)

    model2 = create_image_tower("soft-test-4e", num_classes=10)
    opt2 = create_optimizer(model2, OptimConfig(lr=1e-2))
    info = load_training_state(tmp_path / "step_00000001", model2, opt2)
    assert info["step"] == 1
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    # One more identical step keeps them identical (the moments really were restored).
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_latest_and_prune(tmp_path):
    for step in (5, 10, 15):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "state.json").write_text("{}")
    (tmp_path / ".step_00000020.tmp-abc").mkdir()  # an interrupted write is never picked
    (tmp_path / "step_00000020").mkdir()  # nor a folder without its metadata
    assert latest_checkpoint(tmp_path).name == "step_00000015"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000015", "step_00000020"]
