"""Export a trained LiT pair (or a pretrained tower alone) as one self-contained folder, and load it back.

The folder follows Hugging Face's `save_pretrained` convention (safetensors weights + a config.json
that rebuilds the architecture + the tokenizer files, nothing pickled), and `load_pretrained`
follows open_clip's `create_model_and_transforms`: it returns `(model, preprocess, tokenizer)`.

    DIR/
        config.json                 format version, both towers' configs, embed width, loss, temperature
                                    (and SigLIP bias), image preprocessing, tokenizer spec + context
                                    length, image_tower_sha256, lit_softmoe version
        image_encoder.safetensors   `image_tower.*` (+ `image_head.*`): LiTModel's own key names
        text_encoder.safetensors    `text_tower.*`, `log_scale` (+ `logit_bias`)
        tokenizer.json              a `tokenizers` tokenizer with truncation and padding to the context
                                    length built in: ids without torch (the ONNX example uses it)
        tokenizer/                  the original tokenizer files: open_clip's BPE vocabulary, or the
                                    Hugging Face tokenizer (save_pretrained) + the encoder's config.json
        image_encoder.onnx          with --onnx: pixels (B, C, H, W) float32 → image_embedding (B, D)
        text_encoder.onnx           with --onnx: ids (B, L) int64 → text_embedding (B, D)
        README.md                   model card: towers, data, training, zero-shot table

An image-only export (from a pretraining tower) has config.json (kind "image"), image_encoder.safetensors,
image_encoder.onnx (pixels → image_features (B, width), the pooled features, unnormalized: what linear
probes and `lit-softmoe embed` use) and the model card; load it with `load_image_tower`.

Decisions:
- `image_tower_sha256` keys the image tower's weights (caches of its embeddings use it): a run's tower
  file's sha256 (`tower_fingerprint`), copied into an fp32 export so the same weights keep the same key;
  for bf16/fp16 exports, the sha256 of the written image_encoder.safetensors (other weights, other key).
- bf16/fp16 halve the safetensors; `load_pretrained` always returns an fp32 model (the half-precision
  weights upcast exactly; `.to(torch.bfloat16)` it if you like). ONNX graphs are always fp32, built from
  those same upcast weights: onnxruntime's CPU provider has no bf16 kernels for most ops, and the
  ONNX-vs-PyTorch check then holds to 1e-4 whatever the stored dtype.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save, save_file
from torch import nn

from lit_softmoe.data.tokenizers import HF_PREFIX, OPENCLIP_BPE, create_tokenizer
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError, check_writable
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.vit import ViTConfig, VisionTransformer
from lit_softmoe.train.checkpoint import (STATE_META, STATE_TENSORS, TOWER_CONFIG, TOWER_WEIGHTS, FolderTakenError,
                                          check_state_dict, load_tower, load_weights, write_folder_atomically)
from lit_softmoe.train.embed import tower_fingerprint

FORMAT_VERSION = 1
EXPORT_CONFIG, MODEL_CARD = "config.json", "README.md"
IMAGE_WEIGHTS, TEXT_WEIGHTS = "image_encoder.safetensors", "text_encoder.safetensors"
IMAGE_ONNX, TEXT_ONNX = "image_encoder.onnx", "text_encoder.onnx"
TOKENIZER_JSON, TOKENIZER_DIR = "tokenizer.json", "tokenizer"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ONNX_TOLERANCE = 1e-4  # max abs difference of fp32 ONNX vs PyTorch embeddings
_EXPECTED = ("an export folder (from `lit-softmoe export`), a LiT run folder, its model/ folder, a LiT checkpoint "
             "folder RUN/checkpoints/step_N, or (for the image tower alone) a pretraining run or its tower/ folder")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("lit-softmoe")
    except PackageNotFoundError:
        return "unknown"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({err}); is it a complete folder?") from None


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---- what a path is -----------------------------------------------------------------------------

@dataclass
class _Source:
    kind: str  # "export" | "lit-model" | "checkpoint" | "tower"
    path: Path  # the export / model / checkpoint / tower folder itself
    run_dir: Path | None = None  # the run folder holding it (config.yaml, results.json, eval/), if any


def _classify(path: str | Path) -> _Source:
    """Recognize a folder by the files in it; a run folder that has not finished says how to finish it."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; expected {_EXPECTED}")
    config = path / EXPORT_CONFIG
    if config.is_file() and (path / IMAGE_WEIGHTS).is_file() and "format" in _read_json(config):
        return _Source("export", path)
    if config.is_file() and (path / TOWER_WEIGHTS).is_file():
        meta = _read_json(config)
        if "text" in meta and "image_tower_config" in meta:  # RUN/model, written by the LiT recipe
            return _Source("lit-model", path, path.parent if (path.parent / "config.yaml").is_file() else None)
        if "tower" in meta:  # RUN/tower, written by pretraining
            return _Source("tower", path, path.parent if (path.parent / "config.yaml").is_file() else None)
    if (path / "model" / EXPORT_CONFIG).is_file() and (path / "model" / TOWER_WEIGHTS).is_file():
        return _Source("lit-model", path / "model", path)
    if (path / "tower" / TOWER_CONFIG).is_file() and (path / "tower" / TOWER_WEIGHTS).is_file():
        return _Source("tower", path / "tower", path if (path / "config.yaml").is_file() else None)
    if (path / STATE_META).is_file() and (path / STATE_TENSORS).is_file() and path.parent.name == "checkpoints":
        run_dir = path.parent.parent
        if (run_dir / "config.yaml").is_file() and "text" in _run_config(run_dir):
            return _Source("checkpoint", path, run_dir)
    if (path / "config.yaml").is_file():
        run_config = _run_config(path)
        if "text" in run_config:
            raise UserError(f"{path} is a LiT run whose training has not finished (no model/ folder); run "
                            f"`lit-softmoe train --config {path / 'config.yaml'}` to resume it, or point to one of "
                            f"its checkpoints ({path / 'checkpoints'}/step_N)")
        if "tower" in run_config:
            raise UserError(f"{path} is a pretraining run that has not finished (no tower/ folder); run "
                            f"`lit-softmoe pretrain --config {path / 'config.yaml'}` to resume it")
    raise UserError(f"{path} is not a model folder lit-softmoe knows; expected {_EXPECTED}")


def _run_config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    except Exception as err:  # noqa: BLE001 — any YAML problem is the user's file, named in one line
        raise UserError(f"cannot read {run_dir / 'config.yaml'} ({err})") from None
    return loaded if isinstance(loaded, dict) else {}


def _find_tower(recorded: str, run_dir: Path | None) -> Path:
    """The tower folder a run names. Relative paths in config.yaml are relative to where training was
    launched, i.e. the folder that holds the run folder as config.yaml's run_dir spells it."""
    candidates = [Path(recorded)]
    if run_dir is not None and not Path(recorded).is_absolute():
        written = Path(str(_run_config(run_dir).get("run_dir", "")))
        if written.parts and not written.is_absolute():
            launch_dir = run_dir.resolve()
            for _ in written.parts:
                launch_dir = launch_dir.parent
            candidates.append(launch_dir / recorded)
    for candidate in candidates:
        if (candidate / TOWER_CONFIG).is_file() and (candidate / TOWER_WEIGHTS).is_file():
            return candidate
    raise UserError(f"the image tower {recorded} the run was trained against is not there (looked in "
                    f"{', '.join(str(c) for c in candidates)}); put the pretraining run's tower/ folder back there")


# ---- rebuilding the pair ------------------------------------------------------------------------

def _preprocess_spec(tower_cfg: dict, preprocess: dict | None) -> dict:
    """Everything `eval_transform` does, spelled out so a reader without torch can redo it."""
    if not isinstance(preprocess, dict) or not {"image_size", "mean", "std"} <= set(preprocess):
        raise UserError("the tower's config.json has no preprocess entry (image_size, mean, std); "
                        "re-save it with `lit-softmoe pretrain`")
    channels, size = int(tower_cfg["in_channels"]), int(preprocess["image_size"])

    def per_channel(values) -> list[float]:
        values = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
        return values * channels if len(values) == 1 else values

    return {"image_size": size, "channels": channels, "mode": "L" if channels == 1 else "RGB",
            "resize": "shorter side to image_size, bilinear, antialiased", "crop": "center",
            "scale": "pixel / 255", "mean": per_channel(preprocess["mean"]), "std": per_channel(preprocess["std"]),
            # RGB → gray for 1-channel towers: PIL's convert("L") (exact on gray content).
            "gray": "PIL convert('L')"}


def make_preprocess(spec: dict):
    """PIL image → normalized float32 (C, H, W): the tower's eval transform (RGB ↔ gray converted)."""
    return eval_transform(spec["image_size"], spec["channels"], spec["mean"], spec["std"])


@contextlib.contextmanager
def _hf_architecture_only():
    # HFTextTower loads pretrained weights in its constructor; an export has the architecture's
    # config.json only (its weights are in text_encoder.safetensors, which replaces them all), so
    # build the encoder from that config while the tower is constructed.
    from transformers import AutoConfig, AutoModel
    original = AutoModel.from_pretrained
    AutoModel.from_pretrained = lambda path, **kwargs: AutoModel.from_config(AutoConfig.from_pretrained(path))
    try:
        yield
    finally:
        AutoModel.from_pretrained = original


def _load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `model` loudly; without `image_tower.*` keys the model's own tower stays."""
    skip = () if any(k.startswith("image_tower.") for k in state) else ("image_tower.",)
    check_state_dict(model, state, source, skip_prefixes=skip)
    model.load_state_dict(state, strict=not skip)


def _state_sha256(state: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(save({k: v.contiguous() for k, v in state.items()})).hexdigest()


def _check_same_tower(info: dict, tower_cfg: dict, tower_meta: dict, tower_dir: Path) -> None:
    """model/config.json records the tower's config, preprocessing and weights' sha256 the text tower
    was trained against; a tower folder rewritten since (another tower, other preprocessing, retrained
    weights) would be paired with that text tower without a word, and every embedding would be wrong."""
    recorded_cfg, recorded_pre = info.get("image_tower_config"), info.get("preprocess")
    # Keys both know only: a run saved by an older version may lack a key added since.
    changed = [key for key in (recorded_cfg or {}) if key in tower_cfg and recorded_cfg[key] != tower_cfg[key]]
    if recorded_pre and recorded_pre != tower_meta.get("preprocess"):
        changed.append("preprocess")
    recorded_sha = info.get("image_tower_sha256")  # runs saved before it was recorded have none
    if recorded_sha and recorded_sha != tower_fingerprint(tower_dir)["tower_sha256"]:
        changed.append("its weights")
    if changed:
        raise UserError(f"the image tower at {tower_dir} is not the one the run was trained against (it differs in "
                        f"{', '.join(changed)}); put that tower back there, or train the text tower against this one")


def _load_run_pair(source: _Source) -> tuple[LiTModel, dict]:
    """A LiT run's model/ folder or a training checkpoint → (fp32 LiTModel, facts about it)."""
    if source.kind == "checkpoint":
        from lit_softmoe.config import LiTConfig, load_config
        cfg = load_config(LiTConfig, source.run_dir / "config.yaml")
        text_cfg, loss, image_head = cfg.text, cfg.loss, cfg.image_head
        tower_dir = _find_tower(cfg.image_tower, source.run_dir)
        tensors = load_weights(source.path / STATE_TENSORS)
        state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        info = _read_json(source.path / STATE_META)  # its image_tower_sha256: checkpoints before it have none
        step = info.get("step")
    else:
        info = _read_json(source.path / EXPORT_CONFIG)
        text_cfg, loss = TextTowerConfig.from_dict(info["text"]), info["loss"]
        tower_dir = _find_tower(info["image_tower"], source.run_dir)
        state = load_weights(source.path / TOWER_WEIGHTS)
        image_head = "image_head.weight" in state  # not in model/config.json; the weights tell
        step = (info.get("results") or {}).get("steps")
    tower, tower_meta = load_tower(tower_dir)
    _check_same_tower(info, tower.cfg.to_dict(), tower_meta, tower_dir)
    model = LiTModel(tower, create_text_tower(text_cfg, embed_dim=tower.embed_dim), loss=loss, image_head=image_head)
    _load_weights(model, state, str(source.path))
    tower_state = {k: v for k, v in state.items() if k.startswith("image_tower.")}
    # A partly unlocked run changed the tower: its weights are the run's, not the tower file's.
    sha = _state_sha256(tower_state) if tower_state else tower_fingerprint(tower_dir)["tower_sha256"]
    facts = {"text": text_cfg.to_dict(), "image_tower": tower.cfg.to_dict(), "embed_dim": model.text_tower.embed_dim,
             "loss": loss, "image_head": image_head, "image_tower_sha256": sha, "tower_dir": str(tower_dir),
             "tower_meta": tower_meta, "step": step,
             "checkpoint": str(source.path) if source.kind == "checkpoint" else None,
             "preprocess": _preprocess_spec(tower.cfg.to_dict(), tower_meta.get("preprocess"))}
    return model.eval(), facts


def _load_export_pair(path: Path, config: dict) -> LiTModel:
    """An export folder → fp32 LiTModel (half-precision weights upcast exactly)."""
    if config.get("kind") != "pair":
        raise UserError(f"{path} is an image-only export (no text tower); load it with "
                        "lit_softmoe.load_image_tower(path)")
    if config.get("format", 0) > FORMAT_VERSION:
        raise UserError(f"{path} has export format {config['format']}, newer than this lit-softmoe reads "
                        f"({FORMAT_VERSION}); upgrade lit-softmoe")
    tower = VisionTransformer(ViTConfig.from_dict(config["image_tower"]), device="meta")
    text_cfg = TextTowerConfig.from_dict(config["text"])
    hf = text_cfg.kind == "hf"
    if hf:  # the architecture and tokenizer travel in the export; the original path may be gone
        text_cfg.path = str(path / TOKENIZER_DIR)
    with _hf_architecture_only() if hf else contextlib.nullcontext():
        text_tower = create_text_tower(text_cfg, embed_dim=config["embed_dim"])
    model = LiTModel(tower, text_tower, loss=config["loss"], image_head=config["image_head"])
    state = {k: v.float() if v.is_floating_point() else v
             for name in (IMAGE_WEIGHTS, TEXT_WEIGHTS) for k, v in load_weights(path / name).items()}
    check_state_dict(model, state, str(path))
    model.load_state_dict(state, assign=True)  # assign: the meta-device tower takes the loaded tensors
    model.lock_image_tower()
    return model.eval()


def _tokenizer_for(spec: str, context_length: int, export_dir: Path | None = None):
    if export_dir is not None and spec.startswith(HF_PREFIX):
        return create_tokenizer(f"{HF_PREFIX}{export_dir / TOKENIZER_DIR}", context_length)
    return create_tokenizer(spec, context_length)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu"):
    """(model, preprocess, tokenizer) from an export folder, a LiT run, its model/ folder or a checkpoint.

    `model.encode_image(preprocess(img)[None])` and `model.encode_text(tokenizer(["a cat"]))` give
    normalized embeddings (B, D); `model.pretrained_info` says what was loaded (source, kind,
    image_tower_sha256, the tower's config, the preprocessing). The model is fp32 in eval mode.
    """
    source = _classify(path)
    if source.kind == "tower":
        raise UserError(f"{path} is a pretrained image tower without a text tower; load it with "
                        "lit_softmoe.load_image_tower(path), or point to a LiT run trained against it")
    if source.kind == "export":
        config = _read_json(source.path / EXPORT_CONFIG)
        model = _load_export_pair(source.path, config)
        preprocess_spec, sha, tower_cfg = config["preprocess"], config["image_tower_sha256"], config["image_tower"]
        tokenizer = _tokenizer_for(config["tokenizer"]["spec"], config["tokenizer"]["context_length"], source.path)
        kind = "export"
    else:
        model, facts = _load_run_pair(source)
        preprocess_spec, sha, tower_cfg = facts["preprocess"], facts["image_tower_sha256"], facts["image_tower"]
        tokenizer = _tokenizer_for(model.text_tower.tokenizer_spec, model.text_tower.context_length)
        kind = "run"
    model.to(device)
    model.pretrained_info = {"source": str(path), "kind": kind, "image_tower_sha256": sha,
                             "image_tower": tower_cfg, "preprocess": preprocess_spec,
                             "tokenizer": getattr(model.text_tower, "tokenizer_spec", None)}
    return model, make_preprocess(preprocess_spec), tokenizer


def load_image_tower(path: str | Path, device: str | torch.device = "cpu"):
    """(tower, preprocess) from any export (pair or image-only), a tower folder, or a pretraining/LiT run.

    `tower.forward_features(preprocess(img)[None])` gives the pooled Soft MoE features (B, width);
    `tower.pretrained_info` is as in `load_pretrained`.
    """
    source = _classify(path)
    if source.kind == "export":
        config = _read_json(source.path / EXPORT_CONFIG)
        tower = VisionTransformer(ViTConfig.from_dict(config["image_tower"]), device="meta")
        state = {k[len("image_tower."):]: v.float() if v.is_floating_point() else v
                 for k, v in load_weights(source.path / IMAGE_WEIGHTS).items() if k.startswith("image_tower.")}
        check_state_dict(tower, state, str(source.path / IMAGE_WEIGHTS))
        tower.load_state_dict(state, assign=True)
        spec, sha, kind = config["preprocess"], config["image_tower_sha256"], "export"
    elif source.kind == "tower":
        tower, meta = load_tower(source.path)
        spec = _preprocess_spec(tower.cfg.to_dict(), meta.get("preprocess"))
        sha, kind = tower_fingerprint(source.path)["tower_sha256"], "run"
    else:
        model, facts = _load_run_pair(source)
        tower, spec, sha, kind = model.image_tower, facts["preprocess"], facts["image_tower_sha256"], "run"
    tower = tower.to(device).eval().requires_grad_(False)
    tower.pretrained_info = {"source": str(path), "kind": kind, "image_tower_sha256": sha,
                             "image_tower": tower.cfg.to_dict(), "preprocess": spec}
    return tower, make_preprocess(spec)


# ---- ONNX ---------------------------------------------------------------------------------------

class _ImageEncoder(nn.Module):
    def __init__(self, model: LiTModel | None = None, tower: VisionTransformer | None = None):
        super().__init__()
        self.model, self.tower = model, tower

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) → (B, D)
        return self.model.encode_image(pixels) if self.model is not None else self.tower.forward_features(pixels)


class _TextEncoder(nn.Module):
    def __init__(self, model: LiTModel):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, L) int64 → (B, D)
        return self.model.encode_text(ids)


@contextlib.contextmanager
def _silenced_output():
    """Send stdout and stderr to nowhere, Python's and the file descriptors both: the TorchScript
    exporter prints its whole graph (hundreds of lines) from C++ when it fails, past sys.stdout."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 1)
        os.dup2(nowhere.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _export_onnx(module: nn.Module, example: torch.Tensor, check: torch.Tensor, file: Path,
                 input_name: str, output_name: str, what: str) -> dict:
    """Export `module` with a dynamic batch axis, then check onnxruntime against PyTorch on `check`.

    Exporter: torch's default (dynamo=True, torch.export + onnxscript) exports both towers of
    torch 2.14 correctly (Soft MoE einsums, open_clip's argmax pooling); the older TorchScript
    exporter (dynamo=False) is the fallback when it raises. Output names must differ from every
    module path: "embedding" collides with open_clip's token embedding and makes an invalid model.
    """
    try:
        import onnxruntime
    except ImportError:
        raise UserError("--onnx needs onnx, onnxscript and onnxruntime: pip install 'lit-softmoe[onnx]'") from None
    module = module.eval()
    # > 2 GB of weights does not fit one protobuf: then the weights go to FILE.data beside it.
    external = sum(p.numel() * 4 for p in module.parameters()) > 1.5 * 2 ** 30
    errors = []
    for exporter in ("dynamo", "torchscript"):
        kwargs = (dict(dynamic_shapes={input_name: {0: torch.export.Dim("batch")}}) if exporter == "dynamo" else
                  dict(dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}}))
        try:
            # The exporter reports progress (and its optimizer's harmless constant-folding misses) on
            # stdout and stderr; the CLI prints one line, and a real failure raises anyway.
            with _silenced_output(), torch.no_grad():
                torch.onnx.export(module, (example,), str(file), input_names=[input_name], output_names=[output_name],
                                  dynamo=exporter == "dynamo", external_data=external, verbose=False, **kwargs)
            break
        except Exception as err:  # noqa: BLE001 — any exporter failure: try the other, then say why
            message = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()  # no terminal colour codes in the one line
            errors.append(f"{exporter}: {type(err).__name__}: {message.splitlines()[0] if message else ''}")
            for leftover in (file, file.with_name(file.name + ".data")):
                leftover.unlink(missing_ok=True)
    else:
        raise UserError(f"ONNX export of the {what} failed ({'; '.join(errors)}); export without --onnx")
    try:
        session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        ours = session.run(None, {input_name: check.numpy()})[0]  # (B, D)
    except Exception as err:  # noqa: BLE001
        raise UserError(f"onnxruntime cannot run the exported {what} ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0]}); export without --onnx") from None
    with torch.no_grad():
        reference = module(check)  # (B, D)
    difference = float((torch.from_numpy(ours) - reference).abs().max()) if ours.shape == reference.shape else math.inf
    # Embeddings are unit vectors; raw features (image-only export) are checked relative to their size.
    scale = max(1.0, float(reference.abs().max()))
    if not difference < ONNX_TOLERANCE * scale:
        raise UserError(f"the ONNX {what} differs from PyTorch by {difference:.3g} (max abs, tolerance "
                        f"{ONNX_TOLERANCE:g}); export without --onnx")
    return {"file": file.name, "exporter": exporter, "input": input_name, "output": output_name,
            "max_abs_diff": difference}


def _onnx_inputs(tower: VisionTransformer, tokenizer=None):
    """Example inputs (batch 2, traced) and check inputs (batch 3: proves the batch axis is dynamic)."""
    size, channels = tower.cfg.image_size, tower.cfg.in_channels
    pixels = torch.randn(5, channels, size, size, generator=torch.Generator().manual_seed(0))  # (5, C, H, W)
    if tokenizer is None:
        return pixels[:2], pixels[2:], None, None
    ids = tokenizer(["a photo of a cat.", "two dogs playing in the snow", "a t-shirt", "an ankle boot",
                     "a very long caption that goes on well past the context length of the text tower"])  # (5, L)
    return pixels[:2], pixels[2:], ids[:2], ids[2:]


# ---- tokenizer files ----------------------------------------------------------------------------

def _write_tokenizer(out: Path, spec: str, context_length: int, tokenizer) -> dict:
    """tokenizer.json (the `tokenizers` package, no torch) + the original files under tokenizer/."""
    from tokenizers import Tokenizer
    (out / TOKENIZER_DIR).mkdir()
    if spec == OPENCLIP_BPE:
        from open_clip.tokenizer import default_bpe
        shutil.copy(default_bpe(), out / TOKENIZER_DIR / Path(default_bpe()).name)
        fast = _openclip_bpe_as_tokenizers(tokenizer._bpe)
        pad_token = "!"  # id 0, open_clip's padding (it never names the token)
    else:
        hf = tokenizer._tokenizer
        hf.save_pretrained(out / TOKENIZER_DIR)
        fast = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        pad_token = hf.pad_token
    fast.enable_truncation(context_length)
    fast.enable_padding(pad_id=tokenizer.pad_id, pad_token=pad_token, length=context_length)
    fast.save(str(out / TOKENIZER_JSON))
    info = {"spec": spec, "context_length": context_length, "pad_id": tokenizer.pad_id,
            "vocab_size": tokenizer.vocab_size, "tokenizer_json": TOKENIZER_JSON, "files": TOKENIZER_DIR}
    if spec == OPENCLIP_BPE:
        info["tokenizer_json_differences"] = OPENCLIP_BPE_DIFFERENCES
    return info


# What tokenizer.json does not reproduce of open_clip's text clean-up (recorded in the export's config).
OPENCLIP_BPE_DIFFERENCES = (
    "tokenizer.json replays ftfy.fix_text's character fixes (curly quotes, ligatures, fullwidth forms, "
    "control characters, NFC), the common HTML entities (&amp; &lt; &gt; &quot; &#39; &apos; &nbsp;), whitespace "
    "clean-up and lower-casing; it cannot repair mojibake (ftfy's fix_encoding) or decode other HTML entities, "
    "so such text gets other ids than open_clip's tokenizer")


def _openclip_clean_normalizer():
    """`tokenizers` normalizers for open_clip's `basic_clean` (ftfy.fix_text, html.unescape twice),
    `whitespace_clean` and `lower()`. Without them everyday captions ("it’s", "“a photo”", "ﬁsh") get
    other ids in the ONNX path than in training and eval."""
    from ftfy.chardata import CONTROL_CHARS, DOUBLE_QUOTE_RE, LIGATURES, SINGLE_QUOTE_RE, WIDTH_MAP
    from tokenizers import Regex, normalizers

    def table(mapping: dict) -> list:  # {codepoint: replacement or None}, one Replace per replacement
        by_target: dict[str, list[str]] = {}
        for code, target in mapping.items():
            by_target.setdefault(target or "", []).append(chr(code))
        return [normalizers.Replace(Regex("[" + "".join(f"\\x{{{ord(c):x}}}" for c in chars) + "]"), target)
                for target, chars in by_target.items()]

    # ftfy.fix_text's steps that map characters, in its order (uncurl_quotes runs after the ligatures:
    # ŉ becomes ʼn, then 'n), ending with its NFC.
    steps = table(LIGATURES) + table(WIDTH_MAP) + [
        normalizers.Replace(Regex(DOUBLE_QUOTE_RE.pattern), '"'),
        normalizers.Replace(Regex(SINGLE_QUOTE_RE.pattern), "'")] + table(CONTROL_CHARS) + [normalizers.NFC()]
    # html.unescape for the entities captions carry; "&amp;" first and twice, as open_clip unescapes twice.
    steps += [normalizers.Replace("&amp;", "&"), normalizers.Replace("&amp;", "&")] + [
        normalizers.Replace(entity, char) for entity, char in
        (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&#39;", "'"), ("&apos;", "'"), ("&nbsp;", "\xa0"))]
    steps += [normalizers.Replace(Regex(r"\s+"), " "),
              # Python's lower() writes a word-final capital sigma as ς; Lowercase alone would give σ.
              normalizers.Replace(Regex(r"(?<=\p{L})Σ(?!\p{L})"), "ς"),
              normalizers.Lowercase()]
    return normalizers.Sequence(steps)


def _openclip_bpe_as_tokenizers(bpe):
    """open_clip's SimpleTokenizer as a `tokenizers` Tokenizer (the recipe of transformers' CLIPConverter).

    The normalizer replays what open_clip's `basic_clean` + `whitespace_clean` + `lower()` do, as far
    as a fixed normalizer can (`OPENCLIP_BPE_DIFFERENCES` says what is left).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get)
    fast = Tokenizer(models.BPE(vocab=dict(bpe.encoder), merges=merges, continuing_subword_prefix="",
                                end_of_word_suffix="</w>", fuse_unk=False))
    fast.normalizer = _openclip_clean_normalizer()
    fast.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                             behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast.decoder = decoders.ByteLevel()
    fast.post_processor = processors.TemplateProcessing(
        single="<start_of_text> $A <end_of_text>",
        special_tokens=[("<start_of_text>", bpe.sot_token_id), ("<end_of_text>", bpe.eot_token_id)])
    return fast


# ---- model card ---------------------------------------------------------------------------------

def _latest_eval(run_dir: Path | None, checkpoint: Path | None = None) -> tuple[Path, dict] | None:
    """The newest RUN/eval/*.json the eval suite wrote for the exported model, if any: the run's final
    model, or the exported `checkpoint` (a report on another model describes other weights)."""
    if run_dir is None or not (run_dir / "eval").is_dir():
        return None
    files = sorted((run_dir / "eval").glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for file in reversed(files):
        try:
            report = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(report, dict) or not isinstance(report.get("results"), list):
            continue
        evaluated = Path(str(report.get("model", "")))
        if (evaluated.parent.name == "checkpoints") != (checkpoint is not None):
            continue
        if checkpoint is not None and evaluated.name != checkpoint.name:  # another step of the run
            continue
        return file, report
    return None


def _percent(value) -> str:
    """A metric (a fraction) as the eval table shows it: a percentage with 2 decimals."""
    return f"{100 * value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _row(cells: list[str]) -> str:
    # Cells joined last: an empty list of metric columns (no benchmark ran) adds no phantom cell.
    return "| " + " | ".join(cells) + " |"


def _zeroshot_section(run_dir: Path | None, results: dict, checkpoint: Path | None = None) -> list[str]:
    latest = _latest_eval(run_dir, checkpoint)
    if latest is not None:
        file, report = latest
        rows = report["results"]
        metrics = list(dict.fromkeys(k for row in rows for k in (row.get("metrics") or {})))
        lines = [f"From `{file.name}` (suite `{report.get('suite', '?')}`, model `{report.get('model', '?')}`), "
                 "metrics in %:", "",
                 _row(["benchmark", "task", *metrics, "samples", "status"]),
                 "|" + "---|" * (len(metrics) + 4)]
        for row in rows:
            values = [_percent((row.get("metrics") or {}).get(m, "")) for m in metrics]
            status = row.get("status", "")
            if status in ("skipped", "failed") and row.get("reason"):
                status = f"{status}: {row['reason']}"
            lines.append(_row([str(row.get("benchmark", "")), str(row.get("task", "")), *values,
                               str(row.get("num_samples", "")), status]))
        return lines
    scores = {k: v for k, v in results.items() if k.startswith(("zeroshot_", "linear_probe_top1"))}
    if not scores:
        return ["No evaluation recorded."]
    return ["From the run's results.json (the LiT recipe's own eval set):", "", "| metric | % |", "|---|---|",
            *[f"| {k} | {_percent(v)} |" for k, v in scores.items()]]


def _tower_line(tower_cfg: dict, params: int, name: str | None) -> str:
    kind = {"soft": "Soft MoE", "tokens_choice": f"Tokens Choice (top-{tower_cfg.get('num_selected_experts', 1)})",
            "experts_choice": "Experts Choice"}.get(tower_cfg.get("moe_type", "soft"), tower_cfg.get("moe_type"))
    per_expert = f" × {tower_cfg.get('slots_per_expert', 1)} slot(s)" if tower_cfg.get("moe_type", "soft") == "soft" else ""
    moe = (f"{kind}, {tower_cfg['num_experts']} experts{per_expert} in blocks "
           f"{', '.join(map(str, tower_cfg['moe_layers']))}" if tower_cfg.get("moe_layers") else "dense")
    return (f"{name + ': ' if name else ''}ViT {tower_cfg['image_size']}px / patch {tower_cfg['patch_size']}, "
            f"{tower_cfg['in_channels']} channel(s), width {tower_cfg['width']}, depth {tower_cfg['depth']}, {moe}; "
            f"{params / 1e6:.2f}M parameters")


def _model_card(config: dict, model: LiTModel | None, tower: VisionTransformer, facts: dict,
                run_dir: Path | None, results: dict, out_dir: Path) -> str:
    pretrain = facts["tower_meta"].get("pretrain") or {}
    tower_params = sum(p.numel() for p in tower.parameters())
    title = "LiT image–text pair" if model is not None else "Soft MoE image tower"
    lines = [f"# {title} exported by lit-softmoe {config['lit_softmoe_version']}", "",
             f"Weights in {config['dtype']} safetensors; `image_tower_sha256` {config['image_tower_sha256']}.", "",
             "## Towers", "",
             f"- Image (locked): {_tower_line(config['image_tower'], tower_params, pretrain.get('tower'))}"]
    if model is not None:
        text = config["text"]
        text_params = sum(p.numel() for p in model.text_tower.parameters())
        shape = (f"open_clip text transformer, width {text['width']}, {text['layers']} layers, {text['heads']} heads"
                 if text["kind"] == "transformer" else f"Hugging Face encoder {text['path']} ({text['pooling']} pooling)")
        lines += [f"- Text (trained): {shape}, context {text['context_length']} tokens, tokenizer "
                  f"`{config['tokenizer']['spec']}`; {text_params / 1e6:.2f}M parameters",
                  f"- Embedding width {config['embed_dim']}, {config['loss']} loss, temperature "
                  f"{config['temperature']:.3f}" + (f", bias {config['logit_bias']:.3f}" if config.get("logit_bias") is not None
                                                   else "") + (", image head" if config["image_head"] else "")]
    lines += ["", "## Training", ""]
    if pretrain:
        lines.append(f"- Image tower: pretrained by `lit-softmoe pretrain` ({pretrain.get('config', '?')}), "
                     f"{pretrain.get('steps', '?')} steps in {pretrain.get('train_seconds', '?')} s"
                     + (f", test top-1 {_percent(pretrain['test_top1'])}%" if "test_top1" in pretrain else ""))
    pre_run = _run_config(run_dir) if run_dir is not None and model is None else {}
    if pre_run.get("data"):
        lines.append(f"- Pretraining data: train `{pre_run['data'].get('train')}`, test `{pre_run['data'].get('test')}`")
    if model is not None and run_dir is not None:
        run = _run_config(run_dir)
        data, evaluation = run.get("data") or {}, run.get("eval") or {}
        lines.append(f"- LiT data: `{data.get('train', '?')}`" + (" (cached image features)" if results.get("cached_features")
                                                                 else "") + f", eval `{evaluation.get('shards', '?')}`")
    if model is not None:
        lines.append(f"- LiT: {results.get('steps', facts.get('step', '?'))} steps in {results.get('train_seconds', '?')} s")
    if model is not None:
        checkpoint = Path(facts["checkpoint"]) if facts.get("checkpoint") else None
        lines += ["", "## Zero-shot", "", *_zeroshot_section(run_dir, results, checkpoint)]
    lines += ["", "## Use", "", "```python", "from lit_softmoe import " + ("load_pretrained" if model else "load_image_tower"),
              "", (f"model, preprocess, tokenizer = load_pretrained(\"{out_dir}\")" if model is not None else
                   f"tower, preprocess = load_image_tower(\"{out_dir}\")"),
              ("image = model.encode_image(preprocess(pil_image)[None])  # (1, D), normalized" if model is not None else
               "features = tower.forward_features(preprocess(pil_image)[None])  # (1, width)")]
    if model is not None:
        lines.append("text = model.encode_text(tokenizer([\"a photo of a cat\"]))  # (1, D), normalized")
    lines += ["```", "", "Without torch: onnxruntime + numpy + PIL (+ `tokenizers` for the text) — see "
              "`scripts/onnx_example.py` in lit-softmoe." if model is not None else
              "Without torch: `image_encoder.onnx` (pixels → image_features) with onnxruntime.", ""]
    return "\n".join(lines)


# ---- export -------------------------------------------------------------------------------------

def _check_out_dir(out_dir: Path, read_from: list[Path], overwrite: bool) -> None:
    """Refuse an --out that cannot be written, or whose replacement would delete what is exported."""
    check_writable(out_dir, "--out", folder=True)  # a file in the way, a read-only parent: before any work
    filled = out_dir.is_dir() and any(out_dir.iterdir())
    if filled and not overwrite:
        raise UserError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it, or pick another folder")
    # --overwrite replaces the whole folder: never a folder we read from (the run, its image tower and
    # the pretraining run around it) nor one holding it, and inside them only an earlier export
    # (RUN/checkpoints or the tower's run would be lost).
    target = out_dir.resolve()
    for protected in dict.fromkeys(path.resolve() for path in read_from):
        if target == protected or target in protected.parents:
            raise UserError(f"--out {out_dir} holds the model being exported ({protected}); pick another folder")
        if filled and protected in target.parents and not _is_export(out_dir):
            raise UserError(f"--out {out_dir} is inside {protected}, which this export reads, and is not an "
                            "earlier export: --overwrite would delete it; pick another folder")


def _is_export(path: Path) -> bool:
    try:
        return "format" in json.loads((path / EXPORT_CONFIG).read_text()) and (path / IMAGE_WEIGHTS).is_file()
    except (OSError, ValueError, TypeError):
        return False


def _read_from(source: _Source, tower_dir: Path | None = None) -> list[Path]:
    """The folders an export of `source` reads: the run (or model/checkpoint/tower folder), and for a
    pair the image tower with the pretraining run that holds it."""
    paths = [source.path, *([source.run_dir] if source.run_dir else [])]
    if tower_dir is not None:
        paths.append(tower_dir)
        if (tower_dir.parent / "config.yaml").is_file():
            paths.append(tower_dir.parent)
    return paths


def export_pair(run: str | Path, out_dir: str | Path, dtype: str = "fp32", onnx: bool = False,
                overwrite: bool = False) -> Path:
    """Export a finished LiT run (or a pretraining tower, image-only) to `out_dir`; returns `out_dir`.

    Written into a temporary sibling folder and renamed at the end: a failure leaves nothing behind
    and an existing `out_dir` untouched.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {list(DTYPES)}")
    source = _classify(run)
    if source.kind == "export":
        raise UserError(f"{run} is already an export; copy the folder instead of exporting it again")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, _read_from(source), overwrite)
    if source.kind == "tower":
        tower, tower_meta = load_tower(source.path)
        model = None
        facts = {"image_tower": tower.cfg.to_dict(), "tower_meta": tower_meta,
                 "image_tower_sha256": tower_fingerprint(source.path)["tower_sha256"],
                 "preprocess": _preprocess_spec(tower.cfg.to_dict(), tower_meta.get("preprocess"))}
        tower.eval().requires_grad_(False)
    else:
        model, facts = _load_run_pair(source)
        tower = model.image_tower
        _check_out_dir(out_dir, _read_from(source, Path(facts["tower_dir"])), overwrite)  # now the tower is known
    run_dir = source.run_dir
    results = _read_json(run_dir / "results.json") if run_dir and (run_dir / "results.json").is_file() else {}
    if source.kind == "checkpoint":
        # The run's results.json describes its final model, not this checkpoint: keep only what the
        # whole run shares, and take the step and training time from the checkpoint itself.
        state_meta = _read_json(source.path / STATE_META)
        seconds = state_meta.get("train_seconds")
        results = {"steps": state_meta.get("step"), "train_seconds": round(seconds, 1) if seconds is not None else "?",
                   **({"cached_features": results["cached_features"]} if "cached_features" in results else {})}

    # The state to write, in the export's dtype; the model then takes these exact (rounded) values
    # so that the ONNX graphs and their check see what a user loading the export gets.
    target = DTYPES[dtype]
    full = {f"image_tower.{k}": v for k, v in tower.state_dict().items()} if model is None else model.state_dict()
    state = {k: (v.to(target) if v.is_floating_point() else v).detach().contiguous().clone() for k, v in full.items()}
    image_state = {k: v for k, v in state.items() if k.startswith(("image_tower.", "image_head."))}
    text_state = {k: v for k, v in state.items() if k not in image_state}
    if dtype != "fp32":
        upcast = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        (model if model is not None else _Prefixed(tower)).load_state_dict(upcast)

    config = {"format": FORMAT_VERSION, "kind": "pair" if model is not None else "image",
              "lit_softmoe_version": _version(), "dtype": dtype, "image_tower": facts["image_tower"],
              "embed_dim": model.text_tower.embed_dim if model is not None else tower.embed_dim,
              "preprocess": facts["preprocess"], "image_tower_sha256": facts["image_tower_sha256"],
              "source": {"path": str(Path(run).resolve()), "tower": facts.get("tower_dir", str(source.path)),
                         "step": results.get("steps", facts.get("step"))}}
    if model is None:
        config["classnames"] = facts["tower_meta"].get("classnames")
    else:
        config.update({"text": facts["text"], "loss": facts["loss"], "image_head": facts["image_head"],
                       "temperature": float(model.log_scale.detach().exp().clamp(max=model.max_temperature)),
                       "logit_bias": float(model.logit_bias.detach()) if model.logit_bias is not None else None})

    tokenizer = (create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
                 if model is not None else None)

    def write(tmp: Path) -> None:
        save_file(image_state, tmp / IMAGE_WEIGHTS)
        if dtype != "fp32":  # other weights, other key (see the module docstring)
            config["image_tower_sha256"] = _sha256_file(tmp / IMAGE_WEIGHTS)
        if model is not None:
            save_file(text_state, tmp / TEXT_WEIGHTS)
            config["tokenizer"] = _write_tokenizer(tmp, model.text_tower.tokenizer_spec,
                                                   model.text_tower.context_length, tokenizer)
            if model.text_tower.tokenizer_spec.startswith(HF_PREFIX):
                model.text_tower.encoder.config.save_pretrained(tmp / TOKENIZER_DIR)  # the architecture
        if onnx:
            config["onnx"] = _write_onnx(tmp, model, tower, tokenizer)
        (tmp / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / MODEL_CARD).write_text(_model_card(config, model, tower, facts, run_dir, results, out_dir))

    try:
        # Without --overwrite, --out may only be absent or empty, also at the very end: the emptiness
        # check at the start does not settle it (two exports to one new --out both pass it).
        return write_folder_atomically(out_dir, write, replace=overwrite)
    except FolderTakenError:
        raise UserError(f"--out {out_dir} was written by another run while this export ran (it was absent "
                        "or empty when the export started), and is kept; pass --overwrite to replace it, or pick "
                        "another folder") from None


class _Prefixed(nn.Module):
    """A tower under the name `image_tower`, so its state dict has the export's key names."""

    def __init__(self, tower: VisionTransformer):
        super().__init__()
        self.image_tower = tower


def _write_onnx(tmp: Path, model: LiTModel | None, tower: VisionTransformer, tokenizer) -> dict:
    started = time.perf_counter()
    pixels, check_pixels, ids, check_ids = _onnx_inputs(tower, tokenizer)
    if model is None:
        image = _export_onnx(_ImageEncoder(tower=tower), pixels, check_pixels, tmp / IMAGE_ONNX, "pixels",
                             "image_features", "image tower")
        return {"image": image, "seconds": round(time.perf_counter() - started, 1)}
    image = _export_onnx(_ImageEncoder(model=model), pixels, check_pixels, tmp / IMAGE_ONNX, "pixels",
                         "image_embedding", "image tower")
    text = _export_onnx(_TextEncoder(model), ids, check_ids, tmp / TEXT_ONNX, "ids", "text_embedding", "text tower")
    return {"image": image, "text": text, "seconds": round(time.perf_counter() - started, 1)}
