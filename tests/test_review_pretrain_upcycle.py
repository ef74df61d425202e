"""`lit-softmoe upcycle` from a half-precision checkpoint (no timm needed: the file uses timm's names)."""
import pytest
import torch
from safetensors.torch import save_file

from lit_softmoe.cli import main
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower


def _timm_named_state(tower):
    """Our dense tower's tensors under timm's names, with a class token and its position, as timm saves them."""
    state = {}
    for key, value in tower.state_dict().items():
        if key.startswith("patch_embed."):
            key = "patch_embed.proj." + key[len("patch_embed."):]
        if key == "pos_embed":
            value = torch.cat([torch.zeros(1, 1, value.shape[2]), value], dim=1)
        state[key] = value.contiguous()
    state["cls_token"] = torch.zeros(1, 1, tower.cfg.width)
    return state


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_checkpoint_upcycles_into_a_float32_tower_that_runs(tmp_path, capsys, dtype):
    """The tower kept the checkpoint's dtype, so embed, inspect-routing and LiT (float32 pixels) all
    ended in 'mat1 and mat2 must have the same dtype' tracebacks."""
    torch.manual_seed(0)
    dense = create_image_tower("vit-test", num_classes=10).eval()
    half = {k: v.to(dtype) for k, v in _timm_named_state(dense).items()}
    save_file(half, tmp_path / "vit.safetensors")
    assert main(["upcycle", "--from", str(tmp_path / "vit.safetensors"), "--to", "soft-test-4e",
                 "--out", str(tmp_path / "up")]) == 0
    tower, _ = load_tower(tmp_path / "up")
    assert {p.dtype for p in tower.state_dict().values()} == {torch.float32}
    # Copied tensors are the half values widened exactly; the fresh router is drawn in float32.
    assert torch.equal(tower.state_dict()["blocks.0.attn.qkv.weight"], half["blocks.0.attn.qkv.weight"].float())
    assert torch.equal(tower.state_dict()["blocks.1.mlp.experts.w1"][2], half["blocks.1.mlp.fc1.weight"].float().t())
    with torch.no_grad():
        assert tower.eval()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
