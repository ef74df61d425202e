"""Load what lit-softmoe wrote: `load_pretrained` (an image–text pair) and `load_image_tower`;
open_clip's `create_model_from_pretrained` and `get_tokenizer` split the first.

Both take any folder `lit_softmoe.model_folders.classify_folder` recognizes
(an export, a LiT run, its model/ folder, a training checkpoint, a pretraining run or its tower/),
or `hf-hub:ORG/NAME[@REVISION]` for an export on the Hugging Face Hub (`resolve_model_path`, as
open_clip's `hf-hub:` names), and follow open_clip's `create_model_and_transforms` in spirit:
the model comes with the preprocessing its image tower was trained with, and the pair with its
tokenizer. Nothing here needs the training code.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from lit_softmoe.data.images import jpeg_min_side
from lit_softmoe.data.transforms import image_transform
from lit_softmoe.errors import UserError, first_line
from lit_softmoe.model_folders import (
    EXPORT_CONFIG,
    MODEL_CARD,
    STATE_META,
    TOKENIZER_DIR,
    TOKENIZER_JSON,
    DamagedCheckpoint,
    ModelFolder,
    check_export_weights,
    classify_folder,
    export_weight_files,
    read_checkpoint_tensors,
    read_export_config,
    read_json,
    read_state_meta,
    require_keys,
)
from lit_softmoe.models.export_weights import WEIGHTS_FILES, load_export_weights
from lit_softmoe.models.inference import prepare_for_inference
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.preprocess import Preprocess
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.timm_tower import fill_computed_buffers
from lit_softmoe.models.tokenizers import HF_PREFIX, create_tokenizer
from lit_softmoe.models.tower_folder import (
    TOWER_CONFIG,
    TOWER_WEIGHTS,
    check_state_dict,
    load_tower,
    load_weights,
    tower_fingerprint,
    tower_preprocess,
    tower_skeleton,
)
from lit_softmoe.utils.device import inference_dtype
from lit_softmoe.utils.folder_identity import check_same_folder
from lit_softmoe.utils.hashing import weights_sha256

HF_HUB_PREFIX = "hf-hub:"
# What loading an export reads: the weights files of either layout (models.export_weights) and the
# tokenizer; the ONNX graphs (a copy of the weights, for runtimes without torch) stay on the Hub.
HF_HUB_PATTERNS = [EXPORT_CONFIG, MODEL_CARD, *WEIGHTS_FILES, TOKENIZER_JSON, f"{TOKENIZER_DIR}/*"]
_REPO_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+")


def parse_hf_hub_spec(spec: str) -> tuple[str, str | None]:
    """`hf-hub:ORG/NAME[@REVISION]` → (repo_id, revision or None), or one UserError line."""
    repo_id, _, revision = spec[len(HF_HUB_PREFIX):].partition("@")
    if not _REPO_ID.fullmatch(repo_id) or repo_id.startswith((".", "-")) \
            or (revision == "" and "@" in spec):
        raise UserError(f"{spec!r} is not a Hub model name; write hf-hub:ORG/NAME, or "
                        "hf-hub:ORG/NAME@REVISION (a branch, tag or commit)")
    return repo_id, revision or None


def resolve_model_path(spec: str | Path) -> Path:
    """The local folder a model spec names: `hf-hub:ORG/NAME[@REVISION]` is fetched into
    (or found in) the Hugging Face cache with `huggingface_hub.snapshot_download`, which honours
    HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME and HF_TOKEN; any other spec is a path, returned as it is.
    Every loader starts here."""
    if not str(spec).startswith(HF_HUB_PREFIX):
        return Path(spec)
    repo_id, revision = parse_hf_hub_spec(str(spec))
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HF_HUB_PATTERNS))
    except GatedRepoError:
        raise UserError(f"{spec} is gated: accept its terms on https://huggingface.co/{repo_id}, "
                        "then log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{spec}: no such model repository on the Hub, or it is private; check the "
                        "name, or log in (`hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UserError(f"{spec}: the repository has no revision {revision!r}; name a branch, tag "
                        "or commit it has") from None
    except LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{spec} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                            "and HF_HUB_OFFLINE is set; download it once with the network on "
                            "(unset HF_HUB_OFFLINE), or load an export "
                            "folder by its path") from None
        raise UserError(f"{spec} could not be downloaded and is not in the Hugging Face cache "
                        f"({type(err).__name__}); check the network, or load an export "
                        "folder by its path") from None
    except (HfHubHTTPError, HFValidationError) as err:
        raise UserError(f"{spec} could not be downloaded ({type(err).__name__}: "
                        f"{first_line(err)}); check the network and the name, or load an export "
                        "folder by its path") from None


def _find_tower(recorded: str) -> Path:
    """The tower folder a pair's description names (resolved when the run recorded it)."""
    tower_dir = Path(recorded)
    if (tower_dir / TOWER_CONFIG).is_file() and (tower_dir / TOWER_WEIGHTS).is_file():
        return tower_dir
    raise UserError(f"the image tower {recorded} the run was trained against is not there; put the "
                    "pretraining run's tower/ folder back there")


def preprocess_spec(preprocess: Preprocess) -> dict:
    """Everything the tower's `image_transform` does, spelled out so a reader without
    torch can redo it."""
    return {"image_size": preprocess.image_size, "channels": preprocess.channels,
            "mode": preprocess.mode,
            # reduced: PIL's image.draft(image.mode, (jpeg_min_side,) * 2) on an opened JPEG
            # whose shorter side is at least 2 × jpeg_min_side, before anything loads it
            # (libjpeg's DCT scaling).
            "decode": preprocess.decode,
            "jpeg_min_side": jpeg_min_side(preprocess.decode, preprocess.image_size),
            "resize": "shorter side to image_size, bilinear, antialiased", "crop": "center",
            "scale": "pixel / 255", "mean": list(preprocess.mean), "std": list(preprocess.std),
            # RGB → gray for 1-channel towers: PIL's convert("L") (exact on gray content).
            "gray": "PIL convert('L')"}


def make_preprocess(spec: dict, source: str | Path = "the export's config.json"):
    """PIL image → normalized float32 (C, H, W): the tower's `image_transform`
    (RGB ↔ gray converted) from its description (`preprocess_spec`).

    With "decode": "reduced", a JPEG given as opened by `PIL.Image.open` (not yet loaded) is decoded
    at a reduced scale, as embed and eval decoded it; an image already loaded is taken as it is.
    """
    return image_transform(Preprocess.from_settings(spec, spec.get("channels"), source))


def _load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str,
                  info: dict) -> None:
    """Load `state` into `model` loudly. The image tower's weights that `state` leaves out
    (all of a locked tower, the locked part of a partly unlocked one) stay the model's own, read
    from the tower folder the run recorded (`_check_same_tower`). A training checkpoint of a locked
    Hugging Face text tower leaves its locked parameters out: the model's own, read from text.path,
    stay if they are the ones the run recorded (`text_locked_sha256` of its description)."""
    # those `state` holds are loaded
    skip = tuple(key for key in model.locked_image_keys() if key not in state)
    recorded = info.get("text_locked_sha256")
    text = model.text_tower.named_parameters() if recorded else ()
    absent = {n: p for n, p in text if f"text_tower.{n}" not in state}
    if absent and weights_sha256(absent) != recorded:
        raise UserError(f"{source} leaves out the locked text layers, which the run read from "
                        f"{info['text']['path']}, and that model has changed since; load the run's "
                        "model/ folder, which holds every weight, or put that model back")
    skip += tuple(f"text_tower.{n}" for n in absent)
    check_state_dict(model, state, source, skip_prefixes=skip)
    model.load_state_dict(state, strict=not skip)


# What `train.lit.model_description` writes and loading reads (model/config.json, a
# checkpoint's "model").
_DESCRIPTION_KEYS = ("image_tower", "image_tower_config", "image_tower_sha256", "preprocess",
                     "text", "loss")


def _check_same_tower(info: dict, tower_cfg: dict, tower_meta: dict, tower_dir: Path) -> None:
    """model/config.json records the tower's config, preprocessing and weights' sha256 the text
    tower was trained against; a tower folder rewritten since (another tower, other preprocessing,
    retrained weights) would be paired with that text tower without a word, and every embedding
    would be wrong."""
    # Its defaults filled in, as tower_cfg's.
    recorded_cfg = tower_skeleton(info["image_tower_config"], tower_dir).cfg.to_dict()
    changed = [key for key in tower_cfg if recorded_cfg.get(key) != tower_cfg[key]]
    if info["preprocess"] != tower_meta.get("preprocess"):
        changed.append("preprocess")
    if info["image_tower_sha256"] != tower_fingerprint(tower_dir)["tower_sha256"]:
        changed.append("its weights")
    if changed:
        raise UserError(f"the image tower at {tower_dir} is not the one the run was trained "
                        f"against (it differs in {', '.join(changed)}); put that tower back there, "
                        "or train the text tower against this one")


def _run_description(source: ModelFolder) -> tuple[dict, int | None]:
    """(the pair's description, the step it was saved at) of a LiT run's model/ folder or a training
    checkpoint: both carry the same description (`train.lit.model_description`)."""
    if source.kind == "checkpoint":
        # its step is its folder's, or it is damaged
        checkpoint = _checked(source.path, read_state_meta)
        info, step, described = (checkpoint["model"], checkpoint.get("step"),
                                 f"{source.path / STATE_META}'s \"model\"")
    else:
        info = read_json(source.path / EXPORT_CONFIG)
        step, described = (info.get("results") or {}).get("steps"), source.path / EXPORT_CONFIG
    return require_keys(info, _DESCRIPTION_KEYS, described,
                        "train the run again with this version"), step


def _checked(checkpoint: Path, read):
    """`read(checkpoint)`, or one UserError line when the checkpoint is damaged
    (its files disagree with each other or with its name: what a resume passes over)."""
    try:
        return read(checkpoint)
    except DamagedCheckpoint as err:
        raise UserError(f"checkpoint {checkpoint} is damaged ({err}); use the checkpoint before "
                        "it, or the run's model/ folder") from None


def load_run_pair(source: ModelFolder) -> tuple[LiTModel, dict]:
    """A LiT run's model/ folder or a training checkpoint → (fp32 LiTModel, facts about it)."""
    info, step = _run_description(source)
    if source.kind == "checkpoint":
        _, tensors = _checked(source.path, read_checkpoint_tensors)
        state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    else:
        check_same_folder(info, source.path / EXPORT_CONFIG, source.path / TOWER_WEIGHTS)
        state = load_weights(source.path / TOWER_WEIGHTS)
    text_cfg, loss = TextTowerConfig.from_dict(info["text"]), info["loss"]
    tower_dir = _find_tower(info["image_tower"])
    image_head = "image_head.weight" in state  # the weights tell
    tower, tower_meta = load_tower(tower_dir)
    _check_same_tower(info, tower.cfg.to_dict(), tower_meta, tower_dir)
    model = LiTModel(tower, create_text_tower(text_cfg, embed_dim=tower.embed_dim), loss=loss,
                     image_head=image_head, unlocked_blocks=info.get("unlocked_blocks", 0))
    _load_weights(model, state, str(source.path), info)
    # A partly unlocked run changed the tower: its weights are the run's, not the tower folder's.
    trained = any(k.startswith("image_tower.") for k in state)
    sha = (weights_sha256(model.image_tower.state_dict()) if trained
           else tower_fingerprint(tower_dir)["tower_sha256"])
    facts = {"text": text_cfg.to_dict(), "image_tower": tower.cfg.to_dict(),
             "embed_dim": model.text_tower.embed_dim, "loss": loss, "image_head": image_head,
             "image_tower_sha256": sha, "tower_dir": str(tower_dir), "tower_meta": tower_meta,
             "step": step,
             "checkpoint": str(source.path) if source.kind == "checkpoint" else None,
             "preprocess": preprocess_spec(tower_preprocess(tower_dir, tower, tower_meta))}
    return model.eval(), facts


def _load_export_pair(path: Path, config: dict) -> LiTModel:
    """An export folder → fp32 LiTModel (half-precision weights upcast exactly)."""
    if config.get("kind") != "pair":
        raise UserError(f"{path} is an image-only export (no text tower); load it with "
                        "lit_softmoe.load_image_tower(path)")
    tower = tower_skeleton(config["image_tower"], path)
    text_cfg = TextTowerConfig.from_dict(config["text"])
    hf = text_cfg.kind == "hf"
    if hf:  # the architecture and tokenizer travel in the export; the original path may be gone
        text_cfg.path = str(path / TOKENIZER_DIR)
    # The architecture travels in the export (tokenizer/config.json); the export's weights hold
    # every text weight, so the encoder is built from its config without reading pretrained weights.
    text_tower = create_text_tower(text_cfg, embed_dim=config["embed_dim"],
                                   pretrained_weights=False)
    model = LiTModel(tower, text_tower, loss=config["loss"], image_head=config["image_head"])
    files = export_weight_files(path, config)
    # a file missing or cut short: named by its own line first
    state = load_export_weights(path, files)
    check_export_weights(path, config, files)
    check_state_dict(model, state, str(path))
    # assign: the meta-device tower takes the loaded tensors
    model.load_state_dict(state, assign=True)
    fill_computed_buffers(model.image_tower)
    model.lock_image_tower()
    return model.eval()


def _tokenizer_for(spec: str, context_length: int, export_dir: Path | None = None):
    if export_dir is not None and spec.startswith(HF_PREFIX):
        return create_tokenizer(f"{HF_PREFIX}{export_dir / TOKENIZER_DIR}", context_length)
    return create_tokenizer(spec, context_length)


def _pair_folder(path: str | Path) -> ModelFolder:
    source = classify_folder(resolve_model_path(path))
    if source.kind == "tower":
        raise UserError(f"{path} is a pretrained image tower without a text tower; load it with "
                        "lit_softmoe.load_image_tower(path), or point to a LiT run trained "
                        "against it")
    return source


def _pair_tokenizer(source: ModelFolder):
    """The tokenizer the pair in `source` was trained with, read from its config alone
    (no weights)."""
    if source.kind == "export":
        config = read_export_config(source.path)
        if config.get("kind") != "pair":
            raise UserError(f"{source.path} is an image-only export (no text tower, no tokenizer)")
        return _tokenizer_for(config["tokenizer"]["spec"], config["tokenizer"]["context_length"],
                              source.path)
    text_cfg = TextTowerConfig.from_dict(_run_description(source)[0]["text"])
    # as the towers build it
    spec = f"{HF_PREFIX}{text_cfg.path}" if text_cfg.kind == "hf" else text_cfg.tokenizer
    return _tokenizer_for(spec, text_cfg.context_length)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", precision: str = "auto"):
    """(model, preprocess, tokenizer) from an export folder, a LiT run, its model/ folder or
    a checkpoint, or `hf-hub:ORG/NAME[@REVISION]` (an export on the Hugging Face Hub, see
    `resolve_model_path`).

    `model.encode_image(preprocess(img)[None])` and `model.encode_text(tokenizer(["a cat"]))`
    give normalized float32 embeddings (B, D); `model.pretrained_info` says what was loaded
    (source, kind, image_tower_sha256, the tower's config, the preprocessing). The model is in
    eval mode, in fp32 but for its locked image tower, whose weights take the dtype it runs in
    on `device` (`precision`: auto = bf16 on GPUs that support it, fp32 elsewhere; fp32 | bf16).
    open_clip's habit, `create_model_from_pretrained(path)` + `get_tokenizer(path)`, gives the same.
    """
    source = _pair_folder(path)
    if source.kind == "export":
        config = read_export_config(source.path)
        model = _load_export_pair(source.path, config)
        preprocess_spec, sha, tower_cfg = (config["preprocess"], config["image_tower_sha256"],
                                           config["image_tower"])
        kind = "export"
    else:
        model, facts = load_run_pair(source)
        preprocess_spec, sha, tower_cfg = (facts["preprocess"], facts["image_tower_sha256"],
                                           facts["image_tower"])
        kind = "run"
    tokenizer = _pair_tokenizer(source)
    model.to(device)
    prepare_for_inference(model.image_tower, dtype=inference_dtype(precision, torch.device(device)))
    model.pretrained_info = {"source": str(path), "kind": kind, "image_tower_sha256": sha,
                             "image_tower": tower_cfg, "preprocess": preprocess_spec,
                             "tokenizer": getattr(model.text_tower, "tokenizer_spec", None)}
    return model, make_preprocess(preprocess_spec, source.path), tokenizer


def create_model_from_pretrained(path: str | Path, device: str | torch.device = "cpu",
                                 precision: str = "auto"):
    """(model, preprocess), as open_clip's `create_model_from_pretrained`: `load_pretrained`
    less the tokenizer, for the same `path` specs (a folder or `hf-hub:ORG/NAME[@REVISION]`);
    `get_tokenizer(path)`."""
    model, preprocess, _ = load_pretrained(path, device, precision)
    return model, preprocess


def get_tokenizer(path: str | Path):
    """The tokenizer of the pair at `path` (any spec `load_pretrained` takes), as open_clip's
    `get_tokenizer(name)`: `tokenizer(["a cat"])` → ids (B, context_length). Reads no weights."""
    return _pair_tokenizer(_pair_folder(path))


def load_image_tower(path: str | Path, device: str | torch.device = "cpu", precision: str = "auto"):
    """(tower, preprocess) from any export (pair or image-only), a tower folder,
    or a pretraining/LiT run.

    `tower.forward_pooled(preprocess(img)[None])` gives the pooled Soft MoE features (B, width),
    in the weights' dtype: bf16 on GPUs that support it with `precision` auto, else fp32
    (see `load_pretrained`); `tower.pretrained_info` is as in `load_pretrained`; `path` may be
    `hf-hub:ORG/NAME[@REVISION]` too.
    """
    source = classify_folder(resolve_model_path(path))
    if source.kind == "export":
        config = read_export_config(source.path)
        tower = tower_skeleton(config["image_tower"], source.path)
        files = export_weight_files(source.path, config)
        state = load_export_weights(source.path, files, prefix="image_tower.")
        check_export_weights(source.path, config, files)
        check_state_dict(tower, state, str(source.path))
        tower.load_state_dict(state, assign=True)
        fill_computed_buffers(tower)
        spec, sha, kind = config["preprocess"], config["image_tower_sha256"], "export"
    elif source.kind == "tower":
        tower, meta = load_tower(source.path)
        spec = preprocess_spec(tower_preprocess(source.path, tower, meta))
        sha, kind = tower_fingerprint(source.path)["tower_sha256"], "run"
    else:
        model, facts = load_run_pair(source)
        tower, spec, sha, kind = (model.image_tower, facts["preprocess"],
                                  facts["image_tower_sha256"], "run")
    device = torch.device(device)
    tower = prepare_for_inference(tower.to(device), dtype=inference_dtype(precision, device))
    tower.pretrained_info = {"source": str(path), "kind": kind, "image_tower_sha256": sha,
                             "image_tower": tower.cfg.to_dict(), "preprocess": spec}
    return tower, make_preprocess(spec, source.path)


