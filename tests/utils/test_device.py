"""lit_softmoe.utils.device: a --device that is not there is one line naming the choices."""
import pytest
import torch

from cli_errors import one_line_error


@pytest.mark.parametrize("device, expected", [
    ("gpu", "--device 'gpu' is not a device; give cpu, cuda or cuda:N"),
    ("cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}",
     "no CUDA GPU here" if not torch.cuda.is_available() else "CUDA GPU(s), cuda:0 to")])
def test_eval_device_that_is_not_there(tmp_path, capsys, suite, device, expected):
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "run"), "--suite", suite,
                                    "--out", str(tmp_path / "e.json"), "--device", device])
    assert expected in line


def test_parse_device_called_as_a_library_names_its_parameter_not_the_flag():
    from lit_softmoe.errors import UserError
    from lit_softmoe.utils.device import parse_device
    with pytest.raises(UserError) as err:
        parse_device("gpu")
    assert str(err.value) == "device 'gpu' is not a device; give cpu, cuda or cuda:N" and "--" not in str(err.value)
    with pytest.raises(UserError, match=r"^eval_device 'gpu' is not a device"):  # the caller's own name for it
        parse_device("gpu", setting="eval_device")


# ---- the fast-path defaults: weight dtype, compile, cores ---------------------------------------------

from lit_softmoe.errors import UserError  # noqa: E402
from lit_softmoe.utils.device import available_cpus, inference_dtype, resolve_compile  # noqa: E402


@pytest.mark.parametrize("precision, bf16_gpu, device, expected", [
    ("auto", True, "cuda", torch.bfloat16),    # a GPU with bf16: the locked tower is held in bf16
    ("auto", False, "cuda", torch.float32),    # a V100 or T4: fp32
    ("auto", True, "cpu", torch.float32),      # the CPU: fp32 (bf16 matmuls are slow there)
    ("bf16", False, "cpu", torch.bfloat16),    # asked for
    ("fp32", True, "cuda", torch.float32),
    ("fp16", False, "cuda", torch.float16),    # asked for, on a GPU without bf16
])
def test_inference_dtype_follows_precision_and_the_device(monkeypatch, precision, bf16_gpu, device, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_gpu)
    assert inference_dtype(precision, torch.device(device)) == expected


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cuda", True), ("auto", "cpu", False), ("true", "cpu", True), ("True", "cuda", True),
    ("false", "cuda", False), (False, "cuda", False), (True, "cpu", True)])
def test_resolve_compile(setting, device, expected):
    assert resolve_compile(setting, torch.device(device)) is expected


def test_resolve_compile_names_the_choices():
    with pytest.raises(UserError, match=r"^compile must be one of auto, true, false, got 'yes'$"):
        resolve_compile("yes", torch.device("cpu"))


def test_available_cpus_is_the_affinity_mask(monkeypatch):
    import os
    assert available_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # e.g. `taskset -c 3`: one core, not all
    assert available_cpus() == 1
