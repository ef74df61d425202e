"""`lit-softmoe push`: an export folder → a model repository on the Hugging Face Hub, as timm's and
open_clip's `push_to_hf_hub` do it (`HfApi.create_repo(exist_ok=True)`, then `upload_folder`).

Only a complete export goes up, checked before anything is sent (a dry run checks the same): the
repo id valid (huggingface_hub's `validate_repo_id`), the files its kind needs there and its weights
files readable (what the loader would say of a folder copied in part), `image_tower_sha256` still
the key of the image weights in it (caches of its embeddings are keyed by it, so weights edited
after the export would lie under the old key), and every file the sha256 `config.json`'s
`files_sha256` recorded at export time, no file more. `load_pretrained("hf-hub:REPO_ID")` reads it
back (lit_softmoe.hub).

The README.md that goes up is the card written for the Hub at push time (`model_card.hub_card`, from
config.json's "card"): snippets on `hf-hub:REPO_ID`, no local path, the results as `model-index`.
The export's own README.md (snippets on its folder) stays as it is on disk. config.json goes up
without the paths of this machine (`hub_config`), with that card's sha256. Everything goes up in one
commit.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from lit_softmoe.errors import UserError
from lit_softmoe.export.model_card import hub_card, hub_card_facts, hub_text_path, read_front_matter
from lit_softmoe.export.open_clip import OPEN_CLIP_CONFIG
from lit_softmoe.model_folders import (
    CONFIG_SHA256,
    EXPORT_CONFIG,
    EXPORT_FORMAT,
    FILES_SHA256,
    MODEL_CARD,
    TOKENIZER_DIR,
    TOKENIZER_JSON,
    classify_folder,
    export_config_sha256,
    export_weight_files,
    read_export_config,
)
from lit_softmoe.models.export_weights import ExportWeights
from lit_softmoe.models.tokenizers import HF_PREFIX
from lit_softmoe.utils.hashing import file_sha256, weights_sha256

_LOGIN = ("log in with `hf auth login` (or `huggingface-cli login`), or set HF_TOKEN to a token "
          "with write access")


def _front_matter(folder: Path) -> dict:
    """The model card's front matter: what the Hub indexes the model by (library, pipeline, license,
    tags)."""
    try:
        front = read_front_matter((folder / MODEL_CARD).read_text())
    except ValueError as err:
        raise UserError(f"{folder / MODEL_CARD}: {err}; fix it, or export the run again") from None
    if front is None:
        raise UserError(f"{folder / MODEL_CARD} has no front matter (the `---`-fenced YAML the Hub "
                        "indexes a model by); export the run again, or put it back at the top of "
                        "the card")
    return front


def _files(folder: Path) -> list[str]:
    """The files (relative, sorted) in `folder`, hidden ones (`.cache/`, `.git*`) left out."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _check_files_sha256(folder: Path, recorded) -> None:
    """Every file of the export is the one the export wrote (config.json's `files_sha256`), and none
    was added."""
    if not isinstance(recorded, dict):
        raise UserError(f"{folder / EXPORT_CONFIG} has no {FILES_SHA256} (the sha256 of each "
                        "file), so its files cannot be verified; export it again with this "
                        "version")
    for name in sorted(set(_files(folder)) - {EXPORT_CONFIG} | set(recorded)):
        if name not in recorded:
            raise UserError(f"{folder / name} is not among the files {EXPORT_CONFIG} records "
                            "(added after the export); remove it, or export again")
        if not (folder / name).is_file():
            raise UserError(f"{folder} is incomplete (no {name}); export it again")
        if file_sha256(folder / name) != recorded[name]:
            edited = (" (or, if you edited the card on purpose, put its new sha256, "
                      f"`sha256sum {MODEL_CARD}`, in {EXPORT_CONFIG}'s {FILES_SHA256})"
                      if name == MODEL_CARD else "")
            raise UserError(f"{folder / name} is not the file the export wrote (its sha256 differs "
                            f"from {EXPORT_CONFIG}'s): it was changed or damaged since; export it "
                            f"again{edited}")


def hub_config(config: dict, card: str) -> bytes:
    """config.json as it goes up: the source run and tower by folder name, a Hugging Face text model
    read from a folder of this machine by its name (`hub_text_path`; the export carries its config
    and tokenizer), the card's facts as the Hub card shows them (`hub_card_facts`), and the sha256
    of the card that goes up in place of the export's own."""
    hub = copy.deepcopy(config)
    for key in ("path", "tower"):
        if (hub.get("source") or {}).get(key):
            hub["source"][key] = Path(hub["source"][key]).name
    text = hub.get("text") or {}
    if text.get("kind") == "hf" and text.get("path"):
        local, text["path"] = text["path"], hub_text_path(text["path"])
        tokenizer = hub.get("tokenizer") or {}
        if tokenizer.get("spec") == f"{HF_PREFIX}{local}":
            tokenizer["spec"] = f"{HF_PREFIX}{text['path']}"
    if isinstance(hub.get("card"), dict):
        hub["card"] = hub_card_facts(hub["card"])
    hub[FILES_SHA256] = {**hub[FILES_SHA256], MODEL_CARD: hashlib.sha256(card.encode()).hexdigest()}
    if CONFIG_SHA256 in hub:  # changed above: the copy that goes up verifies itself too
        hub[CONFIG_SHA256] = export_config_sha256(hub)
    return (json.dumps(hub, indent=2) + "\n").encode()


def check_export(folder: str | Path) -> list[str]:
    """The files (relative, sorted) of a complete export at `folder`, or one UserError line naming
    what is wrong."""
    folder = Path(folder)
    if classify_folder(folder).kind != "export":
        raise UserError(f"{folder} is not an export; write one with "
                        f"`lit-softmoe export RUN --out {folder}`")
    config = read_export_config(folder)
    if config["format"] != EXPORT_FORMAT:
        raise UserError(f"{folder} has export format {config['format']} (its weights twice, its "
                        "files not all hashed), which push does not take; export the run again "
                        "with this version")
    weight_files = export_weight_files(folder, config)
    needed = [EXPORT_CONFIG, MODEL_CARD, *weight_files]
    if config.get("kind") == "pair":
        needed += [TOKENIZER_JSON, TOKENIZER_DIR]
    if "config" in (config.get("open_clip") or {}):
        needed.append(OPEN_CLIP_CONFIG)
    missing = [name for name in needed if not (folder / name).exists()]
    if missing:
        raise UserError(f"{folder} is incomplete (no {', '.join(missing)}); export it again")
    # Readable weights (a truncated or damaged file: one line naming it), every file the one
    # written, and the weights' identity (utils.hashing.weights_sha256) of the `image_tower.*`
    # tensors as the export computed it (weights edited with their sha256 recorded anew are still
    # not the tower the key names).
    tower = ExportWeights(folder, weight_files, prefix="image_tower.")
    _check_files_sha256(folder, config.get(FILES_SHA256))
    if weights_sha256(tower) != config.get("image_tower_sha256"):
        files = sorted({tower.stored_as(name)[0] for name in tower})
        raise UserError(f"the image tower in {', '.join(str(folder / name) for name in files)} is "
                        f"not the one {EXPORT_CONFIG}'s image_tower_sha256 names (the weights were "
                        "changed after the export); export it again")
    _front_matter(folder)
    return _files(folder)


def push_export(folder: str | Path, repo_id: str, private: bool = False,
                revision: str | None = None, dry_run: bool = False) -> dict:
    """Upload a complete export to the Hub model repository `repo_id` (created if absent).

    Returns {"files", "front_matter", "url" (None on a dry run)}; a dry run checks the export and
    touches no network.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:  # before any work, dry run too
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UserError(f"{repo_id!r} is not a Hub repository name ({' '.join(str(err).split())}); "
                        "write ORG/NAME, e.g. my-org/soft-s16-lit") from None
    folder = Path(folder)
    files = check_export(folder)
    config = read_export_config(folder)
    try:
        card = hub_card(config, repo_id)
    except ValueError as err:
        raise UserError(f"{folder}: {err}; export the run again with this version") from None
    summary = {"files": files, "front_matter": read_front_matter(card), "card": card, "url": None}
    if dry_run:
        return summary
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
    api = HfApi()
    # The export's files as they are, but its README.md (the card written for the Hub) and its
    # config.json (without this machine's paths), in the same commit.
    written = {MODEL_CARD: card.encode(), EXPORT_CONFIG: hub_config(config, card)}
    operations = [CommitOperationAdd(path_in_repo=name,
                                     path_or_fileobj=written.get(name, str(folder / name)))
                  for name in files]
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        commit = api.create_commit(repo_id=repo_id, operations=operations, repo_type="model",
                                   revision=revision,
                                   commit_message=f"Upload lit-softmoe export {folder.name}")
    except LocalTokenNotFoundError:
        raise UserError(f"no Hugging Face token to push {repo_id} with; {_LOGIN}") from None
    except HFValidationError as err:
        raise UserError(f"{repo_id!r} is not a Hub repository name ({err}); "
                        "write ORG/NAME") from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        fix = _LOGIN if status in (401, 403) else "check the repository name and your rights to it"
        raise UserError(f"the Hub refused the push to {repo_id} (HTTP {status}); {fix}") from None
    except OSError as err:
        # the network: no connection, a timeout, a proxy (httpx's errors are OSErrors too)
        raise UserError(f"could not reach the Hugging Face Hub to push {repo_id} "
                        f"({type(err).__name__}); check the network, then run the same command "
                        "again") from None
    summary["url"] = str(getattr(commit, "commit_url", commit))
    return summary
