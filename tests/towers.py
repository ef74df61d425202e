"""Towers for the tower tests: paper-sized ones on the meta device (no memory allocated), tiny seeded ones
with random images for real numbers, and parameter counts."""
from __future__ import annotations

import torch

from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.models.vit_config import ViTConfig

JFT_CLASSES = 29_593


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_tower(name: str, **overrides) -> VisionTransformer:
    tower = create_image_tower(name, device="meta", **overrides)
    assert all(p.is_meta for p in tower.parameters()), f"{name}: a parameter was allocated"
    return tower


def tiny(name="soft-test-4e", seed=0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    return create_image_tower(name, **overrides).eval()


def images(cfg: ViTConfig, b=3, size=None, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    size = size or cfg.image_size
    return torch.randn(b, cfg.in_channels, size, size, generator=g, dtype=dtype)


def resized_copy(tower_dir, dest, size: int | None = None) -> tuple:
    """A copy of the tower folder at `tower_dir` whose preprocess.image_size is `size` (default: twice the size
    the tower was built for): a deliberate resolution change. → (the copy, the size it was built for)."""
    import json
    import shutil
    shutil.copytree(tower_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    built = config["tower"]["image_size"]
    config["preprocess"]["image_size"] = size or 2 * built
    (dest / "config.json").write_text(json.dumps(config))
    return dest, built
