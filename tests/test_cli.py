"""lit_softmoe.cli: what the command line itself does: closing lines from the main process only, an
interrupt on its own line, a --benchmarks that names nothing refused, exit code 2 when nothing was evaluated."""
import pytest

from lit_softmoe.cli import main

from cli_errors import _one_line_error


def test_train_says_where_the_model_went_with_or_without_an_eval(tmp_path, capsys, monkeypatch):
    import lit_softmoe.train.lit as lit
    config = tmp_path / "lit.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")
    monkeypatch.setattr(lit, "train_lit", lambda cfg: {"steps": 3})  # eval.shards= : no zero-shot score
    assert main(["train", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"model saved to {tmp_path / 'run'}/model"
    monkeypatch.setattr(lit, "train_lit", lambda cfg: {"zeroshot_top1": 0.5})
    assert main(["train", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"zero-shot top-1 0.5000; model saved to {tmp_path / 'run'}/model"


@pytest.mark.parametrize("command, function, result, line", [
    ("train", "lit_softmoe.train.lit.train_lit", {"zeroshot_top1": 0.5}, "zero-shot top-1 0.5000; model saved to"),
    ("pretrain", "lit_softmoe.train.pretrain.pretrain", {"test_top1": 0.25}, "test top-1 0.2500; tower saved to"),
])
def test_the_closing_line_comes_from_the_main_process_only(tmp_path, capsys, monkeypatch, command, function,
                                                           result, line):
    # Under torchrun every process returns from training; only rank 0 says so.
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")
    monkeypatch.setattr(function, lambda cfg: result)
    monkeypatch.setenv("RANK", "0")
    assert main([command, "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith(line)
    monkeypatch.setenv("RANK", "3")
    assert main([command, "--config", str(config)]) == 0
    assert capsys.readouterr().out == ""


def test_an_interrupt_is_reported_on_its_own_line(tmp_path, capsys, monkeypatch):
    import lit_softmoe.train.lit as lit
    config = tmp_path / "lit.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")

    def interrupted(cfg):
        print("  12%|#  | 108/468", end="", file=__import__("sys").stderr)  # a progress bar mid-line
        raise KeyboardInterrupt
    monkeypatch.setattr(lit, "train_lit", interrupted)
    assert main(["train", "--config", str(config)]) == 130
    err = capsys.readouterr().err
    assert err.endswith("108/468\nlit-softmoe train: interrupted; rerun the same command to resume\n")


def test_eval_where_every_benchmark_was_skipped_exits_2(tmp_path, capsys, monkeypatch, suite):
    from lit_softmoe.evals import suite as suite_module
    skipped = {"benchmark": "fashion-mnist", "task": "classification", "status": "skipped",
               "reason": "fashion-mnist data folder not found at data/fashion-mnist"}
    monkeypatch.setattr(suite_module, "run_suite", lambda *a, **k: {"suite": "s", "evaluated": 0, "paths": {},
                                                                   "results": [skipped]})
    assert main(["eval", "--model", str(tmp_path), "--suite", suite]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("lit-softmoe eval: error: nothing evaluated, so no results were written: "
                                    "fashion-mnist: fashion-mnist data folder not found at data/fashion-mnist")
    assert "not found at data/fashion-mnist" in captured.out and "| benchmark" not in captured.out


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_eval_benchmarks_that_name_nothing_are_refused(tmp_path, capsys, monkeypatch, value):
    # An empty subset ran the whole suite without a word.
    from lit_softmoe.evals import suite as suite_module
    monkeypatch.setattr(suite_module, "run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: s\n")
    line = _one_line_error(capsys, ["eval", "--model", str(tmp_path), "--suite", str(suite), "--benchmarks", value])
    assert line == (f"lit-softmoe eval: error: --benchmarks {value!r} names no benchmark; give a comma-separated "
                    "list such as fashion-mnist,cifar10, or leave it out for the whole suite")
