"""Shared pieces of the eval tests: tiny model pairs, real-image benchmarks written to disk, suites over
them, and the marks of tests that need foolbox's images or CLIP_benchmark.

Real images: the foolbox package ships 20 ImageNet (label = ImageNet-1k index), 20 CIFAR-10 and
20 CIFAR-100 test images named `{dataset}_{idx}_{label}.{png,jpg}`; only its data files are read.
"""
from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path

import PIL.Image
import pytest
import torch
import webdataset as wds

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available
from lit_softmoe.metadata import benchmark_info
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer

# Found without importing foolbox (its own imports need packages we do not install), wherever it is installed.
_FOOLBOX = importlib.util.find_spec("foolbox")
FOOLBOX_DATA = Path(next(iter(_FOOLBOX.submodule_search_locations or [""])) if _FOOLBOX else "/nonexistent") / "data"
TINY_TEXT = TextTowerConfig(kind="transformer", width=32, layers=1, heads=2, context_length=16, vocab_size=49408)

# The marks of the tests that need foolbox's images or the peer package.
needs_foolbox = pytest.mark.skipif(not FOOLBOX_DATA.is_dir(), reason="foolbox's test images are not installed")
needs_clip_benchmark = pytest.mark.skipif(not clip_benchmark_available(), reason="clip-benchmark is not installed")


def foolbox_images(dataset: str) -> list[tuple[Path, int]]:
    """[(file, label)] of foolbox's `dataset` images ("imagenet", "cifar10", "cifar100"), in index order."""
    files = sorted(FOOLBOX_DATA.glob(f"{dataset}_*"), key=lambda p: int(p.stem.split("_")[1]))
    return [(path, int(path.stem.split("_")[2])) for path in files]


def tiny_pair(in_channels: int = 1, image_size: int = 28, seed: int = 0):
    """(model, preprocess, tokenizer) of a random soft-test-4e tower + 1-layer text tower."""
    torch.manual_seed(seed)
    tower = create_image_tower("soft-test-4e", in_channels=in_channels, image_size=image_size,
                               patch_size=7 if image_size % 8 else 8)
    model = LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=tower.embed_dim)).eval()
    preprocess = eval_transform(image_size, in_channels, 0.5, 0.25)
    return model, preprocess, create_tokenizer("openclip-bpe", TINY_TEXT.context_length)


def write_wds_benchmark(root: Path, samples: list[tuple[bytes, str, int | str]], classnames=None, templates=None,
                        retrieval: bool = False, split: str = "test", per_shard: int = 1000) -> Path:
    """The CLIP_benchmark webdataset layout: samples are (image bytes, extension, label or captions)."""
    (root / split).mkdir(parents=True, exist_ok=True)
    shards = 0
    for start in range(0, len(samples), per_shard):
        with wds.TarWriter(str(root / split / f"{shards}.tar")) as sink:
            for i, (image, ext, target) in enumerate(samples[start:start + per_shard], start):
                sink.write({"__key__": f"s{i:07d}", ext: image,
                            ("txt" if retrieval else "cls"): str(target)})
        shards += 1
    (root / split / "nshards.txt").write_text(f"{shards}\n")
    (root / "dataset_type.txt").write_text("retrieval\n" if retrieval else "classification\n")
    if classnames:
        (root / "classnames.txt").write_text("\n".join(classnames) + "\n")
    if templates:
        (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return root


def foolbox_benchmark(root: Path, dataset: str, classnames, templates) -> Path:
    samples = [(path.read_bytes(), path.suffix[1:], label) for path, label in foolbox_images(dataset)]
    return write_wds_benchmark(root, samples, classnames, templates)


def save_pair(root: Path, in_channels: int = 1, image_size: int = 28, seed: int = 0) -> Path:
    """A LiT run folder (tower + model/) around `tiny_pair`, written by the recipes' own writers,
    so `load_pretrained(run)` — and CLIP_benchmark through our loader — load it from disk."""
    from lit_softmoe.config import LiTConfig
    from lit_softmoe.config_loading import load_config
    from lit_softmoe.models.tower_folder import save_tower, tower_fingerprint
    from lit_softmoe.train.lit import model_description, save_model
    model, _, _ = tiny_pair(in_channels, image_size, seed)
    preprocess = {"image_size": image_size, "mean": [0.5] * in_channels, "std": [0.25] * in_channels}
    tower_dir = save_tower(root / "pretrain" / "tower", model.image_tower, extra={"preprocess": preprocess})
    cfg = load_config(LiTConfig, None, [f"run_dir={root / 'lit'}", f"image_tower={tower_dir}", "text.width=32",
                                        "text.layers=1", "text.heads=2", "text.context_length=16"])
    meta = {"tower": model.image_tower.cfg.to_dict(), "preprocess": preprocess}
    tower_sha = tower_fingerprint(tower_dir)["tower_sha256"]
    save_model(root / "lit", model, model_description(cfg, meta, model, tower_sha), {})
    return root / "lit"


def raw_tar_samples(split_dir):
    """Every (PIL image, label) of a split, read with tarfile alone: the independent reference."""
    samples = {}
    for shard in sorted(split_dir.glob("*.tar"), key=lambda p: int(p.stem)):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault((int(shard.stem), key), {})[ext] = tar.extractfile(member).read()
    return [(PIL.Image.open(io.BytesIO(s["png"])), int(s["cls"])) for _, s in sorted(samples.items())]


def suite_config(root, cache_dir, name="fashion-mnist", **kwargs) -> EvalSuiteConfig:
    return EvalSuiteConfig(name="t", benchmarks=[BenchmarkConfig(name=name, root=str(root), **kwargs)],
                           batch_size=64, workers=0, cache_dir=str(cache_dir))


def _class_folders(root, names, per_class=1):
    image = foolbox_images("cifar10")[0][0].read_bytes()
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / name / f"{i}.png").write_bytes(image)
    return root


def wds_set(root):
    images = foolbox_images("cifar10")[:6]
    return write_wds_benchmark(root, [(p.read_bytes(), "png", label) for p, label in images],
                               classnames=list(benchmark_info("cifar10").classnames), templates=["a photo of a {c}."])
