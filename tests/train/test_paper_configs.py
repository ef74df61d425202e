"""The paper-scale pretraining configs (`configs/pretrain/*-imagenet*.yaml`) stay valid: each loads as a
PretrainConfig, names a tower of the paper's parameter count (built on the meta device), and its recipe
runs three steps with the tower shrunk to test size on stand-in ImageNet class shards (foolbox's 20 real
ImageNet images in WordNet-id folders, written by `data from-folder --layout classes`), streamed with the
config's augmentation (inception crop, RandAugment, mixup)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import PIL.Image
import pytest

from evalkit import foolbox_images, needs_foolbox
from lit_softmoe.cli import main
from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import SHIPPED_CONFIGS, load_config
from lit_softmoe.metadata import imagenet_wnids
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.memory_plan import plan_report
from lit_softmoe.train.optim import lr_at
from lit_softmoe.train.pretrain import pretrain
from towers import JFT_CLASSES, count_params, meta_tower

PAPER_CONFIGS = sorted(path.stem for path in (SHIPPED_CONFIGS / "pretrain").glob("*-imagenet*.yaml"))
TOWERS_DOC = Path(__file__).parents[2] / "docs" / "towers.md"

# The Soft MoE paper's parameter counts, with the 29,593-class JFT-4B head, as printed: (count, its last digit).
PAPER_COUNTS = {"soft-s16-128e": (933e6, 1e6), "soft-b16-128e": (3.7e9, 0.1e9)}

# The tower shrunk to test size: the config's tower (its patch size, its Soft MoE layer) at width 32, two
# blocks with MoE in the last, 4 experts, on 64×64 images.
SHRINK = ["tower.options.width=32", "tower.options.depth=2", "tower.options.num_heads=2", "tower.options.mlp_dim=64",
          "tower.options.num_experts=4", "tower.options.moe_layers=[1]", "tower.options.image_size=64"]
STEPS = 3


def _docs_counts() -> dict[str, float]:
    """{tower: parameters without a head} from the Soft MoE row of docs/towers.md's tower zoo."""
    row = next(line for line in TOWERS_DOC.read_text().splitlines() if line.startswith("| Soft MoE (paper) |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    names = re.findall(r"`([^`]+)`", cells[1])
    units = {"M": 1e6, "B": 1e9}
    counts = [float(text[:-1]) * units[text[-1]] for text in (c.strip() for c in cells[4].split(","))]
    assert len(names) == len(counts), row
    return dict(zip(names, counts))


def test_the_paper_scale_configs_are_shipped():
    assert {"soft-s16-128e-imagenet21k", "soft-b16-128e-imagenet21k", "soft-s16-128e-imagenet1k",
            "soft-b16-128e-imagenet1k"} <= set(PAPER_CONFIGS)


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_config_loads_and_names_its_tower_and_data(name):
    cfg = load_config(PretrainConfig, f"pretrain/{name}")
    tower, dataset = re.fullmatch(r"(.+)-(imagenet1k|imagenet21k)", name).groups()
    assert cfg.tower.name == tower and cfg.tower.options == {}
    assert (cfg.data.train, cfg.data.test) == (f"data/{dataset}/train", f"data/{dataset}/test")
    assert cfg.run_dir == f"runs/{name}"
    assert cfg.batch_size == 4096 and cfg.optim.lr == 1e-3 and cfg.optim.schedule == "rsqrt"


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_config_tower_has_the_papers_parameter_count(name):
    cfg = load_config(PretrainConfig, f"pretrain/{name}")
    want, last_digit = PAPER_COUNTS[cfg.tower.name]
    with_jft_head = count_params(meta_tower(cfg.tower.name, num_classes=JFT_CLASSES, **cfg.tower.options))
    assert abs(with_jft_head - want) < last_digit, f"{with_jft_head:,} vs the paper's {want:,.0f}"
    # docs/towers.md's count (no head), printed to 3 significant digits, agrees too.
    without_head = count_params(meta_tower(cfg.tower.name, **cfg.tower.options))
    documented = _docs_counts()[cfg.tower.name]
    assert abs(without_head - documented) / documented < 0.005, f"{without_head:,} vs docs/towers.md {documented:,.0f}"


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_config_plans_to_fit_eight_80gb_gpus(name):
    """As shipped (its levers set), the memory plan fits 8 × 80 GB; the B/16 ones only with sharding."""
    cfg = load_config(PretrainConfig, f"pretrain/{name}")
    report, fits = plan_report(cfg, 8, 80 << 30)
    assert fits, report
    if "b16" in name:
        assert cfg.sharding == "fsdp"
        assert not plan_report(load_config(PretrainConfig, f"pretrain/{name}", ["sharding=none"]), 8, 80 << 30)[1]


@pytest.fixture(scope="module")
def imagenet_standin(tmp_path_factory):
    """foolbox's 20 ImageNet images, cropped to 64×64 squares, in their classes' WordNet-id folders, written
    as train and test class shards by `data from-folder --layout classes` (ImageNet's label indices)."""
    root = tmp_path_factory.mktemp("imagenet")
    src = root / "src"
    wnids = imagenet_wnids()
    for path, label in foolbox_images("imagenet"):
        image = PIL.Image.open(path).convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        (src / wnids[label]).mkdir(parents=True, exist_ok=True)
        image.crop((left, top, left + side, top + side)).resize((64, 64)).save(src / wnids[label] / f"{path.stem}.jpg")
    for split in ("train", "test"):
        assert main(["data", "from-folder", str(src), "--layout", "classes", "--out", str(root / "shards"),
                     "--split", split]) == 0
    return root / "shards"


@needs_foolbox
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_recipe_runs_with_the_tower_shrunk(name, imagenet_standin, tmp_path):
    run_dir = tmp_path / "run"
    # As the CLI applies overrides: the config's optimizer, schedule, loss and augmentation stay; the tower
    # shrinks, the data points at the stand-in, the run is 3 steps of 8 on the CPU (no compile, no tracker).
    cfg = load_config(PretrainConfig, f"pretrain/{name}", [
        *SHRINK, f"data.train={imagenet_standin / 'train'}", f"data.test={imagenet_standin / 'test'}",
        f"run_dir={run_dir}", "batch_size=8", f"steps={STEPS}", "log_every=1", "compile=false", "log_with=[]",
        "data.workers=1", "sharding=none"])  # one process here: tests/train/test_sharding.py runs fsdp on two
    shipped = load_config(PretrainConfig, f"pretrain/{name}")
    assert (cfg.optim, cfg.loss, cfg.label_smoothing) == (shipped.optim, shipped.loss, shipped.label_smoothing)
    recipe = ("loader", "augment", "crop", "crop_scale", "randaugment", "mixup", "mean", "std")
    assert [getattr(cfg.data, key) for key in recipe] == [getattr(shipped.data, key) for key in recipe]
    assert shipped.data.loader == "stream" and shipped.data.crop == "random_resized"

    results = pretrain(cfg)

    assert results["tower"] == shipped.tower.name and results["steps"] == STEPS
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    # The config's schedule drove the run: its rsqrt warmup, 10k steps long, at its first steps.
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, STEPS, cfg.optim) for s in range(STEPS)])
    assert records[0]["lr"] == pytest.approx(shipped.optim.lr / shipped.optim.warmup)
    assert math.isfinite(results["test_top1"])
    tower, meta = load_tower(run_dir / "tower")
    assert (tower.cfg.width, tower.cfg.num_experts, tower.cfg.patch_size) == (32, 4, 16)
    assert tower.cfg.num_classes == len(meta["classnames"]) == 19  # foolbox's 20 images: 19 ImageNet classes
    assert "bald eagle" in meta["classnames"]  # wnid folders named by ImageNet's class names
