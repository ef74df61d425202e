"""One benchmark of a zero-shot suite: read its split, encode (or load) its image features, build
the text classifier from its prompts (or encode its captions) and score.

A benchmark whose data is absent is a result with status "skipped", the path looked for and what
puts the data there; the suite's other benchmarks still run.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.tar_reading import is_tar_archive
from lit_softmoe.errors import UserError
from lit_softmoe.evals.classifier import build_zeroshot_classifier
from lit_softmoe.evals.eval_data import EvalData, MissingData
from lit_softmoe.evals.features import cached_image_features
from lit_softmoe.evals.metrics import retrieval_metrics, zeroshot_metrics
from lit_softmoe.evals.prompts import resolve_prompts, shipped_metadata
from lit_softmoe.evals.readers import read_benchmark
from lit_softmoe.utils.device import autocast_context

logger = logging.getLogger(__name__)

# The shipped suites read each benchmark from $LIT_SOFTMOE_BENCHMARKS/<name>, default data/<name>:
# where `lit-softmoe data fashion-mnist --out data/fashion-mnist` writes. It is not
# LIT_SOFTMOE_DATA, which names the folder of Fashion-MNIST's raw *-ubyte.gz downloads that
# `lit-softmoe data fashion-mnist` converts (the suites read shards, never the raw files).
BENCHMARKS_ENV = "LIT_SOFTMOE_BENCHMARKS"
RAW_DATA_ENV = "LIT_SOFTMOE_DATA"


@torch.inference_mode()
def _encode_texts(model, tokenizer, texts: list[str], batch_size: int, device,
                  precision: str) -> torch.Tensor:
    autocast = autocast_context(device, precision)
    out = []
    for start in range(0, len(texts), batch_size):
        with autocast:
            out.append(model.encode_text(tokenizer(texts[start:start + batch_size]).to(device))
                       .float())
    return torch.cat(out)  # (M, D)


def evaluate_benchmark(model, preprocess, tokenizer, spec: BenchmarkConfig, cfg: EvalSuiteConfig,
                       device: torch.device, cache_dir: Path | None = None,
                       progress: bool = False) -> dict:
    """One result entry: metrics, or status "skipped" with the reason and the path looked for."""
    tic = time.perf_counter()
    meta = shipped_metadata(spec.name)
    try:
        data = read_split(spec, preprocess)
    except MissingData as missing:
        return {"benchmark": spec.name,
                "task": spec.task or (meta.task if meta else "classification"),
                "status": "skipped", "reason": f"{missing}; {_missing_data_fix(spec)}",
                "path": missing.path}
    # Prompts first: a missing class list or a bad template is reported before the images are
    # encoded.
    prompts = resolve_prompts(spec, data) if data.task == "classification" else None
    features, targets, bad, cache = cached_image_features(model, spec, data, cfg, device,
                                                          cache_dir, progress)
    if len(targets) == 0 and bad and data.format == "wds" and data.task == "classification":
        # Caption shards read as classes (with a classnames.txt) have no .cls anywhere: a mistake,
        # as the README lists it, so failed with the fix rather than skipped.
        raise UserError(f"{spec.name}: none of the {bad} samples in {spec.root} has a readable "
                        "image and a class index (.cls); for a set of images with .txt captions, "
                        "set task: retrieval")
    if len(targets) == 0:
        return {"benchmark": spec.name, "task": data.task, "status": "skipped",
                "path": str(spec.root),
                "reason": f"no readable images in {spec.root} ("
                          + (f"{bad} unreadable)" if bad
                             else "no sample could be read: see the shards named above)")}
    partial = _partial_read(spec, data, len(targets) + bad)
    uncaptioned = empty_captions = 0
    if data.task == "retrieval":
        # An image without a caption could only ever miss in image→text: it is left out and counted.
        # A blank line of a caption file is no caption here either, but CLIP_benchmark reads the
        # file with str.splitlines and keeps it as an empty caption (a query in text→image, a
        # candidate in image→text), so its recall@k can differ: they are counted (empty_captions)
        # and said.
        lines = [c.splitlines() for c in targets]
        captions = [[t.strip() for t in group if t.strip()] for group in lines]
        empty_captions = sum(map(len, lines)) - sum(map(len, captions))
        if empty_captions:
            logger.warning("%s: %d blank caption line(s) left out; CLIP_benchmark scores them as "
                           "empty captions, so its recall@k can differ (remove the blank lines "
                           "from the .txt files to agree)", spec.name, empty_captions)
        keep = [i for i, group in enumerate(captions) if group]
        uncaptioned = len(targets) - len(keep)
        if not keep:
            return {"benchmark": spec.name, "task": data.task, "status": "skipped",
                    "path": str(spec.root),
                    "reason": f"no captions in {spec.root} ({len(targets)} images, none with a "
                              "caption); put the captions in the samples' .txt files, or set "
                              "task: classification if it is a class set"}
        features, targets, captions = (features[keep], [targets[i] for i in keep],
                                       [captions[i] for i in keep])
    with torch.inference_mode():
        images = model.encode_image_features(features.to(device)).float()  # (N, D), normalized
        result = {"benchmark": spec.name, "task": data.task}
        if data.task == "classification":
            classnames, templates, source = prompts
            labels = torch.tensor(targets)
            if labels.min() < 0 or labels.max() >= len(classnames):
                raise UserError(f"{spec.name}: labels run from {labels.min()} to {labels.max()} "
                                f"but there are {len(classnames)} class names; check classnames "
                                f"for {spec.root}")
            with autocast_context(device, cfg.precision):
                classifier = build_zeroshot_classifier(model.encode_text, tokenizer, classnames,
                                                       templates, batch_size=cfg.text_batch_size,
                                                       device=device)
            result.update(metrics=zeroshot_metrics(images, labels, classifier), templates=source,
                          num_classes=len(classnames))
        else:
            texts = [t for group in captions for t in group]
            owner = torch.tensor([i for i, group in enumerate(captions) for _ in group])
            texts_emb = _encode_texts(model, tokenizer, texts, cfg.text_batch_size, device,
                                      cfg.precision)
            result.update(metrics=retrieval_metrics(images, texts_emb, owner.to(device),
                                                    ks=tuple(cfg.recall_k)),
                          num_captions=len(texts), images_without_captions=uncaptioned,
                          empty_captions=empty_captions, templates=None)
    result.update(num_samples=len(targets), bad_samples=bad, bad_shards=len(data.damaged_shards),
                  image_cache=cache, format=data.format, root=str(spec.root), split=spec.split,
                  seconds=round(time.perf_counter() - tic, 2), status="ok")
    if partial:
        result["partial"] = partial
    return result


def _partial_read(spec: BenchmarkConfig, data: EvalData, read: int) -> str | None:
    """Why the metrics cover only part of the split (its shards hold fewer samples than their
    sizes.json lists: truncated; img2dataset's _stats.json serves as one), or None. A cut at a
    sample boundary reads as a shorter, clean tar."""
    reasons = []
    if data.listed_samples is not None and read < data.listed_samples:
        reasons.append(f"{read} of the {data.listed_samples} samples that the sizes.json of "
                       f"{spec.root}/{spec.split} lists were read: its shards are truncated")
    no_tar = [url for url in data.damaged_shards if not is_tar_archive(url)]
    cut = [url for url in data.damaged_shards if url not in no_tar]
    if cut:
        reasons.append(f"{len(cut)} shard(s) end inside a sample (first: {cut[0]}) and were read "
                       "up to the damage")
    if no_tar:
        reasons.append(f"{len(no_tar)} shard(s) are no tar archive at all (empty, or another kind "
                       f"of file; first: {no_tar[0]}) and gave no sample")
    if not reasons:
        return None
    partial = f"{'; '.join(reasons)}, and the metrics cover the samples read only"
    logger.warning("%s: %s", spec.name, partial)
    return partial


def read_split(spec: BenchmarkConfig, preprocess) -> EvalData:
    """The benchmark's split through its reader, told the shipped class list, wnids and task."""
    meta = shipped_metadata(spec.name)
    return read_benchmark(spec.name, spec.root, spec.split, preprocess, spec.format,
                          classnames=list(meta.classnames) if meta and meta.classnames else None,
                          wnids=_imagenet_wnids(meta), annotations=spec.annotations,
                          task=spec.task or (meta.task if meta is not None else ""),
                          folder_aliases=dict(meta.folder_aliases) if meta is not None else None)


def _missing_data_fix(spec: BenchmarkConfig) -> str:
    """What puts a skipped benchmark's data where the suite looks (ends its skip reason)."""
    root = Path(spec.root)
    raw = next((d for d in (root, root.parent) if d.is_dir() and any(d.glob("*-ubyte.gz"))), None)
    if raw is not None:  # e.g. LIT_SOFTMOE_BENCHMARKS pointed at the raw downloads
        return (f"{raw} holds raw *-ubyte.gz files, which the suites do not read: convert them "
                f"with `lit-softmoe data fashion-mnist --source {raw} --out data/fashion-mnist` "
                f"and leave {BENCHMARKS_ENV} unset (or set it to the folder holding "
                "fashion-mnist/)")
    raw_root = os.environ.get(RAW_DATA_ENV)
    if raw_root and root.name == spec.name and (Path(raw_root) / spec.name).is_dir():
        # The benchmark's folder is under the raw downloads' variable: name the one the suites read.
        return (f"{Path(raw_root) / spec.name} exists, but the suites read {BENCHMARKS_ENV}, "
                f"not {RAW_DATA_ENV}; set {BENCHMARKS_ENV}={raw_root}")
    if spec.name == "fashion-mnist":
        return f"write it with `lit-softmoe data fashion-mnist --out {root}`"
    if root.name == spec.name:
        return f"put the data there, or set {BENCHMARKS_ENV}=DIR to read DIR/{spec.name}"
    return "put the data there, or change the benchmark's root: in the suite"


def _imagenet_wnids(meta) -> list[str] | None:
    wnids = getattr(meta, "wnids", None) if meta is not None else None
    return list(wnids) if wnids else None
