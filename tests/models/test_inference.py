"""lit_softmoe.models.inference: a locked tower converted for inference computes the same features."""
import torch

from lit_softmoe.models.inference import encode_images, prepare_for_inference
from lit_softmoe.models.registry import create_image_tower


def test_prepare_for_inference_converts_in_place_and_keeps_the_function():
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e")
    pixels = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        want = tower.eval().forward_pooled(pixels)
    keys = list(tower.state_dict())
    tower.train()
    got_tower = prepare_for_inference(tower)
    assert got_tower is tower and not tower.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in tower.parameters())
    assert list(tower.state_dict()) == keys
    features = encode_images(tower, pixels)
    assert features.dtype == torch.bfloat16 and features.shape == want.shape and features.is_inference()
    assert ((features.float() - want).norm() / want.norm()) < 3e-2


def test_prepare_for_inference_compiles_forward_features():
    torch.manual_seed(0)
    tower = create_image_tower("vit-test")
    pixels = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        want = tower.eval().forward_pooled(pixels)
    # backend="eager": traced by dynamo, no kernels built (CPU tests stay fast).
    prepare_for_inference(tower, dtype=None, compile=True, backend="eager")
    assert tower.pos_embed.dtype == torch.float32
    assert "forward_features" in vars(tower)  # the compiled wrapper sits on the instance
    torch.testing.assert_close(encode_images(tower, pixels), want)
    torch.testing.assert_close(tower(pixels), want)


def test_encode_images_moves_pixels_to_the_towers_device_and_dtype():
    # A tower elsewhere than the pixels (meta here, CUDA for a user): CPU float32 pixels from a
    # dataloader ended in torch's device-mismatch error.
    tower = create_image_tower("vit-test", device="meta", dtype=torch.bfloat16)
    features = encode_images(tower, torch.randn(3, 1, 28, 28))
    assert features.device.type == "meta" and features.dtype == torch.bfloat16
    assert features.shape == (3, 32)
