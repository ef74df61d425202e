"""One timm image model of each family users lock as a LiT tower: the models the "any timm model" tests
share. timm's own test models where timm has one of the family (random weights, seconds a run); its
smallest real model where not (Swin, EVA)."""
from __future__ import annotations

import torch

from lit_softmoe.models.timm_tower import TimmTowerConfig, as_tower

TIMM_FAMILIES = {
    "resnet": "test_resnet",
    "convnext": "test_convnext",  # its pre-logits norm sits in `head`
    "efficientnet": "test_efficientnet",  # its last layer group holds a block, conv_head and bn2
    "swin": "swin_tiny_patch4_window7_224",  # relative-position indices: buffers no checkpoint holds
    "vit-registers": "test_vit2",  # a register token, average pooling, fc_norm after it
    "vit-attention-pool": "test_vit3",  # a register token, timm's attention-pool ("map") head
    "eva": "eva02_tiny_patch14_224",  # rotary tables: buffers no checkpoint holds
}


def random_timm_tower(name: str, seed: int = 0) -> torch.nn.Module:
    """timm's `name` with random weights, without a classifier, as a tower (in eval mode)."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=0).eval()
    channels, size, _ = model.pretrained_cfg["input_size"]
    width = int(getattr(model, "head_hidden_size", None) or model.num_features)
    return as_tower(model, TimmTowerConfig(timm_model_name=name, image_size=size, in_channels=channels, width=width))
