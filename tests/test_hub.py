"""lit_softmoe.hub: load_pretrained / load_image_tower: preprocessing for the tower, and a tower or export that is
not the one the run was trained against, or is damaged, is one UserError."""
from __future__ import annotations

import re

import numpy as np
import PIL.Image
import pytest
import torch

import lit_softmoe
from cli_errors import one_error_line
from lit_runs import make_run
from lit_softmoe import cli
from lit_softmoe.hub import load_pretrained


def test_preprocess_converts_rgb_to_the_towers_gray(run):
    _, preprocess, _ = load_pretrained(run)
    rgb = PIL.Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
    assert preprocess(rgb).shape == (1, 28, 28) and preprocess(rgb).dtype == torch.float32


def test_a_tower_rewritten_since_training_is_refused(tmp_path, capsys):
    import json

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = make_run(tmp_path)
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same width (the pair still builds), other architecture: a dense tower saved over the Soft MoE one.
    save_tower(tower_dir, create_image_tower("vit-test", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against" in line and "moe_layers" in line, line
    with pytest.raises(UserError, match="not the one the run was trained against"):
        load_pretrained(run)
    # Other preprocessing is refused too.
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={**{k: v for k, v in meta.items() if k != "tower"},
                      "preprocess": {"image_size": 28, "mean": [0.5], "std": [0.5]}})
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "differs in preprocess" in line, line
    assert not (tmp_path / "out").exists()


def test_a_retrained_tower_of_the_same_architecture_is_refused(tmp_path, capsys):
    import json

    import torch

    from lit_softmoe import load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.registry import create_image_tower
    from lit_softmoe.models.tower_folder import save_tower
    run = make_run(tmp_path)
    assert json.loads((run / "model" / "config.json").read_text())["image_tower_sha256"]
    load_pretrained(run)  # the tower the run recorded: accepted
    tower_dir = tmp_path / "pre" / "tower"
    meta = json.loads((tower_dir / "config.json").read_text())
    # Same tower name, config and preprocessing, other weights: only the recorded sha256 can tell.
    torch.manual_seed(1)
    save_tower(tower_dir, create_image_tower("soft-test-4e", num_classes=3),
               extra={k: v for k, v in meta.items() if k != "tower"})
    line = one_error_line(capsys, cli.main(["export", str(run), "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    with pytest.raises(UserError, match="differs in its weights"):
        load_pretrained(run)
    # A training checkpoint records the tower's sha256 too.
    line = one_error_line(capsys, cli.main(["export", str(run / "checkpoints" / "step_00000010"),
                                             "--out", str(tmp_path / "out")]))
    assert "not the one the run was trained against (it differs in its weights)" in line, line
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_loads_from_its_own_description_without_the_training_config(run, tmp_path):
    """A checkpoint's state.json describes the pair it holds (text tower, loss, image tower), as model/config.json
    does: loading reads no training YAML, so a run folder without its config.yaml still loads."""
    import json
    import shutil

    from lit_runs import CAPTIONS
    from lit_softmoe.errors import UserError
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "config.yaml").unlink()
    checkpoint = copy / "checkpoints" / "step_00000010"
    model, _, tokenizer = load_pretrained(checkpoint)
    reference, _, reference_tokenizer = load_pretrained(run / "checkpoints" / "step_00000010")
    assert torch.equal(tokenizer(CAPTIONS), reference_tokenizer(CAPTIONS))
    ids = tokenizer(CAPTIONS)
    with torch.no_grad():
        assert torch.equal(model.encode_text(ids), reference.encode_text(ids))
    assert model.pretrained_info["image_tower_sha256"] == reference.pretrained_info["image_tower_sha256"]

    state = json.loads((checkpoint / "state.json").read_text())
    del state["model"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"step_00000010 is not a model folder lit-softmoe knows"):
        load_pretrained(checkpoint)  # a pretraining checkpoint, or another program's


def test_an_export_copied_in_part_is_one_line(run, tmp_path):
    import shutil

    from lit_softmoe import load_image_tower, load_pretrained
    from lit_softmoe.errors import UserError
    from lit_softmoe.export import export_pair
    out = export_pair(run, tmp_path / "export")
    missing, truncated = tmp_path / "missing", tmp_path / "truncated"
    shutil.copytree(out, missing)
    (missing / "image_tower_extra.safetensors").unlink()
    shutil.copytree(out, truncated)
    with open(truncated / "open_clip_model.safetensors", "r+b") as file:
        file.truncate(1000)
    for load in (load_pretrained, load_image_tower):
        with pytest.raises(UserError, match="image_tower_extra.safetensors .*incomplete or damaged"):
            load(missing)
        with pytest.raises(UserError, match="open_clip_model.safetensors .*incomplete or damaged"):
            load(truncated)


# ---- hf-hub: an export on the Hugging Face Hub, read from an offline cache (hub_export: conftest.py) ----

def test_hf_hub_spec_loads_the_cached_export_as_its_folder(hub_export, tmp_path, monkeypatch):
    from hf_hub_cache import cache_repo, offline_hf_cache
    from lit_runs import embed_pair, pair_inputs
    from lit_softmoe.hub import load_image_tower, resolve_model_path
    cache = offline_hf_cache(monkeypatch, tmp_path / "hf")
    snapshot = cache_repo(cache, "org/name", hub_export)
    cache_repo(cache, "org/name", hub_export, revision="v1")
    assert resolve_model_path("hf-hub:org/name") == snapshot
    assert resolve_model_path(hub_export) == hub_export  # a path stays a path

    reference, _, tokenizer = load_pretrained(hub_export)
    image, text = embed_pair(reference, tokenizer)
    for spec in ("hf-hub:org/name", "hf-hub:org/name@v1"):
        model, preprocess, tok = load_pretrained(spec)
        got_image, got_text = embed_pair(model, tok)
        assert torch.equal(got_image, image) and torch.equal(got_text, text), spec
        assert model.pretrained_info["source"] == spec and model.pretrained_info["kind"] == "export"
    tower, _ = load_image_tower("hf-hub:org/name")
    reference_tower, _ = load_image_tower(hub_export)
    with torch.no_grad():
        assert torch.equal(tower.forward_pooled(pair_inputs()), reference_tower.forward_pooled(pair_inputs()))


def test_hf_hub_spec_not_in_the_offline_cache_is_one_line(tmp_path, monkeypatch):
    from hf_hub_cache import cache_repo, offline_hf_cache
    from lit_softmoe.errors import UserError
    cache = offline_hf_cache(monkeypatch, tmp_path / "hf")
    with pytest.raises(UserError) as err:
        load_pretrained("hf-hub:org/absent")
    line = str(err.value)
    assert "\n" not in line and "hf-hub:org/absent is not in the Hugging Face cache" in line, line
    assert "HF_HUB_OFFLINE" in line and str(cache) in line
    (tmp_path / "files").mkdir()
    cache_repo(cache, "org/name", tmp_path / "files")  # cached at main only
    with pytest.raises(UserError, match="not in the Hugging Face cache"):
        load_pretrained("hf-hub:org/name@v2")
    for bad in ("hf-hub:a/b/c", "hf-hub:org/name@", "hf-hub:"):
        with pytest.raises(UserError, match="is not a Hub model name; write hf-hub:ORG/NAME"):
            load_pretrained(bad)


# ---- what another version wrote is refused in one line that names what it lacks ------------------

def _rename_key(file, old: str, new: str) -> None:
    """As a writer that named the key so: the file's metadata (its folder's id, a checkpoint's step) kept."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(file, framework="pt") as opened:
        metadata = opened.metadata()
    state = load_file(file)
    state[new] = state.pop(old)
    save_file(state, file, metadata=metadata)


def test_weights_under_another_name_are_refused_naming_the_key(run, hub_export, tmp_path):
    """`logit_scale` is the one name of the log-scale: weights holding it under another are refused, from an
    export, a run's model/ or a checkpoint, before anything loads."""
    import json
    import shutil

    from lit_softmoe.errors import UserError
    from lit_softmoe.model_folders import export_config_sha256
    from lit_softmoe.utils.hashing import file_sha256
    export, other_run = tmp_path / "export", tmp_path / "run"
    shutil.copytree(hub_export, export)
    _rename_key(export / "open_clip_model.safetensors", "logit_scale", "log_scale")
    # As a writer that named the key so would record its file (else the sha256 check refuses it first).
    config = json.loads((export / "config.json").read_text())
    config["files_sha256"]["open_clip_model.safetensors"] = file_sha256(export / "open_clip_model.safetensors")
    config["config_sha256"] = export_config_sha256(config)
    (export / "config.json").write_text(json.dumps(config))
    shutil.copytree(run, other_run)  # its model/config.json names the tower by absolute path: still found
    _rename_key(other_run / "model" / "model.safetensors", "logit_scale", "log_scale")
    checkpoint = other_run / "checkpoints" / "step_00000010"
    _rename_key(checkpoint / "state.safetensors", "model.logit_scale", "model.log_scale")
    for source in (export, other_run, other_run / "model", checkpoint):
        with pytest.raises(UserError, match=r"does not fit the tower: missing 1 keys \(e\.g\. logit_scale\); "
                                            r"unexpected 1 keys \(e\.g\. log_scale\)"):
            load_pretrained(source)


def test_an_export_of_another_format_is_refused_by_every_reader(hub_export, tmp_path):
    import json
    import shutil

    from lit_softmoe.errors import UserError
    from lit_softmoe.export.push import check_export
    for found, fix in ((1, r"which this lit-softmoe does not read \(it reads 2 and 3\); export the run again with "
                           r"this version"), (4, r"newer than this lit-softmoe reads \(3\); upgrade lit-softmoe")):
        export = tmp_path / f"format-{found}"
        shutil.copytree(hub_export, export)
        config = json.loads((export / "config.json").read_text())
        (export / "config.json").write_text(json.dumps({**config, "format": found}))
        for read in (load_pretrained, lit_softmoe.load_image_tower, lit_softmoe.get_tokenizer, check_export):
            with pytest.raises(UserError, match=rf"^{re.escape(str(export))} has export format {found}, {fix}$"):
                read(export)


@pytest.mark.parametrize("key", ["image_tower_sha256", "image_tower_config", "preprocess"])
def test_a_run_whose_description_lacks_a_key_is_refused_naming_it(run, tmp_path, key):
    """model/config.json and a checkpoint's state.json describe the pair; this version writes every key, and
    reads none with a guess (no tower check skipped for want of a recorded sha256)."""
    import json
    import shutil

    from lit_softmoe.errors import UserError
    other = tmp_path / "run"
    shutil.copytree(run, other)
    config = json.loads((other / "model" / "config.json").read_text())
    del config[key]
    (other / "model" / "config.json").write_text(json.dumps(config))
    checkpoint = other / "checkpoints" / "step_00000010"
    state = json.loads((checkpoint / "state.json").read_text())
    del state["model"][key]
    (checkpoint / "state.json").write_text(json.dumps(state))
    fix = r" \(written by another version of lit-softmoe\); train the run again with this version$"
    with pytest.raises(UserError, match=rf"^{re.escape(str(other / 'model' / 'config.json'))} has no {key}{fix}"):
        load_pretrained(other)
    with pytest.raises(UserError, match=rf"^{re.escape(str(checkpoint / 'state.json'))}'s \"model\" has no {key}{fix}"):
        load_pretrained(checkpoint)
    with pytest.raises(UserError, match=rf"has no {key}"):
        lit_softmoe.get_tokenizer(other)


# ---- open_clip's habits: create_model_from_pretrained + get_tokenizer, and its helpers on our model ----

def test_create_model_from_pretrained_and_get_tokenizer_give_load_pretrained(run, hub_export, tmp_path, monkeypatch):
    import lit_softmoe
    from hf_hub_cache import cache_repo, offline_hf_cache
    from lit_runs import CAPTIONS, embed_pair
    cache_repo(offline_hf_cache(monkeypatch, tmp_path / "hf"), "org/name", hub_export)
    checkpoint = run / "checkpoints" / "step_00000010"
    for source in (hub_export, "hf-hub:org/name", run, run / "model", checkpoint):
        reference, reference_preprocess, reference_tokenizer = load_pretrained(source)
        model, preprocess = lit_softmoe.create_model_from_pretrained(source)
        tokenizer = lit_softmoe.get_tokenizer(source)
        assert torch.equal(tokenizer(CAPTIONS), reference_tokenizer(CAPTIONS)), source
        got, expected = embed_pair(model, tokenizer), embed_pair(reference, reference_tokenizer)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), source
        image = PIL.Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
        assert torch.equal(preprocess(image), reference_preprocess(image))
    from lit_softmoe.errors import UserError
    with pytest.raises(UserError, match="without a text tower"):
        lit_softmoe.get_tokenizer(run.parent / "pre" / "tower")


def test_open_clips_zero_shot_classifier_builds_ours_on_our_model(hub_export):
    """open_clip.build_zero_shot_classifier calls `model.encode_text(ids, normalize=True)`: on our model it
    gives the classifier lit_softmoe.evals.classifier builds from the same class names and templates."""
    open_clip = pytest.importorskip("open_clip")
    import lit_softmoe
    from lit_softmoe.evals.classifier import build_zeroshot_classifier
    model, _ = lit_softmoe.create_model_from_pretrained(hub_export)
    tokenizer = lit_softmoe.get_tokenizer(hub_export)
    classnames = ["sneaker", "ankle boot", "trouser", "pullover", "bag"]
    templates = ["a photo of a {c}.", "a blurry photo of the {c}.", "{c}"]  # ours name the class {c}
    theirs = open_clip.build_zero_shot_classifier(model, tokenizer, classnames,
                                                  [lambda c, t=t: t.format(c=c) for t in templates],
                                                  num_classes_per_batch=2)
    ours = build_zeroshot_classifier(model.encode_text, tokenizer, classnames, templates)
    assert theirs.shape == ours.shape == (model.text_tower.embed_dim, len(classnames))
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)


def test_a_run_models_weights_copied_in_from_another_run_are_one_line(tmp_path, capsys):
    """RUN/model's model.safetensors replaced by another run's (one architecture) was loaded, exported and scored
    as this run's model."""
    from lit_softmoe.errors import UserError
    run, other = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    load_pretrained(run)  # as written, it loads
    (run / "model" / "model.safetensors").write_bytes((other / "model" / "model.safetensors").read_bytes())
    says = (f"{run / 'model' / 'model.safetensors'} was not written with the config.json beside it (it carries "
            "another folder_id: a file copied in from another folder); copy the whole folder again, or write it anew")
    with pytest.raises(UserError) as refused:
        load_pretrained(run)
    assert str(refused.value) == says
    capsys.readouterr()
    assert cli.main(["export", str(run), "--out", str(tmp_path / "export")]) == 2
    assert capsys.readouterr().err.strip() == f"lit-softmoe export: error: {says}"
    assert not (tmp_path / "export").exists()
