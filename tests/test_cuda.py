"""GPU checks: skipped without CUDA (run on a GPU machine with `pytest tests/test_cuda.py`)."""
import pytest
import torch

from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.nn.soft_moe import SoftMoE
from soft_moe_reference import reference_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dim,experts", [(384, 128), (768, 128)])
def test_layer_on_gpu_matches_the_fp64_cpu_reference(dim, experts):
    torch.manual_seed(0)
    layer = SoftMoE(dim, experts, 4 * dim, slots_per_expert=1)
    x = torch.randn(8, 196, dim)
    reference = layer.double()(x.double())
    gpu = layer.float().cuda()
    out32 = gpu(x.cuda())
    assert _relative_error(out32.cpu(), reference) < 1e-3  # tf32-or-better matmuls
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out16 = gpu(x.cuda())
    assert out16.dtype == torch.bfloat16
    assert _relative_error(out16.float().cpu(), reference) < 3e-2
    dispatch, combine = gpu.routing_weights(x.cuda())
    assert dispatch.dtype == torch.float32  # the softmaxes stay in fp32 under any input dtype
    torch.testing.assert_close(dispatch.sum(1), torch.ones_like(dispatch.sum(1)))


def test_gradients_on_gpu_match_the_cpu_reference():
    torch.manual_seed(0)
    layer = SoftMoE(64, 16, 256, slots_per_expert=2).double()
    x = torch.randn(4, 49, 64, dtype=torch.float64, requires_grad=True)
    layer(x).square().sum().backward()
    ref_grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    gpu_layer = layer.cuda()
    x_gpu = x.detach().cuda().requires_grad_()
    gpu_layer(x_gpu).square().sum().backward()
    for got, want in zip([p.grad for p in gpu_layer.parameters()] + [x_gpu.grad], ref_grads):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-9)


def test_paper_tower_runs_in_bf16_and_compiles():
    tower = create_image_tower("soft-s16-128e").cuda().eval()  # no head: compare the embeddings
    pixels = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        eager = tower(pixels)
        compiled = torch.compile(tower)(pixels)
    assert eager.shape == (4, 384) and eager.float().std() > 0.1
    assert _relative_error(compiled.float(), eager.float()) < 3e-2


def test_fused_and_compiled_layer_in_bf16_match_the_fp64_reference():
    import copy
    torch.manual_seed(0)
    layer = SoftMoE(384, 128, 1536, slots_per_expert=1)
    with torch.no_grad():
        layer.scale.fill_(4.0)  # sharper routing than at init
    x = torch.randn(8, 196, 384)
    reference = copy.deepcopy(layer).double()
    x64 = x.double().requires_grad_()
    want = reference_forward(reference, x64)
    grad = torch.randn_like(want)
    want.backward(grad)
    for compiled in (False, True):
        gpu = copy.deepcopy(layer).cuda().bfloat16()
        gpu.compiled = compiled
        x16 = x.cuda().bfloat16().requires_grad_()
        out = gpu(x16)
        assert out.dtype == torch.bfloat16
        assert _relative_error(out.float().cpu(), want.detach()) < 2e-2, compiled
        out.backward(grad.cuda().bfloat16())
        assert _relative_error(x16.grad.float().cpu(), x64.grad) < 5e-2, compiled
        for name in ("experts.w1", "experts.w2", "phi"):
            got = dict(gpu.named_parameters())[name].grad.float().cpu()
            assert _relative_error(got, dict(reference.named_parameters())[name].grad) < 5e-2, (compiled, name)


def test_inference_mode_tower_matches_fp32():
    from lit_softmoe.models.inference import encode_images, prepare_for_inference
    torch.manual_seed(0)
    tower = create_image_tower("soft-s16-128e").cuda().eval()
    pixels = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.no_grad():
        want = tower.forward_pooled(pixels)
    got = encode_images(prepare_for_inference(tower), pixels)
    assert got.dtype == torch.bfloat16 and _relative_error(got.float(), want) < 3e-2


def test_triton_qk_norm_equals_layer_norm_at_paper_shapes():
    import torch.nn.functional as F

    from lit_softmoe.nn.qk_norm import head_layer_norm
    torch.manual_seed(0)
    b, m, heads, head_dim = 8, 196, 12, 64
    qkv = (torch.randn(b, m, 3 * heads * head_dim, device="cuda") * 2 + 0.5).bfloat16()
    weight = (torch.randn(head_dim, device="cuda") * 0.3 + 1).bfloat16()
    for bias in ((torch.randn(head_dim, device="cuda") * 0.3).bfloat16(), None):  # ours have none (flax)
        for part in (0, 1):
            got = head_layer_norm(qkv, part, heads, weight, bias, 1e-6)
            view = qkv.view(b, m, 3, heads, head_dim)[:, :, part]
            want = F.layer_norm(view.float(), (head_dim,), weight.float(), None if bias is None else bias.float(),
                                1e-6)
            assert got.shape == (b, m, heads, head_dim) and got.dtype == torch.bfloat16
            assert (got.float() - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


def test_tower_takes_the_kernel_in_inference_only(monkeypatch):
    from lit_softmoe.nn import qk_norm
    calls = []
    kernel = qk_norm.head_layer_norm  # what fused_qk_norm calls, once for q and once for k
    monkeypatch.setattr(qk_norm, "head_layer_norm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    torch.manual_seed(0)
    tower = create_image_tower("vit-s16").cuda().bfloat16().eval()
    pixels = torch.randn(4, 3, 224, 224, device="cuda").bfloat16()
    with torch.inference_mode():
        fused = tower.forward_pooled(pixels)
        assert len(calls) == 2 * 12
        monkeypatch.setenv("LIT_SOFTMOE_FUSED_QK_NORM", "0")
        plain = tower.forward_pooled(pixels)
        assert len(calls) == 2 * 12
    assert _relative_error(fused.float(), plain.float()) < 1e-2
    monkeypatch.delenv("LIT_SOFTMOE_FUSED_QK_NORM")
    tower.train()
    tower(pixels).float().square().mean().backward()  # training: PyTorch's LayerNorm, gradients flow
    assert len(calls) == 2 * 12 and tower.blocks[0].attn.q_norm.weight.grad is not None
