"""Review 4: encode_images moves pixels to the tower, clear errors for small images, negative router
noise, upcycling with qk-norm switched off, and CLI / demo mistakes that ended in tracebacks."""
import pytest
import torch

from lit_softmoe.cli import main
from lit_softmoe.models.inference import encode_images
from lit_softmoe.models.registry import create_image_tower

from cli_errors import _one_line_error


def test_encode_images_moves_pixels_to_the_towers_device_and_dtype():
    # A tower elsewhere than the pixels (meta here, CUDA for a user): CPU float32 pixels from a
    # dataloader ended in torch's device-mismatch error.
    tower = create_image_tower("vit-test", device="meta", dtype=torch.bfloat16)
    features = encode_images(tower, torch.randn(3, 1, 28, 28))
    assert features.device.type == "meta" and features.dtype == torch.bfloat16
    assert features.shape == (3, 32)


@pytest.mark.parametrize("height, width", [(6, 6), (6, 28), (28, 3)])
def test_an_image_smaller_than_one_patch_is_one_clear_error(height, width):
    tower = create_image_tower("vit-test")  # patch 7, trained at 28x28
    with pytest.raises(ValueError) as info:
        tower(torch.randn(1, 1, height, width))
    assert str(info.value) == (f"image of {height}x{width} pixels is smaller than one 7x7 patch; "
                               "resize it to at least 7x7 (the tower was trained at 28x28)")
    assert tower(torch.randn(1, 1, 7, 14)).shape == (1, 32)  # one row of two patches still works


def test_upcycling_a_qk_norm_tower_with_qk_norm_off_names_the_mismatch():
    # It said "not a plain ViT of this family" about the dense tower's own q_norm/k_norm weights.
    from lit_softmoe.errors import UserError
    from lit_softmoe.models.upcycle import upcycle_tower
    dense = create_image_tower("vit-test")  # qk-norm on, as registered
    with pytest.raises(UserError) as info:
        upcycle_tower(dense, "soft-test-4e", qk_norm=False)
    assert str(info.value).startswith("the dense tower has qk-norm (LayerNorm on queries and keys) and "
                                      "qk_norm=False would drop its trained norms")
    assert "leave qk_norm unset" in str(info.value)
    assert upcycle_tower(dense, "soft-test-4e").cfg.qk_norm  # unset: follows the dense tower
    plain = create_image_tower("vit-test", qk_norm=False)
    assert not upcycle_tower(plain, "soft-test-4e", qk_norm=False).cfg.qk_norm  # no qk-norm on either side


@pytest.fixture
def dense_tower_dir(tmp_path):
    from lit_softmoe.models.tower_folder import save_tower
    return save_tower(tmp_path / "dense", create_image_tower("vit-test"))


def test_upcycle_seed_out_of_range_is_one_line(tmp_path, capsys, dense_tower_dir):
    # It was torch's "Overflow when unpacking long long" traceback, after reading the checkpoint.
    line = _one_line_error(capsys, ["upcycle", "--from", str(dense_tower_dir), "--to", "soft-test-4e",
                                    "--out", str(tmp_path / "up"), "--seed", str(2**64)])
    assert line == (f"lit-softmoe upcycle: error: --seed {2**64} is out of range; give an integer such as 0 "
                    "(|seed| < 2**63)")
    assert not (tmp_path / "up").exists()
    assert main(["upcycle", "--from", str(dense_tower_dir), "--to", "soft-test-4e", "--out", str(tmp_path / "up"),
                 "--seed", "-1"]) == 0  # a negative seed in range still works


@pytest.mark.parametrize("content, reason", [
    (b"\x89PNG\r\n\x1a\n" + bytes(32), "UnpicklingError: not a pickle of tensors only"),
    (b"", "EOFError: empty or truncated file")])
def test_upcycle_from_a_file_torch_cannot_read_is_one_line(tmp_path, capsys, content, reason):
    # torch's weights-only error ran over several lines (and suggested weights_only=False).
    source = tmp_path / "dense.pth"
    source.write_bytes(content)
    line = _one_line_error(capsys, ["upcycle", "--from", str(source), "--to", "soft-test-4e",
                                    "--out", str(tmp_path / "up")])
    assert line == (f"lit-softmoe upcycle: error: cannot read {source} as a state dict ({reason}); "
                    "give a .safetensors file or a .pth/.bin holding only tensors")


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
