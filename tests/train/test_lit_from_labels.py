"""LiT from labelled data: class folders written with `--caption-templates` train a text tower, and
the zero-shot evaluation reads the same templates from beside the split."""
from __future__ import annotations

import math

import PIL.Image
import torch

from lit_data import PREPROCESS, lit_config
from lit_softmoe.data.captions import load_caption_templates
from lit_softmoe.data.fashion_mnist import read_fashion_mnist
from lit_softmoe.data.shards import read_lines
from lit_softmoe.data.write_options import WriteOptions
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.train import lit as lit_recipe
from lit_softmoe.train import lit_eval
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.logging import read_metrics


def test_class_folder_caption_shards_train_a_text_tower(tmp_path, monkeypatch):
    images, labels = read_fashion_mnist("test", allow_download=False)
    for index in range(200):  # the first 200 test images in one folder per class: 150 train, 50 test
        split = "train" if index < 150 else "test"
        folder = tmp_path / split / FASHION_MNIST_CLASSNAMES[labels[index]]
        folder.mkdir(parents=True, exist_ok=True)
        PIL.Image.fromarray(images[index]).save(folder / f"{index}.png")
    templates = load_caption_templates("default")
    for split in ("train", "test"):
        write_folder_shards(tmp_path / split, tmp_path / "shards", WriteOptions(split=split), layout="classes",
                            caption_templates=templates)
    torch.manual_seed(0)
    save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": PREPROCESS})
    for split in ("train", "test"):
        embed_shards(tmp_path / "tower", str(tmp_path / "shards" / split), tmp_path / "features", batch_size=100)
    prompts_used = []
    real_build = lit_eval.build_zeroshot_classifier

    def build(encode_text, tokenizer, classnames, templates, **kwargs):
        prompts_used.append(list(templates))
        return real_build(encode_text, tokenizer, classnames, templates, **kwargs)

    monkeypatch.setattr(lit_eval, "build_zeroshot_classifier", build)

    results = lit_recipe.train_lit(lit_config(tmp_path, tmp_path / "run", "steps=6"))

    assert results["steps"] == 6 and 0 <= results["zeroshot_top1"] <= 1
    assert read_lines(tmp_path / "features" / "zeroshot_classification_templates.txt") == templates
    assert prompts_used == [templates]  # the eval prompts are the caption templates
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
