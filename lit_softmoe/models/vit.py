"""Vision Transformer towers with dense, Soft MoE or sparse MoE blocks (named variants:
`models.registry`).

The architecture follows the Soft MoE paper's released configs (google-research/vmoe,
`vmoe/nn/vit_moe.py` and `vmoe/projects/soft_moe/configs/`): pre-LN blocks, LayerNorm on queries and
keys (qk-norm), learned position embeddings, no class token, global average pooling, and the
contiguous last half of the MLP blocks replaced by Soft MoE, as the released configs place it.
The paper's sparse baselines (Tokens Choice, Experts Choice) sit in the same blocks, so
`tc-*` / `ec-*` towers differ from `soft-*` ones only in the MoE layer (`moe_type`).
The methods follow timm's contract (`timm/models/vision_transformer.py`): `forward_features` →
tokens `(B, N, C)` after the final norm, `forward_head(x, pre_logits=True)` → pooled `(B, C)`, plus
`reset_classifier`, `get_classifier`, `num_features`, `group_matcher` and `set_grad_checkpointing`,
and for timm's `features_only` wrapper (`FeatureGetterNet`) `feature_info`, `forward_intermediates`
(block outputs as `(B, C, H, W)` maps) and `prune_intermediate_layers`; `forward_pooled` is the
pooled embedding that embedding, LiT and the evals call.

Read bottom-up: Attention → Mlp → Block → VisionTransformer.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_softmoe.models.vit_config import ViTConfig, _is_int
from lit_softmoe.nn.qk_norm import can_fuse_qk_norm, fused_qk_norm
from lit_softmoe.nn.routers import ExpertsChoiceMoE, TokensChoiceMoE
from lit_softmoe.nn.soft_moe import SoftMoE

GLOBAL_POOLS = ("avg", "")  # timm's: "" = no pooling, forward returns the tokens
OUTPUT_FMTS = ("NCHW", "NLC")  # forward_intermediates: maps (b, d, rows, cols) or tokens (b, m, d)


class Attention(nn.Module):
    """Multi-head self-attention with optional LayerNorm on q and k, via SDPA."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, qk_norm_bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, **factory)
        norm = dict(eps=1e-6, bias=qk_norm_bias, **factory)
        self.q_norm = nn.LayerNorm(self.head_dim, **norm) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, **norm) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, m, d = x.shape
        qkv = self.qkv(x)  # (b, m, 3·d)
        # each (b, m, heads, head_dim)
        q, k, v = qkv.view(b, m, 3, self.num_heads, self.head_dim).unbind(2)
        # CUDA inference: one Triton kernel each for q and k (None where it cannot run: PyTorch's
        # path).
        fused = fused_qk_norm(qkv, self.num_heads, self.q_norm, self.k_norm) \
            if can_fuse_qk_norm(qkv, self.q_norm, self.k_norm) else None
        if fused is not None:
            q, k = fused
        else:
            q, k = _layer_norm_keep_dtype(self.q_norm, q), _layer_norm_keep_dtype(self.k_norm, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, m, head_dim)
        x = F.scaled_dot_product_attention(q, k, v)  # (b, heads, m, head_dim)
        return self.proj(x.transpose(1, 2).reshape(b, m, d))


def _layer_norm_keep_dtype(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """qk-norm in the activations' dtype: autocast would round-trip q and k through fp32 (the kernel
    accumulates in fp32 anyway), for the same output in less time."""
    if isinstance(norm, nn.Identity) or t.device.type not in ("cuda", "cpu"):
        return norm(t)
    with torch.autocast(t.device.type, enabled=False):
        bias = None if norm.bias is None else norm.bias.to(t.dtype)
        return F.layer_norm(t, norm.normalized_shape, norm.weight.to(t.dtype), bias, norm.eps)


class Mlp(nn.Module):
    """The dense block MLP: Dense → GELU → Dense."""

    def __init__(self, dim: int, hidden_dim: int, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_dim, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def _moe_layer(cfg: ViTConfig, device=None, dtype=None) -> nn.Module:
    """The MoE layer `cfg.moe_type` names, built from the tower config."""
    factory = dict(device=device, dtype=dtype)
    if cfg.moe_type == "tokens_choice":
        return TokensChoiceMoE(cfg.width, cfg.num_experts, cfg.mlp_dim,
                               num_selected=cfg.num_selected_experts,
                               capacity_factor=cfg.capacity_factor,
                               batch_priority=cfg.batch_priority, noise_std=cfg.router_noise,
                               shared_expert_init=cfg.shared_expert_init, **factory)
    if cfg.moe_type == "experts_choice":
        return ExpertsChoiceMoE(cfg.width, cfg.num_experts, cfg.mlp_dim,
                                capacity_factor=cfg.capacity_factor, noise_std=cfg.router_noise,
                                shared_expert_init=cfg.shared_expert_init, **factory)
    return SoftMoE(cfg.width, cfg.num_experts, cfg.mlp_dim, slots_per_expert=cfg.slots_per_expert,
                   shared_expert_init=cfg.shared_expert_init, **factory)


class Block(nn.Module):
    """Pre-LN transformer block: x + MHSA(LN(x)), then x + MLP_or_MoE(LN(x))."""

    def __init__(self, cfg: ViTConfig, use_moe: bool, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6, **factory)
        self.attn = Attention(cfg.width, cfg.num_heads, cfg.qk_norm, cfg.qk_norm_bias, **factory)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6, **factory)
        if use_moe:
            self.mlp = _moe_layer(cfg, **factory)
        else:
            self.mlp = Mlp(cfg.width, cfg.mlp_dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _channels(count: int) -> str:
    return {1: "1-channel (gray)", 3: "3-channel (RGB)"}.get(count, f"{count}-channel")


def _channel_fix(wanted: int, given: int) -> str:
    if wanted == 1 and given == 3:
        return ("convert the images to gray first: PIL's image.convert('L'), timm's "
                "create_dataset(..., input_img_mode='L'), or the tower's own preprocess "
                "(lit_softmoe.load_pretrained); open_clip's RGB transforms need the export "
                "(lit-softmoe export)")
    if wanted == 3 and given == 1:
        return ("convert the images to RGB first: PIL's image.convert('RGB'), or the tower's own "
                "preprocess")
    return "give images of the tower's channel count"


def _take_indices(depth: int,
                  indices: int | list[int] | tuple[int, ...] | None) -> tuple[list[int], int]:
    """Which blocks' outputs to take, as timm's `feature_take_indices`: None → all, an int n → the
    last n, a sequence → those indices (negative ones count from the end). Returns (indices, the
    largest)."""
    if indices is None:
        indices = depth
    if _is_int(indices):
        if not 0 < indices <= depth:
            raise ValueError(f"indices={indices} asks for the last {indices} blocks of a tower of "
                             f"{depth}")
        take = list(range(depth - indices, depth))
    else:
        take = [i + depth if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, take) if not 0 <= t < depth]
        if bad or not take:
            raise ValueError(f"indices {list(indices)} are no block indices of a tower of {depth} "
                             "blocks")
    return take, max(take)


def _check_pool(global_pool: str) -> str:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"global_pool {global_pool!r} is not one of {GLOBAL_POOLS} (the tower has "
                         "no class token)")
    return global_pool


class VisionTransformer(nn.Module):
    """ViT tower: patches → blocks → final LayerNorm → global average pool → optional head."""

    def __init__(self, cfg: ViTConfig, device=None, dtype=None, global_pool: str = "avg"):
        super().__init__()
        # Built on the meta device, then drawn once by `reset_parameters`: built in place, every
        # nn.Linear would first draw PyTorch's default init, which ours replaces (twice the time to
        # build a tower).
        factory = dict(device="meta", dtype=dtype)
        self.cfg = cfg
        self.embed_dim = self.num_features = self.head_hidden_size = cfg.width  # timm's names
        self.global_pool = _check_pool(global_pool)
        self.grad_checkpointing = False
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.width, cfg.patch_size, cfg.patch_size,
                                     **factory)
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.num_patches, cfg.width, **factory))
        self.blocks = nn.ModuleList(
            Block(cfg, use_moe=i in cfg.moe_layers, **factory) for i in range(cfg.depth))
        # timm's feature metadata: each block's output is a feature level, a (d, h/p, w/p) map.
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=cfg.width, reduction=cfg.patch_size)
                             for i in range(cfg.depth)]
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6, **factory)
        self.head = (nn.Linear(cfg.width, cfg.num_classes, **factory) if cfg.num_classes
                     else nn.Identity())
        target = torch.empty(0, device=device).device  # `device`, or torch's default device
        if target.type != "meta":
            self.to_empty(device=target).reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Draws every weight once; a layer it does not know is an error, not left uninitialized."""
        if self.pos_embed.is_meta:
            return
        nn.init.normal_(self.pos_embed, std=0.02)
        drawn = {self, self.patch_embed, self.head}  # the tower's own tensors: drawn here and below
        for module in self.modules():
            if isinstance(module, Attention):
                # flax's attention (vmoe: kernel_init=xavier_uniform): q, k, v are three (d, d)
                # kernels, each xavier on its own (over the fused (3d, d) weight: sqrt(2) too
                # narrow); zero biases.
                for kernel in module.qkv.weight.chunk(3, dim=0):
                    nn.init.xavier_uniform_(kernel)
                nn.init.xavier_uniform_(module.proj.weight)
                nn.init.zeros_(module.qkv.bias)
                nn.init.zeros_(module.proj.bias)
                drawn |= {module, module.qkv, module.proj}
            elif isinstance(module, Mlp):
                # vmoe's MlpBlock: xavier-uniform kernels, N(0, 1e-6) biases
                for linear in (module.fc1, module.fc2):
                    nn.init.xavier_uniform_(linear.weight)
                    nn.init.normal_(linear.bias, std=1e-6)
                drawn |= {module, module.fc1, module.fc2}
            elif isinstance(module, (nn.LayerNorm, SoftMoE, TokensChoiceMoE, ExpertsChoiceMoE)):
                # ones and zeros; an MoE layer's router and experts (official inits)
                module.reset_parameters()
                drawn |= set(module.modules())
        undrawn = [n for n, m in self.named_modules()
                   if m not in drawn and next(m.parameters(False), None) is not None]
        if undrawn:
            raise TypeError(f"VisionTransformer.reset_parameters draws no init for {undrawn}")
        # vmoe's `embedding` is a flax nn.Conv with its defaults: lecun-normal kernel (fan_in =
        # c·p·p, truncated at ±2σ; 0.8796 is the std of a unit normal truncated there), zero bias.
        # PyTorch's Conv2d default would be sqrt(3) narrower, with a uniform bias.
        std = 1.0 / math.sqrt(self.patch_embed.weight[0].numel()) / 0.87962566103423978
        nn.init.trunc_normal_(self.patch_embed.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(self.patch_embed.bias)
        if isinstance(self.head, nn.Linear):
            # Zero weights and a bias of -log(C): every class starts at probability 1/C, which is
            # what the sigmoid cross-entropy of the released configs wants (harmless for softmax).
            nn.init.zeros_(self.head.weight)
            nn.init.constant_(self.head.bias, -math.log(self.cfg.num_classes))

    def no_weight_decay(self) -> set[str]:
        """Parameter names that get no weight decay: position embeddings, norms, biases, phi.

        Soft MoE's `scale` is not among them although it is a scalar: the released configs decay
        it like a kernel (`('.*/Moe/Router/scale', 0.03)` in vmoe's pretrain_jft4b.py).
        """
        moe_scales = {f"{name}.scale" for name, m in self.named_modules() if isinstance(m, SoftMoE)}
        return {name for name, p in self.named_parameters() if name not in moe_scales and (
            p.ndim <= 1 or name.endswith(("pos_embed", ".phi")) or ".b1" in name or ".b2" in name)}

    def _sparse_moe_layers(self) -> list[nn.Module]:
        return [block.mlp for block in self.blocks
                if isinstance(block.mlp, (TokensChoiceMoE, ExpertsChoiceMoE))]

    def moe_aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' auxiliary losses from the last forward (0 for dense / Soft MoE /
        EC)."""
        losses = [layer.aux_loss for layer in self._sparse_moe_layers()]
        # A plain zero on the weights' device (`new_zeros` of a sharded weight would be a DTensor).
        return (torch.stack(losses).sum() if losses
                else torch.zeros((), device=self.pos_embed.device))

    def moe_dropped_fraction(self) -> torch.Tensor:
        """Mean over the MoE layers of the fraction of tokens no expert processed, in the last
        forward.

        Soft MoE layers count as 0 (they drop nothing); a dense tower reports 0. Detached.
        """
        moe_layers = [block.mlp for block in self.blocks if not isinstance(block.mlp, Mlp)]
        fractions = [layer.dropped_fraction.to(self.pos_embed.device)
                     for layer in self._sparse_moe_layers()]
        if not fractions:
            return torch.zeros((), device=self.pos_embed.device)
        return torch.stack(fractions).sum() / len(moe_layers)

    def _pos_embed(self, num_patches: int, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Position embeddings (1, num_patches, d) for a (rows, cols) patch grid (default:
        square)."""
        rows, cols = grid if grid is not None else (math.isqrt(num_patches),) * 2
        old = math.isqrt(self.pos_embed.shape[1])
        if (rows, cols) == (old, old):
            return self.pos_embed
        # Another resolution or aspect ratio: resample the learned grid to the image's own rows and
        # columns (a non-square image has rows != cols), as timm's `resample_abs_pos_embed` does,
        # but bilinearly where timm is bicubic: the results measured with our towers used bilinear.
        learned = self.pos_embed.reshape(1, old, old, -1).permute(0, 3, 1, 2)  # (1, d, old, old)
        learned = F.interpolate(learned, size=(rows, cols), mode="bilinear", align_corners=False)
        return learned.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)  # (1, rows·cols, d)

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (b, c, h, w) → patch embeddings (b, m, d), token-major and contiguous.

        The function of `self.patch_embed` (a p×p convolution with stride p, whose weights it uses)
        as one matmul over the flattened patches. Two reasons. The convolution's (b, d, h/p, w/p)
        output needs a transpose, and elementwise ops keep their first input's layout, so the whole
        residual stream would inherit it: every residual add would run as a strided kernel and every
        LayerNorm copy its input. And the convolution is slow for what it computes (cuDNN's layout
        conversions); scripts/bench_patches.py times both forms.
        """
        b, c, h, w = pixels.shape
        p = self.cfg.patch_size
        if c != self.cfg.in_channels:  # else a matmul shape error that names neither count
            raise ValueError(f"the tower takes {_channels(self.cfg.in_channels)} images, got "
                             f"{_channels(c)} ones (pixels of shape {tuple(pixels.shape)}); "
                             f"{_channel_fix(self.cfg.in_channels, c)}")
        if h < p or w < p:  # no patch at all: F.interpolate would fail on an empty position grid
            raise ValueError(f"image of {h}x{w} pixels is smaller than one {p}x{p} patch; resize "
                             f"it to at least {p}x{p} (the tower was trained at "
                             f"{self.cfg.image_size}x{self.cfg.image_size})")
        rows, cols = h // p, w // p
        pixels = pixels[:, :, :rows * p, :cols * p]  # as the convolution does, drop a remainder
        # (b, rows, cols, c, p, p)
        patches = pixels.reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5)
        # (b, m, c·p·p), the conv kernel's order
        patches = patches.reshape(b, rows * cols, c * p * p)
        return F.linear(patches, self.patch_embed.weight.flatten(1), self.patch_embed.bias)

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    @property
    def in_chans(self) -> int:
        return self.cfg.in_channels

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head of `num_classes` (0: none), initialized as at construction; `global_pool` None
        keeps it."""
        if global_pool is not None:
            self.global_pool = _check_pool(global_pool)
        self.cfg = replace(self.cfg, num_classes=num_classes)  # validates num_classes
        like = self.pos_embed  # the head joins the tower's device, dtype and mode
        if num_classes:
            self.head = nn.Linear(self.cfg.width, num_classes, device=like.device, dtype=like.dtype)
            if not like.is_meta:
                with torch.no_grad():
                    nn.init.zeros_(self.head.weight)
                    nn.init.constant_(self.head.bias, -math.log(num_classes))
        else:
            self.head = nn.Identity()
        self.head.requires_grad_(like.requires_grad).train(self.training)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for layer-wise lr decay and open_clip's `--lock-image-unlocked-groups`,
        as timm's ViT."""
        return dict(stem=r"^pos_embed|patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def layer_ids(self) -> dict[str, int]:
        """Each parameter's layer (names as in `named_parameters()`), as timm's
        `param_groups_layer_decay` numbers them from `group_matcher`: 0 the patch and position
        embeddings, i + 1 block i, the final norm with the last block (timm's MATCH_PREV_GROUP),
        depth + 1 the head. Layer-wise lr decay (`train.optim.layer_depths`) scales a layer's rate
        by decay ** (the largest id - id)."""
        depth, ids = len(self.blocks), {}
        for name, _ in self.named_parameters():
            block = re.match(r"blocks\.(\d+)\.", name)
            ids[name] = (int(block.group(1)) + 1 if block else
                         0 if name.startswith(("pos_embed", "patch_embed.")) else
                         depth if name.startswith("norm.") else depth + 1)
        return ids

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _embed(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """pixels (b, c, h, w) → tokens with their position embeddings (b, m, d), and the (rows,
        cols) grid."""
        p = self.cfg.patch_size
        # A tower held in bf16 for inference takes the float32 pixels every transform gives (a no-op
        # in fp32, and under autocast the matmul casts anyway).
        pixels = pixels.to(self.patch_embed.weight.dtype)
        grid = (pixels.shape[-2] // p, pixels.shape[-1] // p)
        x = self.embed_patches(pixels)  # (b, m, d), m = rows · cols
        return x + self._pos_embed(x.shape[1], grid), grid

    def _block(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (b, c, h, w) → normalized tokens (b, m, d) before pooling (timm's contract)."""
        x, _ = self._embed(pixels)
        for block in self.blocks:
            x = self._block(block, x)
        return self.norm(x)

    def forward_intermediates(self, pixels: torch.Tensor, indices: int | list[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False,
                              ) -> tuple[torch.Tensor, list[torch.Tensor]] | list[torch.Tensor]:
        """timm's ViT contract: the outputs of the blocks `indices` picks, and the final tokens.

        Args:
            pixels: images (b, c, h, w).
            indices: None → every block, an int n → the last n, a list → those blocks (negative from
                the end).
            return_prefix_tokens: timm's flag, accepted for its callers; the towers have no prefix
                tokens (no class token: they pool by the mean), so it changes nothing.
            norm: pass each intermediate through the final LayerNorm.
            stop_early: run no block after the last one taken (the final tokens are then that
                block's, normed).
            output_fmt: "NCHW" → maps (b, d, rows, cols); "NLC" → tokens (b, m, d).
            intermediates_only: return the list alone.

        Returns (forward_features' tokens (b, m, d), [intermediates]) or, with `intermediates_only`,
        the list.
        """
        if output_fmt not in OUTPUT_FMTS:
            raise ValueError(f"output_fmt {output_fmt!r} is not one of {OUTPUT_FMTS}")
        take, last = _take_indices(len(self.blocks), indices)
        x, (rows, cols) = self._embed(pixels)
        intermediates = []
        for i, block in enumerate(self.blocks[:last + 1] if stop_early else self.blocks):
            x = self._block(block, x)
            if i in take:
                intermediates.append(self.norm(x) if norm else x)  # (b, m, d)
        if output_fmt == "NCHW":  # tokens are row-major over the patch grid (embed_patches)
            intermediates = [y.reshape(y.shape[0], rows, cols, -1).permute(0, 3, 1, 2).contiguous()
                             for y in intermediates]  # each (b, d, rows, cols)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the blocks after the last of `indices` (and the final norm, the head), as timm's ViT
        does for its `features_only` wrapper; returns the absolute block indices to take."""
        take, last = _take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:last + 1]
        # cfg describes the blocks the tower has, so that a pruned tower saved with its cfg loads
        # back.
        self.cfg = replace(self.cfg, depth=last + 1,
                           moe_layers=tuple(i for i in self.cfg.moe_layers if i <= last))
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """tokens (b, m, d) → logits (b, num_classes), or the pooled embedding (b, d) with
        `pre_logits` or without a head; with `global_pool=""` the tokens pass through unpooled."""
        x = tokens.mean(dim=1) if self.global_pool == "avg" else tokens  # (b, d)
        return x if pre_logits else self.head(x)

    def forward_pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (b, c, h, w) → the pooled embedding (b, d) that embedding, LiT and the evals
        use."""
        return self.forward_features(pixels).mean(dim=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Logits (b, num_classes) when the tower has a head, else the pooled embedding (b, d)."""
        return self.forward_head(self.forward_features(pixels))
