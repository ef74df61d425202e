"""lit_softmoe.nn.qk_norm: the Triton qk-norm kernel, checked on the CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, in a subprocess: the variable must be set before the kernel is defined) against
`F.layer_norm`, alone and inside a tower; the GPU run of the same checks is in tests/test_cuda.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.nn import qk_norm
from shared_builds import built_once

pytestmark = pytest.mark.skipif(qk_norm.triton is None, reason="needs Triton")

INTERPRETED_CHECKS = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    import lit_softmoe.models.registry as registry
    import lit_softmoe.models.vit as vit
    from lit_softmoe.nn.qk_norm import head_layer_norm
    torch.manual_seed(0)
    report = {}
    # (batch, tokens, heads, head_dim): a 64-wide head as in the paper's towers; 12 is not a power of 2
    # (masked columns); 7 tokens x 3 heads is not a multiple of the rows per program (masked rows).
    for b, m, heads, head_dim in [(2, 9, 2, 64), (3, 7, 3, 12)]:
        for dtype in (torch.float32, torch.bfloat16):
            d = heads * head_dim
            qkv = (torch.randn(b, m, 3 * d) * 3 + 1).to(dtype)
            errors = []
            for part, with_bias in ((0, True), (1, True), (0, False), (1, False)):  # our towers' norms have no bias
                weight, bias = torch.randn(head_dim) * 0.5 + 1, torch.randn(head_dim) * 0.5
                bias = bias.to(dtype) if with_bias else None
                got = head_layer_norm(qkv, part, heads, weight.to(dtype), bias, 1e-6)
                view = qkv.view(b, m, 3, heads, head_dim)[:, :, part].float()
                want = F.layer_norm(view, (head_dim,), weight.to(dtype).float(), None if bias is None else bias.float(),
                                    1e-6)
                errors.append([list(got.shape) == [b, m, heads, head_dim], str(got.dtype),
                               (got.float() - want).abs().max().item(), want.abs().max().item()])
            report[f"{b}x{m}x{heads}x{head_dim} {dtype}"] = errors
    # Inside a tower: the kernel forced on (the CPU normally takes PyTorch's path) must give the tower's output.
    pixels = torch.randn(3, 1, 28, 28)
    fuse = vit.can_fuse_qk_norm
    for bias in (False, True):  # ours (no bias, as flax), and towers saved with the biases
        tower = registry.create_image_tower("vit-test", qk_norm=True, qk_norm_bias=bias).eval()
        with torch.no_grad():
            for block in tower.blocks:
                for norm in (block.attn.q_norm, block.attn.k_norm):
                    norm.weight.normal_(1, 0.3)
                    if bias:
                        norm.bias.normal_(0, 0.3)
        with torch.inference_mode():
            vit.can_fuse_qk_norm = fuse
            want = tower.forward_pooled(pixels)
            vit.can_fuse_qk_norm = lambda *args: True
            got = tower.forward_pooled(pixels)
        report[f"tower bias={bias}"] = [(got - want).abs().max().item(), want.abs().max().item()]
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    def check(folder):
        done = subprocess.run([sys.executable, "-c", INTERPRETED_CHECKS], env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (folder / "report.json").write_text(done.stdout.strip().splitlines()[-1])
    return json.loads((built_once(tmp_path_factory, "qk-norm-interpreted", check) / "report.json").read_text())


@pytest.mark.parametrize("case", ["2x9x2x64", "3x7x3x12"])
def test_kernel_equals_layer_norm_in_fp32(interpreted, case):
    for shape_ok, dtype, max_error, scale in interpreted[f"{case} torch.float32"]:  # q, k; with and without bias
        assert shape_ok and dtype == "torch.float32"
        assert scale > 1.0 and max_error < 1e-5


@pytest.mark.parametrize("case", ["2x9x2x64", "3x7x3x12"])
def test_kernel_equals_layer_norm_within_bf16_rounding(interpreted, case):
    for shape_ok, dtype, max_error, scale in interpreted[f"{case} torch.bfloat16"]:
        assert shape_ok and dtype == "torch.bfloat16"
        assert max_error <= 2 ** -7 * scale  # one bf16 ulp at the largest value


@pytest.mark.parametrize("bias", [False, True])
def test_tower_with_the_kernel_equals_the_tower_without(interpreted, bias):
    max_error, scale = interpreted[f"tower bias={bias}"]
    assert scale > 0.1 and max_error < 1e-5


def test_cpu_and_training_take_pytorch_path():
    attn = create_image_tower("vit-test").blocks[0].attn
    qkv = torch.randn(2, 16, 3 * 32)
    assert not qk_norm.can_fuse_qk_norm(qkv, attn.q_norm, attn.k_norm)  # CPU: PyTorch's LayerNorm


def test_environment_switch_turns_the_kernel_off(monkeypatch):
    assert qk_norm.fused_qk_norm_enabled()
    monkeypatch.setenv(qk_norm.ENV_SWITCH, "0")
    assert not qk_norm.fused_qk_norm_enabled()


def test_kernel_refuses_a_strided_qkv():
    qkv = torch.randn(2, 3 * 32, 5).transpose(1, 2)  # (2, 5, 96), not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm.head_layer_norm(qkv, 0, 2, torch.ones(16), torch.zeros(16), 1e-6)


def test_a_kernel_that_cannot_run_falls_back_to_pytorch_once(monkeypatch):
    # Forced onto CPU tensors without the interpreter, Triton cannot launch: what a GPU machine
    # without a C compiler looks like to the tower. The output must still be the tower's.
    import lit_softmoe.models.vit as vit
    monkeypatch.setattr(qk_norm, "_kernel_error", None)
    tower = create_image_tower("vit-test", qk_norm=True).eval()
    pixels = torch.randn(2, 1, 28, 28)
    with torch.inference_mode():
        want = tower.forward_pooled(pixels)
        monkeypatch.setattr(vit, "can_fuse_qk_norm", lambda *args: qk_norm.fused_qk_norm_enabled())
        with pytest.warns(RuntimeWarning, match="qk-norm kernel cannot run here .*using PyTorch's LayerNorm"):
            got = tower.forward_pooled(pixels)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert qk_norm._kernel_error and not qk_norm.fused_qk_norm_enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once: later calls go straight to PyTorch's path
            torch.testing.assert_close(tower.forward_pooled(pixels), want, rtol=0, atol=0)
