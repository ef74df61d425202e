"""The GPU measurements in one process: the Soft MoE layer, the locked tower, the LiT step.

Three parts, each a list of rows timed on the same device in the same run, then the issue's ratios
(each with its target) computed from them:

- `layer`: forward+backward of one layer at S/16 and B/16 shapes (batch 256, 196 tokens, 128 experts,
  1 slot), with bf16 weights and with fp32 weights under bf16 autocast: ours (fused eager forward),
  ours step by step (the tests' `reference_forward` oracle), ours compiled, soft-moe-pytorch, the dense MLP eager and
  compiled, and ours and the dense MLP compiled with CUDA graphs (`mode="reduce-overhead"`).
  Targets: ours <= 1.0x the dense MLP's time; soft-moe-pytorch >= 20x ours.
- `tower`: inference of the Soft MoE-B/16 tower (`soft-b16-128e`, 3.7B params) against timm's dense
  `vit_base_patch16_224` (and our dense `vit-b16`), bf16 weights, `torch.inference_mode`, SDPA,
  batch 256, eager and compiled: images/s, MFU, peak memory. Target: soft >= 1.0x timm.
- `lit`: one LiT training step (forward, CLIP loss, backward, AdamW) of open_clip's lock-image
  ViT-B-16 against ours on-the-fly and from cached features (scripts/bench_lit.py's builders).
  Targets: on-the-fly >= 1.2x, cached >= 2x open_clip's samples/s.

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode` on one eager call of the same
step; MFU = FLOPs / time / the device's peak dense bf16 rate (H100 and H200 SXM: 989 TFLOP/s, the
datasheet's; H100 PCIe 756, H100/H200 NVL 835; the run also measures an 8192³ bf16 matmul and reports
it). Timing: CUDA events around each call, calls queued back to back with no synchronization between
them (`benchlib.time_step`), a few warm-up calls (compilation included), median of `--iters`. Each part
has a time budget: a row that would start after its part's budget is spent is skipped and says so, so
the run ends in bounded time.
A peer that is not installed gives a row that says so; a failing row (OOM, compiler) or part never ends
the run. The JSON and Markdown are replaced whole after every row, so a run killed from outside keeps
every row it measured. `--cpu` (automatic without CUDA) runs tiny shapes in seconds (the test suite does)
with the GPU run's rows and precisions, so every code path the GPU run takes has run; its CUDA-graphs
rows run compiled without graphs there (the aot_eager backend ignores the mode) and say so.

    python scripts/bench_gpu.py --json bench_gpu.json --md bench_gpu.md
    python scripts/bench_gpu.py --only layer --iters 20
    python scripts/bench_gpu.py --cpu --json /tmp/b.json --md /tmp/b.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, bench_softmoe, bench_lit beside this
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the step-by-step Soft MoE oracle
from benchlib import setup_device, time_step  # noqa: E402

from lit_softmoe.utils.atomic import write_text_atomic  # noqa: E402
from soft_moe_reference import reference_forward  # noqa: E402

PARTS = ("layer", "tower", "lit")
# Peak dense bf16 tensor-core rate by device name (datasheet; half the "with sparsity" figure), for MFU.
# The first key in the device name wins: the PCIe and NVL parts before the plain names (SXM).
PEAK_BF16_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
                    "A100": 312.0}


def peak_bf16(device_name: str) -> tuple[float, str]:
    """(peak dense bf16 TFLOP/s, where the figure comes from) for a CUDA device name."""
    return next(((v, f"datasheet, {k}") for k, v in PEAK_BF16_TFLOPS.items() if k in device_name),
                (989.0, "assumed H100/H200 SXM class"))


@dataclass
class Row:
    part: str
    name: str
    setting: str  # shape / precision / batch: rows with the same setting are compared
    ms: float | None = None  # median ms per call (layer: fwd+bwd; tower: one batch; lit: one step)
    per_s: float | None = None  # images/s (tower) or samples/s (lit)
    gflop: float | None = None  # FLOPs of one call, FlopCounterMode, GFLOP
    tflops: float | None = None  # achieved
    mfu: float | None = None  # tflops / the device's peak bf16 rate
    peak_mib: float | None = None  # CUDA: torch.cuda.max_memory_allocated over the timed calls
    params_m: float | None = None
    iters: int = 0
    note: str = ""


@dataclass
class Ratio:
    part: str
    name: str
    value: float | None
    target: float | None = None
    better: str = "higher"  # "higher": value >= target meets it; "lower": value <= target
    met: bool | None = None
    note: str = ""


@dataclass
class Bench:
    device: torch.device
    cpu: bool
    iters: int
    warmup: int
    peer_iters: int
    budgets: dict
    backend: str  # torch.compile backend: inductor on CUDA, aot_eager in --cpu mode (no C++ build)
    peak_tflops: float | None
    profile_dir: Path | None
    rows: list = field(default_factory=list)
    ratios: list = field(default_factory=list)
    part_start: float = 0.0
    part: str = ""
    on_row: object = None  # called after every row (main: rewrites the JSON and Markdown)

    def begin(self, part: str):
        self.part, self.part_start = part, time.perf_counter()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.part_start > self.budgets[self.part]

    @property
    def no_graphs_note(self) -> str:
        """The note of a CUDA-graphs row in --cpu mode, where the backend runs it without graphs."""
        return "cpu: no CUDA graphs" if self.cpu else ""

    def run_row(self, name: str, setting: str, build, per_call_items: int | None = None, iters: int | None = None,
                compiled: bool = False, count_flops=None, note: str = "") -> Row:
        """`build()` → (step, params_m); time step(); FLOPs from `count_flops()` (an eager call)."""
        row = Row(self.part, name, setting, iters=iters or self.iters, note=note)
        if self.over_budget():
            row.note = f"skipped: the {self.part} part's {self.budgets[self.part]:.0f} s budget is spent"
            return self._done(row)
        step = None
        try:
            torch.manual_seed(0)
            step, row.params_m = build()
            if count_flops is not None:
                row.gflop = count_flops() / 1e9
            warmup = self.warmup + (2 if compiled else 0)
            row.ms, row.peak_mib = time_step(step, self.device, warmup, row.iters)
            if per_call_items:
                row.per_s = per_call_items / (row.ms / 1e3)
            if row.gflop:
                row.tflops = row.gflop / row.ms  # GFLOP/ms = TFLOP/s
                if self.peak_tflops:
                    row.mfu = row.tflops / self.peak_tflops
        except ImportError as e:
            row.note = f"not installed: {e.name or e}"
        except Exception as e:  # one failing row (OOM, no compiler) must not end the run
            first = str(e).splitlines()[0][:160] if str(e) else ""
            row.note = f"failed: {type(e).__name__}: {first}"
            row.ms = None
        finally:
            step = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return self._done(row)

    def _done(self, row: Row) -> Row:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row()
        shown = (f"{row.ms:9.3f} ms" + (f" {row.per_s:10,.0f}/s" if row.per_s else "")
                 + (f" {row.tflops:7.1f} TFLOP/s" if row.tflops else "")
                 + (f" peak {row.peak_mib:,.0f} MiB" if row.peak_mib else "")) if row.ms else row.note
        print(f"  [{row.part}] {row.name:38s} {row.setting:28s} {shown}", flush=True)
        return row

    def find(self, name: str, setting: str) -> Row | None:
        return next((r for r in self.rows if r.name == name and r.setting == setting and r.ms), None)

    def ratio(self, name: str, value: float | None, target: float | None = None, better: str = "higher",
              note: str = ""):
        met = None
        if value is not None and target is not None:
            met = value >= target if better == "higher" else value <= target
        self.ratios.append(Ratio(self.part, name, value, target, better, met, note))


def count_flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _params_m(*modules) -> float:
    return sum(p.numel() for m in modules for p in m.parameters()) / 1e6


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- part a: the layer --------------------------------------------------------------------------

LAYER_SHAPES = {  # name: (batch, tokens, dim, mlp_dim, experts, slots)
    "S/16": (256, 196, 384, 1536, 128, 1),
    "B/16": (256, 196, 768, 3072, 128, 1),
    "tiny": (4, 16, 32, 64, 8, 1),
}


class _CompiledSoftMoE(torch.nn.Module):
    """A SoftMoE whose forward is `compiled_soft_moe_forward(backend=...)` (inductor = `compiled=True`)."""

    def __init__(self, layer, backend: str, mode: str | None = None):
        super().__init__()
        self.layer, self.backend, self.mode = layer, backend, mode

    def forward(self, x):
        from lit_softmoe.nn.soft_moe import compiled_soft_moe_forward
        layer = self.layer
        return compiled_soft_moe_forward(self.mode, self.backend)(x, layer.phi, layer.scale, layer.experts)


class _Reference(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return reference_forward(self.layer, x)


def bench_layer(bench: Bench, shapes: list[str]):
    from bench_softmoe import Shape, build_dense, build_ours, build_peer

    device = bench.device
    # --cpu runs the same settings (bf16 on a CPU is emulated, but there the run checks code, not speed).
    precisions = [("bf16 weights", torch.bfloat16, None), ("bf16 autocast", torch.float32, torch.bfloat16)]
    # The issue's target setting (bf16 weights) first, both shapes: the budget drops rows from the end.
    for precision, weight_dtype, autocast_dtype in precisions:
        for shape_name in shapes:
            b, m, d, h, n, p = LAYER_SHAPES[shape_name]
            shape = Shape(shape_name, b, m, d, h, n, p)
            setting = f"{shape_name} {precision}"
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(b, m, d, generator=g).to(device, weight_dtype).requires_grad_()
            grad = torch.randn(b, m, d, generator=g).to(device, weight_dtype)

            def step_of(module, cuda_graphs: bool = False):
                def step():
                    if cuda_graphs:  # a new iteration: the graphs may overwrite the last one's outputs
                        torch.compiler.cudagraph_mark_step_begin()
                    module.zero_grad(set_to_none=True)
                    x.grad = None
                    with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                        enabled=autocast_dtype is not None):
                        y = module(x)
                    y.backward(grad.to(y.dtype))
                return step

            def builder(make, wrap=None, compile_module=False, mode=None):
                def build():
                    module = make(shape).to(device, weight_dtype)
                    params = _params_m(module)
                    if wrap is not None:
                        module = wrap(module)
                    if compile_module:
                        module = torch.compile(module, backend=bench.backend, mode=mode)
                    return step_of(module, cuda_graphs=mode == "reduce-overhead"), params
                return build

            def flops_of(make, wrap=None):
                def count():
                    torch.manual_seed(0)
                    module = make(shape).to(device, weight_dtype)
                    if wrap is not None:
                        module = wrap(module)
                    flops = count_flops(step_of(module))
                    _sync(device)
                    return flops
                return count

            # Most important first: the budget skips from the end.
            bench.run_row("ours", setting, builder(build_ours), count_flops=flops_of(build_ours))
            bench.run_row("ours compiled", setting,
                          builder(build_ours, lambda layer: _CompiledSoftMoE(layer, bench.backend)), compiled=True,
                          count_flops=flops_of(build_ours))
            bench.run_row("dense MLP", setting, builder(build_dense), count_flops=flops_of(build_dense))
            bench.run_row("dense MLP compiled", setting, builder(build_dense, compile_module=True), compiled=True,
                          count_flops=flops_of(build_dense))
            bench.run_row("soft-moe-pytorch", setting, builder(build_peer), iters=bench.peer_iters,
                          count_flops=flops_of(build_peer))
            bench.run_row("ours step by step (reference_forward)", setting, builder(build_ours, _Reference))
            # CUDA graphs for both (static shapes): what is left once the host's launch overhead,
            # which a whole compiled tower also amortizes, is gone. --cpu runs the same code (its
            # aot_eager backend ignores the mode: no graphs there).
            bench.run_row("ours compiled, CUDA graphs", setting,
                          builder(build_ours, lambda layer: _CompiledSoftMoE(layer, bench.backend, "reduce-overhead"),
                                  mode="reduce-overhead"),
                          compiled=True, count_flops=flops_of(build_ours), note=bench.no_graphs_note)
            bench.run_row("dense MLP compiled, CUDA graphs", setting,
                          builder(build_dense, compile_module=True, mode="reduce-overhead"), compiled=True,
                          count_flops=flops_of(build_dense), note=bench.no_graphs_note)
            x = grad = None
            if bench.profile_dir is not None and device.type == "cuda" and precision == "bf16 weights" \
                    and not bench.over_budget():
                _profile_layer(bench, shape, weight_dtype)

            dense_c, dense = bench.find("dense MLP compiled", setting), bench.find("dense MLP", setting)
            peer = bench.find("soft-moe-pytorch", setting)
            for ours_name in ("ours", "ours compiled"):
                ours = bench.find(ours_name, setting)
                for ref, label in ((dense_c, "dense MLP compiled"), (dense, "dense MLP")):
                    bench.ratio(f"{setting}: {ours_name} / {label} (time)",
                                ours.ms / ref.ms if ours and ref else None, 1.0, "lower")
                bench.ratio(f"{setting}: soft-moe-pytorch / {ours_name} (time)",
                            peer.ms / ours.ms if ours and peer else None, 20.0, "higher",
                            note="" if peer else "soft-moe-pytorch row missing")
            ours_g, dense_g = bench.find("ours compiled, CUDA graphs", setting), \
                bench.find("dense MLP compiled, CUDA graphs", setting)
            if ours_g and dense_g:
                bench.ratio(f"{setting}: ours / dense MLP, both compiled with CUDA graphs (time)",
                            ours_g.ms / dense_g.ms, 1.0, "lower")


def _profile_layer(bench: Bench, shape, weight_dtype):
    """One profiled fwd+bwd of ours (eager and compiled): the kernel table, for the next iteration."""
    from bench_softmoe import build_ours
    from torch.profiler import ProfilerActivity, profile
    device = bench.device
    x = torch.randn(shape.batch, shape.tokens, shape.dim, device=device, dtype=weight_dtype, requires_grad=True)
    for label, wrap in (("eager", None), ("compiled", lambda layer: _CompiledSoftMoE(layer, bench.backend))):
        try:
            module = build_ours(shape).to(device, weight_dtype)
            module = wrap(module) if wrap else module

            def step():
                # Fresh gradients as in the timed rows and in training: accumulating into the last
                # step's would add an `add_` over all 128 experts' weights (a quarter of the B/16 time).
                module.zero_grad(set_to_none=True)
                x.grad = None
                module(x).sum().backward()
            for _ in range(3):
                step()
            _sync(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                _sync(device)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            path = bench.profile_dir / f"profile_layer_{shape.name.replace('/', '')}_{label}.txt"
            path.write_text(f"3 x fwd+bwd of ours ({label}), {shape}, bf16 weights\n\n{table}\n")
            print(f"  wrote {path}")
        except Exception as e:
            print(f"  profile {label} failed: {type(e).__name__}: {e}")
        module = None


# ---- part b: the locked tower, inference --------------------------------------------------------

def qk_norm_kernel_off():
    """Eager towers with PyTorch's LayerNorm for qk-norm instead of the Triton kernel (lit_softmoe.nn.qk_norm)."""
    from lit_softmoe.nn.qk_norm import ENV_SWITCH
    return mock.patch.dict(os.environ, {ENV_SWITCH: "0"})


def bench_tower(bench: Bench):
    from lit_softmoe.models.inference import prepare_for_inference
    from lit_softmoe.models.registry import create_image_tower

    device = bench.device
    if bench.cpu:
        batch, image, tiny = 4, 32, dict(image_size=32, patch_size=8, width=64, depth=2, num_heads=2, mlp_dim=256)
        soft = dict(tiny, moe_layers=(1,), num_experts=8)
        timm_kwargs = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=4)
    else:
        batch, image, tiny, soft, timm_kwargs = 256, 224, {}, {}, {}
    dtype = torch.bfloat16  # --cpu too: the same code path (bf16 on a CPU is emulated; there it checks code)
    setting = f"batch {batch}, {image}px, {str(dtype).removeprefix('torch.')} weights, inference_mode"
    g = torch.Generator(device="cpu").manual_seed(0)
    pixels = torch.randn(batch, 3, image, image, generator=g).to(device, dtype)

    def make_timm():
        import timm
        if timm_kwargs:
            from timm.models.vision_transformer import VisionTransformer as TimmViT
            return TimmViT(num_classes=0, **timm_kwargs)
        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)

    def make_ours(name, overrides):
        return lambda: create_image_tower(name, device=device, dtype=dtype, num_classes=0, **overrides)

    def builder(make, compiled: bool, mode=None):
        def build():
            model = prepare_for_inference(make().to(device), dtype=dtype)
            params = _params_m(model)
            if compiled:
                model = torch.compile(model, backend=bench.backend, mode=mode, dynamic=False)

            def step():
                with torch.inference_mode():
                    return model(pixels)
            return step, params
        return build

    flops = {}

    def flops_of(key, make):
        def count():
            if key not in flops:
                model = prepare_for_inference(make().to(device), dtype=dtype)
                with torch.inference_mode():
                    flops[key] = count_flops(lambda: model(pixels))
                _sync(device)
            return flops[key]
        return count

    models = [("timm vit_base_patch16_224", make_timm), ("ours soft-b16-128e", make_ours("soft-b16-128e", soft)),
              ("ours vit-b16", make_ours("vit-b16", tiny))]
    for name, make in models[:2]:
        bench.run_row(f"{name}", setting, builder(make, False), per_call_items=batch, count_flops=flops_of(name, make))
    for name, make in models[:2]:
        bench.run_row(f"{name} compiled", setting, builder(make, True), per_call_items=batch, compiled=True,
                      count_flops=flops_of(name, make))
    name, make = models[2]
    bench.run_row(name, setting, builder(make, False), per_call_items=batch, count_flops=flops_of(name, make))
    # The eager rows again with PyTorch's LayerNorm for qk-norm: what the Triton kernel buys (CUDA only;
    # --cpu runs the rows to check them, both sides PyTorch's LayerNorm there).
    with qk_norm_kernel_off():
        for name, make in models[1:]:
            bench.run_row(f"{name}, PyTorch qk-norm", setting, builder(make, False), per_call_items=batch)
    # CUDA graphs (static shapes): one more compile, last so the budget can drop it.
    name, make = models[1]
    bench.run_row(f"{name} compiled reduce-overhead", setting, builder(make, True, "reduce-overhead"),
                  per_call_items=batch, compiled=True, count_flops=flops_of(name, make), note=bench.no_graphs_note)
    pixels = None

    for suffix in ("", " compiled"):
        timm_row = bench.find("timm vit_base_patch16_224" + suffix, setting)
        soft_row = bench.find("ours soft-b16-128e" + suffix, setting)
        bench.ratio(f"soft-b16-128e / timm vit_base_patch16_224{suffix} (images/s)",
                    soft_row.per_s / timm_row.per_s if soft_row and timm_row else None, 1.0, "higher")
    for name in ("ours soft-b16-128e", "ours vit-b16"):
        fused, plain = bench.find(name, setting), bench.find(f"{name}, PyTorch qk-norm", setting)
        if fused and plain:
            bench.ratio(f"{name} eager: Triton qk-norm / PyTorch qk-norm (images/s)",
                        fused.per_s / plain.per_s if fused.per_s and plain.per_s else None, None, "higher")
    soft_row = next((r for r in bench.rows if r.part == "tower" and r.name.startswith("ours soft") and r.peak_mib),
                    None)
    if soft_row is not None:
        bench.ratio(f"soft-b16-128e peak memory at batch {batch} (GiB)", soft_row.peak_mib / 1024, 80.0, "lower")


# ---- part c: the LiT step -----------------------------------------------------------------------

def bench_lit(bench: Bench):
    import bench_lit as bl

    device = bench.device
    preset = bl.PRESETS["cpu" if bench.cpu else "b16"]
    precision = "autocast-bf16"  # --cpu too: autocast and our bf16 locked tower are the GPU run's code
    autocast_dtype = torch.bfloat16
    args = SimpleNamespace(precision=precision, fp32_tower=False, compile_mode=None)
    inputs = bl.make_inputs(preset, device)
    setting = f"batch {preset.batch}, {precision}"

    def openclip(features_given: bool):
        def build():
            built = bl.build_openclip(preset, device, False, args)
            return bl.openclip_step(*built, inputs, autocast_dtype, features_given=features_given), _params_m(built[0])
        return build

    def ours(cached: bool, compile_tower: bool = False, compile_text: bool = False):
        def build():
            model, optimizer = bl.build_ours(preset, device, False, args, "vit-b16")
            if compile_tower:
                model.image_tower.forward_features = torch.compile(model.image_tower.forward_features,
                                                                   backend=bench.backend, dynamic=False)
            if compile_text:
                model.text_tower.compile(backend=bench.backend, dynamic=False)
            return bl.ours_step(model, optimizer, inputs, autocast_dtype, cached=cached), _params_m(model)
        return build

    def flops_of(make):
        def count():
            step, _ = make()()
            step()  # AdamW's lazy state out of the count
            flops = count_flops(step)
            _sync(device)
            return flops
        return count

    b = preset.batch
    bench.run_row(bl.BASELINE, setting, openclip(False), per_call_items=b,
                  count_flops=flops_of(lambda: openclip(False)))
    bench.run_row("ours on-the-fly", setting, ours(False), per_call_items=b, count_flops=flops_of(lambda: ours(False)))
    bench.run_row("ours cached", setting, ours(True), per_call_items=b, count_flops=flops_of(lambda: ours(True)))
    bench.run_row("ours on-the-fly, tower compiled", setting, ours(False, compile_tower=True), per_call_items=b,
                  compiled=True)
    bench.run_row("open_clip image features given", setting, openclip(True), per_call_items=b)
    bench.run_row("ours cached, text compiled", setting, ours(True, compile_text=True), per_call_items=b,
                  compiled=True)
    with qk_norm_kernel_off():  # CUDA: what the Triton kernel buys; --cpu: the row runs (no kernel there)
        bench.run_row("ours on-the-fly, PyTorch qk-norm", setting, ours(False), per_call_items=b)
    inputs = None

    base = bench.find(bl.BASELINE, setting)
    for name, target in (("ours on-the-fly", 1.2), ("ours on-the-fly, tower compiled", 1.2),
                         ("ours cached", 2.0), ("ours cached, text compiled", 2.0),
                         ("open_clip image features given", None)):
        row = bench.find(name, setting)
        bench.ratio(f"{name} / {bl.BASELINE} (samples/s)", row.per_s / base.per_s if row and base else None,
                    target, "higher")


# ---- output -------------------------------------------------------------------------------------

def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def markdown(meta: dict, rows: list[Row], ratios: list[Ratio]) -> str:
    lines = [f"# GPU benchmarks: {meta['device_name']}", "",
             f"torch {meta['torch']}, {meta['mode']} mode, median of {meta['iters']} calls after "
             f"{meta['warmup']} warm-ups (soft-moe-pytorch: {meta['peer_iters']}); MFU against "
             + (f"{meta['peak_tflops']:.0f} TFLOP/s peak dense bf16 ({meta['peak_source']})"
                if meta["peak_tflops"] else "no peak (CPU)")
             + (f"; measured 8192³ bf16 matmul: {meta['matmul_tflops']:.0f} TFLOP/s"
                if meta.get("matmul_tflops") else "")
             + f"; total {meta['seconds']:.0f} s.", ""]
    heads = {"layer": "ms fwd+bwd", "tower": "ms/batch", "lit": "ms/step"}
    per = {"layer": "", "tower": "images/s", "lit": "samples/s"}
    for part in PARTS:
        part_rows = [r for r in rows if r.part == part]
        if not part_rows:
            continue
        lines += [f"## {part}", "", f"| row | setting | {heads[part]} | {per[part] or '–'} | GFLOP | TFLOP/s | MFU | "
                  "peak MiB | params (M) | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in part_rows:
            lines.append(f"| {r.name} | {r.setting} | {_f(r.ms, '.3f')} | {_f(r.per_s, ',.0f')} | "
                         f"{_f(r.gflop, ',.4g')} | {_f(r.tflops, '.4g')} | {_f(r.mfu, '.1%')} | "
                         f"{_f(r.peak_mib, ',.0f')} | {_f(r.params_m, ',.1f')} | {r.note or f'median of {r.iters}'} |")
        lines.append("")
        part_ratios = [q for q in ratios if q.part == part]
        if part_ratios:
            lines += ["| ratio | value | target | met |", "|---|---:|---|---|"]
            for q in part_ratios:
                target = "–" if q.target is None else (">= " if q.better == "higher" else "<= ") + f"{q.target:g}"
                met = "–" if q.met is None else ("yes" if q.met else "**no**")
                lines.append(f"| {q.name} | {_f(q.value, '.2f')} | {target} | {met}{' ' + q.note if q.note else ''} |")
            lines.append("")
    return "\n".join(lines)


def _matmul_tflops(device) -> float | None:
    """The bf16 matmul ceiling on random data (METHOD.md): median of 10 8192³ products."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms, _ = time_step(lambda: a @ b, device, 3, 10)
    return 2 * 8192 ** 3 / ms / 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    p.add_argument("--layer-shapes", default=None, help="S/16,B/16 (default on CUDA); tiny in --cpu mode")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (median); default 10, CPU 2")
    p.add_argument("--warmup", type=int, default=None, help="default 3, CPU 1 (+2 for compiled rows)")
    p.add_argument("--peer-iters", type=int, default=None, help="soft-moe-pytorch timed calls; default 5, CPU 2")
    p.add_argument("--budget", default=None, metavar="PART=S,...",
                   help="seconds per part after which its remaining rows are skipped "
                        "(default layer=150,tower=110,lit=60; CPU 60 each)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense bf16 TFLOP/s for MFU (default: by device name, H100/H200 989)")
    p.add_argument("--profile-dir", default=None,
                   help="write profiler kernel tables of the layer (bf16 weights, S/16 and B/16) here")
    p.add_argument("--threads", type=int, default=1, help="CPU threads in --cpu mode")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--md", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.cpu = args.cpu or not torch.cuda.is_available()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    shapes = args.layer_shapes or ("tiny" if args.cpu else "S/16,B/16")
    args.layer_shapes = [s.strip() for s in shapes.split(",") if s.strip()]
    bad = sorted(set(args.layer_shapes) - set(LAYER_SHAPES))
    if bad:
        p.error(f"unknown layer shapes {bad}; choose from {', '.join(LAYER_SHAPES)}")
    args.iters = args.iters or (2 if args.cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 3)
    args.peer_iters = args.peer_iters or (2 if args.cpu else 5)
    budgets = dict(layer=60.0, tower=60.0, lit=60.0) if args.cpu else dict(layer=150.0, tower=110.0, lit=60.0)
    for item in (args.budget or "").split(","):
        if item.strip():
            key, _, value = item.partition("=")
            if key.strip() not in PARTS:
                p.error(f"--budget: unknown part {key!r}")
            budgets[key.strip()] = float(value)
    args.budgets = budgets
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cpu" if args.cpu else "cuda")
    device_name = setup_device(device, args.threads)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    peak, source = args.peak_tflops, "given"
    if peak is None and not args.cpu:
        peak, source = peak_bf16(device_name)
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(device, args.cpu, args.iters, args.warmup, args.peer_iters, args.budgets,
                  "aot_eager" if args.cpu else "inductor", peak, profile_dir)
    print(f"device {device_name}, torch {torch.__version__}, parts {','.join(args.only)}, budgets {args.budgets}",
          flush=True)
    matmul = _matmul_tflops(device)
    if matmul:
        print(f"8192³ bf16 matmul: {matmul:.0f} TFLOP/s", flush=True)
    meta = {"device": str(device), "device_name": device_name, "torch": torch.__version__,
            "mode": "cpu" if args.cpu else "cuda", "iters": args.iters, "warmup": args.warmup,
            "peer_iters": args.peer_iters, "budgets": args.budgets, "peak_tflops": peak,
            "peak_source": source if peak else None, "matmul_tflops": matmul, "compile_backend": bench.backend}
    for name in ("timm", "open_clip", "soft_moe_pytorch"):
        try:
            meta[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            meta[name] = None

    def write(final: bool):
        # After every row and part too: a run killed by an outer timeout (gpu_check.sh's) still leaves
        # every row it measured, and never a half-written file (each is replaced whole).
        meta["seconds"], meta["complete"] = time.perf_counter() - t0, final
        result = {**meta, "rows": [asdict(r) for r in bench.rows], "ratios": [asdict(q) for q in bench.ratios]}
        table = markdown(meta, bench.rows, bench.ratios)
        if args.json:
            write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        if args.md:
            write_text_atomic(args.md, table + "\n")
        return result, table

    bench.on_row = lambda: write(final=False)

    for part, run in (("layer", lambda: bench_layer(bench, args.layer_shapes)), ("tower", lambda: bench_tower(bench)),
                      ("lit", lambda: bench_lit(bench))):
        if part in args.only:
            bench.begin(part)
            try:
                run()
            except ImportError as e:  # a part whose own module is missing (e.g. timm): say so, go on
                bench.rows.append(Row(part, "(part)", "", note=f"not installed: {e.name or e}"))
            except Exception as e:  # a part failing outside its rows must not cost the later parts
                first = str(e).splitlines()[0][:160] if str(e) else ""
                bench.rows.append(Row(part, "(part)", "", note=f"failed: {type(e).__name__}: {first}"))
            print(f"[{part}] {time.perf_counter() - bench.part_start:.0f} s", flush=True)
            write(final=False)
    result, table = write(final=True)
    print()
    print(table)
    for path in (args.json, args.md):
        if path:
            print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
