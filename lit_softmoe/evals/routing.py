"""Where a Soft MoE tower routes one image: dispatch/combine statistics and slot heatmaps.

Soft MoE (Puigcerver et al., "From Sparse to Soft Mixtures of Experts", ICLR 2024) gives each slot a
convex mix of the tokens (dispatch weights D, softmax over the m tokens) and each token a convex
mix of the slot outputs (combine weights C, softmax over all n·p slots). The paper's Figures 8-10
and vmoe's SoftRouter metrics (`vmoe/projects/soft_moe/router.py`: min/max of both weights,
similarities between slots) read the routing from exactly these two tensors; this module does the
same for one image, with the layer's own `SoftMoE.routing_weights` called from a forward pre-hook
(the layer's maths is untouched, and `nn/` stays free of I/O: statistics, plotting and files are
here).

Statistics per Soft MoE block, all in nats:
- dispatch entropy: per slot, H(D[:, s]) over tokens, averaged over slots; its maximum is log m
  (a slot averaging all tokens uniformly), 0 a slot that copies one token;
- combine entropy: per token, H(C[i, :]) over slots, averaged over tokens; maximum log(n·p);
- argmax sharing: the token each slot weights most; how many distinct tokens those are, and the
  size of the largest group of slots sharing one argmax token (many slots on one token =
  redundancy).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lit_softmoe.errors import UserError
from lit_softmoe.nn.soft_moe import SoftMoE
from lit_softmoe.utils.atomic import replacing, write_text_atomic
from lit_softmoe.utils.paths import check_writable

PANEL_PIXELS = 200  # each panel of the routing figure is 200×200 px (2 in at 100 dpi)
HEADER_PIXELS = 60  # room for the two-line title above the panels
MAX_COLUMNS = 5


# ---- capture ------------------------------------------------------------------------------------

def soft_moe_blocks(tower: torch.nn.Module) -> list[int]:
    """Indices of the blocks whose MLP is a Soft MoE layer."""
    return [i for i, block in enumerate(tower.blocks) if isinstance(block.mlp, SoftMoE)]


@torch.no_grad()
def capture_routing(tower: torch.nn.Module,
                    pixels: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run `tower` once on `pixels` (b, c, h, w); return {block: (dispatch, combine)}, each
    (b, m, n, p).

    A pre-hook on each Soft MoE layer recomputes its routing weights from the exact input the
    layer gets (the LayerNorm output). The tower runs in eval mode, so no logit noise is drawn and
    the weights are the ones its forward pass uses.
    """
    captured, hooks = {}, []
    for i in soft_moe_blocks(tower):
        layer = tower.blocks[i].mlp
        hooks.append(layer.register_forward_pre_hook(
            lambda module, args, i=i: captured.__setitem__(i, module.routing_weights(*args))))
    was_training = tower.training
    try:
        tower.eval()
        tower(pixels)
    finally:
        tower.train(was_training)
        for hook in hooks:
            hook.remove()
    return captured


# ---- statistics ---------------------------------------------------------------------------------

def _entropy(weights: torch.Tensor, dim: int) -> torch.Tensor:
    return -torch.special.xlogy(weights, weights).sum(dim)  # 0 · log 0 = 0


def routing_stats(dispatch: torch.Tensor, combine: torch.Tensor) -> dict:
    """Statistics of one image's routing in one layer.

    Args:
        dispatch, combine: (m, n, p) or (m, n·p) weights of one image (as `routing_weights` returns
            them for one example): dispatch sums to 1 over tokens, combine over slots.
    """
    m = dispatch.shape[0]
    dispatch = dispatch.reshape(m, -1).double()  # (m, S)
    combine = combine.reshape(m, -1).double()  # (m, S)
    slots = dispatch.shape[1]
    argmax_token = dispatch.argmax(dim=0)  # (S,): the token each slot weights most
    group_sizes = torch.bincount(argmax_token, minlength=m)  # (m,): slots per argmax token
    return {
        "tokens": m,
        "slots": slots,
        "dispatch_entropy_mean": _entropy(dispatch, dim=0).mean().item(),
        "dispatch_entropy_max": math.log(m),
        "combine_entropy_mean": _entropy(combine, dim=1).mean().item(),
        "combine_entropy_max": math.log(slots),
        "dispatch_max_weight_mean": dispatch.max(dim=0).values.mean().item(),
        "combine_max_weight_mean": combine.max(dim=1).values.mean().item(),
        "distinct_argmax_tokens": int((group_sizes > 0).sum()),
        "largest_argmax_group": int(group_sizes.max()),
    }


def stats_table(layers: list[dict]) -> str:
    """A plain-text table, one row per Soft MoE block (entropies in nats, with their maxima)."""
    rows = [("block", "tokens", "slots", "dispatch H (max)", "combine H (max)", "max D",
             "distinct argmax", "largest group")]
    for s in layers:
        rows.append((str(s["block"]), str(s["tokens"]), str(s["slots"]),
                     f"{s['dispatch_entropy_mean']:.3f} ({s['dispatch_entropy_max']:.3f})",
                     f"{s['combine_entropy_mean']:.3f} ({s['combine_entropy_max']:.3f})",
                     f"{s['dispatch_max_weight_mean']:.3f}",
                     f"{s['distinct_argmax_tokens']}/{s['slots']}", str(s["largest_argmax_group"])))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


# ---- plotting -----------------------------------------------------------------------------------

def figure_size(num_slots: int) -> tuple[int, int]:
    """(width, height) in pixels of the figure `plot_routing` draws for `num_slots` slots."""
    panels = num_slots + 1
    columns = min(panels, MAX_COLUMNS)
    return columns * PANEL_PIXELS, math.ceil(panels / columns) * PANEL_PIXELS + HEADER_PIXELS


def plot_routing(image: torch.Tensor, dispatch: torch.Tensor, slots: list[int],
                 grid: tuple[int, int], out_png: str | Path, title: str = "",
                 slots_per_expert: int = 1) -> tuple[int, int]:
    """Draw the image, then the dispatch weights of each chosen slot as a heatmap over the patch
    grid.

    Args:
        image: (c, h, w) in [0, 1], the image as the tower saw it.
        dispatch: (m, S) dispatch weights of one layer for this image, m = grid[0] · grid[1].
        slots: indices into S to draw; slot s belongs to expert s // slots_per_expert.
        grid: (rows, columns) of patches.
    Returns the figure's size in pixels (see `figure_size`).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    width, height = figure_size(len(slots))
    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    columns = width // PANEL_PIXELS
    rows = (height - HEADER_PIXELS) // PANEL_PIXELS
    picture = image.permute(1, 2, 0).clamp(0, 1).numpy()  # (h, w, c)
    cmap = "gray" if picture.shape[2] == 1 else None
    picture = picture[:, :, 0] if picture.shape[2] == 1 else picture
    h, w = picture.shape[:2]
    shown = dispatch[:, slots]  # (m, k)
    # One colour scale for every slot, so panels compare; from the smallest weight shown, not 0,
    # because dispatch weights near uniform (1/m) would otherwise all look alike.
    vmin, vmax = float(shown.min()), float(shown.max())
    ax = fig.add_subplot(rows, columns, 1)
    ax.imshow(picture, cmap=cmap, vmin=0, vmax=1)
    ax.set_title("input", fontsize=8)
    ax.axis("off")
    for k, slot in enumerate(slots):
        ax = fig.add_subplot(rows, columns, k + 2)
        ax.imshow(picture, cmap=cmap, vmin=0, vmax=1, alpha=0.35)
        heat = shown[:, k].reshape(grid).numpy()  # (rows, columns) of patches
        ax.imshow(heat, cmap="magma", vmin=vmin, vmax=vmax, alpha=0.75, extent=(0, w, h, 0),
                  interpolation="nearest")
        ax.set_title(f"slot {slot} (expert {slot // slots_per_expert})\nmax {heat.max():.2f}",
                     fontsize=8)
        ax.axis("off")
    fig.suptitle((f"{title}\ncolour scale: dispatch weight {vmin:.3f} (dark) to "
                  f"{vmax:.3f} (bright)").lstrip(), fontsize=8)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - (HEADER_PIXELS + 25) / height,
                        wspace=0.05, hspace=0.3)
    with replacing(out_png) as temporary:  # never half a figure; a full disk names the path
        fig.savefig(temporary, dpi=dpi, format=Path(out_png).suffix[1:].lower() or "png")
    return width, height


# ---- the command --------------------------------------------------------------------------------

def _read_image(path: Path, transform) -> torch.Tensor:
    import PIL.Image
    try:
        # Decoded by the transform (at the scale the tower's preprocessing asks for), as eval
        # decodes.
        with PIL.Image.open(path) as image:
            return transform(image)
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise UserError(f"cannot read {path} as an image ({type(err).__name__}: {err}); "
                        "give a PNG or JPEG file") from None


def _check_out(out_png: Path) -> None:
    """--out must be a writable file whose suffix names a format matplotlib writes (the JSON goes
    beside it)."""
    from matplotlib.backend_bases import FigureCanvasBase
    check_writable(out_png, "--out", folder=False)
    suffix = out_png.suffix.lstrip(".").lower()
    if not suffix:  # matplotlib would write OUT.png, and the report and message would name OUT
        raise UserError(f"--out {out_png} has no file suffix; give the figure's file, e.g. "
                        f"{out_png}.png")
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise UserError(f"--out {out_png}: cannot write a .{suffix} figure; give a .png (or .pdf, "
                        f".svg, .jpg) file, e.g. {out_png.with_suffix('.png')}")


def inspect_routing(tower_dir: str | Path, image_path: str | Path, out_png: str | Path,
                    layer: int | None = None, num_slots: int = 8) -> dict:
    """Route one image through a tower; write the heatmap PNG and the statistics as JSON beside it.

    Args:
        layer: the block whose slots are drawn (a block index, as in the tower's `moe_layers`);
            default: the last Soft MoE block. Statistics cover every Soft MoE block.
        num_slots: draw the first `num_slots` slots of that block.
    Returns the report written to `out_png` with suffix .json.
    """
    from lit_softmoe.data.transforms import BatchNormalize, pixel_transform
    from lit_softmoe.models.tower_folder import (
        load_tower,
        resolution_change,
        tower_preprocess,
    )

    # before the work: matplotlib would fail only after it, with a traceback
    _check_out(Path(out_png))
    tower, meta = load_tower(tower_dir)
    blocks = soft_moe_blocks(tower)
    if not blocks:
        raise UserError(f"{tower_dir} has no Soft MoE block (a dense tower); "
                        "inspect a soft-* tower")
    if layer is None:
        layer = blocks[-1]
    if not -tower.cfg.depth <= layer < tower.cfg.depth:
        raise UserError(f"--layer {layer} is out of range: the tower has {tower.cfg.depth} blocks; "
                        f"its Soft MoE blocks are {blocks}")
    layer %= tower.cfg.depth
    if layer not in blocks:
        raise UserError(f"block {layer} has a dense MLP, not a Soft MoE layer; "
                        f"choose one of {blocks}")
    if num_slots < 1:
        raise UserError(f"--slots must be at least 1, got {num_slots}")
    preprocess = tower_preprocess(tower_dir, tower, meta)

    image_path = Path(image_path)
    # uint8 (c, h, w): what the tower sees
    seen = _read_image(image_path, pixel_transform(preprocess))
    pixels = BatchNormalize(preprocess)(seen.unsqueeze(0))  # (1, c, h, w), the tower's input
    routing = capture_routing(tower, pixels)
    with torch.no_grad():
        logits = tower(pixels)[0]

    layers = [{"block": i, **routing_stats(routing[i][0][0], routing[i][1][0])} for i in blocks]
    dispatch = routing[layer][0][0].flatten(1)  # (m, S)
    slots = list(range(min(num_slots, dispatch.shape[1])))
    grid = (pixels.shape[2] // tower.cfg.patch_size, pixels.shape[3] // tower.cfg.patch_size)
    prediction = None
    classnames = meta.get("classnames")
    if tower.cfg.num_classes and classnames and len(classnames) == tower.cfg.num_classes:
        prediction = classnames[int(logits.argmax())]
    stats = next(s for s in layers if s["block"] == layer)
    title = (f"{image_path.name}: block {layer}, dispatch weights of slots {slots[0]}-{slots[-1]}"
             f"{f' (predicted: {prediction})' if prediction else ''}\n"
             f"dispatch H {stats['dispatch_entropy_mean']:.2f}/"
             f"{stats['dispatch_entropy_max']:.2f} nats, "
             f"{stats['distinct_argmax_tokens']} distinct argmax tokens of {stats['tokens']}")
    # The figure and its statistics are one pair: an earlier run's report goes before the new figure
    # takes its name, so a kill between the two renames leaves a figure without statistics, never
    # another image's.
    Path(out_png).with_suffix(".json").unlink(missing_ok=True)
    size = plot_routing(seen.float() / 255, dispatch, slots, grid, out_png, title,
                        tower.cfg.slots_per_expert)
    report = {"tower": str(tower_dir), "image": str(image_path),
              "plotted": {"block": layer, "slots": slots, "png": str(out_png), "size": list(size)},
              "prediction": prediction, "layers": layers,
              "resolution_change": resolution_change(tower, meta["preprocess"])}
    write_text_atomic(Path(out_png).with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    return report
