"""Review 4: encode_images moves pixels to the tower, clear errors for small images, negative router
noise, upcycling with qk-norm switched off, and CLI / demo mistakes that ended in tracebacks."""
import pytest

from cli_errors import _one_line_error


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


@pytest.fixture
def no_shards(monkeypatch):
    from lit_softmoe.data import fashion_mnist as sources
    monkeypatch.setattr(sources, "write_fashion_mnist_shards", lambda *a, **k: pytest.fail("the demo started"))


@pytest.mark.parametrize("flag", ["--data", "--runs"])
def test_demo_folders_that_cannot_be_written_are_refused_before_any_stage(tmp_path, capsys, no_shards, flag):
    # --data was reported as "--out …/fashion-mnist" by the first stage, and --runs only at its first write.
    (tmp_path / "file").write_text("x")
    folders = {"--data": str(tmp_path / "data"), "--runs": str(tmp_path / "runs"), flag: str(tmp_path / "file")}
    line = _one_line_error(capsys, ["demo", "--fast", *[x for item in folders.items() for x in item]])
    assert line == f"lit-softmoe demo: error: {flag} {tmp_path / 'file'} is a file; give a folder path"


def test_demo_step_errors_say_which_command_the_flags_belong_to(tmp_path, capsys, monkeypatch):
    # The stage's fix names `--overwrite` and `--out`, which `lit-softmoe demo` does not have.
    from lit_softmoe.data import fashion_mnist as sources
    from lit_softmoe.errors import UserError

    def refuse(out_dir, limit=None):
        raise UserError(f"{out_dir}/train already holds other shards; pass --overwrite to replace it with "
                        "Fashion-MNIST, or choose another --out")
    monkeypatch.setattr(sources, "write_fashion_mnist_shards", refuse)
    shards = tmp_path / "data" / "fashion-mnist-10k"
    line = _one_line_error(capsys, ["demo", "--fast", "--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs")])
    assert line == (f"lit-softmoe demo: error: {shards}/train already holds other shards; pass --overwrite to replace "
                    f"it with Fashion-MNIST, or choose another --out (the demo ran this step as `lit-softmoe data "
                    f"fashion-mnist --out {shards} --limit 10000`; or give the demo another --data or --runs)")


def test_demo_says_why_the_promised_clip_benchmark_cross_check_did_not_run():
    # The eval headline says "(cross-checked with CLIP_benchmark)"; a failed peer run printed nothing.
    from lit_softmoe import demo
    assert demo._peer_line({"status": "failed", "reason": "RuntimeError: boom"}) == \
        "CLIP_benchmark cross-check failed: RuntimeError: boom"
    assert demo._peer_line({"status": "ok", "metrics": {"top1": 0.8849}, "max_abs_diff_points": 0.01,
                            "seconds": 12.4}) == ("CLIP_benchmark on the same model and files: top-1 88.49 "
                                                  "(largest gap 0.010 points; its run took 12 s)")
