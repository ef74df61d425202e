"""lit_softmoe.utils.hashing: one identity of weights, the same from memory and from a safetensors file."""
import pytest
import torch
from safetensors.torch import save_file

from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import contiguous_state
from lit_softmoe.utils.hashing import safetensors_weights_sha256, weights_sha256


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {**contiguous_state(create_image_tower("soft-test-4e")), "counts": torch.arange(3),
            "flag": torch.tensor(True), "half": torch.randn(2, 3).bfloat16(), "none": torch.empty(0, 4)}


def test_the_hash_of_a_state_dict_is_the_hash_of_the_safetensors_file_saved_from_it(tmp_path):
    state = _state()
    save_file(state, tmp_path / "model.safetensors")
    assert weights_sha256(state) == safetensors_weights_sha256(tmp_path / "model.safetensors")
    assert len(weights_sha256(state)) == 64
    # Under a prefix (an export's `image_tower.*`): the same tensors under their own names, others left out.
    save_file({**{f"image_tower.{k}": v for k, v in state.items()}, "image_head.weight": torch.ones(2, 2)},
              tmp_path / "export.safetensors")
    assert safetensors_weights_sha256(tmp_path / "export.safetensors", prefix="image_tower.") == weights_sha256(state)
    assert safetensors_weights_sha256(tmp_path / "export.safetensors") != weights_sha256(state)


def test_the_same_tensors_anywhere_have_the_same_hash():
    state = _state()
    reordered = dict(reversed(list(state.items())))
    name = next(k for k, v in state.items() if v.ndim == 2 and min(v.shape) > 1)
    strided = {**state, name: state[name].t().contiguous().t()}  # the same values, column-major
    assert not strided[name].is_contiguous()
    assert weights_sha256(reordered) == weights_sha256(strided) == weights_sha256(state)


def test_one_changed_element_dtype_name_or_shape_changes_the_hash():
    state = _state()
    before = weights_sha256(state)
    weight = state["patch_embed.weight"].clone()
    weight.view(-1)[7] = torch.nextafter(weight.view(-1)[7], torch.tensor(1.0))  # one bit of one element
    assert weights_sha256({**state, "patch_embed.weight": weight}) != before
    assert weights_sha256({**state, "patch_embed.weight": state["patch_embed.weight"].double()}) != before
    assert weights_sha256({**state, "half": state["half"].view(torch.float16)}) != before  # same bytes, other dtype
    renamed = {("patch_embed.w" if k == "patch_embed.weight" else k): v for k, v in state.items()}
    assert weights_sha256(renamed) != before
    assert weights_sha256({**state, "none": torch.empty(4, 0)}) != before  # no bytes either way, other shape
    assert weights_sha256({k: v for k, v in state.items() if k != "none"}) != before
    assert weights_sha256(state) == before


def test_a_file_is_hashed_once_per_version_and_a_damaged_one_is_one_line(tmp_path, monkeypatch):
    import os

    from lit_softmoe.utils import hashing
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3)}, path)
    first = safetensors_weights_sha256(path)
    monkeypatch.setattr(hashing, "_digest", lambda named: pytest.fail("hashed again"))
    assert safetensors_weights_sha256(path) == first
    monkeypatch.undo()
    save_file({"a": torch.ones(3)}, path)
    os.utime(path, ns=(1, 1))  # a rewrite is seen even within the clock's resolution: the mtime differs
    assert safetensors_weights_sha256(path) == weights_sha256({"a": torch.ones(3)}) != first
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(UserError, match=f"cannot read {path} .*incomplete or damaged"):
        safetensors_weights_sha256(path)
