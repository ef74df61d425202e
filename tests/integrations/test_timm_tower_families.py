"""Any timm image model as the locked LiT tower, one model of each family users lock (ResNet, ConvNeXt,
EfficientNet, Swin, a ViT with registers, a ViT with an attention-pool head, EVA), through the whole path as a
user takes it: a random-weights checkpoint (`timm:NAME?file=...`) → `embed` → `train` on the cached features →
`train` with its last block unlocked on images → our eval of the export → `load_pretrained` → stock open_clip,
in a process that never imports lit_softmoe. Offline: random weights (tests/timm_families.py)."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch import python_command
from lit_softmoe import load_pretrained
from lit_softmoe.cli import main
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig, LiTConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.export import export_pair
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.models.tower_layers import tower_layers
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.model_count import count_lit
from shared_builds import built_once
from timm_families import TIMM_FAMILIES

timm = pytest.importorskip("timm")

TEXT = ["text.width=32", "text.layers=1", "text.heads=2", "precision=fp32", "log_with=[]", "data.workers=0"]


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory):
    """16 train and 16 test Fashion-MNIST images, in shards of 8."""
    return built_once(tmp_path_factory, "timm-families-fmnist", lambda root: write_fashion_mnist_shards(
        root, samples_per_shard=8, limit=16, allow_download=False))


_STOCK_OPEN_CLIP = textwrap.dedent("""
    import sys, open_clip, torch
    from safetensors.torch import load_file, save_file
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + sys.argv[1])
    model.eval()  # as open_clip's README says: it starts in train mode, which BatchNorm models feel
    tokenizer = open_clip.get_tokenizer("local-dir:" + sys.argv[1])
    pixels = load_file(sys.argv[2])["pixels"]
    with torch.no_grad():
        image = model.encode_image(pixels, normalize=True)
        text = model.encode_text(tokenizer(["a photo of a sneaker", "an ankle boot"]), normalize=True)
    assert not any(name == "lit_softmoe" or name.startswith("lit_softmoe.") for name in sys.modules)
    save_file({"image": image, "text": text}, sys.argv[3])
""")


@pytest.mark.slow
@pytest.mark.parametrize("family", TIMM_FAMILIES)
def test_a_timm_tower_of_each_family_goes_the_whole_path(family, fmnist, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_SOFTMOE_CACHE", str(tmp_path / "cache"))
    name = TIMM_FAMILIES[family]
    torch.manual_seed(0)
    save_file(timm.create_model(name, pretrained=False).state_dict(), tmp_path / "weights.safetensors")
    spec = f"timm:{name}?file={tmp_path / 'weights.safetensors'}"

    # The tower loads with every buffer on the CPU and equal to timm's own model's (computed ones included).
    tower, _ = load_tower(spec)
    tower.eval()
    reference = timm.create_model(name, pretrained=False, num_classes=0).eval()
    reference.load_state_dict(load_file(tmp_path / "weights.safetensors"), strict=False)  # its class head aside
    for key, buffer in reference.named_buffers():
        assert torch.equal(tower.get_buffer(key), buffer), key
    size = tower.cfg.image_size
    pixels = torch.randn(3, 3, size, size)
    with torch.no_grad():
        assert torch.equal(tower.forward_pooled(pixels), reference.forward_head(
            reference.forward_features(pixels), pre_logits=True))

    features = tmp_path / "features"
    for split in ("train", "test"):
        assert main(["embed", "--tower", spec, "--shards", str(fmnist / split), "--out", str(features),
                     "--batch-size", "16", "--workers", "0"]) == 0
    run = tmp_path / "run"
    train_lit(load_config(LiTConfig, None, [
        f"run_dir={run}", f"image_tower={spec}", f"data.train={features / 'train'}",
        f"eval.shards={features / 'test'}", "batch_size=8", "steps=4", "optim.lr=3e-3", "optim.warmup=1", *TEXT]))
    results = json.loads((run / "results.json").read_text())
    export_pair(run, tmp_path / "export")

    # Our eval of the export on the images scores as the run's eval on the cached features did.
    suite = EvalSuiteConfig(name="families", workers=0, batch_size=16, cache_dir=str(tmp_path / "eval-cache"),
                            benchmarks=[BenchmarkConfig(name="fashion-mnist", root=str(fmnist))])
    ours = run_suite(tmp_path / "export", suite, out=tmp_path / "eval.json")["results"][0]
    assert ours["status"] == "ok" and ours["num_samples"] == 16
    assert ours["metrics"]["top1"] == pytest.approx(results["zeroshot_top1"], abs=1e-6)

    # Stock open_clip, without our package, gives our embeddings.
    model, _, tokenizer = load_pretrained(tmp_path / "export")
    save_file({"pixels": pixels}, tmp_path / "pixels.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stock = subprocess.run([*python_command("torch"), "-c", _STOCK_OPEN_CLIP, str(tmp_path / "export"),
                            str(tmp_path / "pixels.safetensors"), str(tmp_path / "theirs.safetensors")],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert stock.returncode == 0, stock.stderr[-3000:]
    theirs = load_file(tmp_path / "theirs.safetensors")
    with torch.no_grad():
        assert (model.encode_image(pixels) - theirs["image"]).abs().max() <= 1e-5
        text = model.encode_text(tokenizer(["a photo of a sneaker", "an ankle boot"]))
    assert (text - theirs["text"]).abs().max() <= 1e-5

    # The last block (and what runs after it) trains on the images; the rest of the tower stays as it was.
    unlocked_run = tmp_path / "unlocked"
    overrides = [f"run_dir={unlocked_run}", f"image_tower={spec}", f"data.train={fmnist / 'train'}",
                 "eval.shards=", "unlocked_blocks=1", "batch_size=8", "steps=2", "optim.lr=1e-2", "optim.warmup=1",
                 *TEXT]
    cfg = load_config(LiTConfig, None, overrides)
    layers = tower_layers(tower)
    unlocked = layers.unlocked(1)
    assert unlocked and layers.block_parameters(-1) <= unlocked and len(unlocked) < len(layers.layer_ids)
    plan = count_lit(cfg)  # the memory plan: the unlocked block's parameters train, the rest is held locked
    sizes = {key: p.numel() for key, p in tower.named_parameters()}
    assert plan.trainable - count_lit(load_config(LiTConfig, None, [*overrides, "unlocked_blocks=0"])).trainable \
        == sum(sizes[key] for key in unlocked)
    train_lit(cfg)
    trained = load_file(unlocked_run / "model" / "model.safetensors")
    before = tower.state_dict()
    image_keys = {key.removeprefix("image_tower.") for key in trained if key.startswith("image_tower.")}
    assert unlocked <= image_keys and not image_keys & (set(sizes) - unlocked)
    assert any(not torch.equal(trained[f"image_tower.{key}"], before[key]) for key in layers.block_parameters(-1))
    pair = load_pretrained(unlocked_run / "model")[0].image_tower.state_dict()
    for key in set(sizes) - unlocked:
        assert torch.equal(pair[key], before[key]), key
