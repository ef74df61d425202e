"""A finished LiT run folder around a tiny pair, written by the recipes' own writers, and what the export,
hub and ONNX-example tests do with it: embed, run the CLI in a subprocess, snapshot a folder."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from launch import python_command
from lit_softmoe.config import LiTConfig, PretrainConfig, to_yaml
from lit_softmoe.config_loading import load_config
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.models.tower_folder import save_tower, tower_fingerprint
from lit_softmoe.train.checkpoint import save_training_state
from lit_softmoe.train.lit import model_description, save_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "scripts" / "onnx_example.py"
CAPTIONS = ["a photo of a sneaker", "an ankle boot.", "Trousers, folded!", "a very long caption that goes on "
            "and on well past the sixteen tokens of the text tower"]
PREPROCESS = {"image_size": 28, "mean": [0.2860], "std": [0.3530]}
PREPROCESS_RGB = {"image_size": 28, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def make_run(root: Path, loss: str = "softmax", rgb: bool = False, image_head: bool = False) -> Path:
    """A tiny pretrained tower and a LiT run folder around a randomly 'trained' pair, written by the
    recipe's own writers (save_tower, save_model, save_training_state, config.yaml). `rgb`: a 3-channel
    tower (per-channel mean/std); `image_head`: a linear head on the image features."""
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=3, in_channels=3 if rgb else 1)
    preprocess = PREPROCESS_RGB if rgb else PREPROCESS
    tower_dir = save_tower(root / "pre" / "tower", tower, extra={
        "classnames": ["a", "b", "c"], "preprocess": preprocess,
        "pretrain": {"tower": "soft-test-4e", "steps": 10, "train_seconds": 1.5, "test_top1": 0.5}})
    (root / "pre" / "config.yaml").write_text(to_yaml(load_config(PretrainConfig, None, [
        f"run_dir={root / 'pre'}", "tower.name=soft-test-4e", "data.train=data/fm/train", "data.test=data/fm/test"])))
    cfg = load_config(LiTConfig, None, [f"run_dir={root / 'run'}", f"image_tower={tower_dir}", f"loss={loss}",
                                        "text.width=32", "text.layers=1", "text.heads=2",
                                        "data.train=data/feats/train", "eval.shards=data/feats/test",
                                        f"image_head={str(image_head).lower()}"])
    model = LiTModel(tower, create_text_tower(cfg.text, embed_dim=tower.embed_dim), loss=loss, image_head=image_head)
    with torch.no_grad():  # something other than the init: a trained scale and moved text and head weights
        model.logit_scale.fill_(2.7)
        for p in (*model.text_tower.parameters(), *model.image_head.parameters()):
            p.add_(0.01 * torch.randn_like(p))
    run = Path(cfg.run_dir)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tower_sha = tower_fingerprint(tower_dir)["tower_sha256"]
    description = model_description(cfg, {"tower": tower.cfg.to_dict(), "preprocess": preprocess}, model, tower_sha)
    save_training_state(run / "checkpoints" / "step_00000010", 10, model, optimizer, skip_prefixes=("image_tower.",),
                        meta={"train_seconds": 2.5, "data_counts": {"samples_read": 40, "bad": {}},
                              "image_tower_sha256": tower_sha, "model": description})
    results = {"steps": 10, "train_seconds": 2.5, "cached_features": True, "zeroshot_top1": 0.4321,
               "linear_probe_top1": 0.6543}
    save_model(run, model, description, results)
    (run / "results.json").write_text(json.dumps(results))
    return run


def make_hf_run(tmp_path: Path, text_path, *overrides) -> Path:
    """A finished LiT run (untrained) of the tiny tower with the Hugging Face text model at `text_path`."""
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e")
    tower_dir = save_tower(tmp_path / "pre" / "tower", tower, extra={"preprocess": PREPROCESS})
    cfg = load_config(LiTConfig, None, [f"run_dir={tmp_path / 'run'}", f"image_tower={tower_dir}", "text.kind=hf",
                                        f"text.path={text_path}", *overrides])
    model = LiTModel(tower, create_text_tower(cfg.text, embed_dim=tower.embed_dim))
    run = Path(cfg.run_dir)
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    meta = {"tower": tower.cfg.to_dict(), "preprocess": PREPROCESS}
    save_model(run, model, model_description(cfg, meta, model, tower_fingerprint(tower_dir)["tower_sha256"]),
               {"steps": 0})
    return run


def pair_inputs(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def embed_pair(model, tokenizer, pixels=None, captions=CAPTIONS):
    with torch.no_grad():
        return model.encode_image(pair_inputs() if pixels is None else pixels), model.encode_text(tokenizer(captions))


def run_cli(*args) -> tuple[int, str, str]:
    result = subprocess.run([*python_command(), "-m", "lit_softmoe.cli", *map(str, args)], capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, result.stdout, result.stderr


def snapshot_files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


