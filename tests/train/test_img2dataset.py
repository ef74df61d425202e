"""img2dataset's webdataset output as it comes (00000.tar … with .jpg/.txt/.json samples, .parquet and
_stats.json beside, no nshards.txt or sizes.json; failed downloads absent from the tars, one shard
unfinished): `embed` → `train` from the features and on the fly → `eval` retrieval, each progress bar
knowing its total from the _stats.json.

The steps share module fixtures (each step runs once); the embed step is the one call `_embed`.
"""
from __future__ import annotations

import contextlib
import io
import math
import re

import numpy as np
import pytest
import torch

from img2dataset_shards import write_img2dataset_output
from lit_data import PREPROCESS, lit_config
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics

# 240 rows in shards of 80, every 7th a failed download: 69 + 69 + 68 samples; plus a fourth shard of
# 10 rows whose tar has no _stats.json yet (left out everywhere).
ROWS, ROWS_PER_SHARD, SAMPLES = 240, 80, 206
EMBED_BATCH, LIT_BATCH, EVAL_BATCH = 64, 50, 64  # lit_config's batch_size is 50


def _bar_totals(text: str, desc: str) -> list[tuple[int, int]]:
    """Every (n, total) a tqdm bar named `desc` printed."""
    return [(int(n), int(total)) for n, total in re.findall(rf"{re.escape(desc)}:[^\r\n|]*\|[^|]*\|\s*(\d+)/(\d+)",
                                                              text)]


def _embed(tower, folder, out) -> dict:
    """The embed step: img2dataset's folder → feature split `out/train` (with its progress bar)."""
    return embed_shards(tower, str(folder), out, split="train", batch_size=EMBED_BATCH, progress=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The downloads (ROOT/downloads/laion) and a random tower saved with its preprocessing."""
    root = tmp_path_factory.mktemp("img2dataset")
    out = write_img2dataset_output(root / "downloads" / "laion", ROWS, ROWS_PER_SHARD, unfinished_rows=10)
    assert sum(out.successes) == SAMPLES and len(out.keys) == SAMPLES and len(out.unfinished) == 1
    torch.manual_seed(0)
    save_tower(root / "tower", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": PREPROCESS})
    return root, out


@pytest.fixture(scope="module")
def embedded(root):
    root, out = root
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        summary = _embed(root / "tower", out.folder, root / "features")
    return summary, stderr.getvalue()


def _train(root, name: str, train: str) -> tuple[dict, str]:
    """One epoch of LiT on `train`, no eval set; (results, what its progress bar printed)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        results = train_lit(lit_config(root, root / name, "epochs=1", f"data.train={train}", "eval.shards=''"))
    return results, stderr.getvalue()


@pytest.fixture(scope="module")
def from_features(root, embedded):
    root, _ = root
    return _train(root, "run-features", str(root / "features" / "train"))


def test_embed_reads_img2dataset_output_and_knows_its_total(root, embedded):
    root, out = root
    summary, progress = embedded
    # Every finished shard's sample, none of the failed downloads nor of the unfinished tar, nothing bad
    # (the .json members are read past).
    assert summary["num_samples"] == SAMPLES and summary["bad"] == {}
    loader = create_shard_loader(ShardDataConfig(urls=summary["split_dir"], batch_size=500, workers=0, shuffle=False,
                                                 exact_epoch=True), "embedding-caption")
    batches = list(loader)
    keys = [key for batch in batches for key in batch["key"]]
    assert sorted(keys) == out.keys
    assert [c for batch in batches for c in batch["caption"]] == [out.captions[key] for key in keys]
    assert all(np.isfinite(batch["embedding"].numpy()).all() for batch in batches)
    # The bar's total, from the _stats.json: ceil(206 / 64) = 4 batches (or the 206 samples), reached.
    totals = _bar_totals(progress, "embed")
    assert totals and totals[-1][1] in (math.ceil(SAMPLES / EMBED_BATCH), SAMPLES), progress
    assert totals[-1][0] == totals[-1][1], progress


def test_lit_trains_an_epoch_of_the_features(from_features):
    results, progress = from_features
    steps = math.ceil(SAMPLES / LIT_BATCH)  # 206 cached features, batches of 50: 5 steps an epoch
    assert results["cached_features"] and results["steps"] == steps
    assert _bar_totals(progress, "lit")[-1] == (steps, steps), progress


def test_lit_trains_an_epoch_on_the_fly_from_the_images(root):
    root, out = root
    results, progress = _train(root, "run-images", str(out.folder))
    steps = math.ceil(SAMPLES / LIT_BATCH)
    assert not results["cached_features"] and results["steps"] == steps
    losses = [r["loss"] for r in read_metrics(root / "run-images" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    assert _bar_totals(progress, "lit")[-1] == (steps, steps), progress


def test_eval_retrieval_on_img2dataset_output(root, from_features, tmp_path):
    root, out = root
    bench = BenchmarkConfig(name="laion", root=str(out.folder.parent), split=out.folder.name, task="retrieval")
    cfg = EvalSuiteConfig(name="img2dataset", benchmarks=[bench], batch_size=EVAL_BATCH, workers=0,
                          cache_dir=str(tmp_path / "cache"))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        entry = run_suite(root / "run-features", cfg, out=tmp_path / "eval.json", progress=True)["results"][0]
    assert entry["status"] == "ok" and entry["task"] == "retrieval" and entry["format"] == "wds", entry
    # One image and one caption per sample of the finished shards: no failed download, no unfinished tar.
    assert (entry["num_samples"], entry["num_captions"], entry["bad_samples"]) == (SAMPLES, SAMPLES, 0)
    assert "partial" not in entry
    for direction in ("image_to_text", "text_to_image"):
        recalls = [entry["metrics"][f"{direction}_R@{k}"] for k in (1, 5, 10)]
        assert 0 <= recalls[0] <= recalls[1] <= recalls[2] <= 1
        # Scored over 206 queries: each recall is a whole number of them.
        assert all(abs(r * SAMPLES - round(r * SAMPLES)) < 1e-3 for r in recalls), recalls
    # The image-encoding bar's total: ceil(206 / 64) = 4 batches.
    assert {total for _, total in _bar_totals(stderr.getvalue(), "laion")} == {math.ceil(SAMPLES / EVAL_BATCH)}
