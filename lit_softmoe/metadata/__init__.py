"""Class names and prompt templates per zero-shot benchmark, shipped as package data (no network).

Follows CLIP_benchmark 1.6.2 (`clip_benchmark/datasets/builder.py`): the same canonical names, the
same class order (the label order of each dataset's reader), the same `{c}` templates and the same
fallback to ImageNet's templates for a benchmark without its own, except that the fallback is
reported in `templates_from` rather than done silently. ImageNet's 1000 names and 80 templates are
open_clip's (`open_clip/zero_shot_metadata.py`). Where each list came from is in `source` and in
SOURCES.md beside this file.

Aliases: a leading "wds/" (CLIP_benchmark's webdataset mirrors) and then "vtab/" are stripped, so
"wds/vtab/cifar100" → "cifar100"; "vtab/caltech101" → "caltech101_vtab" (VTAB's class list differs
from torchvision's); a few short names map to the canonical ones (`ALIASES`). Names are
case-insensitive.
"""
from __future__ import annotations

import difflib
import json
import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from lit_softmoe.errors import UserError

_HERE = Path(__file__).parent
TASKS = ("classification", "retrieval")
ALIASES = {
    "imagenet": "imagenet1k",
    "imagenet-1k": "imagenet1k",
    "imagenet_1k": "imagenet1k",
    "imagenet-v2": "imagenetv2",
    "imagenet-sketch": "imagenet_sketch",
    "imagenet_a": "imagenet-a",
    "imagenet_r": "imagenet-r",
    "imagenet_o": "imagenet-o",
    "fashion_mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "caltech101-vtab": "caltech101_vtab",
    "sst2": "renderedsst2",
    "kitti": "kitti_closest_vehicle_distance",
    "coco": "mscoco_captions",
    "mscoco": "mscoco_captions",
    "flickr": "flickr30k",
}
# Only these keep a distinct entry under "vtab/": the rest are the same classes as the plain name.
_VTAB_NAMES = {"caltech101": "caltech101_vtab"}
# Our own Fashion-MNIST names and prompts; CLIP_benchmark 1.6.2 ships none.
_FASHION_MNIST = "fashion-mnist"
# Label order of the idx files; readable, caption-friendly forms of the official names
# ("T-shirt/top", "Trouser", …, "Ankle boot").
FASHION_MNIST_CLASSNAMES = (
    "t-shirt", "trousers", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)
# Zero-shot prompts share no template with the training captions, so a zero-shot score measures
# transfer to new wordings rather than recall of the captions.
ZEROSHOT_TEMPLATES = (
    "a low resolution photo of the {c}.",
    "a grayscale photo of my {c}.",
    "a cropped photo of the {c}.",
    "a product photo of the {c}.",
    "a close-up photo of the {c}.",
    "a picture of one {c}.",
)


def check_templates(templates: Sequence[str], source: str = "templates") -> None:
    """Raise a UserError naming the first template that does not put the class name in as `{c}`.

    Checked up front, since a bad template otherwise fails only when the classifier is built (for
    LiT: after training), and one without a placeholder gives every class the same prompt.
    """
    if not templates:
        raise UserError(f"{source} holds no templates; "
                        "give one prompt per line, such as 'a photo of a {c}.'")
    for template in templates:
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(template)
                      if field is not None]
        except ValueError as err:  # a lone brace
            problem = f"is not a format string ({err})"
        else:
            others = [field for field in fields if field != "c"]
            if others:
                problem = f"has the placeholder {{{others[0]}}}"
            elif not fields:
                problem = "has no {c}, so every class would get the same prompt"
            else:
                continue
        raise UserError(f"{source}: template {template!r} {problem}; write the class name as "
                        "{c}, e.g. 'a photo of a {c}.' (a literal brace as {{ or }})")


@dataclass(frozen=True)
class BenchmarkInfo:
    """What zero-shot evaluation needs to know about one benchmark.

    `classnames[i]` is the name of label i. `templates_from` names the benchmark whose templates
    these are: the benchmark itself, or e.g. "imagenet1k" when it has none of its own (empty for
    retrieval). For the ImageNet family, `wnids[i]` is the WordNet id (the ImageFolder folder name)
    of label i, and `imagenet_indices[i]` its index among ImageNet-1k's 1000 classes.
    `folder_aliases` pairs the class-folder names a common copy of the set uses (Kaggle's FER2013
    `disgust/`, EuroSAT's `SeaLake/`) with the shipped class name each folder holds, for the
    image-folder reader; folders named after the class names themselves need no entry.
    """

    name: str
    task: str
    classnames: tuple[str, ...] | None
    templates: tuple[str, ...] | None
    templates_from: str
    source: str
    imagenet_indices: tuple[int, ...] | None = None
    wnids: tuple[str, ...] | None = None
    folder_aliases: tuple[tuple[str, str], ...] = ()  # (folder name, shipped class name)


@lru_cache(maxsize=None)
def _load(filename: str):
    return json.loads((_HERE / filename).read_text(encoding="utf-8"))


def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1k WordNet ids in label order (sorted, as torchvision's
    ImageNet/ImageFolder)."""
    return tuple(_load("imagenet_wnids.json"))


def list_benchmarks(task: str | None = None) -> list[str]:
    """Canonical benchmark names, sorted; only those of `task` ("classification"/"retrieval")
    if given."""
    if task is not None and task not in TASKS:
        raise UserError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    entries = {name: entry["task"] for name, entry in _load("benchmarks.json").items()}
    entries[_FASHION_MNIST] = "classification"
    return sorted(name for name, kind in entries.items() if task is None or kind == task)


def canonical_name(name: str) -> str:
    """Resolve aliases and "wds/" / "vtab/" prefixes to our canonical name
    (not checked to exist)."""
    key = name.strip().lower()
    key = key.removeprefix("wds/")
    if key.startswith("vtab/"):
        key = key.removeprefix("vtab/")
        key = _VTAB_NAMES.get(key, key)
    return ALIASES.get(key, key)


def benchmark_info(name: str) -> BenchmarkInfo:
    """Class names, templates and their provenance for benchmark `name` (aliases accepted)."""
    key = canonical_name(name)
    if key == _FASHION_MNIST:
        return _fashion_mnist_info()
    entries = _load("benchmarks.json")
    if key not in entries:
        known = list_benchmarks()
        close = difflib.get_close_matches(key, known + list(ALIASES), n=1)
        hint = f"did you mean {canonical_name(close[0])!r}? " if close else ""
        raise UserError(f"unknown benchmark {name!r}; {hint}(known: {', '.join(known)})")
    entry = entries[key]
    if entry["task"] == "retrieval":
        return BenchmarkInfo(key, "retrieval", None, None, "", entry["source"])
    indices = _imagenet_indices(key)
    return BenchmarkInfo(
        name=key,
        task=entry["task"],
        classnames=tuple(_load("classnames.json")[entry["classnames"]]),
        templates=tuple(_load("templates.json")[entry["templates"]]),
        templates_from=entry["templates"],
        source=entry["source"],
        imagenet_indices=indices,
        wnids=None if indices is None else tuple(imagenet_wnids()[i] for i in indices),
        folder_aliases=tuple(entry.get("folder_aliases", {}).items()),
    )


def _imagenet_indices(key: str) -> tuple[int, ...] | None:
    """ImageNet-1k label indices for the ImageNet family (all 1000, or a 200-class subset)."""
    if key in ("imagenet1k", "imagenetv2", "imagenet_sketch"):
        return tuple(range(1000))
    subset = _load("imagenet_subsets.json").get(key)
    return None if subset is None else tuple(subset)


def _fashion_mnist_info() -> BenchmarkInfo:
    return BenchmarkInfo(
        name=_FASHION_MNIST,
        task="classification",
        classnames=FASHION_MNIST_CLASSNAMES,
        templates=ZEROSHOT_TEMPLATES,
        templates_from=_FASHION_MNIST,
        source="lit_softmoe.metadata FASHION_MNIST_CLASSNAMES and ZEROSHOT_TEMPLATES (our own)",
    )
