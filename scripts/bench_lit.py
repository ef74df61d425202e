"""Time one LiT training step, ours against open_clip's `--lock-image`, on the same towers and batch.

Every row times a full training step — forward, CLIP softmax loss, backward, AdamW step, zero_grad —
on random inputs already on the device (no data loading), under bf16 autocast on CUDA:
- `open_clip lock-image`: `open_clip.create_model("ViT-B-16")` (random init, nothing downloaded),
  `model.lock_image_tower(unlocked_groups=0, freeze_bn_stats=False)` as its `--lock-image` does,
  `model.train()`, its `ClipLoss`, AdamW over the parameters that require grad with its training
  script's groups, and its `logit_scale.clamp_(0, log 100)` after the step;
- `open_clip image features given`: the same model and step, but only the text tower runs: the
  image features (B, embed_dim) are given, as from a cache (for reference);
- `ours on-the-fly`: `LiTModel` with our dense `vit-b16` tower (run each step, no graph, eval
  mode, its frozen weights converted to bf16 once) and a text tower with open_clip ViT-B-16's text
  config, `contrastive_loss`, the recipe's AdamW (`lit_softmoe.train.optim.create_optimizer`: fused);
- `ours cached`: the same model fed the tower's pooled features (B, width), as the embedding cache
  (`lit-softmoe embed`) stores them (fp16);
- with --soft, `ours on-the-fly soft-b16-128e`: the Soft MoE B/16 tower, built without a head;
- with --compile, the rows above again with torch.compile (open_clip: the whole model, as its
  `--torchcompile`; ours: the image tower's forward_features and the text tower).

The towers differ in architecture where the two codebases do (printed under the table): open_clip's
ViT-B-16 visual has a class token, ln_pre, no qk-norm, exact GELU, class-token pooling and a frozen
768→512 projection (197 tokens); ours has no class token, LayerNorm on q and k, tanh GELU, global
average pooling and no projection (196 tokens), so our text tower projects to 768, open_clip's to 512.
The text transformers are otherwise the same class (open_clip's `TextTransformer`).

The issue's targets (H200, bf16, batch 256, open_clip ViT-B-16: 3,842 samples/s for its LiT step,
8,352 with image features given): ours on-the-fly >= 1.2x and ours cached >= 2x the samples/s of
`open_clip lock-image` measured in the same run. Examples:

    python scripts/bench_lit.py                                 # CUDA: preset b16; CPU: preset cpu
    python scripts/bench_lit.py --compile --soft --json bench_lit.json
    python scripts/bench_lit.py --preset cpu --batch 16 --iters 3
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace

import torch
from benchlib import setup_device, time_step  # scripts/benchlib.py, beside this script

from lit_softmoe.config import OptimConfig
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.train.loss import contrastive_loss
from lit_softmoe.train.optim import create_optimizer

LR, WEIGHT_DECAY = 1e-4, 0.1  # values only matter for the step being a real AdamW step
TARGETS = {"ours on-the-fly": 1.2, "ours cached": 2.0}  # min samples/s ratio vs open_clip lock-image
BASELINE = "open_clip lock-image"


@dataclass(frozen=True)
class Preset:
    """Both models' shapes: the image tower (ours and open_clip's visual) and the text tower."""
    name: str
    batch: int
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    text_width: int = 512
    text_layers: int = 12
    text_heads: int = 8
    context_length: int = 77
    vocab_size: int = 49408
    openclip_embed_dim: int = 512  # open_clip's shared embedding width (its visual projects 768 → 512)
    openclip_model: str | None = "ViT-B-16"  # None: build open_clip.CLIP from the fields above
    soft_overrides: dict = field(default_factory=dict)  # for soft-b16-128e on a shrunken tower

    def __str__(self) -> str:
        return (f"{self.name} (batch {self.batch}; image {self.image_size}px/p{self.patch_size}, width "
                f"{self.width}, depth {self.depth}, heads {self.heads}, mlp {self.mlp_dim}; text width "
                f"{self.text_width}, layers {self.text_layers}, heads {self.text_heads}, context "
                f"{self.context_length}, vocab {self.vocab_size}"
                + (f"; open_clip {self.openclip_model}" if self.openclip_model else "") + ")")


PRESETS = {
    "b16": Preset("b16", batch=256),
    # Seconds per step on a couple of CPU cores: only shows that every row runs.
    "cpu": Preset("cpu", batch=8, image_size=64, width=128, depth=2, heads=4, mlp_dim=512, text_width=128,
                  text_layers=2, text_heads=4, openclip_embed_dim=128, openclip_model=None,
                  soft_overrides=dict(moe_layers=(1,), num_experts=16)),
}


# ---- inputs -------------------------------------------------------------------------------------

def make_inputs(preset: Preset, device: torch.device) -> dict:
    """Random pixels, token ids shaped like CLIP BPE output, and cache-like image features."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, length = preset.batch, preset.context_length
    pixels = torch.randn(b, 3, preset.image_size, preset.image_size, generator=g)
    # <start_of_text> w1 … wn <end_of_text> 0 … 0, with <end_of_text> the largest id (argmax pooling).
    sot, eot = preset.vocab_size - 2, preset.vocab_size - 1
    ids = torch.randint(1, sot, (b, length), generator=g)
    ends = torch.randint(length // 4, length, (b,), generator=g)
    pos = torch.arange(length)
    ids[:, 0] = sot
    ids[pos[None] > ends[:, None]] = 0
    ids[torch.arange(b), ends] = eot
    cache_dtype = torch.float16 if device.type == "cuda" else torch.float32  # the cache stores fp16
    return {
        "pixels": pixels.to(device),
        "text": ids.to(device),
        "features": torch.randn(b, preset.width, generator=g).to(device, cache_dtype),
        "openclip_features": torch.nn.functional.normalize(
            torch.randn(b, preset.openclip_embed_dim, generator=g), dim=-1).to(device),
    }


# ---- the implementations: each returns (step, trainable module, all modules, note) ---------------

def build_openclip(preset: Preset, device: torch.device, compiled: bool, args):
    import open_clip

    if preset.openclip_model:
        model = open_clip.create_model(preset.openclip_model, pretrained=None, device=device,
                                       output_dict=True, force_context_length=preset.context_length)
    else:
        model = open_clip.CLIP(
            embed_dim=preset.openclip_embed_dim,
            vision_cfg=dict(image_size=preset.image_size, patch_size=preset.patch_size, width=preset.width,
                            layers=preset.depth, head_width=preset.width // preset.heads,
                            mlp_ratio=preset.mlp_dim / preset.width),
            text_cfg=dict(context_length=preset.context_length, vocab_size=preset.vocab_size,
                          width=preset.text_width, heads=preset.text_heads, layers=preset.text_layers),
            output_dict=True).to(device)
    model.lock_image_tower(unlocked_groups=0, freeze_bn_stats=False)
    model.train()
    # open_clip_train/main.py's AdamW groups.
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
                                   {"params": [p for n, p in named if not exclude(n, p)],
                                    "weight_decay": WEIGHT_DECAY}], lr=LR)
    loss_fn = open_clip.ClipLoss(cache_labels=True)
    forward = torch.compile(model, mode=args.compile_mode) if compiled else model
    return model, forward, optimizer, loss_fn


def openclip_step(model, forward, optimizer, loss_fn, inputs, autocast_dtype, features_given: bool):
    device = inputs["text"].device

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            if features_given:
                out = forward(image=None, text=inputs["text"])
                out["image_features"] = inputs["openclip_features"]
            else:
                out = forward(inputs["pixels"], inputs["text"])
            losses = loss_fn(**out, output_dict=True)
            total = sum(losses.values())
        total.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return step


def build_ours(preset: Preset, device: torch.device, compiled: bool, args, tower_name: str = "vit-b16"):
    overrides = dict(image_size=preset.image_size, patch_size=preset.patch_size, width=preset.width,
                     depth=preset.depth, num_heads=preset.heads, mlp_dim=preset.mlp_dim, num_classes=0)
    if tower_name.startswith("soft-"):
        overrides.update(preset.soft_overrides)
    tower = create_image_tower(tower_name, device=device, **overrides)
    if args.precision == "autocast-bf16" and not args.fp32_tower:
        tower.to(torch.bfloat16)  # locked: convert once instead of autocast casting every step
    text_cfg = TextTowerConfig(kind="transformer", width=preset.text_width, layers=preset.text_layers,
                               heads=preset.text_heads, context_length=preset.context_length,
                               vocab_size=preset.vocab_size)
    text = create_text_tower(text_cfg, embed_dim=tower.embed_dim)
    model = LiTModel(tower, text, loss="softmax").to(device)
    model.train()  # keeps the locked tower in eval mode
    optimizer = create_optimizer(model, OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY))  # the recipe's: fused
    if compiled:
        tower.forward_features = torch.compile(tower.forward_features, mode=args.compile_mode)
        text.compile(mode=args.compile_mode)  # in place: parameter names and the optimizer are unchanged
    return model, optimizer


def ours_step(model, optimizer, inputs, autocast_dtype, cached: bool):
    device = inputs["text"].device

    def step():
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            if cached:
                outputs = model(image_features=inputs["features"], text=inputs["text"])
            else:
                outputs = model(inputs["pixels"], inputs["text"])
            loss = contrastive_loss(*outputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ---- timing -------------------------------------------------------------------------------------

@dataclass
class Result:
    row: str
    preset: str
    batch: int
    ms: float | None = None  # median ms of one training step
    samples_per_s: float | None = None
    ratio: float | None = None  # samples/s / samples/s of `open_clip lock-image`
    target: float | None = None  # the minimum ratio for this row
    trainable_m: float | None = None
    params_m: float | None = None
    peak_mib: float | None = None  # CUDA only: peak allocated during the timed steps, params included
    iters: int = 0
    note: str = ""


def _count(module: torch.nn.Module) -> tuple[float, float]:
    params = list(module.parameters())
    return (sum(p.numel() for p in params if p.requires_grad) / 1e6, sum(p.numel() for p in params) / 1e6)


def run_benchmark(preset: Preset, args, device: torch.device) -> list[Result]:
    autocast_dtype = torch.bfloat16 if args.precision == "autocast-bf16" else None
    inputs = make_inputs(preset, device)

    rows = [(BASELINE, "openclip", False, False), ("open_clip image features given", "openclip", True, False),
            ("ours on-the-fly", "ours", False, False), ("ours cached", "ours", True, False)]
    if args.soft:
        rows.append(("ours on-the-fly soft-b16-128e", "soft", False, False))
    if args.compile:
        rows += [(name + " +compile", kind, given, True) for name, kind, given, _ in list(rows)]

    results = []
    for name, kind, given, compiled in rows:
        result = Result(name, preset.name, preset.batch, iters=args.iters)
        built = None
        try:
            torch.manual_seed(0)
            if kind == "openclip":
                built = build_openclip(preset, device, compiled, args)
                model = built[0]
                step = openclip_step(*built, inputs, autocast_dtype, features_given=given)
            else:
                tower = "soft-b16-128e" if kind == "soft" else "vit-b16"
                built = model, optimizer = build_ours(preset, device, compiled, args, tower)
                step = ours_step(model, optimizer, inputs, autocast_dtype, cached=given)
            result.trainable_m, result.params_m = _count(model)
            warmup = args.warmup + (2 if compiled else 0)
            result.ms, result.peak_mib = time_step(step, device, warmup, args.iters)
            result.samples_per_s = preset.batch / (result.ms / 1e3)
        except ImportError as e:
            result.note = f"skipped: {e.name or 'open_clip'} is not installed"
        except Exception as e:  # one failing row (OOM, no compiler) must not end the benchmark
            result.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        finally:
            built = model = step = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results.append(result)
        print(f"  {name:40s} " + (f"{result.ms:9.2f} ms  {result.samples_per_s:9.1f} samples/s"
                                  if result.ms else result.note), flush=True)

    # Ratios and targets against eager open_clip (its default, the reference); compiled rows
    # also note their ratio against compiled open_clip when that ran.
    base = {r.row.endswith(" +compile"): r.samples_per_s for r in results
            if r.row.removesuffix(" +compile") == BASELINE}
    for r in results:
        compiled = r.row.endswith(" +compile")
        r.target = TARGETS.get(r.row.removesuffix(" +compile"))
        if r.samples_per_s and base.get(False):
            r.ratio = r.samples_per_s / base[False]
        if compiled and r.samples_per_s and base.get(True) and r.row != BASELINE + " +compile":
            r.note = f"{r.samples_per_s / base[True]:.2f}x open_clip +compile"
    return results


def markdown_table(results: list[Result], cuda: bool) -> str:
    head = ["row", "ms/step", "samples/s", f"vs {BASELINE}", "target", "trainable (M)", "params (M)"]
    if cuda:
        head.append("peak MiB")
    head.append("note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        target = "–"
        if r.target is not None:
            met = "" if r.ratio is None else (" met" if r.ratio >= r.target else " NOT met")
            target = f">= {r.target:.1f}x{met}"
        row = [r.row,
               f"{r.ms:.2f}" if r.ms is not None else "–",
               ("–" if r.samples_per_s is None else
                f"{r.samples_per_s:,.0f}" if r.samples_per_s >= 100 else f"{r.samples_per_s:.2f}"),
               f"{r.ratio:.2f}x" if r.ratio is not None else "–",
               target,
               f"{r.trainable_m:.1f}" if r.trainable_m is not None else "–",
               f"{r.params_m:.1f}" if r.params_m is not None else "–"]
        if cuda:
            row.append(f"{r.peak_mib:.0f}" if r.peak_mib is not None else "–")
        row.append(r.note or (f"median of {r.iters}" if r.ms is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="b16: open_clip ViT-B-16 vs our vit-b16 at 224 px; cpu: tiny towers (default on CPU)")
    p.add_argument("--batch", type=int, default=None, help="override the preset's batch size (b16: 256)")
    p.add_argument("--context-length", type=int, default=None,
                   help="override the text context length of both models (default 77, open_clip's; LiT uses 16)")
    p.add_argument("--precision", choices=["auto", "fp32", "autocast-bf16"], default="auto",
                   help="autocast-bf16: fp32 trainable weights under bf16 autocast (open_clip's amp_bf16); "
                        "auto: autocast-bf16 on CUDA, fp32 on CPU")
    p.add_argument("--fp32-tower", action="store_true",
                   help="keep our locked tower's weights in fp32 (default: converted to bf16 once under autocast-bf16)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd variants of every row")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode (e.g. max-autotune-no-cudagraphs); default: torch's default")
    p.add_argument("--soft", action="store_true",
                   help="also time our on-the-fly step with the Soft MoE soft-b16-128e tower (b16: ~7 GiB "
                        "of bf16 weights)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch; 0 (default): torch's choice, or 1 when the machine is "
                        "already busy, where OpenMP threads waiting on each other inflate timings 10x+")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here as JSON")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.precision == "auto":
        args.precision = "autocast-bf16" if cuda else "fp32"
    preset = PRESETS[args.preset or ("b16" if cuda else "cpu")]
    changes = {}
    if args.batch is not None:
        changes["batch"] = args.batch
    if args.context_length is not None:
        changes["context_length"] = args.context_length
    if changes:
        preset = replace(preset, **changes)
    args.preset = preset
    if args.iters < 1 or args.warmup < 0 or preset.batch < 2 or preset.context_length < 2:
        p.error("--iters must be >= 1, --warmup >= 0, --batch >= 2, --context-length >= 2")
    return args


ARCH_NOTES = [
    "open_clip ViT-B-16 visual: class token + ln_pre, no qk-norm, exact GELU, nn.MultiheadAttention, "
    "class-token pooling, frozen projection 768→512 (197 tokens at 224 px)",
    "ours vit-b16: no class token, LayerNorm on q and k, tanh GELU, SDPA, global average pooling, no "
    "projection (196 tokens at 224 px); the text tower projects 512→768 instead of open_clip's 512→512",
    "text: open_clip's TextTransformer in both (causal, argmax pooling, bias-free projection)",
]


def main(argv=None) -> list[Result]:
    args = parse_args(argv)
    preset = args.preset
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    device_name = setup_device(device, args.threads)
    try:
        import open_clip
        openclip_version = getattr(open_clip, "__version__", "?")
    except ImportError:
        openclip_version = None
    tower_dtype = "bf16" if args.precision == "autocast-bf16" and not args.fp32_tower else "fp32"
    print(f"device: {device} ({device_name}), torch {torch.__version__}, open_clip {openclip_version}, "
          f"precision {args.precision}, our locked tower in {tower_dtype}, threads {torch.get_num_threads()}")
    print(f"preset {preset}", flush=True)
    results = run_benchmark(preset, args, device)

    print()
    print(f"LiT training step (forward, CLIP loss, backward, AdamW, zero_grad) on {device_name} "
          f"({args.precision}, batch {preset.batch}, torch {torch.__version__}, open_clip {openclip_version})")
    print()
    print(markdown_table(results, cuda))
    print(f"- {preset}")
    print(f"- ratio: samples/s over eager `{BASELINE}` of this run (the issue's reference step)")
    print("- targets (issue: H200, bf16, batch 256, ViT-B-16; open_clip 3,842 samples/s, 8,352 with image "
          "features given): ours on-the-fly >= 1.2x, ours cached >= 2x open_clip's LiT step")
    for note in ARCH_NOTES:
        print(f"- {note}")
    if args.json:
        payload = {"device": str(device), "device_name": device_name, "torch": torch.__version__,
                   "open_clip": openclip_version, "precision": args.precision, "tower_dtype": tower_dtype,
                   "compile": args.compile, "compile_mode": args.compile_mode, "preset": asdict(preset),
                   "targets": {k: v for k, v in TARGETS.items()}, "baseline": BASELINE,
                   "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
