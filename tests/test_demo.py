"""lit_softmoe.demo: `lit-softmoe demo --fast`, the main job on a real Fashion-MNIST subset, end to end as a
user runs it; its folder checks, step errors and closing results table."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_errors import one_line_error
from launch import python_command

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = {"shards": 1.2, "pretrain": 30.4}


def _demo(tmp_path):
    return subprocess.run([*python_command(), "-m", "lit_softmoe.cli", "demo", "--fast",
                           "--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_demo_fast_runs_the_whole_pipeline(tmp_path):
    result = _demo(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for stage in [f"== {i}/7" for i in range(1, 8)] + ["== results"]:
        assert stage in out
    runs = tmp_path / "runs" / "demo-fast"
    tower = json.loads((runs / "pretrain" / "results.json").read_text())
    lit = json.loads((runs / "lit" / "results.json").read_text())
    # 5,000 real training images: the tower and the text tower trained against it are far above
    # chance (10%); measured 0.768 (tower) and 0.773 (zero-shot, prompts unseen in training).
    assert tower["test_top1"] > 0.65
    assert lit["zeroshot_top1"] > 0.65
    assert lit["cached_features"] is True
    assert f"{tower['test_top1']:.4f}" in out
    assert (runs / "lit" / "model" / "model.safetensors").is_file()
    # The eval suite's report agrees with the training run's own final zero-shot number (same model,
    # same test images, same prompts) and, where clip_benchmark is installed, with the peer.
    (report_file,) = (runs / "lit" / "eval").glob("fashion-mnist-*.json")
    entry = json.loads(report_file.read_text())["results"][0]
    assert entry["num_samples"] == 5_000 and abs(entry["metrics"]["top1"] - lit["zeroshot_top1"]) < 1e-3
    (row,) = [line for line in out.splitlines() if "LiT zero-shot top-1" in line]
    assert row.endswith(f"{entry['metrics']['top1']:.4f}")
    if "peer" in entry:
        assert entry["peer"]["status"] == "ok" and entry["peer"]["max_abs_diff_points"] <= 0.1 + 1e-6
    # The export holds both encoders as safetensors and checked ONNX graphs, and a model card.
    export = runs / "export"
    config = json.loads((export / "config.json").read_text())
    written = {p.name for p in export.iterdir()}
    assert {"image_encoder.onnx", "text_encoder.onnx", "README.md", "tokenizer.json"} <= written
    assert config["onnx"]["image"]["max_abs_diff"] < 1e-4 and config["onnx"]["text"]["max_abs_diff"] < 1e-4
    # Five test images classified by text prompts through the loaded export: mostly right at ~75% top-1.
    picks = [line for line in out.splitlines() if line.startswith("  test image ")]
    assert len(picks) == 5 and sum(line.endswith("[ok]") for line in picks) >= 3
    # A second run finds every stage done: nothing is rewritten or retrained, only re-evaluated.
    again = _demo(tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("already there") == 3  # the shards and both feature splits
    reports = sorted((runs / "lit" / "eval").glob("fashion-mnist-*.json"))  # a new file, the first one kept
    assert len(reports) == 2 and reports[0] == report_file
    rerun = json.loads(reports[1].read_text())["results"][0]
    assert rerun["image_cache"] == "hit" and rerun["metrics"] == entry["metrics"]
    if "peer" in entry:  # CLIP_benchmark's result, recorded by the first run on the same model and files
        assert rerun["peer"] == {**entry["peer"], "cache": "hit"}
    assert "(step 156 of 156)" in again.stdout and "(step 160 of 160)" in again.stdout
    onnx = json.loads((export / "config.json").read_text())["onnx"]  # the same model: its graphs copied, checked
    assert all(onnx[side]["reused"] for side in ("image", "text")) and "ONNX graphs copied" in again.stdout


@pytest.fixture
def no_shards(monkeypatch):
    from lit_softmoe.data import fashion_mnist as sources
    monkeypatch.setattr(sources, "write_fashion_mnist_shards", lambda *a, **k: pytest.fail("the demo started"))


@pytest.mark.parametrize("flag", ["--data", "--runs"])
def test_demo_folders_that_cannot_be_written_are_refused_before_any_stage(tmp_path, capsys, no_shards, flag):
    # --data was reported as "--out …/fashion-mnist" by the first stage, and --runs only at its first write.
    (tmp_path / "file").write_text("x")
    folders = {"--data": str(tmp_path / "data"), "--runs": str(tmp_path / "runs"), flag: str(tmp_path / "file")}
    line = one_line_error(capsys, ["demo", "--fast", *[x for item in folders.items() for x in item]])
    assert line == f"lit-softmoe demo: error: {flag} {tmp_path / 'file'} is a file; give a folder path"


def test_demo_step_errors_say_which_command_the_flags_belong_to(tmp_path, capsys, monkeypatch):
    # The stage's fix names `--overwrite` and `--out`, which `lit-softmoe demo` does not have.
    from lit_softmoe.data import fashion_mnist as sources
    from lit_softmoe.errors import UserError, setting

    def refuse(out_dir, limit=None, setting_names=None):  # naming its settings as the writer does
        overwrite = setting(setting_names, "overwrite", True)
        out = setting(setting_names, "out_dir")
        raise UserError(f"{out_dir}/train already holds other shards; pass {overwrite} to replace "
                        f"it with Fashion-MNIST, or choose another {out}")
    monkeypatch.setattr(sources, "write_fashion_mnist_shards", refuse)
    shards = tmp_path / "data" / "fashion-mnist-5k"
    argv = ["demo", "--fast", "--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs")]
    line = one_line_error(capsys, argv)
    assert line == (f"lit-softmoe demo: error: {shards}/train already holds other shards; pass --overwrite to replace "
                    f"it with Fashion-MNIST, or choose another --out (the demo ran this step as `lit-softmoe data "
                    f"fashion-mnist --out {shards} --limit 5000`; or give the demo another --data or --runs)")


def test_demo_says_why_the_promised_clip_benchmark_cross_check_did_not_run():
    # The eval headline says "(cross-checked with CLIP_benchmark)"; a failed peer run printed nothing.
    from lit_softmoe import demo
    assert demo._peer_line({"status": "failed", "reason": "RuntimeError: boom"}) == \
        "CLIP_benchmark cross-check failed: RuntimeError: boom"
    assert demo._peer_line({"status": "ok", "metrics": {"top1": 0.8849}, "max_abs_diff_points": 0.01,
                            "seconds": 12.4}) == ("CLIP_benchmark on the same model and files: top-1 88.49 "
                                                  "(largest gap 0.010 points; its run took 12 s)")
    assert demo._peer_line({"status": "ok", "metrics": {"top1": 0.8849}, "max_abs_diff_points": 0.01,
                            "seconds": 12.4, "cache": "hit"}) == (
        "CLIP_benchmark on the same model and files: top-1 88.49 (largest gap 0.010 points; recorded by its run of "
        "12 s on the unchanged model and files)")


# ---- the demo's results table ------------------------------------------------------------------

def _table(shots=10, tower=None, lit=None, entry=None) -> dict:
    from lit_softmoe.demo import results_rows
    tower = {"params": 1_234_567, "test_top1": 0.81234, "fewshot10_top1": 0.65432} if tower is None else tower
    lit = {"linear_probe_top1": 0.85, "zeroshot_top1": 0.7} if lit is None else lit
    entry = {"status": "ok", "metrics": {"top1": 0.7512, "top5": 0.98765}} if entry is None else entry
    rows = results_rows("soft-tiny-p4", shots, tower, lit, entry, TIMINGS)
    assert len(rows) == len(dict(rows))  # one row per line of the table
    return dict(rows)


def test_demo_table_with_every_number():
    table = _table()
    assert table["image tower"] == "soft-tiny-p4 (1.23M params)"
    assert (table["tower test top-1 (classifier head)"], table["tower 10-shot linear probe"]) == ("0.8123", "0.6543")
    assert table["tower linear probe, all train images"] == "0.8500"
    assert (table["LiT zero-shot top-1 (unseen prompts)"], table["LiT zero-shot top-5"]) == ("0.7512", "0.9877")
    assert (table["time: pretrain"], table["time: total"]) == ("30 s", "32 s")


def test_demo_table_says_which_probe_was_skipped_and_why():
    tower = {"params": 1_000_000, "test_top1": 0.5,
             "fewshot_skipped": "the 10-shot linear probe is skipped: class 3 (dress) has 4 training images; "
                                "lower fewshot_shots (0 turns the probe off)"}
    lit = {"probe_skipped": "the linear probe is skipped: eval.probe_train p holds 1 sample(s), "
                            "and it needs at least 2"}
    table = _table(tower=tower, lit=lit)
    assert table["tower 10-shot linear probe"] == \
        "skipped: class 3 (dress) has 4 training images; lower fewshot_shots (0 turns the probe off)"
    assert table["tower linear probe, all train images"] == \
        "skipped: eval.probe_train p holds 1 sample(s), and it needs at least 2"
    assert table["LiT zero-shot top-1 (unseen prompts)"] == "0.7512"
    off = _table(shots=0, tower={"params": 1_000_000, "test_top1": 0.5}, lit={})
    assert off["tower 0-shot linear probe"] == "off (fewshot_shots is 0)"
    assert off["tower linear probe, all train images"] == "not run (eval.probe_train is not set)"


@pytest.mark.parametrize("status, reason", [
    ("failed", "fashion-mnist: labels run from 0 to 11 but there are 10 class names; check classnames for d"),
    ("skipped", "fashion-mnist data folder not found at d; write it with `lit-softmoe data fashion-mnist --out d`"),
])
def test_demo_table_says_an_eval_that_did_not_run(status, reason):
    entry = {"benchmark": "fashion-mnist", "task": "classification", "status": status, "reason": reason, "path": "d"}
    table = _table(entry=entry)
    assert table["LiT zero-shot top-1 (unseen prompts)"] == table["LiT zero-shot top-5"] == f"{status}: {reason}"
    assert table["tower 10-shot linear probe"] == "0.6543"  # the numbers that exist are still shown
    two = _table(entry={"status": "ok", "metrics": {"top1": 0.5}})  # under 5 classes there is no top-5
    assert two["LiT zero-shot top-5"].startswith("not measured")
    assert two["LiT zero-shot top-1 (unseen prompts)"] == "0.5000"
