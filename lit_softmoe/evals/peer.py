"""`--peer`: CLIP_benchmark's cross-check of a suite entry, recorded under what it depends on.

CLIP_benchmark evaluates the whole benchmark again with its own reader and loop: ~10 s for
Fashion-MNIST's 10,000 test images on one core, much longer for ImageNet. Its result is a function
of the model, the files and the settings, so a rerun of a suite on an unchanged model reads the
result recorded by the first run (`cache: "hit"` in the entry's `peer`), as `evals.features` reads
the image features. The key covers everything the result depends on: the whole model's weights (the
image tower, the text tower, the temperature), its preprocessing, the benchmark's files, split and
task, the prompts, recall@k, the batch size, and the versions of clip_benchmark and lit_softmoe
(whose loader runs our model inside CLIP_benchmark). The gap to our own metrics is computed again on
every run, and a CLIP_benchmark run that failed is not recorded: the next run tries again.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from lit_softmoe import __version__
from lit_softmoe.config import BenchmarkConfig
from lit_softmoe.evals.eval_data import EvalData
from lit_softmoe.evals.features import tower_hash
from lit_softmoe.integrations.clip_benchmark import (
    PEER_BATCH_SIZE,
    agreement,
    clip_benchmark_available,
    compare_with_clip_benchmark,
)
from lit_softmoe.utils.atomic import write_text_atomic
from lit_softmoe.utils.hashing import cache_key, weights_sha256
from lit_softmoe.utils.versions import distribution_version

logger = logging.getLogger(__name__)

PEER_FORMAT = 1  # in the key: a result recorded in another format is not read
PEER_FOLDER = "clip_benchmark"  # under the suite's cache folder


def peer_key(model, spec: BenchmarkConfig, data: EvalData, task: str, recall_k: tuple,
             prompts: dict) -> str:
    """The name of the recorded result: a hash of everything CLIP_benchmark's metrics depend on."""
    info = getattr(model, "pretrained_info", None) or {}
    rest = {k: v for k, v in model.state_dict().items() if not k.startswith("image_tower.")}
    identity = {"format": PEER_FORMAT, "image_tower_sha256": tower_hash(model),
                "rest_sha256": weights_sha256(rest), "preprocess": info.get("preprocess"),
                "transform": repr(getattr(data.dataset, "transform", None)),
                "benchmark": spec.name, "split": spec.split, "task": task, "data": data.signature,
                "prompts": prompts, "recall_k": list(recall_k), "batch_size": PEER_BATCH_SIZE,
                "clip_benchmark": distribution_version("clip-benchmark"),
                "lit_softmoe": __version__}
    return cache_key(identity, 32)


def _recorded(path: Path) -> dict | None:
    """The recorded metrics and seconds, or None (none recorded, or a file that does not parse)."""
    try:
        recorded = json.loads(path.read_text())
        return {"metrics": dict(recorded["metrics"]), "seconds": float(recorded["seconds"])}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("CLIP_benchmark result %s unreadable (%s); running it again", path, err)
        return None


def cross_check(model_path, bundle, spec: BenchmarkConfig, data: EvalData, entry: dict,
                recall_k: tuple, prompts: dict, cache_dir: Path | None) -> dict:
    """The entry's `peer`: CLIP_benchmark's metrics and the largest gap, recorded in
    `cache_dir/clip_benchmark/KEY.json` and read from there when the key is the same (no
    `cache_dir`: always run)."""
    path = None
    if cache_dir is not None and clip_benchmark_available():  # else nothing to key: it is skipped
        key = peer_key(bundle[0], spec, data, entry["task"], recall_k, prompts)
        path = cache_dir / PEER_FOLDER / f"{key}.json"
        recorded = _recorded(path)
        if recorded is not None:
            return {**agreement(entry, recorded["metrics"], recorded["seconds"]), "cache": "hit"}
    result = compare_with_clip_benchmark(model_path, spec, entry, bundle,
                                         recall_k=tuple(recall_k), **prompts)
    if path is None or result["status"] != "ok":
        return result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"metrics": result["metrics"],
                                            "seconds": result["seconds"]}) + "\n")
    except OSError as err:  # a read-only or full cache: the result is in hand all the same
        logger.warning("CLIP_benchmark result not recorded in %s (%s)", path, err)
        return {**result, "cache": "off"}
    return {**result, "cache": "miss"}
