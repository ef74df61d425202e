"""lit_softmoe.export.push / `lit-softmoe push`: a complete export goes to the Hub through HfApi (recorded
here, never sent); a dry run lists it without the network; an incomplete one is refused in one line."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_errors import one_error_line
from hf_models import tiny_bert
from lit_runs import make_hf_run
from lit_softmoe import cli
from lit_softmoe.errors import UserError
from lit_softmoe.export import export_pair
from lit_softmoe.export.model_card import hub_card
from lit_softmoe.hub import load_pretrained
from lit_softmoe.model_folders import export_config_sha256

FILES = ["README.md", "config.json", "image_tower_extra.safetensors", "open_clip_config.json",
         "open_clip_model.safetensors", "tokenizer.json", "tokenizer/bpe_simple_vocab_16e6.txt.gz"]


@pytest.fixture(scope="module")
def export(run, tmp_path_factory):
    return export_pair(run, tmp_path_factory.mktemp("push") / "export")


class _RecordingHfApi:
    """HfApi's three calls that push makes, recorded."""
    calls: list = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def create_commit(self, **kwargs):
        self.calls.append(("create_commit", kwargs["repo_id"], kwargs))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"})()


def _push(capsys, *args) -> tuple[int, str]:
    code = cli.main(["push", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return code, captured.out


@pytest.fixture
def hf_api(monkeypatch):
    import huggingface_hub
    _RecordingHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", _RecordingHfApi)
    return _RecordingHfApi


def test_dry_run_lists_the_files_and_the_front_matter(export, hf_api, capsys):
    _, out = _push(capsys, export, "org/name", "--dry-run")
    lines = out.splitlines()
    assert lines[0] == f"dry run: 7 files of {export} would go to org/name:"
    assert [line.strip() for line in lines[1:8]] == FILES
    assert "library_name: lit-softmoe" in lines[8] and "pipeline_tag: zero-shot-image-classification" in lines[8]
    assert hf_api.calls == []  # nothing sent


def test_push_creates_the_repo_and_uploads_the_export(export, hf_api, capsys):
    _, out = _push(capsys, export, "org/name", "--private", "--revision", "v1")
    assert out.strip() == (f"7 files of {export} pushed to org/name (revision v1): "
                           "https://huggingface.co/org/name/commit/abc")
    (create, _, create_kwargs), (branch, _, branch_kwargs), (upload, repo_id, upload_kwargs) = hf_api.calls
    assert (create, branch, upload, repo_id) == ("create_repo", "create_branch", "create_commit", "org/name")
    assert create_kwargs == {"repo_type": "model", "private": True, "exist_ok": True}
    assert branch_kwargs == {"branch": "v1", "repo_type": "model", "exist_ok": True}
    assert upload_kwargs["revision"] == "v1" and upload_kwargs["repo_type"] == "model"
    operations = upload_kwargs["operations"]
    assert [op.path_in_repo for op in operations] == FILES  # one commit: every file
    config = json.loads((export / "config.json").read_text())
    card = hub_card(config, "org/name")
    for op in operations:  # the export's own files, but README.md (the Hub's card) and config.json (no local path)
        if op.path_in_repo == "README.md":
            assert op.path_or_fileobj == card.encode()
        elif op.path_in_repo == "config.json":
            uploaded = json.loads(op.path_or_fileobj)
            run_path = config["source"]["path"]  # where the run was, on this machine
            assert Path(run_path).is_absolute() and run_path not in json.dumps(uploaded)
            assert "/tmp" not in json.dumps(uploaded) and uploaded["source"]["path"] == Path(run_path).name
            assert uploaded["files_sha256"]["README.md"] == hashlib.sha256(card.encode()).hexdigest()
            changed = ("source", "card", "files_sha256", "config_sha256")
            assert {k: v for k, v in uploaded.items() if k not in changed} == \
                {k: v for k, v in config.items() if k not in changed}
            assert uploaded["config_sha256"] == export_config_sha256(uploaded)  # it verifies itself once downloaded
            assert hub_card(uploaded, "org/name") == card  # the Hub's copy renders the same card
        else:
            assert op.path_or_fileobj == str(export / op.path_in_repo)
    hf_api.calls.clear()
    _push(capsys, export, "org/name")  # no --revision: main, no branch made
    assert [call[0] for call in hf_api.calls] == ["create_repo", "create_commit"]
    assert hf_api.calls[1][2]["revision"] is None


def test_an_incomplete_or_edited_export_is_refused_in_one_line(export, tmp_path, capsys, hf_api):
    import json

    from safetensors.torch import load_file, save_file

    from lit_softmoe.utils.hashing import file_sha256
    missing, edited, truncated = tmp_path / "missing", tmp_path / "edited", tmp_path / "truncated"
    shutil.copytree(export, missing)
    shutil.rmtree(missing / "tokenizer")
    line = one_error_line(capsys, cli.main(["push", str(missing), "org/name", "--dry-run"]))
    assert f"{missing} is incomplete (no tokenizer); export it again" in line, line
    (missing / "open_clip_model.safetensors").unlink()  # the weights config.json names are needed too
    line = one_error_line(capsys, cli.main(["push", str(missing), "org/name", "--dry-run"]))
    assert f"{missing} is incomplete (no open_clip_model.safetensors, tokenizer); export it again" in line, line
    shutil.copytree(export, truncated)
    with open(truncated / "open_clip_model.safetensors", "r+b") as file:
        file.truncate(1000)
    line = one_error_line(capsys, cli.main(["push", str(truncated), "org/name"]))
    assert "open_clip_model.safetensors" in line and "incomplete or damaged" in line, line
    shutil.copy(export / "open_clip_model.safetensors", truncated / "open_clip_model.safetensors")
    (truncated / "image_tower_extra.safetensors").write_bytes(b"")  # the rest of the weights too
    line = one_error_line(capsys, cli.main(["push", str(truncated), "org/name"]))
    assert "image_tower_extra.safetensors" in line and "incomplete or damaged" in line, line
    shutil.copytree(export, edited)
    state = load_file(edited / "open_clip_model.safetensors")
    state["visual.trunk.norm.weight"] += 1
    save_file(state, edited / "open_clip_model.safetensors")
    line = one_error_line(capsys, cli.main(["push", str(edited), "org/name"]))
    assert "open_clip_model.safetensors is not the file the export wrote" in line, line
    config = json.loads((edited / "config.json").read_text())  # its sha256 recorded anew: still not the tower
    config["files_sha256"]["open_clip_model.safetensors"] = file_sha256(edited / "open_clip_model.safetensors")
    config["config_sha256"] = export_config_sha256(config)  # and config.json's own
    (edited / "config.json").write_text(json.dumps(config))
    line = one_error_line(capsys, cli.main(["push", str(edited), "org/name"]))
    assert line.endswith(f"the image tower in {edited / 'image_tower_extra.safetensors'}, "
                         f"{edited / 'open_clip_model.safetensors'} is not the one config.json's image_tower_sha256 "
                         "names (the weights were changed after the export); export it again"), line
    line = one_error_line(capsys, cli.main(["push", str(tmp_path), "org/name"]))
    assert "is not a model folder" in line, line
    assert hf_api.calls == []


def test_an_export_without_its_card_front_matter_or_files_sha256_is_refused_in_one_line(export, tmp_path, capsys,
                                                                                         hf_api):
    """The Hub indexes a model by its card's front matter, and push verifies every file against config.json's
    files_sha256: an export without either is refused, not pushed half-described."""
    import hashlib
    import json
    bare, broken, unverified = tmp_path / "bare", tmp_path / "broken", tmp_path / "unverified"
    for folder in (bare, broken, unverified):
        shutil.copytree(export, folder)

    def edit_card(folder, text):  # and record it, as the refusal of an edited card says to
        (folder / "README.md").write_text(text)
        config = json.loads((folder / "config.json").read_text())
        config["files_sha256"]["README.md"] = hashlib.sha256(text.encode()).hexdigest()
        (folder / "config.json").write_text(json.dumps(config))
    card = (export / "README.md").read_text()
    edit_card(bare, card.split("---\n", 2)[2])
    line = one_error_line(capsys, cli.main(["push", str(bare), "org/name", "--dry-run"]))
    assert line.endswith(f"{bare / 'README.md'} has no front matter (the `---`-fenced YAML the Hub indexes a model "
                         "by); export the run again, or put it back at the top of the card"), line
    edit_card(broken, card.replace("library_name:", "library_name: [", 1))
    line = one_error_line(capsys, cli.main(["push", str(broken), "org/name", "--dry-run"]))
    assert f"{broken / 'README.md'}: its front matter is not YAML (" in line and line.endswith(
        "); fix it, or export the run again"), line
    config = json.loads((unverified / "config.json").read_text())
    del config["files_sha256"], config["config_sha256"]  # as another version wrote it
    (unverified / "config.json").write_text(json.dumps(config))
    line = one_error_line(capsys, cli.main(["push", str(unverified), "org/name"]))
    assert line.endswith(f"{unverified / 'config.json'} has no files_sha256 (the sha256 of each file), so its files "
                         "cannot be verified; export it again with this version"), line
    assert hf_api.calls == []


def test_no_token_and_no_network_are_one_line(export, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import LocalTokenNotFoundError

    class Failing(_RecordingHfApi):
        error: Exception

        def create_repo(self, repo_id, **kwargs):
            raise self.error
    monkeypatch.setattr(huggingface_hub, "HfApi", Failing)
    Failing.error = LocalTokenNotFoundError("Token is required")
    line = one_error_line(capsys, cli.main(["push", str(export), "org/name"]))
    assert "no Hugging Face token to push org/name" in line and "hf auth login" in line and "HF_TOKEN" in line
    Failing.error = ConnectionError("connection refused")
    line = one_error_line(capsys, cli.main(["push", str(export), "org/name"]))
    assert "could not reach the Hugging Face Hub to push org/name (ConnectionError)" in line, line


@pytest.mark.parametrize("name", [file for file in FILES if file != "config.json"])
def test_a_flipped_bit_in_any_file_is_refused_by_a_dry_run(export, tmp_path, capsys, hf_api, name):
    """Every file of the export has its sha256 in config.json (files_sha256): a bit flipped in any of them (the
    weights still load, the tokenizer still reads, the card still parses) is refused before anything goes up."""
    import json

    from lit_softmoe.export.push import check_export
    from lit_softmoe.utils.hashing import file_sha256
    flipped = tmp_path / "flipped"
    shutil.copytree(export, flipped)
    data = bytearray((flipped / name).read_bytes())
    data[-5] ^= 0x01  # inside the last tensor of a weights file: it still loads
    (flipped / name).write_bytes(bytes(data))
    line = one_error_line(capsys, cli.main(["push", str(flipped), "org/name", "--dry-run"]))
    assert line.startswith(f"lit-softmoe push: error: {flipped / name} is not the file the export wrote (its sha256 "
                           "differs from config.json's): it was changed or damaged since; export it again"), line
    card = " (or, if you edited the card on purpose, put its new sha256, `sha256sum README.md`, in config.json's "
    assert line.endswith(card + "files_sha256)" if name == "README.md" else "export it again"), line
    assert hf_api.calls == []
    recorded = json.loads((export / "config.json").read_text())["files_sha256"]
    assert recorded == {file: file_sha256(export / file) for file in FILES if file != "config.json"}
    assert len(check_export(export)) == len(FILES)  # the export itself verifies


@pytest.mark.parametrize("where", ["a file's recorded sha256", "a setting"])
def test_a_changed_byte_in_config_json_is_refused_naming_it(export, tmp_path, capsys, hf_api, where):
    """A byte changed in config.json where it still parses: in the tokenizer's sha256, push blamed the tokenizer
    file; in a setting, the export was pushed, and loaded, as another model than the one exported."""
    flipped = tmp_path / "flipped"
    shutil.copytree(export, flipped)
    text = (flipped / "config.json").read_text()
    config = json.loads(text)
    if where == "a setting":
        old = '"pooling": "mean"'
        assert text.count(old) == 1
        text = text.replace(old, '"pooling": "last"')
    else:
        sha = config["files_sha256"]["tokenizer.json"]
        text = text.replace(sha, sha[:10] + ("0" if sha[10] != "0" else "1") + sha[11:])
    (flipped / "config.json").write_text(text)
    expected = (f"{flipped / 'config.json'} is not the file the export wrote (its contents do not give the "
                "config_sha256 it records): it was changed or damaged since; copy or download the export again, or "
                "export the run again")
    line = one_error_line(capsys, cli.main(["push", str(flipped), "org/name", "--dry-run"]))
    assert line == f"lit-softmoe push: error: {expected}"
    line = one_error_line(capsys, cli.main(["eval", "--model", str(flipped), "--suite", "fashion-mnist",
                                            "--out", str(tmp_path / "r.json")]))
    assert line == f"lit-softmoe eval: error: {expected}"
    with pytest.raises(UserError, match="its contents do not give the config_sha256 it records"):
        load_pretrained(flipped)
    assert hf_api.calls == []
    # What goes up verifies too: the Hub's config.json (source paths by name, the Hub's card) records its own sha.
    from lit_softmoe.export.push import hub_config
    uploaded = json.loads(hub_config(json.loads((export / "config.json").read_text()), "a card\n"))
    assert uploaded["config_sha256"] == export_config_sha256(uploaded) != config["config_sha256"]


def test_a_file_added_to_the_export_is_refused_naming_it(export, tmp_path, capsys, hf_api):
    added = tmp_path / "added"
    shutil.copytree(export, added)
    (added / "tokenizer" / "notes.txt").write_text("not from the export")
    line = one_error_line(capsys, cli.main(["push", str(added), "org/name", "--dry-run"]))
    assert line.endswith(f"{added / 'tokenizer' / 'notes.txt'} is not among the files config.json records (added "
                         "after the export); remove it, or export again"), line
    assert hf_api.calls == []


@pytest.mark.parametrize("repo_id", ["org/name/extra", "org//name", "org/na me", "org/name.git", "a" * 97])
def test_an_invalid_repo_id_is_one_line_before_any_work(export, tmp_path, capsys, hf_api, repo_id):
    """A dry run accepted `org/name/extra` and the like; the real push failed on it only at the Hub."""
    for folder, dry_run in ((tmp_path / "no-export", ["--dry-run"]), (export, ["--dry-run"]), (export, [])):
        line = one_error_line(capsys, cli.main(["push", str(folder), repo_id, *dry_run]))
        assert line.startswith(f"lit-softmoe push: error: {repo_id!r} is not a Hub repository name (")
        assert line.endswith("); write ORG/NAME, e.g. my-org/soft-s16-lit")
    assert hf_api.calls == []


def test_a_hugging_face_text_model_from_a_local_folder_goes_up_by_its_name(tmp_path, hf_api, capsys, monkeypatch):
    """The export carries the encoder's config and tokenizer, so the folder it was read from on this machine is
    named, not given as a path: config.json's text.path and tokenizer specs as the Hub card shows it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bert = tiny_bert(tmp_path / "bert", torch.float32)
    export = export_pair(make_hf_run(tmp_path, bert, "text.context_length=16"), tmp_path / "export")
    config = json.loads((export / "config.json").read_text())
    assert config["text"]["path"] == str(bert) and config["tokenizer"]["spec"] == f"hf:{bert}"  # the local record
    _push(capsys, export, "org/name")
    operations = {op.path_in_repo: op.path_or_fileobj for op in hf_api.calls[-1][2]["operations"]}
    uploaded = json.loads(operations["config.json"])
    assert str(tmp_path) not in operations["config.json"].decode()
    assert (uploaded["text"]["path"], uploaded["tokenizer"]["spec"]) == ("bert", "hf:bert")
    assert "Hugging Face encoder bert (" in operations["README.md"].decode()
    assert hub_card(uploaded, "org/name").encode() == operations["README.md"]  # the Hub's copy renders the same card
    loaded, _, tokenizer = load_pretrained(export)  # the export itself loads as before, from its own files
    assert loaded.text_tower.cfg.kind == "hf"
