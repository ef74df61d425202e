"""Training recipes as a demanding user reruns them (review 4), on 300 + 300 Fashion-MNIST images and a
soft-test-4e tower: a LiT probe without an eval set says it is skipped; a finished run rerun logs its
final evaluation once; pretrain's periodic evaluation runs in the main process only; the full linear
probe on a handful of samples picks its penalty by leave-one-out instead of an empty hold-out; a text
MLP of no width is refused."""
import json

import pytest

from lit_softmoe.config import PretrainConfig, load_config
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain

from lit_data import _lit

SKIPPED = ("the linear probe on eval.probe_train is skipped: there is no eval set to score it on (eval.shards is "
           "empty); set eval.shards to a labelled split to run it")


def test_a_probe_set_without_an_eval_set_is_skipped_with_a_warning_and_recorded(data, tmp_path, caplog):
    """The README's own-data command (`eval.shards=` over fmnist-tiny.yaml, which names a probe set)
    trained and silently reported no probe. It still runs, and says the probe was skipped: before
    training, at the end and in results.json, as pretrain does for its few-shot probe."""
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="lit_softmoe.train.lit"):
        results = train_lit(_lit(data, run, "steps=2", "eval.shards=", f"eval.probe_train={data / 'features' / 'train'}"))
    assert results["steps"] == 2 and "linear_probe_top1" not in results
    assert results["probe_skipped"] == SKIPPED
    assert json.loads((run / "results.json").read_text())["probe_skipped"] == SKIPPED
    assert [r.getMessage() for r in caplog.records if r.name == "lit_softmoe.train.lit"] == [SKIPPED, SKIPPED]
    # With an eval set the probe runs, and nothing is said to be skipped.
    results = train_lit(_lit(data, tmp_path / "with-eval", "steps=2", f"eval.probe_train={data / 'features' / 'train'}"))
    assert 0.0 <= results["linear_probe_top1"] <= 1.0 and "probe_skipped" not in results


def _png() -> bytes:
    from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist
    images, _ = read_fashion_mnist("test", allow_download=False)
    return _png_bytes(images[0])


def test_lit_probe_set_of_one_sample_is_skipped_not_scored(data, tmp_path):
    """One sample has no spread to standardize by: the probe scored NaN features (every test image
    the first class). The run still saves its model and records why the probe is missing."""
    from lit_softmoe.data.shards import write_split
    from lit_softmoe.train.embed import embed_shards
    one = tmp_path / "one"
    write_split(iter([{"png": _png(), "cls": b"3"}]), one, "train", samples_per_shard=10)
    (one / "classnames.txt").write_text((data / "fmnist" / "classnames.txt").read_text())
    embed_shards(data / "tower", str(one / "train"), tmp_path / "one-features", batch_size=10)
    run = tmp_path / "run"
    results = train_lit(_lit(data, run, "steps=2", f"eval.probe_train={tmp_path / 'one-features' / 'train'}"))
    assert "linear_probe_top1" not in results and 0.0 <= results["zeroshot_top1"] <= 1.0
    assert results["probe_skipped"] == (f"the linear probe is skipped: eval.probe_train "
                                        f"{tmp_path / 'one-features' / 'train'} holds 1 sample(s), and it needs at least 2")
    assert (run / "model" / "model.safetensors").is_file()


# ---- a finished run rerun logs its final evaluation once --------------------------------------------

def _pretrain_cfg(data, run, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
        "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=3", "precision=fp32", "log_every=1", *extra])


def test_pretrain_rerun_of_a_finished_run_logs_its_final_evaluation_once(data, tmp_path):
    """The rerun resumed at the last step, evaluated again and appended a second final record (and a
    third on the next rerun). Now the new evaluation replaces the old one; periodic ones stay."""
    run = tmp_path / "run"
    first = pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2"))
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], "loss" in r) for r in records] == [(1, True), (2, True), (2, False), (3, True), (4, True),
                                                           (4, False)]
    for _ in range(2):
        again = pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2"))
        assert read_metrics(run / "metrics.jsonl") == records
        assert again["test_top1"] == first["test_top1"] and again["fewshot3_top1"] == first["fewshot3_top1"]
    # Extended, the old final evaluation is a record of step 4 like any other, and the new one follows.
    pretrain(_pretrain_cfg(data, run, "steps=6", "eval_every=2"))
    steps = [(r["step"], "loss" in r) for r in read_metrics(run / "metrics.jsonl")]
    assert steps == [(1, True), (2, True), (2, False), (3, True), (4, True), (4, False), (5, True), (6, True),
                     (6, False)]


def test_lit_rerun_of_a_finished_run_logs_its_final_evaluation_once(data, tmp_path):
    run = tmp_path / "run"
    first = train_lit(_lit(data, run, "steps=4", "eval.every=2"))
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], "zeroshot_top1" in r) for r in records] == [(1, False), (2, False), (2, True), (3, False),
                                                                    (4, False), (4, True)]
    again = train_lit(_lit(data, run, "steps=4", "eval.every=2"))
    assert read_metrics(run / "metrics.jsonl") == records
    assert again["zeroshot_top1"] == first["zeroshot_top1"] == records[-1]["zeroshot_top1"]


# ---- pretrain's periodic evaluation runs in the main process only -----------------------------------

def test_pretrain_periodic_evaluation_runs_in_the_main_process_only(data, tmp_path, monkeypatch):
    """Under torchrun every process scored the whole test set at each eval_every step; only the main
    process's score was logged. Here one process plays a non-main rank of such a run."""
    from lit_softmoe.train import pretrain as recipe
    calls = []
    real_test_top1 = recipe._test_top1
    monkeypatch.setattr(recipe, "_test_top1", lambda *args: calls.append(1) or real_test_top1(*args))
    pretrain(_pretrain_cfg(data, tmp_path / "main", "steps=6", "eval_every=2", "fewshot_shots=0"))
    assert len(calls) == 2  # steps 2 and 4; the final evaluation is not _test_top1's

    class NonMain:  # the accelerator of a rank other than 0: the same, but not the main process
        def __init__(self, accelerator):
            self._accelerator = accelerator
        is_main_process = False

        def __getattr__(self, name):
            return getattr(self._accelerator, name)

    real_create = recipe.create_accelerator
    monkeypatch.setattr(recipe, "create_accelerator", lambda *args: NonMain(real_create(*args)))
    calls.clear()
    results = pretrain(_pretrain_cfg(data, tmp_path / "other", "steps=6", "eval_every=2", "fewshot_shots=0"))
    assert calls == [] and results["steps"] == 6 and "test_top1" not in results


@pytest.mark.slow
def test_two_process_pretrain_with_periodic_evaluation_logs_it_once(data, tmp_path):
    """The two gloo processes (torchrun) go on training while the main one evaluates."""
    import os
    import subprocess
    import sys
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("{}\n")
    run = tmp_path / "double"
    overrides = [f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
                 "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=0", "precision=fp32", "log_every=1",
                 "steps=6", "eval_every=2", "checkpoint_every=3"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29541", "-m", "lit_softmoe.cli", "pretrain", "--config", str(yaml_file),
                             *overrides], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    evaluations = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "test_top1" in r]
    assert evaluations == [2, 4, 6]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
