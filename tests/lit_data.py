"""The small LiT data set (300 + 300 Fashion-MNIST images, a random soft-test-4e tower and its feature
cache) behind the `data` fixtures, and the LiT config that trains on it."""
from pathlib import Path

import torch

from lit_softmoe.config import LiTConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.train.embed import embed_shards

PREPROCESS = {"image_size": 28, "mean": [0.286], "std": [0.353]}


def write_lit_data(root: Path, **embed_options) -> Path:
    """300 + 300 Fashion-MNIST images in shards of 50, a random tower with its preprocess entry, and
    the tower's feature cache of both splits (`embed_options` go to `embed_shards`)."""
    write_fashion_mnist_shards(root / "fmnist", samples_per_shard=50, limit=300, allow_download=False)
    torch.manual_seed(0)
    save_tower(root / "tower", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": PREPROCESS})
    for split in ("train", "test"):
        embed_shards(root / "tower", str(root / "fmnist" / split), root / "features", batch_size=100, **embed_options)
    return root


def lit_config(data, run_dir, *extra) -> LiTConfig:
    return load_config(LiTConfig, None, [
        f"run_dir={run_dir}", f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
        f"eval.shards={data / 'features' / 'test'}", "data.workers=0", "batch_size=50", "log_every=1",
        "precision=fp32", "text.width=64", "text.layers=1", "text.heads=2", *extra])
