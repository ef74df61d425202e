"""Review 4: encode_images moves pixels to the tower, clear errors for small images, negative router
noise, upcycling with qk-norm switched off, and CLI / demo mistakes that ended in tracebacks."""
import pytest
import torch

from lit_softmoe.inference import encode_images
from lit_softmoe.models.vit import create_image_tower


def test_encode_images_moves_pixels_to_the_towers_device_and_dtype():
    # A tower elsewhere than the pixels (meta here, CUDA for a user): CPU float32 pixels from a
    # dataloader ended in torch's device-mismatch error.
    tower = create_image_tower("vit-test", device="meta", dtype=torch.bfloat16)
    features = encode_images(tower, torch.randn(3, 1, 28, 28))
    assert features.device.type == "meta" and features.dtype == torch.bfloat16
    assert features.shape == (3, 32)
