"""Time the patch embedding: our matmul form (`VisionTransformer.embed_patches`) against the stride-p
convolution that timm's `PatchEmbed` runs (same weights), on the CPU or a GPU.

    python scripts/bench_patches.py            # the paper's B/16 shape and the tiny CPU towers
    python scripts/bench_patches.py --device cuda --batch 256

Prints one row per tower and dtype: milliseconds for both, their ratio, and the largest difference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this
from benchlib import setup_device, time_step  # noqa: E402

from lit_softmoe.models.registry import create_image_tower  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=None, help="default: 16 for B/16, 256 for the tiny towers")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"device: {setup_device(device)}, torch {torch.__version__}\n")
    dtypes = [torch.float32, torch.bfloat16]
    print("| tower | batch | dtype | convolution (timm's PatchEmbed) ms | ours (matmul) ms | conv / ours "
          "| max abs diff |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, default_batch in (("vit-b16", 16), ("vit-tiny-p7", 256), ("vit-tiny-p4", 256)):
        batch = args.batch or default_batch
        tower = create_image_tower(name).to(device)
        cfg = tower.cfg
        pixels = torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device=device)
        for dtype in dtypes:
            tower.to(dtype)
            x = pixels.to(dtype)

            def conv():
                return tower.patch_embed(x).flatten(2).transpose(1, 2).contiguous()

            def ours():
                return tower.embed_patches(x)

            with torch.inference_mode():
                diff = (conv().float() - ours().float()).abs().max().item()
                conv_ms, _ = time_step(conv, device, 2, args.iters)
                ours_ms, _ = time_step(ours, device, 2, args.iters)
            print(f"| {name} | {batch} | {str(dtype).removeprefix('torch.')} | {conv_ms:.2f} | {ours_ms:.2f} | "
                  f"{conv_ms / ours_ms:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
