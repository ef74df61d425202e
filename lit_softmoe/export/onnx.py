"""ONNX graphs of an export: `image_encoder.onnx` (pixels → embedding) and `text_encoder.onnx`
(ids → embedding), each checked against PyTorch with onnxruntime before it is kept.

Each graph records the key of what it was exported from (`graph_key`: the module's weights and
layers, the traced input's shape, the names, and the versions of torch, onnx, onnxscript and
lit-softmoe). An `--overwrite` export over an export whose graph has the same key copies that
graph instead of exporting it again (torch's exporter takes seconds even for a tiny pair: 9 of the
19 s of a second `demo --fast`), and checks it against PyTorch as it checks a new one."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lit_softmoe import __version__
from lit_softmoe.errors import UserError, first_line
from lit_softmoe.model_folders import EXPORT_CONFIG, FILES_SHA256, IMAGE_ONNX, TEXT_ONNX
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.utils.hashing import cache_key, file_sha256, weights_sha256
from lit_softmoe.utils.versions import distribution_version

ONNX_TOLERANCE = 1e-4  # max abs difference of fp32 ONNX vs PyTorch embeddings


class _ImageEncoder(nn.Module):
    def __init__(self, model: LiTModel | None = None, tower: VisionTransformer | None = None):
        super().__init__()
        self.model, self.tower = model, tower

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) → (B, D)
        return (self.model.encode_image(pixels) if self.model is not None
                else self.tower.forward_pooled(pixels))


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
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 1)
        os.dup2(nowhere.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _graph_key(module: nn.Module, weights: str, example: torch.Tensor, input_name: str,
               output_name: str) -> str:
    """What the graph of `module` (whose weights have `weights_sha256` `weights`) traced on
    `example` is a function of (see the module's doc)."""
    return cache_key({"weights": weights, "layers": repr(module),
                      "example": [list(example.shape), str(example.dtype)],
                      "names": [input_name, output_name], "lit_softmoe": __version__,
                      "packages": {name: distribution_version(name)
                                   for name in ("torch", "onnx", "onnxscript")}}, length=64)


def previous_graphs(folder: Path) -> dict:
    """{file name: (its path, its entry)} of the ONNX graphs of the export in `folder` whose bytes
    are still those its config.json records; {} where there is none (or no readable config)."""
    try:
        config = json.loads((folder / EXPORT_CONFIG).read_text())
        entries = [entry for entry in config.get("onnx", {}).values()  # ours only: no other path
                   if isinstance(entry, dict) and entry.get("file") in (IMAGE_ONNX, TEXT_ONNX)
                   and entry.get("graph_key") and entry.get("exporter")]
        graphs = {}
        for entry in entries:
            path = folder / entry["file"]
            if path.is_file() and config[FILES_SHA256].get(entry["file"]) == file_sha256(path):
                graphs[entry["file"]] = (path, entry)
        return graphs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _export(module: nn.Module, example: torch.Tensor, file: Path, input_name: str,
            output_name: str, external: bool, what: str) -> str:
    """Write the graph of `module` traced on `example` to `file`; → the exporter that did.

    Exporter: torch's default (dynamo=True, torch.export + onnxscript) exports both towers of
    torch 2.14 correctly (Soft MoE einsums, open_clip's argmax pooling); the older TorchScript
    exporter (dynamo=False) is the fallback when it raises. Output names must differ from every
    module path: "embedding" collides with open_clip's token embedding and makes an invalid model.
    """
    errors = []
    for exporter in ("dynamo", "torchscript"):
        kwargs = (dict(dynamic_shapes={input_name: {0: torch.export.Dim("batch")}})
                  if exporter == "dynamo" else
                  dict(dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}}))
        try:
            # The exporter reports progress (and its optimizer's harmless constant-folding misses)
            # on stdout and stderr; the CLI prints one line, and a real failure raises anyway.
            with _silenced_output(), torch.no_grad():
                torch.onnx.export(module, (example,), str(file), input_names=[input_name],
                                  output_names=[output_name], dynamo=exporter == "dynamo",
                                  external_data=external, verbose=False, **kwargs)
            return exporter
        except Exception as err:  # noqa: BLE001 — any exporter failure: try the other, then say why
            # no terminal colour codes in the one line
            message = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
            errors.append(f"{exporter}: {type(err).__name__}: "
                          f"{message.splitlines()[0] if message else ''}")
            for leftover in (file, file.with_name(file.name + ".data")):
                leftover.unlink(missing_ok=True)
    raise UserError(f"ONNX export of the {what} failed ({'; '.join(errors)}); "
                    "export without --onnx")


def _export_onnx(module: nn.Module, example: torch.Tensor, check: torch.Tensor, file: Path,
                 input_name: str, output_name: str, what: str, weights: str | None,
                 previous: dict | None = None) -> dict:
    """Export `module` with a dynamic batch axis (or copy the graph of the same key that `previous`
    holds, see `previous_graphs`), then check onnxruntime against PyTorch on `check`. `weights`:
    the `weights_sha256` of the module's state; None for weights too large for one file
    (`write_onnx`)."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError("--onnx needs onnx, onnxscript and onnxruntime: "
                        "pip install 'lit-softmoe[onnx]'") from None
    module = module.eval()
    external = weights is None
    key = None if external else _graph_key(module, weights, example, input_name, output_name)
    path, entry = (previous or {}).get(file.name, (None, {}))
    reused = key is not None and entry.get("graph_key") == key
    if reused:
        shutil.copyfile(path, file)
        exporter = entry["exporter"]
    else:
        exporter = _export(module, example, file, input_name, output_name, external, what)
    try:
        session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        ours = session.run(None, {input_name: check.numpy()})[0]  # (B, D)
    except Exception as err:  # noqa: BLE001
        raise UserError(f"onnxruntime cannot run the exported {what} ({type(err).__name__}: "
                        f"{first_line(err)}); export without --onnx") from None
    with torch.no_grad():
        reference = module(check)  # (B, D)
    difference = (float((torch.from_numpy(ours) - reference).abs().max())
                  if ours.shape == reference.shape else math.inf)
    # Embeddings are unit vectors; raw features (image-only export) are checked relative to
    # their size.
    scale = max(1.0, float(reference.abs().max()))
    if not difference < ONNX_TOLERANCE * scale:
        raise UserError(f"the ONNX {what} differs from PyTorch by {difference:.3g} (max abs, "
                        f"tolerance {ONNX_TOLERANCE:g}); export without --onnx")
    return {"file": file.name, "exporter": exporter, "input": input_name, "output": output_name,
            "max_abs_diff": difference, "graph_key": key, "reused": reused}


def onnx_summary(onnx: dict) -> str:
    """An export's `onnx` entry as the CLI and the demo print it ("" for none)."""
    graphs = {side: info for side, info in onnx.items() if isinstance(info, dict)}
    if not graphs:
        return ""
    copied = any(info.get("reused") for info in graphs.values())
    return ("ONNX vs PyTorch max abs difference: "
            + ", ".join(f"{side} {info['max_abs_diff']:.1e}" for side, info in graphs.items())
            + ("; the unchanged model's ONNX graphs copied" if copied else ""))


def _onnx_inputs(tower: VisionTransformer, tokenizer=None):
    """Example inputs (batch 2, traced) and check inputs (batch 3: proves the batch axis is
    dynamic)."""
    size, channels = tower.cfg.image_size, tower.cfg.in_channels
    pixels = torch.randn(5, channels, size, size,
                         generator=torch.Generator().manual_seed(0))  # (5, C, H, W)
    if tokenizer is None:
        return pixels[:2], pixels[2:], None, None
    ids = tokenizer(["a photo of a cat.", "two dogs playing in the snow", "a t-shirt",
                     "an ankle boot",
                     "a very long caption that goes on well past the context length of the "
                     "text tower"])  # (5, L)
    return pixels[:2], pixels[2:], ids[:2], ids[2:]




def write_onnx(tmp: Path, model: LiTModel | None, tower: VisionTransformer, tokenizer,
               previous: dict | None = None) -> dict:
    """The graphs into `tmp`; `previous`: `previous_graphs` of the export being replaced."""
    started = time.perf_counter()
    pixels, check_pixels, ids, check_ids = _onnx_inputs(tower, tokenizer)
    # > 2 GB of weights does not fit one protobuf: then the weights go to FILE.data beside each
    # graph, and the graphs are exported again each time (a key covers one file). Both encoders
    # hold the whole pair (or the tower): its weights are hashed once, for both keys.
    source = tower if model is None else model
    external = sum(p.numel() * 4 for p in source.parameters()) > 1.5 * 2 ** 30
    weights = None if external else weights_sha256(source.state_dict())
    if model is None:
        image = _export_onnx(_ImageEncoder(tower=tower), pixels, check_pixels, tmp / IMAGE_ONNX,
                             "pixels", "image_features", "image tower", weights, previous)
        return {"image": image, "seconds": round(time.perf_counter() - started, 1)}
    image = _export_onnx(_ImageEncoder(model=model), pixels, check_pixels, tmp / IMAGE_ONNX,
                         "pixels", "image_embedding", "image tower", weights, previous)
    text = _export_onnx(_TextEncoder(model), ids, check_ids, tmp / TEXT_ONNX, "ids",
                        "text_embedding", "text tower", weights, previous)
    return {"image": image, "text": text, "seconds": round(time.perf_counter() - started, 1)}
