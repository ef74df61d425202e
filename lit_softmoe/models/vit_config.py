"""The ViT tower's config, `ViTConfig`: everything that fixes a tower's shapes, checked when it is
built and saved as JSON beside its weights (the model that reads it: `models.vit`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from lit_softmoe.errors import check_known_keys

MOE_TYPES = ("soft", "tokens_choice", "experts_choice")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ViTConfig:
    """Everything that fixes a tower's shapes; saved as JSON beside its weights."""
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    width: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 0  # 0: no head, the tower returns its pooled embedding
    moe_layers: tuple[int, ...] = ()  # indices of the blocks whose MLP is a MoE layer
    num_experts: int = 0
    slots_per_expert: int = 1  # Soft MoE only
    shared_expert_init: bool = True
    qk_norm: bool = True
    # flax's qk LayerNorm (vmoe's towers) has a scale and no bias. A bias on k is dead weight (it
    # adds the same score to every key of a query) and one on q adds a per-key logit the paper's
    # model lacks.
    qk_norm_bias: bool = False
    # Which MoE layer: "soft" (Soft MoE), or the paper's sparse baselines "tokens_choice" /
    # "experts_choice". The fields below are read by the sparse layers only (defaults: the paper's
    # sparse baselines).
    moe_type: str = "soft"
    num_selected_experts: int = 1  # Tokens Choice K
    # TC: C = ceil(m·K·cf / n) → multiple of 4; EC: C = round(m·cf / n)
    capacity_factor: float = 1.0
    batch_priority: bool = True  # TC: Batch Priority Routing (V-MoE)
    router_noise: float = 1.0  # logit noise in training has std router_noise / num_experts; 0 = off

    def __post_init__(self):
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        # Checked first: a 0 here would end in a ZeroDivisionError below or in an init, a negative
        # in torch's "negative dimension", and a moe_layers entry such as 1.5 matches no block (a
        # dense tower).
        for name in ("image_size", "patch_size", "in_channels", "width", "depth", "num_heads",
                     "mlp_dim"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not _is_int(self.num_classes) or self.num_classes < 0:
            raise ValueError("num_classes must be an integer >= 0 (0: no head), "
                             f"got {self.num_classes!r}")
        if not all(_is_int(i) for i in self.moe_layers):
            raise ValueError("moe_layers must be block indices (integers), "
                             f"got {list(self.moe_layers)}")
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"moe_layers {bad} fall outside the tower's {self.depth} blocks")
        if self.moe_layers and self.num_experts < 1:
            raise ValueError("a tower with moe_layers needs num_experts >= 1")
        if self.moe_type not in MOE_TYPES:
            raise ValueError(f"moe_type {self.moe_type!r} is not one of {', '.join(MOE_TYPES)}")
        if not self.router_noise >= 0:  # a negative std would silently mean no noise
            raise ValueError("router_noise is a noise std and must be >= 0 (0: off), "
                             f"got {self.router_noise!r}")
        if self.moe_type == "tokens_choice" and self.moe_layers and \
                not 1 <= self.num_selected_experts <= self.num_experts:
            raise ValueError(f"num_selected_experts {self.num_selected_experts} must be in [1, "
                             f"{self.num_experts}]")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ViTConfig":
        """The config `to_dict` wrote; a key it lacks takes the field's default, an unknown key is a
        UserError (an impossible value stays a ValueError, as from the constructor)."""
        check_known_keys(d, {f.name for f in fields(cls)}, "tower config")
        return cls(**d)
