"""lit_softmoe.evals.suite: run_suite's numbers equal a direct computation, a suite's mistakes are refused
before any work, absent data is skipped, results are never overwritten and go to the run, and one failing
benchmark loses none of the others."""
from __future__ import annotations

import json
import os
from pathlib import Path

import PIL.Image
import pytest
import torch

from evalkit import (
    _class_folders,
    foolbox_images,
    needs_foolbox,
    raw_tar_samples,
    save_pair,
    suite_config,
    tiny_pair,
    wds_set,
    write_wds_benchmark,
)
from launch import python_command
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, suite, zeroshot_metrics
from lit_softmoe.evals.suite import run_suite

pytestmark = needs_foolbox


def test_suite_equals_a_direct_computation(fmnist, tmp_path):
    bundle = tiny_pair()
    model, preprocess, tokenizer = bundle
    report = run_suite("tiny", suite_config(fmnist, tmp_path / "cache"), out=tmp_path / "r.json", model_bundle=bundle)
    entry = report["results"][0]
    samples = raw_tar_samples(fmnist / "test")
    with torch.no_grad():
        images = model.encode_image(torch.stack([preprocess(im) for im, _ in samples]))
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer,
                                               (fmnist / "classnames.txt").read_text().split("\n")[:10],
                                               (fmnist / "zeroshot_classification_templates.txt")
                                               .read_text().split("\n")[:-1])
    expected = zeroshot_metrics(images, torch.tensor([label for _, label in samples]), classifier)
    assert entry["num_samples"] == len(samples) == 300
    for key, value in expected.items():
        assert entry["metrics"][key] == pytest.approx(value, abs=1e-6), key
    assert entry["templates"] == {"from": "fashion-mnist (dataset files)", "borrowed": False, "count": 6}
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["results"][0]["metrics"] == entry["metrics"] and on_disk["suite"] == "t"
    assert "| fashion-mnist |" in (tmp_path / "r.md").read_text()
    assert PIL.Image.open(tmp_path / "r.png").size[0] > 100


def test_absent_benchmark_is_skipped_with_its_path_and_the_rest_run(fmnist, tmp_path):
    cfg = suite_config(fmnist, tmp_path / "cache")
    cfg.benchmarks.insert(0, BenchmarkConfig(name="cifar100", root=str(tmp_path / "nowhere")))
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    skipped, ran = report["results"]
    assert skipped["status"] == "skipped" and skipped["path"] == str(tmp_path / "nowhere")
    assert ran["status"] == "ok" and ran["num_samples"] == 300
    # The table gives the reason (what was looked for and what puts it there), as the console does.
    assert str(tmp_path / "nowhere") in skipped["reason"]
    assert f"skipped: {skipped['reason']}" in (tmp_path / "r.md").read_text()


def test_results_are_never_overwritten_silently(fmnist, tmp_path):
    cfg = suite_config(fmnist, tmp_path / "cache")
    out = tmp_path / "r.json"
    out.write_text("{}")
    with pytest.raises(UserError, match="exists; choose another --out or pass --overwrite"):
        run_suite("m", cfg, out=out, model_bundle=tiny_pair())
    assert out.read_text() == "{}"
    run_suite("m", cfg, out=out, overwrite=True, model_bundle=tiny_pair())
    assert json.loads(out.read_text())["results"][0]["status"] == "ok"
    with pytest.raises(UserError, match="not in suite t"):
        run_suite("m", cfg, benchmarks=["cifar10"], out=tmp_path / "x.json", model_bundle=tiny_pair())


def test_default_results_go_to_the_run_and_survive_checkpoint_pruning(fmnist, tmp_path):
    # A checkpoint folder is deleted by pruning and model/ is replaced when a run finishes: results
    # written inside either would be lost, so the default --out is RUN/eval/, the step in the name.
    from evalkit import save_pair
    from lit_softmoe.config import LiTConfig, to_yaml
    from lit_softmoe.train.checkpoint import prune_checkpoints, save_training_state
    run = save_pair(tmp_path / "pair")
    (run / "config.yaml").write_text(to_yaml(load_config(LiTConfig, None, [  # as the recipe writes it
        f"run_dir={run}", f"image_tower={tmp_path / 'pair' / 'pretrain' / 'tower'}", "text.width=32",
        "text.layers=1", "text.heads=2", "text.context_length=16"])))
    model, _, _ = tiny_pair()
    optimizer = torch.optim.AdamW([p for p in model.text_tower.parameters()])
    # A checkpoint describes its pair as model/config.json does (the recipe's model_description).
    description = {k: v for k, v in json.loads((run / "model" / "config.json").read_text()).items() if k != "results"}
    step = save_training_state(run / "checkpoints" / "step_00000006", 6, model, optimizer,
                               meta={"model": description}, skip_prefixes=("image_tower.",))
    cfg = suite_config(fmnist, tmp_path / "cache")
    from_step = run_suite(step, cfg)["paths"]["json"]
    from_model = run_suite(run / "model", cfg)["paths"]["json"]
    assert Path(from_step).parent == Path(from_model).parent == run / "eval"
    assert Path(from_step).name.startswith("t-step_00000006-") and Path(from_model).name.startswith("t-2")
    for s in (8, 10):  # training goes on and keeps 2 checkpoints: step 6 goes
        save_training_state(run / "checkpoints" / f"step_{s:08d}", s, model, optimizer, meta={"model": description},
                            skip_prefixes=("image_tower.",))
    prune_checkpoints(run / "checkpoints", 2)
    assert not step.exists() and Path(from_step).is_file() and Path(from_model).is_file()


def test_a_suite_in_which_nothing_ran_says_so_and_writes_nothing(tmp_path):
    from lit_softmoe.evals.reports import markdown_table
    from lit_softmoe.evals.suite import nothing_evaluated
    cfg = EvalSuiteConfig(name="s", workers=0, benchmarks=[
        BenchmarkConfig(name="imagenet1k", root=str(tmp_path / "imagenet1k"), split="val"),
        BenchmarkConfig(name="cifar100", root=str(tmp_path / "cifar100"))])
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 0 and [e["status"] for e in report["results"]] == ["skipped", "skipped"]
    assert list(tmp_path.iterdir()) == [] and report["paths"] == {}
    line = nothing_evaluated(report)
    assert line.startswith("nothing evaluated, so no results were written: all 2 benchmarks were skipped "
                           f"(imagenet1k: imagenet1k data folder not found at {tmp_path / 'imagenet1k'}; put") and \
        "\n" not in line
    one = {**report, "results": report["results"][1:]}
    assert nothing_evaluated(one) == ("nothing evaluated, so no results were written: cifar100: "
                                      f"{report['results'][1]['reason']}")
    assert "set LIT_SOFTMOE_BENCHMARKS=DIR to read DIR/cifar100" in nothing_evaluated(one)
    # The table of such a report: every row has as many cells as the header (no phantom column).
    rows = [line for line in markdown_table(report).splitlines() if line.startswith("|")]
    assert len(rows) == 4
    assert {row.count("|") for row in rows} == {6}, rows  # benchmark, task, samples, templates, seconds


def test_a_benchmark_without_root_or_name_is_refused(tmp_path, monkeypatch):
    # Path("") is the working directory: without the check, its subfolders were read as a class set.
    _class_folders(tmp_path, ["a", "b"])
    monkeypatch.chdir(tmp_path)
    for spec, words in ((BenchmarkConfig(name="cifar100"), "cifar100 has no root"),
                        (BenchmarkConfig(root=str(tmp_path)), "benchmark 1 has no name")):
        cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"), benchmarks=[spec])
        with pytest.raises(UserError, match=words):
            run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))
    assert not (tmp_path / "o.json").exists()


def test_two_runs_finishing_on_one_default_path_keep_both_results(tmp_path, monkeypatch):
    # Two evals of one suite started in the same second (e.g. --benchmarks a and b on two GPUs) got the
    # same default name; both passed the check at the start and the second overwrote the first.
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    taken = [tmp_path / "eval" / "s-20260101-000000.json"]  # the path the other run writes
    monkeypatch.setattr(suite, "_default_out", lambda model_path, name: taken[0])
    evaluate = suite.evaluate_benchmark

    def other_run_finishes_first(*args, **kwargs):
        taken[0].parent.mkdir(exist_ok=True)
        taken[0].write_text('{"other": "run"}')
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(suite, "evaluate_benchmark", other_run_finishes_first)
    report = run_suite(tmp_path / "m", cfg, model_bundle=tiny_pair(3, 32))
    assert json.loads(taken[0].read_text()) == {"other": "run"}
    mine = report["paths"]["json"]
    assert mine == str(taken[0].with_name("s-20260101-000000-2.json"))
    assert json.loads(open(mine).read())["results"][0]["status"] == "ok"
    # An explicit --out that appeared during the run is not replaced either (without --overwrite).
    taken[0] = tmp_path / "mine.json"
    report = run_suite(tmp_path / "m", cfg, out=taken[0], model_bundle=tiny_pair(3, 32))
    assert json.loads(taken[0].read_text()) == {"other": "run"} and report["paths"]["json"] != str(taken[0])
    report = run_suite(tmp_path / "m", cfg, out=taken[0], overwrite=True, model_bundle=tiny_pair(3, 32))
    assert report["paths"]["json"] == str(taken[0]) and "results" in json.loads(taken[0].read_text())


@pytest.mark.parametrize("link", ["loop", "dangling", "loop on the way"])
def test_an_out_that_is_a_link_to_nothing_is_refused_not_written_elsewhere(tmp_path, link):
    """A looping or dangling link as --out: its name was taken (O_EXCL), so the results silently went
    to loop-2.json beside it."""
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    if link == "dangling":
        out = part = tmp_path / "r.json"
        part.symlink_to(tmp_path / "gone" / "r.json")
        problem = f"is a symbolic link to {tmp_path / 'gone' / 'r.json'}, which does not exist"
    else:
        part = tmp_path / "loop.json" if link == "loop" else tmp_path / "loop"
        part.symlink_to(part.name)
        out = part if link == "loop" else part / "r.json"
        problem = "is a symbolic link that loops"
    with pytest.raises(UserError) as caught:
        run_suite("m", cfg, out=out, model_bundle=tiny_pair(3, 32))
    where = f"--out {out}" if out == part else f"--out {out}: {part}"
    assert str(caught.value) == f"{where} {problem}; remove the link (rm {part}) or give another --out"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cifar10", part.name])  # nothing written elsewhere


@pytest.mark.parametrize("fails", ["writing the chart", "renaming the table"])
def test_a_full_disk_leaves_no_part_of_the_results_and_the_rerun_writes_them(tmp_path, monkeypatch, fails):
    """ENOSPC after the JSON left a complete r.json without r.md and r.png at their final names, and the
    same command, rerun once there was space, refused: "r.json exists; pass --overwrite"."""
    import errno
    import os

    from lit_softmoe.evals import reports
    from lit_softmoe.utils import atomic
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    out = tmp_path / "results" / "r.json"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails == "writing the chart":
        monkeypatch.setattr(reports, "plot_report", full)
    else:
        real_replace = os.replace
        monkeypatch.setattr(atomic.os, "replace", lambda a, b: full() if str(b).endswith(".md") else real_replace(a, b))
    with pytest.raises(OSError, match="No space left"):
        run_suite("m", cfg, out=out, model_bundle=tiny_pair(3, 32))
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no results, no temporaries, no claimed name
    monkeypatch.undo()
    report = run_suite("m", cfg, out=out, model_bundle=tiny_pair(3, 32))  # the same command, without --overwrite
    assert report["paths"]["json"] == str(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json", "r.md", "r.png"]
    assert json.loads(out.read_text())["results"][0]["status"] == "ok"


def test_out_naming_the_markdown_or_png_is_refused(tmp_path):
    # The Markdown and PNG go beside --out with its suffix swapped: --out r.md wrote the JSON, then
    # replaced it with the table.
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    for name in ("r.md", "r.PNG"):
        with pytest.raises(UserError, match="give a .json path"):
            run_suite("m", cfg, out=tmp_path / name, model_bundle=tiny_pair(3, 32))
    assert not list(tmp_path.glob("r.*"))


def test_a_failing_benchmark_loses_none_of_the_others_results(tmp_path, capsys):
    # A mistake in one entry (here a caption set read as classes) ended the suite with the results of
    # the benchmarks before it, already computed, unwritten.
    from lit_softmoe import cli
    images = foolbox_images("imagenet")[:3]
    captions = write_wds_benchmark(tmp_path / "caps", [(p.read_bytes(), "jpg", f"caption {i}")
                                                       for i, (p, _) in enumerate(images)], retrieval=True)
    (captions / "dataset_type.txt").unlink()
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(wds_set(tmp_path / "cifar10"))),
                                      BenchmarkConfig(name="my-captions", root=str(captions))])
    report = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))
    written = json.loads((tmp_path / "o.json").read_text())["results"]
    assert [(e["benchmark"], e["status"]) for e in written] == [("cifar10", "ok"), ("my-captions", "failed")]
    assert written[0]["metrics"]["top1"] == report["results"][0]["metrics"]["top1"]
    table = (tmp_path / "o.md").read_text()
    assert "failed: my-captions" in table and "set task: retrieval" in table

    # The CLI writes them too, then ends in one line naming the failure and where the rest went: exit 2.
    model = save_pair(tmp_path / "pair", in_channels=3, image_size=32)
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: s\nworkers: 0\ncache_dir: {tmp_path / 'c2'}\nbenchmarks:\n"
                     f"  - {{name: cifar10, root: {tmp_path / 'cifar10'}}}\n"
                     f"  - {{name: my-captions, root: {captions}}}\n")
    code = cli.main(["eval", "--model", str(model), "--suite", str(suite), "--out", str(tmp_path / "cli.json")])
    captured = capsys.readouterr()
    assert code == 2 and (tmp_path / "cli.json").is_file()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-softmoe eval: error: my-captions: ")
    assert str(tmp_path / "cli.json") in lines[0]


@pytest.mark.parametrize("ks", [[0], [-1, 5], []])
def test_recall_k_below_one_is_refused(tmp_path, ks):
    # recall_k=[0] scored R@0 = 0 and [-1] ranked "all but the last" (a slice), both silently.
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"), recall_k=ks,
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    with pytest.raises(UserError, match="recall_k"):
        run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))


def test_the_results_name_a_killed_run_held_is_free_for_the_rerun(tmp_path):
    """kill -9 of `eval --out r.json` while it writes leaves its claim on r.json (and temporaries beside it):
    a process that claimed the name and was killed. The rerun, without --overwrite, takes the name and
    writes all three results; no temporary is left. A live run's claim is still respected."""
    import signal
    import subprocess
    import textwrap

    out = tmp_path / "r.json"
    killed = subprocess.run([*python_command(), "-c", textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from lit_softmoe.evals import suite
        from lit_softmoe.utils.atomic import replacing
        assert suite._claim(Path({str(out)!r})) == Path({str(out)!r})
        with replacing(Path({str(out.with_suffix('.md'))!r})) as temporary:
            temporary.write_text("half a table")
            os.kill(os.getpid(), signal.SIGKILL)
        """)])
    assert killed.returncode == -signal.SIGKILL
    assert out.read_text().startswith("results of process") and len(list(tmp_path.glob(".r.md.tmp-*"))) == 1
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    report = run_suite(tmp_path / "m", cfg, out=out, model_bundle=tiny_pair(3, 32))
    assert report["paths"]["json"] == str(out) and json.loads(out.read_text())["results"][0]["status"] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("r")) == ["r.json", "r.md", "r.png"]
    assert not list(tmp_path.glob(".r.*"))
    # This process's own claim (alive) is not free.
    other = tmp_path / "other.json"
    other.write_text(suite._CLAIM.format(os.getppid()))
    with pytest.raises(UserError, match="exists; choose another --out or pass --overwrite"):
        run_suite(tmp_path / "m", cfg, out=other, model_bundle=tiny_pair(3, 32))
