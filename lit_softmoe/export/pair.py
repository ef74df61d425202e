"""Export a trained LiT pair (or a pretrained tower alone) as one self-contained folder.

The folder follows Hugging Face's `save_pretrained` convention (safetensors weights + a config.json
that rebuilds the architecture + the tokenizer files, nothing pickled);
`lit_softmoe.hub.load_pretrained` loads it back as `(model, preprocess, tokenizer)`. Its file names
are in `lit_softmoe.model_folders`. Each tensor is stored once (models.export_weights): open_clip's
weights file is the weights file.

    DIR/
        config.json                 format version, both towers' configs, embed width, loss,
                                    temperature (and SigLIP bias), image preprocessing, tokenizer
                                    spec + context length, image_tower_sha256, lit_softmoe version,
                                    "weights" (which file holds the tensors under which names),
                                    "files_sha256" (every other file's)
        open_clip_config.json       open_clip's `local-dir:`/`hf-hub:` config (model_cfg +
                                    preprocess_cfg) and
        open_clip_model.safetensors the weights, under open_clip's names (export/open_clip.py),
                                    which our loader maps back to LiTModel's
        image_tower_extra.safetensors  what open_clip's model has no place for, under our names: the
                                    pretraining class head, a gray tower's own patch embedding
        image_encoder.safetensors   in place of the three above when open_clip cannot load the
                                    pair (a
        text_encoder.safetensors    Hugging Face text tower, a Tokens Choice tower: config.json's
                                    "open_clip" says why) or with --no-open-clip: `image_tower.*`
                                    (+ `image_head.*`), and `text_tower.*`, `logit_scale`
                                    (+ `logit_bias`), LiTModel's own names
        tokenizer.json              a `tokenizers` tokenizer with truncation and padding to the
                                    context length built in: ids without torch (the ONNX example
                                    uses it)
        tokenizer/                  the original tokenizer files: open_clip's BPE vocabulary, or the
                                    Hugging Face tokenizer (save_pretrained) + the encoder's
                                    config.json
        image_encoder.onnx          with --onnx: pixels (B, C, H, W) float32 → image_embedding
                                    (B, D)
        text_encoder.onnx           with --onnx: ids (B, L) int64 → text_embedding (B, D)
        README.md                   model card: towers, data, training, zero-shot table

An image-only export (from a pretraining tower) has config.json (kind "image", plus timm's hub keys
as a tower folder's: `timm.create_model("local-dir:DIR")` builds it), image_encoder.safetensors,
with --onnx image_encoder.onnx (pixels → image_features (B, width), the pooled features,
unnormalized: what linear probes and `lit-softmoe embed` use) and the model card; load it with
`load_image_tower`.

Decisions:
- `image_tower_sha256` keys the image tower's weights (caches of its embeddings use it): the
  `utils.hashing.weights_sha256` of the `image_tower.*` tensors the export holds, under the tower's
  own names. An fp32 export thus has the run's key (its tower folder's `tower_sha256`, or a partly
  unlocked run's trained tower); a bf16/fp16 export holds other tensors and has another key.
- `files_sha256`: every file but config.json itself, so that `push` (dry run too) verifies the whole
  folder before anything goes up. The model card is written before config.json for that.
- bf16/fp16 halve the safetensors; `load_pretrained` always returns an fp32 model (the
  half-precision weights upcast exactly; `.to(torch.bfloat16)` it if you like). ONNX graphs are
  always fp32, built from those same upcast weights: onnxruntime's CPU provider has no bf16 kernels
  for most ops, and the ONNX-vs-PyTorch check then holds to 1e-4 whatever the stored dtype.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lit_softmoe.errors import UserError
from lit_softmoe.export.model_card import card_facts, front_matter_text, render_body
from lit_softmoe.export.onnx import previous_graphs, write_onnx
from lit_softmoe.export.open_clip import (
    OPEN_CLIP_CONFIG,
    open_clip_config,
    open_clip_skip_reason,
    open_clip_weights,
)
from lit_softmoe.export.tokenizer_json import write_tokenizer
from lit_softmoe.hub import load_run_pair, preprocess_spec
from lit_softmoe.model_folders import (
    CONFIG_SHA256,
    EXPORT_CONFIG,
    EXPORT_FORMAT,
    FILES_SHA256,
    IMAGE_WEIGHTS,
    MODEL_CARD,
    RUN_CONFIG,
    STATE_META,
    TEXT_WEIGHTS,
    TOKENIZER_DIR,
    ModelFolder,
    classify_folder,
    export_config_sha256,
    is_export,
    read_json,
    require_keys,
)
from lit_softmoe.models.export_weights import OPEN_CLIP, OPEN_CLIP_WEIGHTS, OURS
from lit_softmoe.models.timm_config import timm_hub_keys
from lit_softmoe.models.timm_tower import TimmTower, is_timm_tower_config
from lit_softmoe.models.tokenizers import HF_PREFIX, create_tokenizer
from lit_softmoe.models.tower_folder import load_tower, tower_preprocess
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.utils.atomic import FolderTakenError, write_folder_atomically
from lit_softmoe.utils.hashing import file_sha256, weights_sha256
from lit_softmoe.utils.paths import check_writable
from lit_softmoe.utils.versions import distribution_version

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_out_dir(out_dir: Path, read_from: list[Path], overwrite: bool) -> None:
    """Refuse an --out that cannot be written, or whose replacement would delete what is
    exported."""
    # a file in the way, a read-only parent: before any work
    check_writable(out_dir, "--out", folder=True)
    filled = out_dir.is_dir() and any(out_dir.iterdir())
    if filled and not overwrite:
        raise UserError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it, "
                        "or pick another folder")
    # --overwrite replaces the whole folder: never a folder we read from (the run, its image tower
    # and the pretraining run around it) nor one holding it, and inside them only an earlier export
    # (RUN/checkpoints or the tower's run would be lost).
    target = out_dir.resolve()
    for protected in dict.fromkeys(path.resolve() for path in read_from):
        if target == protected or target in protected.parents:
            raise UserError(f"--out {out_dir} holds the model being exported ({protected}); "
                            "pick another folder")
        if filled and protected in target.parents and not is_export(out_dir):
            raise UserError(f"--out {out_dir} is inside {protected}, which this export reads, and "
                            "is not an earlier export: --overwrite would delete it; pick another "
                            "folder")


def _read_from(source: ModelFolder, tower_dir: Path | None = None) -> list[Path]:
    """The folders an export of `source` reads: the run (or model/checkpoint/tower folder), and for
    a pair the image tower with the pretraining run that holds it."""
    paths = [source.path, *([source.run_dir] if source.run_dir else [])]
    if tower_dir is not None:
        paths.append(tower_dir)
        if (tower_dir.parent / RUN_CONFIG).is_file():
            paths.append(tower_dir.parent)
    return paths


def export_pair(run: str | Path, out_dir: str | Path, dtype: str = "fp32", onnx: bool = False,
                overwrite: bool = False, open_clip: bool = True) -> Path:
    """Export a finished LiT run (or a pretraining tower, image-only) to `out_dir`; returns
    `out_dir`.

    `open_clip=False` leaves out open_clip's two files (they hold a second copy of the weights).

    Written into a temporary sibling folder and renamed at the end: a failure leaves nothing behind
    and an existing `out_dir` untouched.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {list(DTYPES)}")
    out_dir = Path(out_dir)
    source, model, tower, facts = _read_source(run, out_dir, overwrite)
    run_dir = source.run_dir
    results = _run_results(source)
    state, image_state, text_state, image_tower_sha256 = _state_to_write(model, tower, dtype)

    config = {"format": EXPORT_FORMAT, "kind": "pair" if model is not None else "image",
              "lit_softmoe_version": distribution_version("lit-softmoe"), "dtype": dtype,
              "image_tower": facts["image_tower"],
              "embed_dim": model.text_tower.embed_dim if model is not None else tower.embed_dim,
              "preprocess": facts["preprocess"], "image_tower_sha256": image_tower_sha256,
              "source": {"path": str(Path(run).resolve()),
                         "tower": facts.get("tower_dir", str(source.path)),
                         "step": results.get("steps", facts.get("step"))}}
    if model is None:
        config["classnames"] = facts["tower_meta"].get("classnames")
        # timm's hub keys, as a tower folder has them: timm's `local-dir:` / `hf-hub:` build the
        # tower (its weights keep the export's `image_tower.` names; our timm integration strips the
        # prefix).
        config.update(timm_hub_keys(tower.cfg, facts["preprocess"], weights_file=IMAGE_WEIGHTS))
    else:
        config.update({"text": facts["text"], "loss": facts["loss"],
                       "image_head": facts["image_head"],
                       "temperature": float(model.logit_scale.detach().exp()
                                            .clamp(max=model.max_temperature)),
                       "logit_bias": (float(model.logit_bias.detach())
                                      if model.logit_bias is not None else None)})

    tokenizer = (create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
                 if model is not None else None)
    skip_open_clip = (open_clip_skip_reason(model) if open_clip
                      else "left out on request (--no-open-clip)")
    config["open_clip"] = ({"config": OPEN_CLIP_CONFIG, "weights": OPEN_CLIP_WEIGHTS}
                           if skip_open_clip is None else {"skipped": skip_open_clip})
    # One copy of the weights (models.export_weights): open_clip's file when open_clip can load the
    # pair, else ours.
    if skip_open_clip is None:
        weights = open_clip_weights(state, tower.cfg.in_channels,
                                    class_head=not isinstance(tower, TimmTower))
        config["weights"] = {name: OPEN_CLIP if name == OPEN_CLIP_WEIGHTS else OURS
                             for name in weights}
    else:
        weights = {IMAGE_WEIGHTS: image_state,
                   **({TEXT_WEIGHTS: text_state} if model is not None else {})}
        config["weights"] = dict.fromkeys(weights, OURS)

    def write(tmp: Path) -> None:
        for name, tensors in weights.items():
            save_file(tensors, tmp / name)
        if model is not None:
            config["tokenizer"] = write_tokenizer(tmp, model.text_tower.tokenizer_spec,
                                                  model.text_tower.context_length, tokenizer)
            if model.text_tower.tokenizer_spec.startswith(HF_PREFIX):
                # the architecture
                model.text_tower.encoder.config.save_pretrained(tmp / TOKENIZER_DIR)
        if skip_open_clip is None:
            open_clip_json = open_clip_config(model, facts["preprocess"])
            config["open_clip"]["timm_model_name"] = (
                open_clip_json["model_cfg"]["vision_cfg"]["timm_model_name"])
            (tmp / OPEN_CLIP_CONFIG).write_text(json.dumps(open_clip_json, indent=2) + "\n")
        if onnx:  # over an export of the same model, its graphs are copied (and checked)
            config["onnx"] = write_onnx(tmp, model, tower, tokenizer,
                                        previous_graphs(out_dir) if overwrite else None)
        # The card's facts stay in config.json: `push` renders the Hub's card from them (no local
        # paths).
        config["card"] = card_facts(config, model, tower, facts, run_dir, results)
        (tmp / MODEL_CARD).write_text(front_matter_text(config["card"]["front_matter"])
                                      + render_body(config, config["card"], str(out_dir)))
        # Every other file's sha256: `push` (dry run too) verifies them all before anything goes up.
        config[FILES_SHA256] = {path.relative_to(tmp).as_posix(): file_sha256(path)
                                for path in sorted(tmp.rglob("*")) if path.is_file()}
        # and config.json's own: a byte changed there is found
        config[CONFIG_SHA256] = export_config_sha256(config)
        (tmp / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    try:
        # Without --overwrite, --out may only be absent or empty, also at the very end: the
        # emptiness check at the start does not settle it (two exports to one new --out both pass
        # it).
        return write_folder_atomically(out_dir, write, replace=overwrite)
    except FolderTakenError:
        raise UserError(f"--out {out_dir} was written by another run while this export ran (it was "
                        "absent or empty when the export started), and is kept; pass --overwrite "
                        "to replace it, or pick another folder") from None




def _read_source(run: str | Path, out_dir: Path, overwrite: bool) -> tuple:
    """(the folder, the pair or None for a tower folder, the image tower, what the export records of
    them), `out_dir` checked against every folder the export reads."""
    source = classify_folder(run)
    if source.kind == "export":
        raise UserError(f"{run} is already an export; copy the folder instead of exporting it "
                        "again")
    _check_out_dir(out_dir, _read_from(source), overwrite)
    if source.kind == "tower":
        tower, tower_meta = load_tower(source.path)
        if is_timm_tower_config(tower_meta.get("tower")):
            raise UserError(f"{run} is a timm model's tower folder ({tower_meta.get('source')}): "
                            "timm loads it as it is, "
                            f"timm.create_model(\"local-dir:{source.path}\", pretrained=True); "
                            "export the LiT runs trained against it")
        model = None
        facts = {"image_tower": tower.cfg.to_dict(), "tower_meta": tower_meta,
                 "preprocess": preprocess_spec(tower_preprocess(source.path, tower, tower_meta))}
        tower.eval().requires_grad_(False)
    else:
        model, facts = load_run_pair(source)
        tower = model.image_tower
        # now the tower is known
        _check_out_dir(out_dir, _read_from(source, Path(facts["tower_dir"])), overwrite)
    return source, model, tower, facts


def _run_results(source: ModelFolder) -> dict:
    """The run's results.json as far as it describes what is exported."""
    run_dir = source.run_dir
    results = (read_json(run_dir / "results.json")
               if run_dir and (run_dir / "results.json").is_file() else {})
    if source.kind == "checkpoint":
        # The run's results.json describes its final model, not this checkpoint: keep only what the
        # whole run shares, and take the step and training time from the checkpoint itself.
        state_meta = require_keys(read_json(source.path / STATE_META), ("step", "train_seconds"),
                                  source.path / STATE_META, "train the run again with this version")
        results = {"steps": state_meta["step"],
                   "train_seconds": round(state_meta["train_seconds"], 1),
                   **({"cached_features": results["cached_features"]}
                      if "cached_features" in results else {})}
    return results


def _state_to_write(model, tower: nn.Module, dtype: str) -> tuple[dict, dict, dict, str]:
    """(the state in the export's dtype, its image and text parts, the sha256 of the tower weights
    written); the model takes these exact (rounded) values."""
    # The model takes the rounded values so that the ONNX graphs and their check see what a user
    # loading the export gets.
    target = DTYPES[dtype]
    full = ({f"image_tower.{k}": v for k, v in tower.state_dict().items()} if model is None
            else model.state_dict())
    # No copy where none is needed: in fp32 these are the parameters themselves (safetensors takes
    # them as they are: contiguous, no storage shared), so a paper-scale tower is held once, not
    # twice, while it is written.
    state = {k: (v.to(target) if v.is_floating_point() else v).detach().contiguous()
             for k, v in full.items()}
    image_state = {k: v for k, v in state.items() if k.startswith(("image_tower.", "image_head."))}
    # The key of the tower weights written (see the module docstring): in fp32 the run's own.
    image_tower_sha256 = weights_sha256({k[len("image_tower."):]: v for k, v in image_state.items()
                                         if k.startswith("image_tower.")})
    text_state = {k: v for k, v in state.items() if k not in image_state}
    if dtype != "fp32":
        # the rounded values, copied into the fp32 parameters (copy_ upcasts exactly)
        (model if model is not None else _Prefixed(tower)).load_state_dict(state)
    return state, image_state, text_state, image_tower_sha256


class _Prefixed(nn.Module):
    """A tower under the name `image_tower`, so its state dict has the export's key names."""

    def __init__(self, tower: VisionTransformer):
        super().__init__()
        self.image_tower = tower


