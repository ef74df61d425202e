"""The zero-shot suite behind `lit-softmoe eval`: one model, the benchmarks of a suite file, one
results JSON (+ a Markdown table and a PNG bar chart).

Per benchmark: read the split (`zeroshot.datasets`), encode its images with the locked tower — or
load those features from the on-disk cache — then build the text classifier in large prompt
batches (or encode the captions) and score. What CLIP_benchmark's users keep tripping over is
handled on purpose (`../shared/reference/lit-and-zero-shot.md` §4):
- the image features are cached, keyed by the image tower's weights (sha256), its config, the
  preprocessing and the data files, so a new text tower against a locked image tower re-encodes only
  text (CLIP_benchmark re-encodes every image every time);
- a benchmark without templates of its own does not silently borrow ImageNet's: the result names the
  templates it used and says when they are borrowed;
- results are never overwritten silently; a benchmark whose data is absent is reported as skipped
  with the path looked for and what puts the data there, and the rest still run (a suite in which
  nothing ran writes no results and says so: `nothing_evaluated`).

The cache holds the tower's pooled `forward_features` (before any trainable image head), so it stays
valid for every text tower and head trained against the same locked tower.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.errors import UserError, check_writable
from lit_softmoe.data.shards import read_lines
from lit_softmoe.train.checkpoint import write_folder_atomically
from lit_softmoe.train.runtime import autocast_dtype, parse_device
from lit_softmoe.zeroshot.classifier import build_zeroshot_classifier, check_templates
from lit_softmoe.zeroshot.datasets import EvalData, MissingData, read_benchmark
from lit_softmoe.zeroshot.metrics import retrieval_metrics, zeroshot_metrics

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3  # 2: the key names the task and the image transform too; 3: a webdataset sample without
# .cls is skipped (cached as label -1 before, which failed its benchmark on every cache hit)
# The shipped suites (eval/*.yaml) read each benchmark from $LIT_SOFTMOE_BENCHMARKS/<name>, default
# data/<name>: where `lit-softmoe data fashion-mnist --out data/fashion-mnist` writes. It is not
# LIT_SOFTMOE_DATA, which names the folder of Fashion-MNIST's raw *-ubyte.gz downloads that
# `lit-softmoe data fashion-mnist` converts (the suites read shards, never the raw files).
BENCHMARKS_ENV = "LIT_SOFTMOE_BENCHMARKS"
RAW_DATA_ENV = "LIT_SOFTMOE_DATA"


def default_cache_dir() -> Path:
    return Path(os.environ.get("LIT_SOFTMOE_CACHE", Path.home() / ".cache" / "lit_softmoe")) / "eval"


# ---------------------------------------------------------------------------------- image features

def _autocast(device: torch.device, precision: str):
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def _collate(items: list[tuple]) -> tuple:
    good = [(i, image, target) for i, image, target in items if image is not None]
    indices = torch.tensor([i for i, _, _ in good], dtype=torch.long)
    images = torch.stack([image for _, image, _ in good]) if good else None
    return indices, images, [t for _, _, t in good], len(items) - len(good)


@torch.inference_mode()
def encode_images(model, data: EvalData, batch_size: int, workers: int, device: torch.device,
                  progress: bool = False, desc: str = "images", precision: str = "auto") -> tuple[torch.Tensor, list, int]:
    """→ (features (N, width) float32 in dataset order, targets (N,), skipped bad images)."""
    loader = DataLoader(data.dataset, batch_size=batch_size, num_workers=workers, collate_fn=_collate,
                        pin_memory=device.type == "cuda", persistent_workers=False)
    autocast = _autocast(device, precision)
    indices, features, targets, bad = [], [], [], 0
    for index, images, target, skipped in tqdm(loader, desc=desc, disable=not progress, leave=False):
        bad += skipped
        if images is None:
            continue
        with autocast:
            features.append(model.image_tower.forward_features(images.to(device, non_blocking=True)).float().cpu())
        indices.append(index)
        targets.extend(target)
    if not features:
        return torch.empty(0), [], bad
    order = torch.cat(indices).argsort()  # workers interleave samples; restore the dataset's order
    features = torch.cat(features)[order]  # (N, width)
    return features, [targets[i] for i in order.tolist()], bad


def _tower_hash(model) -> str:
    """The tower's state hash, computed once per state: every benchmark of a suite needs it, and a
    3.7B-parameter tower takes seconds to hash. A tensor written in place bumps its version counter
    and a replaced one has a new address, so either change recomputes it."""
    stamp = tuple((t.data_ptr(), t._version) for t in model.image_tower.state_dict().values())
    cached = getattr(model, "_eval_tower_hash", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, model.image_tower_state_hash())
        model._eval_tower_hash = cached
    return cached[1]


def _cache_key(model, spec: BenchmarkConfig, data: EvalData, device: torch.device, precision: str) -> str:
    """What the cached features and targets depend on. The tower is identified by its weights
    themselves (sha256 of the state), not by a recorded file hash: the same weights give the same key
    whether they came from a run, an export or memory, and a tower changed in memory never meets its
    old features.

    The task is part of the key because the cache holds the targets as well as the features: class
    indices for classification, captions for retrieval, read from the same files (a webdataset's task
    comes from the suite or from dataset_type.txt, neither of which the file signature covers). The
    transform's repr is too: a model handed in without `pretrained_info` has no recorded preprocessing,
    and its own transform is what the images went through (torchvision's repr spells out the sizes,
    mean and std; a transform whose repr is unstable only costs cache misses)."""
    info = getattr(model, "pretrained_info", None) or {}
    identity = {"format": CACHE_FORMAT, "tower_sha256": _tower_hash(model),
                "tower": model.image_tower.cfg.to_dict(), "preprocess": info.get("preprocess"),
                "transform": repr(getattr(data.dataset, "transform", None)),
                "benchmark": spec.name, "split": spec.split, "task": data.task, "reader": data.format,
                "data": data.signature, "precision": "bf16" if autocast_dtype(precision, device) else "fp32"}
    if data.task == "retrieval":  # the cached captions are the raw text now (blank lines kept, to be counted);
        identity["captions"] = "raw"  # caches of stripped text would undercount them. Classification keeps its key.
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_image_features(model, spec: BenchmarkConfig, data: EvalData, cfg: EvalSuiteConfig,
                          device: torch.device, cache_dir: Path | None, progress: bool) -> tuple:
    """(features, targets, bad, "hit" | "miss" | "off"): from the cache when it holds this key."""
    if cache_dir is None:
        return (*encode_images(model, data, cfg.batch_size, cfg.workers, device, progress, spec.name,
                               cfg.precision), "off")
    folder = cache_dir / _cache_key(model, spec, data, device, cfg.precision)
    if (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        return load_file(folder / "features.safetensors")["features"], meta["targets"], meta["bad"], "hit"
    features, targets, bad = encode_images(model, data, cfg.batch_size, cfg.workers, device, progress, spec.name,
                                           cfg.precision)

    def write(tmp: Path) -> None:
        save_file({"features": features.contiguous()}, tmp / "features.safetensors")
        (tmp / "meta.json").write_text(json.dumps({"benchmark": spec.name, "targets": targets, "bad": bad}))

    try:
        write_folder_atomically(folder, write)
    except OSError as err:  # a read-only ~/.cache, a full disk: the features are in hand, the suite goes on
        logger.warning("image features of %s not cached in %s (%s); set cache_dir= or pass --no-cache",
                       spec.name, cache_dir, err)
        return features, targets, bad, "off"
    return features, targets, bad, "miss"


# ---------------------------------------------------------------------------------- prompts

def _metadata(name: str):
    from lit_softmoe.zeroshot.metadata import benchmark_info
    try:
        return benchmark_info(name)
    except UserError:
        return None  # a user's own benchmark: its files must bring class names and templates


def _read_list(path: str, what: str) -> list[str]:
    lines = read_lines(path)
    if lines is None:
        raise UserError(f"{what} file {path} does not exist; give one entry per line")
    return lines


def resolve_prompts(spec: BenchmarkConfig, data: EvalData) -> tuple[list[str], list[str], dict]:
    """(class names, templates, a record of where the templates came from).

    Class names: the suite's file, else the dataset's own files for the CLIP_benchmark layout (as
    CLIP_benchmark reads them) or the names an ImageFolder reader lined up with its labels, else the
    shipped metadata, else what the files name.
    Templates: the suite's choice (a file, or another benchmark's name), else the dataset's own
    file, else the shipped metadata — which says when a benchmark has none and borrows ImageNet's.
    """
    meta = _metadata(spec.name)
    if spec.classnames:
        classnames = _read_list(spec.classnames, "classnames")
    elif data.format in ("wds", "imagefolder") and data.classnames:  # the reader lined these up with its labels
        classnames = data.classnames
    elif meta is not None and meta.classnames:
        classnames = list(meta.classnames)
    else:
        classnames = data.classnames
    own_names = {spec.name, meta.name if meta is not None else spec.name}
    if spec.templates and Path(spec.templates).is_file():
        templates, source = _read_list(spec.templates, "templates"), {"from": spec.templates, "borrowed": False}
    elif spec.templates:
        other = _metadata(spec.templates)
        if other is None or not other.templates:
            raise UserError(f"templates: {spec.templates!r} for {spec.name} is neither a file nor a benchmark "
                            "with templates; give a path or a name such as imagenet1k")
        templates = list(other.templates)
        source = {"from": other.templates_from, "borrowed": other.templates_from not in own_names}
    elif data.templates:
        templates, source = data.templates, {"from": f"{spec.name} (dataset files)", "borrowed": False}
    elif meta is not None and meta.templates:
        templates = list(meta.templates)
        source = {"from": meta.templates_from, "borrowed": meta.templates_from not in own_names}
    else:
        templates, source = None, {}
    if not classnames or not templates:
        missing = "class names" if not classnames else "templates"
        # Caption shards (`lit-softmoe data from-folder` writes no dataset_type.txt) are read as classes.
        captions = " (or, for a set of images with .txt captions, set task: retrieval)" \
            if data.format == "wds" and not classnames else ""
        raise UserError(f"{spec.name}: no {missing}; put classnames.txt / zeroshot_classification_templates.txt "
                        f"beside the split, or set {'classnames' if not classnames else 'templates'} in the suite"
                        f"{captions}")
    check_templates(templates, str(source.get("from", "templates")))
    source["count"] = len(templates)
    return classnames, templates, source


# ---------------------------------------------------------------------------------- one benchmark

@torch.inference_mode()
def _encode_texts(model, tokenizer, texts: list[str], batch_size: int, device, precision: str) -> torch.Tensor:
    autocast = _autocast(device, precision)
    out = []
    for start in range(0, len(texts), batch_size):
        with autocast:
            out.append(model.encode_text(tokenizer(texts[start:start + batch_size]).to(device)).float())
    return torch.cat(out)  # (M, D)


def evaluate_benchmark(model, preprocess, tokenizer, spec: BenchmarkConfig, cfg: EvalSuiteConfig,
                       device: torch.device, cache_dir: Path | None = None, progress: bool = False) -> dict:
    """One result entry: metrics, or status "skipped" with the reason and the path looked for."""
    tic = time.perf_counter()
    meta = _metadata(spec.name)
    try:
        data = _read(spec, preprocess)
    except MissingData as missing:
        return {"benchmark": spec.name, "task": spec.task or (meta.task if meta else "classification"),
                "status": "skipped", "reason": f"{missing}; {_missing_data_fix(spec)}", "path": missing.path}
    # Prompts first: a missing class list or a bad template is reported before the images are encoded.
    prompts = resolve_prompts(spec, data) if data.task == "classification" else None
    features, targets, bad, cache = cached_image_features(model, spec, data, cfg, device, cache_dir, progress)
    if len(targets) == 0 and bad and data.format == "wds" and data.task == "classification":
        # Caption shards read as classes (with a classnames.txt) have no .cls anywhere: a mistake, as
        # the README lists it, so failed with the fix rather than skipped.
        raise UserError(f"{spec.name}: none of the {bad} samples in {spec.root} has a readable image and a class "
                        "index (.cls); for a set of images with .txt captions, set task: retrieval")
    if len(targets) == 0:
        return {"benchmark": spec.name, "task": data.task, "status": "skipped", "path": str(spec.root),
                "reason": f"no readable images in {spec.root} ({bad} unreadable)"}
    uncaptioned = empty_captions = 0
    if data.task == "retrieval":
        # An image without a caption could only ever miss in image→text: it is left out and counted.
        # A blank line of a caption file is no caption here either, but CLIP_benchmark reads the file
        # with str.splitlines and keeps it as an empty caption (a query in text→image, a candidate in
        # image→text), so its recall@k can differ: they are counted (empty_captions) and said.
        lines = [c.splitlines() for c in targets]
        captions = [[t.strip() for t in group if t.strip()] for group in lines]
        empty_captions = sum(map(len, lines)) - sum(map(len, captions))
        if empty_captions:
            logger.warning("%s: %d blank caption line(s) left out; CLIP_benchmark scores them as empty captions, "
                           "so its recall@k can differ (remove the blank lines from the .txt files to agree)",
                           spec.name, empty_captions)
        keep = [i for i, group in enumerate(captions) if group]
        uncaptioned = len(targets) - len(keep)
        if not keep:
            return {"benchmark": spec.name, "task": data.task, "status": "skipped", "path": str(spec.root),
                    "reason": f"no captions in {spec.root} ({len(targets)} images, none with a caption); put the "
                              "captions in the samples' .txt files, or set task: classification if it is a class set"}
        features, targets, captions = features[keep], [targets[i] for i in keep], [captions[i] for i in keep]
    with torch.inference_mode():
        images = model.encode_image_features(features.to(device)).float()  # (N, D), normalized
        result = {"benchmark": spec.name, "task": data.task}
        if data.task == "classification":
            classnames, templates, source = prompts
            labels = torch.tensor(targets)
            if labels.min() < 0 or labels.max() >= len(classnames):
                raise UserError(f"{spec.name}: labels run from {labels.min()} to {labels.max()} but there are "
                                f"{len(classnames)} class names; check classnames for {spec.root}")
            with _autocast(device, cfg.precision):
                classifier = build_zeroshot_classifier(model.encode_text, tokenizer, classnames, templates,
                                                       batch_size=cfg.text_batch_size, device=device)
            result.update(metrics=zeroshot_metrics(images, labels, classifier), templates=source,
                          num_classes=len(classnames))
        else:
            texts = [t for group in captions for t in group]
            owner = torch.tensor([i for i, group in enumerate(captions) for _ in group])
            texts_emb = _encode_texts(model, tokenizer, texts, cfg.text_batch_size, device, cfg.precision)
            result.update(metrics=retrieval_metrics(images, texts_emb, owner.to(device), ks=tuple(cfg.recall_k)),
                          num_captions=len(texts), images_without_captions=uncaptioned,
                          empty_captions=empty_captions, templates=None)
    result.update(num_samples=len(targets), bad_samples=bad, image_cache=cache, format=data.format,
                  root=str(spec.root), split=spec.split, seconds=round(time.perf_counter() - tic, 2), status="ok")
    return result


def _read(spec: BenchmarkConfig, preprocess) -> EvalData:
    """The benchmark's split through its reader, told the shipped class list, wnids and task."""
    meta = _metadata(spec.name)
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
        return (f"{raw} holds raw *-ubyte.gz files, which the suites do not read: convert them with "
                f"`lit-softmoe data fashion-mnist --source {raw} --out data/fashion-mnist` and leave "
                f"{BENCHMARKS_ENV} unset (or set it to the folder holding fashion-mnist/)")
    legacy = os.environ.get(RAW_DATA_ENV)
    if legacy and root.name == spec.name and (Path(legacy) / spec.name).is_dir():
        # Suites once read LIT_SOFTMOE_DATA: a benchmark folder found there names the new variable.
        return (f"{Path(legacy) / spec.name} exists, but the suites read {BENCHMARKS_ENV}, not {RAW_DATA_ENV}; "
                f"set {BENCHMARKS_ENV}={legacy}")
    if spec.name == "fashion-mnist":
        return f"write it with `lit-softmoe data fashion-mnist --out {root}`"
    if root.name == spec.name:
        return f"put the data there, or set {BENCHMARKS_ENV}=DIR to read DIR/{spec.name}"
    return "put the data there, or change the benchmark's root: in the suite"


def _imagenet_wnids(meta) -> list[str] | None:
    wnids = getattr(meta, "wnids", None) if meta is not None else None
    return list(wnids) if wnids else None


# ---------------------------------------------------------------------------------- the suite

def _default_out(model_path: Path, suite: str) -> Path:
    """RUN/eval/SUITE[-step_N]-TIME.json for a model inside a run, else MODEL/eval/SUITE-TIME.json.

    Never inside a checkpoint or model/ folder: checkpoint pruning deletes step_N/ and a finished or
    resumed run replaces model/, results and all. RUN/eval/ is also where export's model card looks.
    """
    from lit_softmoe.export import _classify
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        source = _classify(model_path)
    except UserError:  # not a model folder (a handed-in model's label): loading reports it if it matters
        source = None
    if source is not None and source.run_dir is not None:
        step = f"-{source.path.name}" if source.kind == "checkpoint" else ""
        return source.run_dir / "eval" / f"{suite}{step}-{stamp}.json"
    folder = model_path if model_path.is_dir() else model_path.parent
    return folder / "eval" / f"{suite}-{stamp}.json"


def check_suite(cfg: EvalSuiteConfig) -> None:
    """Every entry names a benchmark and its data. An empty `root` is Path(""), the working directory:
    its subfolders would be read as class folders and scored as the benchmark, silently. recall_k's
    entries are ranks from 1: R@0 is 0 by definition and a negative k slices off the last ranks."""
    if not cfg.recall_k or any(k < 1 for k in cfg.recall_k):
        raise UserError(f"recall_k is {list(cfg.recall_k)}; give ranks of 1 or more, e.g. recall_k=[1,5,10]")
    for i, spec in enumerate(cfg.benchmarks, 1):
        if not spec.name.strip():
            raise UserError(f"suite {cfg.name}: benchmark {i} has no name:; give a shipped one (e.g. cifar100) "
                            "or one of your own")
        if not str(spec.root).strip():
            raise UserError(f"suite {cfg.name}: benchmark {spec.name} has no root:; set it to its data folder, "
                            f"e.g. root: ${{oc.env:{BENCHMARKS_ENV},data}}/{spec.name}")


def run_suite(model_path: str | Path, cfg: EvalSuiteConfig, benchmarks: list[str] | None = None,
              out: str | Path | None = None, overwrite: bool = False, device: str | None = None,
              use_cache: bool = True, peer: bool = False, progress: bool = False, model_bundle=None) -> dict:
    """Evaluate the model at `model_path` on the suite; write results JSON + Markdown + PNG."""
    check_suite(cfg)
    specs = cfg.benchmarks
    if benchmarks:
        known = {b.name for b in specs}
        unknown = [b for b in benchmarks if b not in known]
        if unknown:
            raise UserError(f"benchmark {unknown[0]!r} is not in suite {cfg.name}; it has: {', '.join(sorted(known))}")
        specs = [b for b in specs if b.name in benchmarks]
    out = Path(out) if out else _default_out(Path(model_path), cfg.name)
    if out.suffix.lower() in (".md", ".png"):  # the table and chart take --out's name with their suffix
        raise UserError(f"--out {out}: the Markdown table and PNG chart are written beside the results JSON "
                        f"under its name; give a .json path, e.g. {out.with_suffix('.json')}")
    check_writable(out, "--out", folder=False)  # now, not after the whole suite has run
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists; choose another --out or pass --overwrite")
    device = parse_device(device)  # a typo or a missing GPU: one line, not a traceback at the model's .to()
    if peer and cfg.precision == "auto":  # CLIP_benchmark runs with --no_amp: compare like with like
        cfg = dataclasses.replace(cfg, precision="fp32")
    if model_bundle is None:
        from lit_softmoe.export import load_pretrained
        model_bundle = load_pretrained(model_path, device=device)
    model, preprocess, tokenizer = model_bundle
    model.to(device).eval()
    cache_dir = (Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()) if use_cache else None

    results = []
    for spec in specs:
        try:
            entry = evaluate_benchmark(model, preprocess, tokenizer, spec, cfg, device, cache_dir, progress)
        except UserError as err:
            # One benchmark's mistake (labels past its class names, a bad templates file) is reported with
            # the rest; stopping here would lose the results the benchmarks before it already paid for.
            entry = {"benchmark": spec.name, "task": spec.task or "classification", "status": "failed",
                     "reason": str(err), "path": str(spec.root)}
            logger.warning("%s failed: %s", spec.name, err)
        if peer and entry["status"] == "ok" and entry["format"] == "wds":
            from lit_softmoe.zeroshot.peer import compare_with_clip_benchmark
            prompts = {}
            if entry["task"] == "classification":  # the prompts we scored, wherever they came from
                classnames, templates, _ = resolve_prompts(spec, _read(spec, preprocess))
                prompts = {"classnames": classnames, "templates": templates}
            entry["peer"] = compare_with_clip_benchmark(model_path, spec, entry, model_bundle,
                                                        recall_k=tuple(cfg.recall_k), **prompts)
        elif peer and entry["status"] == "ok":  # asked for, and not run: say so rather than leave it out
            entry["peer"] = {"status": "skipped", "reason": f"CLIP_benchmark is run on the webdataset layout only, "
                                                            f"and {spec.name} was read as {entry['format']}"}
            logger.warning("--peer: %s", entry["peer"]["reason"])
        results.append(entry)
        if progress:
            print(f"  {summary_line(entry)}", flush=True)
    evaluated = sum(entry["status"] == "ok" for entry in results)
    report = {"model": str(model_path), "suite": cfg.name, "device": str(device), "torch": torch.__version__,
              "created": dt.datetime.now().isoformat(timespec="seconds"), "evaluated": evaluated,
              "results": results}
    if evaluated == 0:  # nothing to report: no empty results files (and a rerun's --out stays free)
        report["paths"] = {}
        return report
    out = out if overwrite else _claim(out)
    write_report(report, out)
    report["paths"] = {"json": str(out), "markdown": str(out.with_suffix(".md")), "png": str(out.with_suffix(".png"))}
    return report


def _claim(out: Path) -> Path:
    """`out`, created empty here so that no other run can take it, or the first free `out-N` beside it.

    The check at the start does not settle it: two runs of a suite started in the same second (say
    --benchmarks a and b on two GPUs) get the same default name, both pass the check, and the second
    to finish replaced the first's results (CLIP_benchmark's #140). An explicit --out that appeared
    while the suite ran is kept too: the results go beside it, with a warning, rather than being lost.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = out if n == 1 else out.with_name(f"{out.stem}-{n}{out.suffix}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        if path != out:
            logger.warning("%s was written by another run while this one ran; results go to %s", out, path)
        return path


def nothing_evaluated(report: dict) -> str | None:
    """One line for a report in which no benchmark ran (each was skipped or failed), else None. run_suite
    writes no files then; `lit-softmoe eval` prints the skip reasons and this, and exits 2. The line
    carries the first skip reason, which names the fix (often the same for every benchmark)."""
    if report.get("evaluated", 1) > 0:
        return None
    results = report["results"]
    if not results:
        return f"nothing evaluated: suite {report['suite']} lists no benchmarks"
    first = f"{results[0]['benchmark']}: {results[0]['reason']}"
    if len(results) == 1:
        return f"nothing evaluated, so no results were written: {first}"
    how = "skipped or failed" if any(entry["status"] == "failed" for entry in results) else "skipped"
    return f"nothing evaluated, so no results were written: all {len(results)} benchmarks were {how} ({first}; …)"


def failed_benchmarks(report: dict) -> str | None:
    """One line naming the benchmarks that failed on a mistake in their data or suite entry (their
    reasons are in the results), else None; `lit-softmoe eval` prints it and exits 2."""
    failed = [entry for entry in report["results"] if entry["status"] == "failed"]
    if not failed:
        return None
    where = f"; the other results are in {report['paths']['json']}" if report.get("paths") else ""
    more = f" (and {len(failed) - 1} more benchmark(s) failed)" if len(failed) > 1 else ""
    return f"{failed[0]['benchmark']}: {failed[0]['reason']}{more}{where}"


# ---------------------------------------------------------------------------------- reports

_COLUMNS = ("top1", "top5", "mean_per_class_recall", "image_to_text_R@1", "image_to_text_R@5",
            "text_to_image_R@1", "text_to_image_R@5")


def summary_line(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"{entry['benchmark']}: {entry['status']} ({entry['reason']})"
    metrics = ", ".join(f"{k} {100 * v:.2f}" for k, v in entry["metrics"].items())
    return f"{entry['benchmark']}: {metrics} ({entry['num_samples']} images, {entry['seconds']:.1f} s, " \
           f"image cache {entry['image_cache']})"


def markdown_row(cells: list[str]) -> str:
    """One table row from its cells. Rows are built as lists and joined last: joining an empty list
    of metric columns in the middle of a row (nothing ran) would add a phantom cell."""
    return "| " + " | ".join(cells) + " |"


def markdown_separator(aligns: list[str]) -> str:
    return "|" + "".join(f"{align}|" for align in aligns)


def markdown_table(report: dict) -> str:
    present = {k for e in report["results"] if e["status"] == "ok" for k in e["metrics"]}
    columns = [c for c in _COLUMNS if c in present] + sorted(present - set(_COLUMNS))
    lines = [f"Zero-shot results of `{report['model']}` on suite `{report['suite']}` ({report['device']})", "",
             markdown_row(["benchmark", "task", *columns, "samples", "templates", "seconds"]),
             markdown_separator(["---", "---", *["---:"] * len(columns), "---:", "---", "---:"])]
    for entry in report["results"]:
        if entry["status"] != "ok":
            lines.append(markdown_row([entry["benchmark"], entry["task"], *[""] * len(columns), "",
                                       f"{entry['status']}: {entry['reason']}".replace("|", "\\|"), ""]))
            continue
        cells = [f"{100 * entry['metrics'][c]:.2f}" if c in entry["metrics"] else "–" for c in columns]
        templates = entry.get("templates") or {}
        used = f"{templates['from']} ×{templates['count']}" + (" (borrowed)" if templates.get("borrowed") else "") \
            if templates else "captions"
        lines.append(markdown_row([entry["benchmark"], entry["task"], *cells, str(entry["num_samples"]), used,
                                   f"{entry['seconds']:.1f}"]))
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = []
    for entry in report["results"]:
        if entry["status"] == "ok":
            for key in ("top1", "image_to_text_R@1", "text_to_image_R@1"):
                if key in entry["metrics"]:
                    bars.append((f"{entry['benchmark']}\n{key}", 100 * entry["metrics"][key]))
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(bars) + 1), 3.5))
    ax.bar(range(len(bars)), [v for _, v in bars], color="#4c72b0")
    for i, (_, value) in enumerate(bars):
        ax.text(i, value + 1, f"{value:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title(f"zero-shot: suite {report['suite']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    """JSON, Markdown and PNG side by side, each written to a temp file and renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, write in ((out, lambda p: p.write_text(json.dumps(report, indent=2) + "\n")),
                        (out.with_suffix(".md"), lambda p: p.write_text(markdown_table(report))),
                        (out.with_suffix(".png"), lambda p: plot_report(report, p))):
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        write(tmp)
        os.replace(tmp, path)
