"""lit_softmoe.export.model_card: the model card shows the newest zero-shot table of the model exported."""
from __future__ import annotations

import json
import time

import pytest

from lit_runs import make_run
from lit_softmoe.export import export_pair


def test_model_card_shows_the_newest_eval_json(tmp_path):
    run = make_run(tmp_path)
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
    run = make_run(tmp_path)
    (run / "eval").mkdir()
    (run / "eval" / "s.json").write_text(json.dumps({"model": str(run), "suite": "lit-paper", "results": [
        {"benchmark": "imagenet1k", "task": "classification", "status": "skipped",
         "reason": "imagenet1k data folder not found at data/imagenet1k", "path": "data/imagenet1k"}]}))
    card = (export_pair(run, tmp_path / "out") / "README.md").read_text()
    rows = [line for line in card.splitlines() if line.startswith("|")]
    assert rows[:2] == ["| benchmark | task | samples | status |", "|---|---|---|---|"]
    assert rows[2] == ("| imagenet1k | classification |  | "
                       "skipped: imagenet1k data folder not found at data/imagenet1k |")


def test_model_card_names_the_moe_kind():
    from lit_softmoe.export.model_card import _tower_line
    from lit_softmoe.models.registry import image_tower_config
    line = lambda name: _tower_line(image_tower_config(name).to_dict(), 1e6, name)  # noqa: E731
    assert "Soft MoE, 4 experts × 1 slot(s) in blocks 1" in line("soft-test-4e")
    assert "Tokens Choice (top-2), 4 experts in blocks 1" in line("tc-test-4e-k2")
    assert "Experts Choice, 4 experts in blocks 1" in line("ec-test-4e")
    assert ", dense;" in line("vit-test")


def test_checkpoint_export_reports_its_own_step_and_evaluation(tmp_path):
    import json
    import shutil

    from lit_softmoe.export import export_pair
    from lit_softmoe.model_folders import load_step_tensors, save_step_tensors
    run = make_run(tmp_path)  # finished at step 10; results.json and model/ are the final model's
    early = run / "checkpoints" / "step_00000005"
    shutil.copytree(run / "checkpoints" / "step_00000010", early)
    meta = json.loads((early / "state.json").read_text())
    (early / "state.json").write_text(json.dumps({**meta, "step": 5, "train_seconds": 1.04}))
    # The tensors file records its step too (a copy of step 10's would be a damaged checkpoint).
    tensors = load_step_tensors(early / "state.safetensors", meta)
    save_step_tensors(tensors, early / "state.safetensors", {**meta, "step": 5})
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


def test_model_card_opens_with_the_hubs_front_matter(tmp_path):
    import re
    from pathlib import Path

    import yaml

    from lit_softmoe.export.model_card import read_front_matter
    run = make_run(tmp_path)
    card = (export_pair(run, tmp_path / "pair") / "README.md").read_text()
    assert card.startswith("---\n")
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    license = re.search(r'^license = "(.+)"$', pyproject, re.MULTILINE).group(1)  # tomllib: Python 3.11+
    assert meta == {"library_name": "lit-softmoe", "license": license.lower(),
                    "pipeline_tag": "zero-shot-image-classification",
                    "tags": ["lit-softmoe", "vision", "lit", "image-text", "soft-moe", "safetensors", "open_clip"]}
    assert read_front_matter(card) == meta
    # The body is the card as before: title first, nothing of the front matter repeated.
    assert body.startswith("# LiT image–text pair exported by lit-softmoe ") and "---" not in body.split("\n")
    assert "## Towers" in body and "## Zero-shot" in body and "## Use" in body
    assert f'open_clip.create_model_and_transforms("local-dir:{tmp_path / "pair"}")' in body

    # Training data the Hub knows (the demo's Fashion-MNIST) is listed; local shard paths are not.
    config = run.parent / "pre" / "config.yaml"
    config.write_text(config.read_text().replace("data/fm/", "data/fashion-mnist/"))
    meta = read_front_matter((export_pair(run, tmp_path / "fmnist") / "README.md").read_text())
    assert meta["datasets"] == ["zalando-datasets/fashion_mnist"]
    # An image tower alone: features, not zero-shot classes.
    meta = read_front_matter((export_pair(run.parent / "pre", tmp_path / "image") / "README.md").read_text())
    assert meta["pipeline_tag"] == "image-feature-extraction" and "lit" not in meta["tags"]
    assert meta["datasets"] == ["zalando-datasets/fashion_mnist"]
    assert read_front_matter("# a card without front matter\n") is None
    with pytest.raises(ValueError, match=r"^its front matter is not YAML \("):
        read_front_matter("---\nlibrary_name: [\n---\n# a card\n")


def _front_and_body(card: str):
    from huggingface_hub import ModelCard
    parsed = ModelCard(card)
    return parsed.data, parsed.text


def test_the_hub_card_holds_no_local_path_and_the_results_as_model_index(tmp_path):
    """What `push` uploads as README.md, rendered from the export alone: snippets on hf-hub:, no path of the
    machine it was made on (data, eval reports, the export), the zero-shot table as a valid model-index."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from lit_softmoe.export.push import push_export
    run = make_run(tmp_path)
    (run / "eval").mkdir()
    (run / "eval" / "fmnist.json").write_text(json.dumps({"model": str(run), "suite": "fmnist", "results": [
        {"benchmark": "fashion-mnist", "task": "zeroshot_classification",
         "metrics": {"acc1": 0.8765, "acc5": 0.9912}, "num_samples": 10000, "status": "ok"},
        {"benchmark": "cifar10", "task": "zeroshot_classification", "metrics": {}, "num_samples": 0,
         "status": "skipped", "reason": f"data not found at {tmp_path}/cifar10"}]}))
    export = export_pair(run, tmp_path / "export")
    local = (export / "README.md").read_text()
    assert f'load_pretrained("{export}")' in local and "data/feats/train" in local  # the local card: its folder
    card = push_export(export, "org/soft-lit", dry_run=True)["card"]
    assert str(tmp_path) not in card and "data/feats" not in card and "/tmp" not in card
    assert 'load_pretrained("hf-hub:org/soft-lit")' in card
    assert "lit-softmoe==0.1.0" in card and "## Intended use and limits" in card
    assert "- LiT data: a local dataset (cached image features), eval a local dataset" in card
    data, _ = _front_and_body(card)
    assert data.library_name == "lit-softmoe" and data.pipeline_tag == "zero-shot-image-classification"
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in data.eval_results}
    assert results == {("fashion-mnist", "acc1"): 87.65, ("fashion-mnist", "acc5"): 99.12}  # the skipped one: none
    name, again = model_index_to_eval_results(data.to_dict()["model-index"])
    assert name == "org/soft-lit" and len(again) == 2
    # Without an eval report, the run's own results (results.json) are the model-index.
    export = export_pair(make_run(tmp_path / "plain"), tmp_path / "plain-export")
    data, _ = _front_and_body(push_export(export, "org/x", dry_run=True)["card"])
    assert {(r.metric_type, r.metric_value) for r in data.eval_results} >= {("zeroshot_top1", 43.21)}


@pytest.mark.parametrize("source, expected", [
    ("timm:hf-hub:timm/vit_base_patch16_224.augreg_in21k", "timm/vit_base_patch16_224.augreg_in21k"),
    ("timm:vit_base_patch16_224.augreg_in21k", "timm/vit_base_patch16_224.augreg_in21k"),
    ("timm:vit_base_patch16_224", None),  # timm's default tag: not a Hub id we can name
    ("timm:test_vit?file=/data/vit.safetensors", None),  # a local checkpoint
    (None, None),  # our own tower
])
def test_base_model_names_the_timm_checkpoint_on_the_hub(source, expected):
    from lit_softmoe.export.model_card import base_model
    assert base_model({"source": source} if source else {}) == expected


def test_the_card_says_how_much_of_the_text_tower_trained(tmp_path):
    from lit_softmoe.export.model_card import render_body
    config = json.loads((export_pair(make_run(tmp_path), tmp_path / "export") / "config.json").read_text())
    assert "- Text (trained): open_clip text transformer" in render_body(config, config["card"], "x")
    config["text"].update(locked=True, unlocked_layers=0)
    assert "- Text (locked): open_clip text transformer" in render_body(config, config["card"], "x")
    config["text"].update(unlocked_layers=1)
    assert "- Text (locked but its last 1 layer(s), trained):" in render_body(config, config["card"], "x")
