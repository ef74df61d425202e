"""lit_softmoe.models.export_weights: an export stores each tensor once, open_clip's weights file being the
weights file when open_clip can load the pair; our loader reads either layout, and the older format 2 (which
held the weights twice) still loads."""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cli_errors import one_error_line
from lit_runs import embed_pair, make_run, pair_inputs
from lit_softmoe import cli
from lit_softmoe.export import export_pair
from lit_softmoe.hub import HF_HUB_PATTERNS, load_image_tower, load_pretrained


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _weights_files(export: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{weights file: its tensors under the names stored}, from the files themselves (not config.json)."""
    files = {}
    for path in sorted(export.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            files[path.name] = {name: file.get_tensor(name) for name in file.keys()}
    return files


def _header_bytes(path: Path) -> int:
    """A safetensors file's 8-byte length + JSON header: what it holds besides the tensors' bytes."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor], int]]:
    """{case: (export, the state the loader gives, bytes the files may hold besides one copy of it)}."""
    root = tmp_path_factory.mktemp("one-copy")
    gray, rgb = make_run(root / "gray"), make_run(root / "rgb", rgb=True, image_head=True)
    cases = {}
    for case, run, kwargs in (("gray", gray, {}), ("rgb-head", rgb, {}), ("no-open-clip", gray, {"open_clip": False}),
                              ("image-only", gray.parent / "pre", {})):
        export = export_pair(run, root / f"export-{case}", **kwargs)
        if case == "image-only":
            tower, _ = load_image_tower(export, precision="fp32")
            state = {f"image_tower.{k}": v for k, v in tower.state_dict().items()}
        else:
            state = load_pretrained(export, precision="fp32")[0].state_dict()
        # A gray tower's patch embedding is in open_clip's file widened to RGB, (d, 3, p, p), a derived tensor.
        derived = 3 * _tensor_bytes(state["image_tower.patch_embed.weight"]) if case == "gray" else 0
        cases[case] = (export, state, derived)
    return cases


@pytest.mark.parametrize("case", ["gray", "rgb-head", "no-open-clip", "image-only"])
def test_an_export_holds_one_copy_of_its_weights(exports, case):
    """The weights files hold the model's tensors once (the files were two copies, ONNX aside): their bytes are
    the state's (+ a gray tower's widened patch embedding) plus the safetensors headers, and no tensor's bytes
    are in two files."""
    export, state, derived = exports[case]
    files = _weights_files(export)
    expected = {"gray": ["image_tower_extra.safetensors", "open_clip_model.safetensors"],
                "rgb-head": ["image_tower_extra.safetensors", "open_clip_model.safetensors"],
                "no-open-clip": ["image_encoder.safetensors", "text_encoder.safetensors"],
                "image-only": ["image_encoder.safetensors"]}[case]
    assert sorted(files) == expected
    assert json.loads((export / "config.json").read_text())["weights"].keys() == set(expected)
    state_bytes = sum(_tensor_bytes(v) for v in state.values())
    stored = {name: sum(_tensor_bytes(v) for v in tensors.values()) for name, tensors in files.items()}
    assert sum(stored.values()) == state_bytes + derived
    on_disk = sum((export / name).stat().st_size for name in files)
    assert on_disk == sum(stored.values()) + sum(_header_bytes(export / name) for name in files)
    tensors = sum(len(t) for t in files.values())
    assert on_disk - sum(stored.values()) < 256 * tensors + 1024  # the headers: a name, shape and offsets a tensor
    # No two files hold the same tensor: every tensor large enough to be unique (random weights, not a
    # LayerNorm's ones) is in exactly one file.
    where: dict[str, list[str]] = {}
    for name, tensors in files.items():
        for tensor in tensors.values():
            if tensor.numel() >= 1024:
                digest = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()
                where.setdefault(digest, []).append(name)
    assert len(where) >= 5 and all(len(names) == 1 for names in where.values()), where


def test_both_layouts_load_as_the_run(exports):
    """The open_clip layout and ours give the same model, bit for bit (load_pretrained maps open_clip's names
    back, and takes the gray tower's own patch embedding, not the widened one)."""
    (gray, gray_state, _), (ours, ours_state, _) = exports["gray"], exports["no-open-clip"]
    assert gray_state.keys() == ours_state.keys()
    assert all(torch.equal(gray_state[k], ours_state[k]) for k in gray_state)
    tower, _ = load_image_tower(gray, precision="fp32")
    reference, _ = load_image_tower(ours, precision="fp32")
    with torch.no_grad():
        assert torch.equal(tower.forward_pooled(pair_inputs()), reference.forward_pooled(pair_inputs()))


def test_the_default_export_writes_no_onnx(run, tmp_path, capsys):
    """ONNX graphs are a copy of the weights in another format: written with --onnx only."""
    assert cli.main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    assert "open_clip_model.safetensors" in capsys.readouterr().out
    assert not list((tmp_path / "export").glob("*.onnx"))


def test_what_hf_hub_fetches_loads(hub_export, tmp_path, monkeypatch):
    """`hf-hub:` downloads HF_HUB_PATTERNS only (snapshot_download's allow_patterns): the weights of either
    layout and the tokenizer, not the ONNX graphs."""
    from huggingface_hub.utils import filter_repo_objects

    from hf_hub_cache import cache_repo, offline_hf_cache
    files = [p.relative_to(hub_export).as_posix() for p in hub_export.rglob("*") if p.is_file()]
    fetched = set(filter_repo_objects(files + ["image_encoder.onnx"], allow_patterns=HF_HUB_PATTERNS))
    assert fetched == set(files) - {"open_clip_config.json"}
    partial = tmp_path / "fetched"
    for name in fetched:
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(hub_export / name, partial / name)
    cache_repo(offline_hf_cache(monkeypatch, tmp_path / "hf"), "org/name", partial)
    model, _, tokenizer = load_pretrained("hf-hub:org/name")
    reference, _, _ = load_pretrained(hub_export)
    for got, want in zip(embed_pair(model, tokenizer), embed_pair(reference, tokenizer), strict=True):
        assert torch.equal(got, want)


def test_a_format_2_export_still_loads_and_push_asks_for_a_new_one(run, tmp_path, capsys):
    """Format 2 held the weights twice (our files + open_clip's copy) and hashed only its weights files: the
    loaders read its own files; push refuses it in one line naming the fix."""
    new, ours = export_pair(run, tmp_path / "new"), export_pair(run, tmp_path / "ours", open_clip=False)
    old = tmp_path / "format-2"
    shutil.copytree(ours, old)
    for name in ("open_clip_config.json", "open_clip_model.safetensors"):
        shutil.copy(new / name, old / name)
    config = json.loads((ours / "config.json").read_text())
    config.update(format=2, open_clip=json.loads((new / "config.json").read_text())["open_clip"])
    del config["weights"], config["files_sha256"], config["config_sha256"]
    (old / "config.json").write_text(json.dumps(config))
    reference, _, tokenizer = load_pretrained(run)
    model, _, _ = load_pretrained(old)
    for got, want in zip(embed_pair(model, tokenizer), embed_pair(reference, tokenizer), strict=True):
        assert torch.equal(got, want)
    tower, _ = load_image_tower(old, precision="fp32")
    assert all(torch.equal(v, reference.image_tower.state_dict()[k]) for k, v in tower.state_dict().items())
    line = one_error_line(capsys, cli.main(["push", str(old), "org/name", "--dry-run"]))
    assert line.endswith(f"{old} has export format 2 (its weights twice, its files not all hashed), which push "
                         "does not take; export the run again with this version"), line
