"""lit_softmoe.utils.device: a --device that is not there is one line naming the choices."""
import pytest
import torch

from cli_errors import _one_line_error


@pytest.mark.parametrize("device, expected", [
    ("gpu", "--device 'gpu' is not a device; give cpu, cuda or cuda:N"),
    ("cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}",
     "no CUDA GPU here" if not torch.cuda.is_available() else "CUDA GPU(s), cuda:0 to")])
def test_eval_device_that_is_not_there(tmp_path, capsys, suite, device, expected):
    line = _one_line_error(capsys, ["eval", "--model", str(tmp_path / "run"), "--suite", suite,
                                    "--out", str(tmp_path / "e.json"), "--device", device])
    assert expected in line
