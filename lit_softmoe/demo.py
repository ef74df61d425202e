"""`lit-softmoe demo`: the whole product on real data, end to end, with a headline per stage.

Fashion-MNIST → shards → pretrain the tiny Soft MoE tower → cache its features (embed) → LiT-train a
text tower against the locked tower → zero-shot eval suite (cross-checked with CLIP_benchmark when
it is installed) → export the pair with ONNX → load the export and classify five test images by
text prompts. Every stage skips work that is already done, so a second run only re-evaluates and
re-exports.
"""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import time
from pathlib import Path

from lit_softmoe.config import LiTConfig, PretrainConfig
from lit_softmoe.config_loading import config_path, load_config
from lit_softmoe.errors import UserError
from lit_softmoe.utils.atomic import naming_full_disk
from lit_softmoe.utils.paths import check_writable

# --fast: 5k train / 5k test images, 156 pretraining and 160 LiT steps: the whole pipeline, as a
# quick check. The same steps on 10k + 10k images took 81 s against 60 s (the test images are
# encoded four times: the tower's eval, embed, our eval and CLIP_benchmark's) for 0.6-0.9 points
# more top-1.
FAST_LIMIT = 5_000
FAST_PRETRAIN = ["epochs=4", "optim.warmup=0.32",  # 50 of 156 steps (39 batches of 128 an epoch)
                 "log_every=10", "checkpoint_every=1000"]
FAST_LIT = ["epochs=8", "optim.warmup=20", "eval.every=0", "log_every=10"]
# Each stage runs as its command (`_step` names it): messages name that command's flags.
_DATA_FLAGS = {"out_dir": "--out", "limit": "--limit", "overwrite": "--overwrite"}


def _headline(text: str) -> None:
    print(f"\n== {text}", flush=True)


@contextlib.contextmanager
def _step(command: str):
    """A step's mistake names the flags of the command it runs (`--out`, `--overwrite`), which the
    demo does not have: say which command that is, so the user can run it by hand or give other
    --data/--runs."""
    try:
        yield
    except UserError as err:
        raise UserError(f"{err} (the demo ran this step as `{command}`; or give the demo another "
                        "--data or --runs)") from None


def _peer_line(peer: dict) -> str:
    """What CLIP_benchmark's cross-check found; the headline promised one, so a failed or skipped
    one says why."""
    if peer.get("status") == "ok":
        run = (f"recorded by its run of {peer['seconds']:.0f} s on the unchanged model and files"
               if peer.get("cache") == "hit" else f"its run took {peer['seconds']:.0f} s")
        return ("CLIP_benchmark on the same model and files: top-1 "
                f"{100 * peer['metrics']['top1']:.2f} (largest gap "
                f"{peer['max_abs_diff_points']:.3f} points; {run})")
    return f"CLIP_benchmark cross-check {peer.get('status')}: {peer.get('reason', '')}"


def _reason(text: str) -> str:
    """A recorded skip reason without its own "the … probe is skipped: " lead (the cell says
    skipped)."""
    return text.split(" is skipped: ", 1)[-1]


def _probe_cell(results: dict, key: str, skipped_key: str, absent: str) -> str:
    """The number, or why it is not there: the stage's recorded skip reason, else `absent`."""
    if key in results:
        return f"{results[key]:.4f}"
    if results.get(skipped_key):
        return f"skipped: {_reason(results[skipped_key])}"
    return absent


def _eval_cell(entry: dict, metric: str) -> str:
    if entry.get("status") != "ok":
        return f"{entry.get('status', 'failed')}: {entry.get('reason', 'no reason recorded')}"
    value = entry.get("metrics", {}).get(metric)
    return f"{value:.4f}" if value is not None else f"not measured ({metric} is undefined here)"


def results_rows(tower_name: str, shots: int, tower_results: dict, lit_results: dict,
                 eval_entry: dict, timings: dict) -> list[tuple[str, str]]:
    """The demo's closing table as (what, value) rows. A probe that was skipped or an eval that was
    skipped or failed says so with its reason: indexing the missing numbers ended a long demo in a
    KeyError."""
    params = tower_results.get("params")
    return [("image tower",
             tower_name + (f" ({params / 1e6:.2f}M params)" if params is not None else "")),
            ("tower test top-1 (classifier head)",
             _probe_cell(tower_results, "test_top1", "", "not measured")),
            (f"tower {shots}-shot linear probe",
             _probe_cell(tower_results, f"fewshot{shots}_top1", "fewshot_skipped",
                         "off (fewshot_shots is 0)" if shots <= 0 else "not measured")),
            ("tower linear probe, all train images",
             _probe_cell(lit_results, "linear_probe_top1", "probe_skipped",
                         "not run (eval.probe_train is not set)")),
            ("LiT zero-shot top-1 (unseen prompts)", _eval_cell(eval_entry, "top1")),
            ("LiT zero-shot top-5", _eval_cell(eval_entry, "top5")),
            *[(f"time: {stage}", f"{seconds:.0f} s") for stage, seconds in timings.items()],
            ("time: total", f"{sum(timings.values()):.0f} s")]


def _classify_with_export(export_dir: Path, shards: Path, count: int = 5) -> list[dict]:
    """Load the export as a user would and pick, for each test image, the best of the class
    prompts."""
    import torch

    from lit_softmoe.evals.readers import read_benchmark
    from lit_softmoe.hub import load_pretrained
    model, preprocess, tokenizer = load_pretrained(export_dir)
    # the eval suite's own reader
    test = read_benchmark("fashion-mnist", shards, "test", preprocess)
    # (index, pixels, label) of the first `count`
    images = list(itertools.islice(test.dataset, count))
    classnames = test.classnames
    prompts = [f"a product photo of the {name}." for name in classnames]
    with torch.no_grad():
        zimg = model.encode_image(torch.stack([pixels for _, pixels, _ in images]))  # (count, D)
        ztxt = model.encode_text(tokenizer(prompts))  # (C, D)
        probs = (model.logit_scale.exp() * zimg @ ztxt.T).softmax(dim=-1)  # (count, C)
    return [{"label": classnames[label], "prompt": prompts[int(p.argmax())], "prob": float(p.max()),
             "right": int(p.argmax()) == label} for (_, _, label), p in zip(images, probs)]


def run_demo(data_dir: str = "data", runs_dir: str = "runs", fast: bool = False) -> dict:
    from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
    from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
    from lit_softmoe.evals.reports import markdown_table
    from lit_softmoe.evals.suite import run_suite
    from lit_softmoe.export import export_pair
    from lit_softmoe.export.onnx import onnx_summary
    from lit_softmoe.integrations.clip_benchmark import clip_benchmark_available
    from lit_softmoe.train.embed import embed_shards
    from lit_softmoe.train.lit import train_lit
    from lit_softmoe.train.pretrain import pretrain

    # before the first stage, not at the export 10 minutes in
    check_writable(data_dir, "--data", folder=True)
    check_writable(runs_dir, "--runs", folder=True)
    timings = {}
    name = f"fashion-mnist-{FAST_LIMIT // 1000}k" if fast else "fashion-mnist"
    shards = Path(data_dir) / name
    features = Path(data_dir) / f"{name}-features"
    run_root = Path(runs_dir) / ("demo-fast" if fast else "demo")

    _headline("1/7 Fashion-MNIST → webdataset shards")
    tic = time.perf_counter()
    with _step(f"lit-softmoe data fashion-mnist --out {shards}"
               + (f" --limit {FAST_LIMIT}" if fast else "")):
        # the shard writer's stream names no path when the disk fills
        with naming_full_disk(shards):
            summary = write_fashion_mnist_shards(shards, limit=FAST_LIMIT if fast else None,
                                                 setting_names=_DATA_FLAGS)
    counts = ", ".join(f"{n} {split}" for split, n in summary["samples"].items())
    print(f"{counts} images {'already there' if summary['skipped'] else 'written'} in {shards}")
    timings["shards"] = time.perf_counter() - tic

    _headline("2/7 pretrain the tiny Soft MoE tower on the class labels")
    tic = time.perf_counter()
    config = config_path(PretrainConfig, "pretrain/fmnist-soft-tiny")
    overrides = (FAST_PRETRAIN if fast else []) + [
        f"data.train={shards / 'train'}", f"data.test={shards / 'test'}",
        f"run_dir={run_root / 'pretrain'}"]
    with _step(f"lit-softmoe pretrain --config {config} {' '.join(overrides)}"):
        pretrain_cfg = load_config(PretrainConfig, config, overrides)
        tower_results = pretrain(pretrain_cfg)
    tower_dir = run_root / "pretrain" / "tower"
    timings["pretrain"] = time.perf_counter() - tic

    _headline("3/7 run the locked tower once over every image (feature cache)")
    tic = time.perf_counter()
    for split in ("train", "test"):
        with _step(f"lit-softmoe embed --tower {tower_dir} --shards {shards / split} "
                   f"--out {features}"):
            cached = embed_shards(tower_dir, str(shards / split), features, split=split)
        print(f"{split}: {cached['num_samples']} embeddings of width {cached['dim']} "
              f"{'already there' if cached['skipped'] else 'written'} in {features / split}")
    timings["embed"] = time.perf_counter() - tic

    _headline("4/7 LiT: train a text tower against the locked tower")
    tic = time.perf_counter()
    config = config_path(LiTConfig, "lit/fmnist-tiny")
    overrides = (FAST_LIT if fast else []) + [
        f"image_tower={tower_dir}", f"data.train={features / 'train'}",
        f"eval.shards={features / 'test'}", f"eval.probe_train={features / 'train'}",
        f"run_dir={run_root / 'lit'}"]
    with _step(f"lit-softmoe train --config {config} {' '.join(overrides)}"):
        lit_results = train_lit(load_config(LiTConfig, config, overrides))
    timings["lit"] = time.perf_counter() - tic

    peer = clip_benchmark_available()
    _headline("5/7 zero-shot eval suite" + (" (cross-checked with CLIP_benchmark)" if peer else ""))
    tic = time.perf_counter()
    suite = EvalSuiteConfig(name="fashion-mnist", cache_dir=str(Path(data_dir) / "eval-cache"),
                            benchmarks=[BenchmarkConfig(name="fashion-mnist", root=str(shards))])
    report = run_suite(run_root / "lit", suite, peer=peer)
    print(markdown_table(report))
    entry = report["results"][0]
    if entry.get("peer"):
        print(_peer_line(entry["peer"]))
    timings["eval"] = time.perf_counter() - tic

    with_onnx = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
    _headline("6/7 export the pair"
              + (" (safetensors + ONNX checked with onnxruntime)" if with_onnx else
                 " (safetensors; pip install 'lit-softmoe[onnx]' adds ONNX)"))
    tic = time.perf_counter()
    export_dir = export_pair(run_root / "lit", run_root / "export", onnx=with_onnx, overwrite=True)
    onnx = onnx_summary(json.loads((export_dir / "config.json").read_text()).get("onnx", {}))
    print(f"exported to {export_dir}" + (f" ({onnx})" if onnx else ""))
    timings["export"] = time.perf_counter() - tic

    _headline("7/7 load the export and classify five test images by text prompts")
    tic = time.perf_counter()
    picks = _classify_with_export(export_dir, shards)
    for i, pick in enumerate(picks):
        mark = "ok" if pick["right"] else "wrong"
        print(f"  test image {i} ({pick['label']}): \"{pick['prompt']}\" "
              f"p={pick['prob']:.2f} [{mark}]")
    timings["classify"] = time.perf_counter() - tic

    _headline("results")
    rows = results_rows(pretrain_cfg.tower.name, pretrain_cfg.fewshot_shots, tower_results,
                        lit_results, entry, timings)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    written = report.get("paths", {}).get("json")
    print(
        f"\nartifacts:\n  shards          {shards}\n  tower           {tower_dir}\n"
        f"  feature cache   {features}\n  LiT run         {run_root / 'lit'}\n"
        "  eval results    "
        f"{f'{written} (+ .md, .png)' if written else 'none written (the benchmark did not run)'}"
        "\n"
        f"  export          {export_dir} (README.md model card, *.safetensors, *.onnx, "
        "tokenizer.json)\n"
        f"  metrics, curves {run_root / 'pretrain'}, {run_root / 'lit'} (metrics.jsonl, "
        "curves.png)")
    return {"pretrain": tower_results, "lit": lit_results, "eval": report,
            "export": str(export_dir), "classified": picks, "timings": timings}
