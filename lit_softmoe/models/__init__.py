"""Towers built from `lit_softmoe.nn` layers: the ViT image towers and their registry, text towers
and tokenizers, the LiT pair, the tower folder format, upcycling and vmoe conversion."""
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import (
    create_image_tower,
    image_tower_config,
    list_image_towers,
    register_image_tower,
)
from lit_softmoe.models.text import TextTower, TextTowerConfig, create_text_tower
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig

__all__ = ["LiTModel", "TextTower", "TextTowerConfig", "ViTConfig", "VisionTransformer",
           "create_image_tower", "create_text_tower", "image_tower_config", "list_image_towers",
           "register_image_tower"]
