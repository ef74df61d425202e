"""lit-softmoe: LiT-style image-text training on frozen Soft MoE image towers."""
from lit_softmoe.models import (LiTModel, TextTowerConfig, ViTConfig, VisionTransformer, create_image_tower,
                                create_text_tower, list_image_towers)
from lit_softmoe.export import load_image_tower, load_pretrained
from lit_softmoe.inference import prepare_for_inference
from lit_softmoe.nn import ExpertsChoiceMoE, SoftMoE, TokensChoiceMoE
from lit_softmoe.upcycle import upcycle_tower

__version__ = "0.1.0"
__all__ = ["ExpertsChoiceMoE", "LiTModel", "SoftMoE", "TextTowerConfig", "TokensChoiceMoE", "ViTConfig",
           "VisionTransformer", "create_image_tower", "create_text_tower", "list_image_towers", "load_image_tower",
           "load_pretrained", "prepare_for_inference", "upcycle_tower"]
