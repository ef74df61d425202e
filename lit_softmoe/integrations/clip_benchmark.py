"""Cross-check against the peer suite, CLIP_benchmark (LAION, PyPI `clip-benchmark`): our model is
registered as a model type of its own at run time (its `TYPE2FUNC` loader dict, the extension point
its README documents), and its own `clip_benchmark eval` runs on the same files.

Only the CLIP_benchmark webdataset layout is cross-checked: it is the one layout both suites read
offline from the same files. Its metric names are mapped onto ours:
acc1 → top1, acc5 → top5, mean_per_class_recall → mean_per_class_recall,
text_retrieval_recall@k (a caption for each image) → image_to_text_R@k,
image_retrieval_recall@k (an image for each caption) → text_to_image_R@k.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

logger = logging.getLogger(__name__)

MODEL_TYPE = "lit_softmoe"
PEER_BATCH_SIZE = 64  # CLIP_benchmark's own default
# path → (model, preprocess, tokenizer) already loaded in this process
_BUNDLES: dict[str, tuple] = {}


def clip_benchmark_available() -> bool:
    try:
        import clip_benchmark.cli  # noqa: F401
    except Exception:  # not installed, or one of its imports (pycocoevalcap, sklearn) missing
        return False
    return True


def _load_for_clip_benchmark(model_name: str, pretrained: str, cache_dir=None, device="cpu"):
    """CLIP_benchmark's loader signature → (model, transform, tokenizer); `pretrained`
    is our path."""
    if pretrained in _BUNDLES:
        return _BUNDLES[pretrained]
    from lit_softmoe.hub import load_pretrained
    return load_pretrained(pretrained, device=device)


def _accuracy_numpy2(output, target, topk=(1,)):
    """clip_benchmark 1.6.2's `accuracy`, formula unchanged, with `.item()` where it calls
    float() on a 1-element array — a TypeError under NumPy 2 (the released package fails every
    classification)."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


@contextlib.contextmanager
def _numpy2_accuracy():
    """CLIP_benchmark's `accuracy` replaced by `_accuracy_numpy2` for one run, then restored:
    the rest of the process (a user's own CLIP_benchmark runs) keeps the library as installed."""
    import clip_benchmark.metrics.zeroshot_classification as zeroshot
    with mock.patch.object(zeroshot, "accuracy", _accuracy_numpy2):
        yield


def register_with_clip_benchmark() -> None:
    """Add our loader to CLIP_benchmark's model types (`TYPE2FUNC`, the extension point
    it documents)."""
    import clip_benchmark.models as models
    if MODEL_TYPE not in models.TYPE2FUNC:
        models.TYPE2FUNC[MODEL_TYPE] = _load_for_clip_benchmark
        models.MODEL_TYPES.append(MODEL_TYPE)  # the CLI's --model_type choices are this same list


def clip_benchmark_cli(argv: list[str]) -> None:
    """CLIP_benchmark's own command line (`clip_benchmark ARGV`) in this process, with our towers
    registered with timm (so open_clip's `local-dir:` / `hf-hub:` load a Soft MoE export),
    our loader as `--model_type lit_softmoe`, and its NumPy-2 `accuracy` fix for this run only:
    `lit-softmoe clip-benchmark -- ARGV`."""
    from lit_softmoe.errors import UserError
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not clip_benchmark_available():
        raise UserError("CLIP_benchmark is not installed; pip install clip-benchmark")
    if not argv:
        raise UserError("give clip_benchmark's own arguments after --, e.g. lit-softmoe "
                        "clip-benchmark -- eval --model_type open_clip --model local-dir:EXPORT "
                        "--dataset wds/cifar10 --dataset_root DIR")
    from clip_benchmark import cli

    import lit_softmoe.integrations.timm  # noqa: F401 (timm.create_model must know our towers)
    register_with_clip_benchmark()
    saved_argv, sys.argv = sys.argv, ["clip_benchmark", *argv]
    try:
        with _numpy2_accuracy():
            cli.main()
    finally:
        sys.argv = saved_argv


def run_clip_benchmark(model_path: str | Path, dataset_root: str | Path, dataset_name: str,
                       split: str = "test", batch_size: int = PEER_BATCH_SIZE, workers: int = 0,
                       recall_k=(1, 5, 10), bundle=None, task: str = "", classnames=None,
                       templates=None, model_type: str = MODEL_TYPE) -> dict:
    """Run `clip_benchmark eval` in this process on a wds-layout dataset; → its metrics JSON.

    `model_type`: "lit_softmoe" (our loader, registered here) or "open_clip" (CLIP_benchmark's own
    open_clip loader on `local-dir:EXPORT`, an export's open_clip files; only our timm towers are
    registered, so nothing of ours loads the model).

    `task` ("classification" | "retrieval"): CLIP_benchmark otherwise picks it by the dataset's
    name, so a caption set of the user's own name is run as classification (and fails). `classnames`
    and `templates`: the prompts our suite used, handed over as its custom JSON files, so both score
    the same prompts even where the suite set them or the dataset has no files of its own."""
    from clip_benchmark import cli
    if model_type == "open_clip":
        import lit_softmoe.integrations.timm  # noqa: F401 (timm.create_model must know the
        # export's tower)
        model_args = ["--model", f"local-dir:{model_path}",
                      "--pretrained", "export"]  # open_clip ignores it
    elif model_type == MODEL_TYPE:
        register_with_clip_benchmark()
        model_args = ["--model", "lit-softmoe", "--pretrained", str(model_path)]
    else:
        raise ValueError(f"model_type {model_type!r}: use {MODEL_TYPE!r} or 'open_clip'")
    if bundle is not None:
        _BUNDLES[str(model_path)] = bundle
    nshards = Path(dataset_root, split, "nshards.txt")
    if nshards.is_file():  # its webdataset reader fails outright with fewer shards than workers
        workers = min(workers, int(nshards.read_text().strip()))
        workers = workers if workers > 1 else 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = ["clip_benchmark", "eval", "--model_type", model_type, *model_args,
                "--dataset", f"wds/{dataset_name}", "--dataset_root",
                str(dataset_root), "--split", split, "--no_amp", "--batch_size", str(batch_size),
                "--num_workers", str(workers), "--output", str(out), "--quiet",
                "--recall_k", *[str(k) for k in recall_k]]
        if task:
            argv += ["--task", f"zeroshot_{task}"]
        for flag, values in (("--custom_classname_file", classnames),
                             ("--custom_template_file", templates)):
            if values:  # keyed by the dataset's short name, which it looks up for wds/NAME
                path = Path(tmp) / f"{flag.strip('-')}.json"
                path.write_text(json.dumps({dataset_name: list(values)}))
                argv += [flag, str(path)]
        saved_argv, sys.argv = sys.argv, argv
        try:
            # Its webdataset calls predate webdataset 1.0's shardshuffle warning.
            with warnings.catch_warnings(), _numpy2_accuracy():
                warnings.simplefilter("ignore", UserWarning)
                cli.main()
        finally:
            sys.argv = saved_argv
            _BUNDLES.pop(str(model_path), None)
        return json.loads(out.read_text())


def in_our_names(metrics: dict) -> dict:
    renamed = {}
    for key, value in metrics.items():
        if key == "acc1":
            renamed["top1"] = value
        elif key == "acc5":
            renamed["top5"] = value
        elif key == "mean_per_class_recall":
            renamed[key] = value
        elif key.startswith("text_retrieval_recall@"):
            renamed[f"image_to_text_R@{key.split('@')[1]}"] = value
        elif key.startswith("image_retrieval_recall@"):
            renamed[f"text_to_image_R@{key.split('@')[1]}"] = value
    return renamed


def compare_with_clip_benchmark(model_path, spec, entry: dict, bundle=None, **kwargs) -> dict:
    """CLIP_benchmark's metrics for one of our result entries, and the largest gap in points.

    A CLIP_benchmark that fails is recorded as status "failed" with its error: the cross-check must
    not take the suite's own results down with it."""
    if not clip_benchmark_available():
        return {"status": "skipped",
                "reason": "clip-benchmark is not installed (pip install clip-benchmark)"}
    tic = time.perf_counter()
    try:
        run = run_clip_benchmark(model_path, spec.root, spec.name, spec.split, bundle=bundle,
                                 task=entry["task"], **kwargs)
    except Exception as err:  # its asserts, a dataset it cannot read …
        reason = f"clip_benchmark failed: {type(err).__name__}: {err}"
        # on the console too, not only in the results JSON
        logger.warning("%s: %s", spec.name, reason)
        return {"status": "failed", "reason": reason}
    return agreement(entry, in_our_names(run["metrics"]), round(time.perf_counter() - tic, 2))


def agreement(entry: dict, theirs: dict, seconds: float) -> dict:
    """The cross-check of our result `entry` against CLIP_benchmark's metrics `theirs` (in our
    names), from a run of `seconds`: the largest gap in points over the metrics both have."""
    shared = [k for k in entry["metrics"] if k in theirs]
    gap = max((abs(entry["metrics"][k] - theirs[k]) * 100 for k in shared), default=None)
    result = {"status": "ok", "metrics": theirs, "max_abs_diff_points": gap, "seconds": seconds}
    if entry.get("empty_captions"):  # a gap these explain is no disagreement of the metrics
        result["note"] = (f"CLIP_benchmark scores the {entry['empty_captions']} blank caption "
                          "line(s) we leave out as empty captions, so recall@k can differ")
    return result
