"""Review of `lit-softmoe export`, `load_pretrained` and `inspect-routing` as a user meets them: --overwrite
aimed at a folder the export reads from, --out paths that cannot be written, routing figures with a
suffix matplotlib cannot write."""
from __future__ import annotations

import pytest

from lit_softmoe import cli

from lit_runs import EXAMPLE, _make_run, _one_error_line, _run_cli, _snapshot


def test_overwrite_refuses_the_image_tower_and_its_pretraining_run(run, capsys):
    pre = run.parent / "pre"
    before = _snapshot(pre)
    for out in (pre, pre / "tower"):
        line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(out), "--overwrite"]))
        assert "holds the model being exported" in line and str(pre / "tower") in line, line
    assert _snapshot(pre) == before


def test_overwrite_refuses_a_folder_of_the_run_that_is_not_an_export(run, tmp_path, capsys):
    before = _snapshot(run)
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(run / "checkpoints"), "--overwrite"]))
    assert "--overwrite would delete" in line and "pick another folder" in line, line
    assert _snapshot(run) == before
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
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(blocker / "sub")]))
    assert "--out" in line and "is a file" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_checkpoint_export_reports_its_own_step_and_evaluation(tmp_path):
    import json
    import shutil

    from lit_softmoe.export import export_pair
    run = _make_run(tmp_path)  # finished at step 10; results.json and model/ are the final model's
    early = run / "checkpoints" / "step_00000005"
    shutil.copytree(run / "checkpoints" / "step_00000010", early)
    meta = json.loads((early / "state.json").read_text())
    (early / "state.json").write_text(json.dumps({**meta, "step": 5, "train_seconds": 1.04}))
    (run / "eval").mkdir()
    for name, model, top1 in [("fm-step_00000005-1.json", early, 0.1111), ("fm-2.json", run, 0.9999)]:
        (run / "eval" / name).write_text(json.dumps({"model": str(model), "suite": "fm", "results": [
            {"benchmark": "fashion-mnist", "task": "classification", "metrics": {"top1": top1}, "status": "ok"}]}))

    out = export_pair(early, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["source"]["step"] == 5
    card = (out / "README.md").read_text()
    assert "LiT: 5 steps in 1.0 s" in card and "11.11" in card, card
    assert "99.99" not in card and "43.21" not in card  # the final model's eval and results.json
    # The final model's export still shows the final model's numbers.
    card = (export_pair(run, tmp_path / "final") / "README.md").read_text()
    assert "LiT: 10 steps in 2.5 s" in card and "99.99" in card and "11.11" not in card


def test_a_tower_rewritten_since_training_is_refused(tmp_path, capsys):
    import json

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = _make_run(tmp_path)
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same width (the pair still builds), other architecture: a dense tower saved over the Soft MoE one.
    save_tower(tower_dir, create_image_tower("vit-test", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against" in line and "moe_layers" in line, line
    with pytest.raises(UserError, match="not the one the run was trained against"):
        load_pretrained(run)
    # Other preprocessing is refused too.
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={**{k: v for k, v in meta.items() if k != "tower"},
                      "preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "differs in preprocess" in line, line
    assert not (tmp_path / "out").exists()


def test_a_retrained_tower_of_the_same_architecture_is_refused(tmp_path, capsys):
    import json

    import torch

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = _make_run(tmp_path)
    assert json.loads((run / "model" / "config.json").read_text())["image_tower_sha256"]
    load_pretrained(run)  # the tower the run recorded: accepted
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same tower name, config and preprocessing, other weights: only the recorded sha256 can tell.
    torch.manual_seed(1)
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = _one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    with pytest.raises(UserError, match="differs in its weights"):
        load_pretrained(run)
    # A training checkpoint records the tower's sha256 too.
    line = _one_error_line(capsys, cli.main(["export", str(run / "checkpoints" / "step_00000010"),
                                             "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    assert not (tmp_path / "out").exists()


def test_an_export_copied_in_part_is_one_line(run, tmp_path):
    import shutil

    from lit_softmoe import load_image_tower, load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.export import export_pair
    out = export_pair(run, tmp_path / "export")
    missing, truncated = tmp_path / "missing", tmp_path / "truncated"
    shutil.copytree(out, missing)
    (missing / "text_encoder.safetensors").unlink()
    shutil.copytree(out, truncated)
    with open(truncated / "image_encoder.safetensors", "r+b") as file:
        file.truncate(1000)
    with pytest.raises(UserError, match="text_encoder.safetensors .*incomplete or damaged"):
        load_pretrained(missing)
    for load in (load_pretrained, load_image_tower):
        with pytest.raises(UserError, match="image_encoder.safetensors .*incomplete or damaged"):
            load(truncated)


# ---- an ONNX failure is one line, whatever the exporters print ----------------------------------

def test_onnx_failure_of_a_tokens_choice_tower_prints_one_line(tmp_path):
    import torch

    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    torch.manual_seed(0)
    # Tokens Choice's sort has no ONNX export in torch 2.14: both exporters fail, and the TorchScript
    # one prints its whole graph from C++ on the way (past sys.stdout).
    save_tower(tmp_path / "tower", create_image_tower("tc-test-4e-k1", num_classes=3),
               extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]}})
    code, stdout, stderr = _run_cli("export", tmp_path / "tower", "--out", tmp_path / "out", "--onnx")
    if code == 0:
        pytest.skip("this torch exports Tokens Choice towers to ONNX")
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, (stdout[:500], stderr[:500])
    assert "ONNX export of the image tower failed" in stderr and "\x1b[" not in stderr
    assert not (tmp_path / "out").exists()


def test_onnx_example_on_an_export_without_onnx_says_how_to_make_one(run, tmp_path):
    import subprocess
    import sys

    from lit_softmoe.export import export_pair
    out = export_pair(run, tmp_path / "export")  # no --onnx
    PIL = pytest.importorskip("PIL.Image")
    PIL.new("L", (28, 28)).save(tmp_path / "x.png")
    for args in ([out, tmp_path / "x.png", "a cat"], [out]):
        result = subprocess.run([sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert ("--onnx" in result.stderr) if len(args) == 3 else ("usage:" in result.stderr)
