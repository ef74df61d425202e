"""The prompts of a zero-shot benchmark: its class names and `{c}` templates, and where they came
from.

A benchmark without templates of its own does not silently borrow ImageNet's: the record names the
templates used and says when they are borrowed.
"""
from __future__ import annotations

from pathlib import Path

from lit_softmoe.config import BenchmarkConfig
from lit_softmoe.data.shards import read_classnames_file, read_lines
from lit_softmoe.errors import UserError
from lit_softmoe.evals.eval_data import EvalData
from lit_softmoe.metadata import BenchmarkInfo, benchmark_info, check_templates


def shipped_metadata(name: str) -> BenchmarkInfo | None:
    """The shipped class names and templates of benchmark `name`; None for a user's own
    benchmark."""
    try:
        return benchmark_info(name)
    except UserError:
        return None  # a user's own benchmark: its files must bring class names and templates


def _read_list(path: str, what: str) -> list[str]:
    lines = read_classnames_file(path) if what == "classnames" else read_lines(path)
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
    meta = shipped_metadata(spec.name)
    if spec.classnames:
        classnames = _read_list(spec.classnames, "classnames")
    elif data.format in ("wds", "imagefolder") and data.classnames:
        # the reader lined these up with its labels
        classnames = data.classnames
    elif meta is not None and meta.classnames:
        classnames = list(meta.classnames)
    else:
        classnames = data.classnames
    own_names = {spec.name, meta.name if meta is not None else spec.name}
    if spec.templates and Path(spec.templates).is_file():
        templates, source = (_read_list(spec.templates, "templates"),
                             {"from": spec.templates, "borrowed": False})
    elif spec.templates:
        other = shipped_metadata(spec.templates)
        if other is None or not other.templates:
            raise UserError(f"templates: {spec.templates!r} for {spec.name} is neither a file nor "
                            "a benchmark with templates; give a path or a name such as imagenet1k")
        templates = list(other.templates)
        source = {"from": other.templates_from, "borrowed": other.templates_from not in own_names}
    elif data.templates:
        templates, source = (data.templates,
                             {"from": f"{spec.name} (dataset files)", "borrowed": False})
    elif meta is not None and meta.templates:
        templates = list(meta.templates)
        source = {"from": meta.templates_from, "borrowed": meta.templates_from not in own_names}
    else:
        templates, source = None, {}
    if not classnames or not templates:
        missing = "class names" if not classnames else "templates"
        # Caption shards (`lit-softmoe data from-folder` writes no dataset_type.txt) are read as
        # classes.
        captions = " (or, for a set of images with .txt captions, set task: retrieval)" \
            if data.format == "wds" and not classnames else ""
        raise UserError(f"{spec.name}: no {missing}; put classnames.txt / "
                        "zeroshot_classification_templates.txt beside the split, or set "
                        f"{'classnames' if not classnames else 'templates'} in the suite{captions}")
    check_templates(templates, str(source.get("from", "templates")))
    source["count"] = len(templates)
    return classnames, templates, source
