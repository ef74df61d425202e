"""Review 5 of the zero-shot evaluation, the demo and export: blank caption lines counted as CLIP_benchmark
reads them, FER2013's Kaggle folders lined up with the shipped class names, the demo's results table when
a probe or an eval was skipped or failed, and two exports racing for one new --out."""
from __future__ import annotations

import pytest

TIMINGS = {"shards": 1.2, "pretrain": 30.4}


# ---- the demo's results table ------------------------------------------------------------------

def _table(shots=10, tower=None, lit=None, entry=None) -> dict:
    from lit_softmoe.demo import results_rows
    tower = {"params": 1_234_567, "test_top1": 0.81234, "fewshot10_top1": 0.65432} if tower is None else tower
    lit = {"linear_probe_top1": 0.85, "zeroshot_top1": 0.7} if lit is None else lit
    entry = {"status": "ok", "metrics": {"top1": 0.7512, "top5": 0.98765}} if entry is None else entry
    rows = results_rows("soft-tiny-p4", shots, tower, lit, entry, TIMINGS)
    assert len(rows) == len(dict(rows))  # one row per line of the table
    return dict(rows)


def test_demo_table_with_every_number():
    table = _table()
    assert table["image tower"] == "soft-tiny-p4 (1.23M params)"
    assert (table["tower test top-1 (classifier head)"], table["tower 10-shot linear probe"]) == ("0.8123", "0.6543")
    assert table["tower linear probe, all train images"] == "0.8500"
    assert (table["LiT zero-shot top-1 (unseen prompts)"], table["LiT zero-shot top-5"]) == ("0.7512", "0.9877")
    assert (table["time: pretrain"], table["time: total"]) == ("30 s", "32 s")


def test_demo_table_says_which_probe_was_skipped_and_why():
    tower = {"params": 1_000_000, "test_top1": 0.5,
             "fewshot_skipped": "the 10-shot linear probe is skipped: class 3 (dress) has 4 training images; "
                                "lower fewshot_shots (0 turns the probe off)"}
    lit = {"probe_skipped": "the linear probe is skipped: eval.probe_train p holds 1 sample(s), and it needs at least 2"}
    table = _table(tower=tower, lit=lit)
    assert table["tower 10-shot linear probe"] == \
        "skipped: class 3 (dress) has 4 training images; lower fewshot_shots (0 turns the probe off)"
    assert table["tower linear probe, all train images"] == \
        "skipped: eval.probe_train p holds 1 sample(s), and it needs at least 2"
    assert table["LiT zero-shot top-1 (unseen prompts)"] == "0.7512"
    off = _table(shots=0, tower={"params": 1_000_000, "test_top1": 0.5}, lit={})
    assert off["tower 0-shot linear probe"] == "off (fewshot_shots is 0)"
    assert off["tower linear probe, all train images"] == "not run (eval.probe_train is not set)"


@pytest.mark.parametrize("status, reason", [
    ("failed", "fashion-mnist: labels run from 0 to 11 but there are 10 class names; check classnames for d"),
    ("skipped", "fashion-mnist data folder not found at d; write it with `lit-softmoe data fashion-mnist --out d`"),
])
def test_demo_table_says_an_eval_that_did_not_run(status, reason):
    entry = {"benchmark": "fashion-mnist", "task": "classification", "status": status, "reason": reason, "path": "d"}
    table = _table(entry=entry)
    assert table["LiT zero-shot top-1 (unseen prompts)"] == table["LiT zero-shot top-5"] == f"{status}: {reason}"
    assert table["tower 10-shot linear probe"] == "0.6543"  # the numbers that exist are still shown
    two = _table(entry={"status": "ok", "metrics": {"top1": 0.5}})  # under 5 classes there is no top-5
    assert two["LiT zero-shot top-5"].startswith("not measured") and two["LiT zero-shot top-1 (unseen prompts)"] == "0.5000"
