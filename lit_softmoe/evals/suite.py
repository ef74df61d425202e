"""The zero-shot suite behind `lit-softmoe eval`: one model, the benchmarks of a suite file, one
results JSON (+ a Markdown table and a PNG bar chart).

Per benchmark (`evals.benchmark`): read the split (`evals.readers`), encode its images with the
locked tower — or load those features from the on-disk cache (`evals.features`) — then build the
text classifier from its prompts (`evals.prompts`) in large batches, or encode the captions, and
score. What CLIP_benchmark's users keep tripping over (its issues about re-encoding, borrowed
templates and overwritten results) is handled on purpose:
- the image features are cached, so a new text tower against a locked image tower re-encodes only
  text; so is `--peer`'s CLIP_benchmark result (`evals.peer`), so a rerun does not evaluate twice;
- a benchmark without templates of its own does not silently borrow ImageNet's;
- results are never overwritten silently; a benchmark whose data is absent is reported as skipped
  with the path looked for and what puts the data there, and the rest still run (a suite in which
  nothing ran writes no results and says so: `nothing_evaluated`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import logging
import os
import re
from pathlib import Path

import torch

from lit_softmoe.config import EvalSuiteConfig
from lit_softmoe.errors import UserError
from lit_softmoe.evals.benchmark import BENCHMARKS_ENV, evaluate_benchmark, read_split
from lit_softmoe.evals.features import default_cache_dir
from lit_softmoe.evals.peer import cross_check
from lit_softmoe.evals.prompts import resolve_prompts
from lit_softmoe.evals.reports import summary_line, write_report
from lit_softmoe.hub import load_pretrained
from lit_softmoe.model_folders import classify_folder
from lit_softmoe.models.inference import prepare_for_inference
from lit_softmoe.utils.atomic import process_alive
from lit_softmoe.utils.device import inference_dtype, parse_device
from lit_softmoe.utils.paths import check_writable

logger = logging.getLogger(__name__)


def _default_out(model_path: Path, suite: str) -> Path:
    """RUN/eval/SUITE[-step_N]-TIME.json for a model inside a run, else MODEL/eval/SUITE-TIME.json.

    Never inside a checkpoint or model/ folder: checkpoint pruning deletes step_N/ and a finished or
    resumed run replaces model/, results and all. RUN/eval/ is also where export's model card looks.
    """
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        source = classify_folder(model_path)
    except UserError:
        # not a model folder (a handed-in model's label): loading reports it if it matters
        source = None
    if source is not None and source.run_dir is not None:
        step = f"-{source.path.name}" if source.kind == "checkpoint" else ""
        return source.run_dir / "eval" / f"{suite}{step}-{stamp}.json"
    folder = model_path if model_path.is_dir() else model_path.parent
    return folder / "eval" / f"{suite}-{stamp}.json"


def check_suite(cfg: EvalSuiteConfig) -> None:
    """Every entry names a benchmark and its data. An empty `root` is Path(""), the working
    directory: its subfolders would be read as class folders and scored as the benchmark, silently.
    recall_k's entries are ranks from 1: R@0 is 0 by definition and a negative k slices off the last
    ranks."""
    if not cfg.recall_k or any(k < 1 for k in cfg.recall_k):
        raise UserError(f"recall_k is {list(cfg.recall_k)}; give ranks of 1 or more, "
                        "e.g. recall_k=[1,5,10]")
    for i, spec in enumerate(cfg.benchmarks, 1):
        if not spec.name.strip():
            raise UserError(f"suite {cfg.name}: benchmark {i} has no name:; give a shipped one "
                            "(e.g. cifar100) or one of your own")
        if not str(spec.root).strip():
            raise UserError(f"suite {cfg.name}: benchmark {spec.name} has no root:; set it to its "
                            f"data folder, e.g. root: ${{oc.env:{BENCHMARKS_ENV},data}}/"
                            f"{spec.name}")


def run_suite(model_path: str | Path, cfg: EvalSuiteConfig, benchmarks: list[str] | None = None,
              out: str | Path | None = None, overwrite: bool = False, device: str | None = None,
              use_cache: bool = True, peer: bool = False, progress: bool = False,
              model_bundle=None) -> dict:
    """Evaluate the model at `model_path` on the suite; write results JSON + Markdown + PNG."""
    check_suite(cfg)
    specs = cfg.benchmarks
    if benchmarks:
        known = {b.name for b in specs}
        unknown = [b for b in benchmarks if b not in known]
        if unknown:
            raise UserError(f"benchmark {unknown[0]!r} is not in suite {cfg.name}; "
                            f"it has: {', '.join(sorted(known))}")
        specs = [b for b in specs if b.name in benchmarks]
    out = Path(out) if out else _default_out(Path(model_path), cfg.name)
    if out.suffix.lower() in (".md", ".png"):
        # the table and chart take --out's name with their suffix
        raise UserError(f"--out {out}: the Markdown table and PNG chart are written beside the "
                        "results JSON under its name; give a .json path, e.g. "
                        f"{out.with_suffix('.json')}")
    check_writable(out, "--out", folder=False)  # now, not after the whole suite has run
    if out.exists() and not overwrite and not _stale_claim(out):
        raise UserError(f"{out} exists; choose another --out or pass --overwrite")
    # a typo or a missing GPU: one line, not a traceback at the model's .to()
    device = parse_device(device)
    if peer and cfg.precision == "auto":
        # CLIP_benchmark runs with --no_amp: compare like with like
        cfg = dataclasses.replace(cfg, precision="fp32")
    if model_bundle is None:
        model_bundle = load_pretrained(model_path, device=device)
    model, preprocess, tokenizer = model_bundle
    model.to(device).eval()
    # The locked tower in the dtype it runs in (bf16 on GPUs under precision auto), cast once.
    prepare_for_inference(model.image_tower, dtype=inference_dtype(cfg.precision, device))
    cache_dir = ((Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir())
                 if use_cache else None)

    results = []
    for spec in specs:
        try:
            entry = evaluate_benchmark(model, preprocess, tokenizer, spec, cfg, device, cache_dir,
                                       progress)
        except UserError as err:
            # One benchmark's mistake (labels past its class names, a bad templates file) is
            # reported with the rest; stopping here would lose the results the benchmarks before it
            # already paid for.
            entry = {"benchmark": spec.name, "task": spec.task or "classification",
                     "status": "failed", "reason": str(err), "path": str(spec.root)}
            logger.warning("%s failed: %s", spec.name, err)
        if peer and entry["status"] == "ok" and entry.get("partial"):
            # no agreement claimed on a part
            entry["peer"] = {"status": "skipped",
                             "reason": f"not compared on a partial split: {entry['partial']}"}
        elif peer and entry["status"] == "ok" and entry["format"] == "wds":
            data, prompts = read_split(spec, preprocess), {}
            if entry["task"] == "classification":  # the prompts we scored, wherever they came from
                classnames, templates, _ = resolve_prompts(spec, data)
                prompts = {"classnames": classnames, "templates": templates}
            entry["peer"] = cross_check(model_path, model_bundle, spec, data, entry,
                                        tuple(cfg.recall_k), prompts, cache_dir)
        elif peer and entry["status"] == "ok":
            # asked for, and not run: say so rather than leave it out
            entry["peer"] = {"status": "skipped",
                             "reason": f"CLIP_benchmark is run on the webdataset layout only, "
                                       f"and {spec.name} was read as {entry['format']}"}
            logger.warning("--peer: %s", entry["peer"]["reason"])
        results.append(entry)
        if progress:
            print(f"  {summary_line(entry)}", flush=True)
    evaluated = sum(entry["status"] == "ok" for entry in results)
    report = {"model": str(model_path), "suite": cfg.name, "device": str(device),
              "torch": torch.__version__,
              "created": dt.datetime.now().isoformat(timespec="seconds"), "evaluated": evaluated,
              "results": results}
    if evaluated == 0:  # nothing to report: no empty results files (and a rerun's --out stays free)
        report["paths"] = {}
        return report
    claimed = None if overwrite else _claim(out)
    out = claimed or out
    try:
        write_report(report, out)
    except BaseException:
        if claimed is not None:  # the empty file that held the name: a rerun must find --out free
            claimed.unlink(missing_ok=True)
        raise
    report["paths"] = {"json": str(out), "markdown": str(out.with_suffix(".md")),
                       "png": str(out.with_suffix(".png"))}
    return report


_CLAIM = "results of process {} to come\n"  # what a claimed name holds until its results replace it


def _claim(out: Path) -> Path:
    """`out`, created here holding this process's pid (`_CLAIM`) so that no other run can take it,
    or the first free `out-N` beside it.

    The check at the start does not settle it: two runs of a suite started in the same second (say
    --benchmarks a and b on two GPUs) get the same default name, both pass the check, and the second
    to finish replaced the first's results (CLIP_benchmark's #140). An explicit --out that appeared
    while the suite ran is kept too: the results go beside it, with a warning, rather than being
    lost. A claim whose process is gone (a run killed before its results were written) is free
    again.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = out if n == 1 else out.with_name(f"{out.stem}-{n}{out.suffix}")
        if _stale_claim(path):
            path.unlink(missing_ok=True)
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        with os.fdopen(descriptor, "w") as file:
            file.write(_CLAIM.format(os.getpid()))
        if path != out:
            logger.warning("%s was written by another run while this one ran; results go to %s",
                           out, path)
        return path


def _stale_claim(path: Path) -> bool:
    """Whether `path` holds a claim (`_CLAIM`) of a process that is gone: what a run killed before
    its results were written leaves."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 64:
            return False
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    match = re.fullmatch(_CLAIM.replace("{}", r"(\d+)"), text)
    return match is not None and not process_alive(int(match.group(1)))


def nothing_evaluated(report: dict) -> str | None:
    """One line for a report in which no benchmark ran (each was skipped or failed), else None.
    run_suite writes no files then; `lit-softmoe eval` prints the skip reasons and this, and
    exits 2. The line carries the first skip reason, which names the fix (often the same for every
    benchmark)."""
    if report.get("evaluated", 1) > 0:
        return None
    results = report["results"]
    if not results:
        return f"nothing evaluated: suite {report['suite']} lists no benchmarks"
    first = f"{results[0]['benchmark']}: {results[0]['reason']}"
    if len(results) == 1:
        return f"nothing evaluated, so no results were written: {first}"
    how = ("skipped or failed" if any(entry["status"] == "failed" for entry in results)
           else "skipped")
    return (f"nothing evaluated, so no results were written: all {len(results)} benchmarks were "
            f"{how} ({first}; …)")


def failed_benchmarks(report: dict) -> str | None:
    """One line naming the benchmarks that failed on a mistake in their data or suite entry (their
    reasons are in the results), else None; `lit-softmoe eval` prints it and exits 2."""
    failed = [entry for entry in report["results"] if entry["status"] == "failed"]
    if not failed:
        return None
    where = f"; the other results are in {report['paths']['json']}" if report.get("paths") else ""
    more = f" (and {len(failed) - 1} more benchmark(s) failed)" if len(failed) > 1 else ""
    return f"{failed[0]['benchmark']}: {failed[0]['reason']}{more}{where}"
