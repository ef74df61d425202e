"""lit_softmoe.train.optim: the learning-rate schedule's warmup, given in steps or as a fraction of the run;
layer-wise lr decay's groups, as timm's `param_groups_layer_decay` makes them, applied by the schedule."""
import re

import pytest
import torch
from timm.optim import param_groups_layer_decay

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.train.optim import (
    check_optim_settings,
    create_optimizer,
    long_warmup_warning,
    lr_at,
    param_groups,
    set_lr,
    warmup_steps,
)


def test_a_warmup_below_one_is_a_fraction_of_the_run():
    cfg = OptimConfig(lr=1.0, warmup=0.25, schedule="constant")
    assert warmup_steps(cfg, 400) == 100
    assert [lr_at(step, 400, cfg) for step in (0, 49, 99, 100)] == [0.01, 0.5, 1.0, 1.0]
    assert warmup_steps(OptimConfig(warmup=300), 400) == 300  # 1 or more: steps
    assert warmup_steps(OptimConfig(warmup=0.08), 3744) == 300  # the shipped pretraining configs' on Fashion-MNIST


def test_a_warmup_of_a_fractional_number_of_steps_is_refused():
    with pytest.raises(UserError, match=r"optim.warmup=12.5 is neither a fraction of the run"):
        check_optim_settings(OptimConfig(warmup=12.5))


def test_a_warmup_longer_than_half_the_run_is_one_warning_line():
    assert long_warmup_warning(OptimConfig(warmup=300), 312) == (
        "warning: the warmup of 300 steps is 96% of this 312-step run, so the learning rate rises for most of it; "
        "give optim.warmup as a fraction of the run (e.g. optim.warmup=0.05) or fewer steps")
    assert "covers the whole 100-step run" in long_warmup_warning(OptimConfig(warmup=300), 100)
    assert long_warmup_warning(OptimConfig(warmup=0.08), 312) is None
    assert long_warmup_warning(OptimConfig(warmup=156), 312) is None  # half: not more than half


# ---- layer-wise lr decay, against timm's param_groups_layer_decay ---------------------------------------

def _scales(groups) -> dict[int, float]:
    """id(parameter) → the lr_scale of its group."""
    return {id(param): group.get("lr_scale", 1.0) for group in groups for param in group["params"]}


def _timm_vit_scales(depth: int, layer_decay: float, head: bool = True) -> dict:
    """timm's lr scales of the parts of a timm ViT of `depth` blocks (final norm after the blocks, as ours and the
    text towers have it): {"stem": .., 0: .., ..., depth - 1: .., "norm": .., "head": ..}."""
    from timm.models.vision_transformer import VisionTransformer
    from timm.optim import param_groups_layer_decay

    vit = VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=3 if head else 0, embed_dim=8,
                            depth=depth, num_heads=2, class_token=False, global_pool="avg", fc_norm=False)
    scale, part = _scales(param_groups_layer_decay(vit, 0.05, layer_decay=layer_decay)), dict(vit.named_parameters())
    roles = {"stem": "pos_embed", "norm": "norm.weight", **{i: f"blocks.{i}.norm1.weight" for i in range(depth)}}
    if head:
        roles["head"] = "head.weight"
    return {role: scale[id(part[name])] for role, name in roles.items()}


def _role(name: str):
    """The part of a tower a parameter belongs to, by its name: the embeddings, block i, final norm, head."""
    block = re.search(r"(?:blocks|resblocks|encoder\.layer)\.(\d+)\.", name)
    if block:
        return int(block.group(1))
    if re.search(r"pos_embed|patch_embed|token_embedding|positional_embedding|embeddings\.", name):
        return "stem"
    if re.search(r"(^|\.)(norm|ln_final)\.", name):
        return "norm"
    assert re.search(r"head\.|text_projection|proj\.weight", name), name
    return "head"


@pytest.mark.parametrize("head", [True, False])
def test_layer_decay_groups_of_a_vit_tower_are_timms(head):
    tower = create_image_tower("soft-test-4e", num_classes=10 if head else 0)
    # timm's own function on our tower (its group_matcher), and a timm ViT of the same depth.
    theirs = _scales(param_groups_layer_decay(tower, 0.05, layer_decay=0.75))
    timm_vit = _timm_vit_scales(len(tower.blocks), 0.75, head=head)
    ours = _scales(param_groups(tower, 0.05, layer_decay=0.75))
    assert ours == pytest.approx(theirs)
    for name, param in tower.named_parameters():
        assert ours[id(param)] == pytest.approx(timm_vit[_role(name)]), name
    assert len(set(ours.values())) == len(tower.blocks) + 1 + head  # stem, each block (the last with the norm), head


def _text_tower(kind: str, minilm_path: str | None, layers: int = 3):
    if kind == "hf":
        return create_text_tower(TextTowerConfig(kind="hf", path=minilm_path), embed_dim=8)
    return create_text_tower(TextTowerConfig(width=32, layers=layers, heads=2), embed_dim=8)


@pytest.mark.parametrize("kind", ["transformer", "hf"])
def test_layer_decay_groups_of_the_text_towers_are_those_of_a_timm_vit_as_deep(kind, request):
    """Embeddings as timm's stem, block i as its block i, the final norm with the last block, the projection as
    its head; BERT's unused pooler is frozen, so in no group."""
    tower = _text_tower(kind, request.getfixturevalue("minilm_path") if kind == "hf" else None)
    depth = max(tower.layer_ids().values()) - 1
    timm_vit = _timm_vit_scales(depth, 0.8)
    groups = param_groups(tower, 0.05, layer_decay=0.8)
    ours = _scales(groups)
    trained = [(name, param) for name, param in tower.named_parameters() if param.requires_grad]
    assert len(ours) == len(trained)
    for name, param in trained:
        assert ours[id(param)] == pytest.approx(timm_vit[_role(name)]), name
    # The weight-decay rule is the project's: the same parameters decay as without layer decay.
    decayed = {id(p) for g in param_groups(tower, 0.05) if g["weight_decay"] for p in g["params"]}
    assert {id(p) for g in groups if g["weight_decay"] for p in g["params"]} == decayed
    assert all(g["weight_decay"] in (0.0, 0.05) for g in groups)


def test_layer_decay_in_lit_counts_each_tower_on_its_own_and_leaves_the_rest_at_one():
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=10)
    text = create_text_tower(TextTowerConfig(width=32, layers=3, heads=2), embed_dim=tower.embed_dim)
    model = LiTModel(tower, text, loss="sigmoid", image_head=True, unlocked_blocks=1, text_locked=True,
                     text_unlocked_layers=2)
    ours = _scales(param_groups(model, 0.05, layer_decay=0.7))
    trained = {name: param for name, param in model.named_parameters() if param.requires_grad}
    assert set(ours) == {id(p) for p in trained.values()}
    # The image tower's unlocked block and norm: as timm's function on the tower (its frozen layers left out).
    image = _scales(param_groups_layer_decay(model.image_tower, 0.05, layer_decay=0.7))
    text_vit = _timm_vit_scales(3, 0.7)
    for name, param in trained.items():
        if name.startswith("image_tower."):
            assert ours[id(param)] == pytest.approx(image[id(param)]), name
        elif name.startswith("text_tower."):
            assert ours[id(param)] == pytest.approx(text_vit[_role(name)]), name
        else:  # logit scale and bias, image head
            assert ours[id(param)] == 1.0, name
    assert {name for name in trained if name.startswith("image_tower.")} == \
        {n for n, _ in model.image_tower.named_parameters(prefix="image_tower") if n.startswith(
            ("image_tower.blocks.1.", "image_tower.norm."))}


def test_the_schedule_multiplies_each_groups_lr_scale():
    tower = create_image_tower("soft-test-4e", num_classes=10)
    cfg = OptimConfig(lr=2e-3, warmup=4, layer_decay=0.5)
    optimizer = create_optimizer(tower, cfg)
    assert sorted({g["lr_scale"] for g in optimizer.param_groups}) == [0.125, 0.25, 0.5, 1.0]
    for step in (0, 3, 7):
        set_lr(optimizer, lr_at(step, 10, cfg))
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(lr_at(step, 10, cfg) * group["lr_scale"])
    # Off (the default): the two groups of before, no lr_scale, every group at the schedule's rate.
    plain = create_optimizer(tower, OptimConfig(lr=2e-3, weight_decay=0.05))
    assert [g["weight_decay"] for g in plain.param_groups] == [0.05, 0.0]
    assert not any("lr_scale" in g for g in plain.param_groups)
    set_lr(plain, 1e-3)
    assert [g["lr"] for g in plain.param_groups] == [1e-3, 1e-3]


@pytest.mark.parametrize("value", [0.0, 1.5, -0.5])
def test_a_layer_decay_outside_zero_to_one_is_refused(value):
    with pytest.raises(UserError, match=rf"^optim.layer_decay={value:g} must be above 0 and at most 1"):
        check_optim_settings(OptimConfig(layer_decay=value))
    check_optim_settings(OptimConfig(layer_decay=1.0))
    check_optim_settings(OptimConfig(layer_decay=0.65))


def test_adamw_is_fused_where_every_parameter_device_has_the_kernel():
    """torch's fused AdamW (one kernel for the whole update) on the CPU and GPUs; its default multi-tensor
    implementation where a device has no fused kernel (the meta device the memory plan builds on). Both make
    the same update, to float rounding. In float32 three steps of lr 1e-2 left them 1.8e-6 apart on one CPU and
    2.7e-6 under another kernel set: Adam divides by sqrt(v) + eps, so the rounding of a near-zero gradient turns
    into a step of up to lr, and the later gradients follow the weights apart. That gap scales with the unit
    roundoff: in float64 (2^-29 times float32's) it is ~1e-14 (measured 0.7-1.4e-14), so 1e-10 bounds it on any
    CPU, while a wrong update -- weight decay left out (lr x 0.1 x |w| >= 1e-5 here), a bias correction off --
    misses it by orders of magnitude."""
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=3).double()
    twin = create_image_tower("soft-test-4e", num_classes=3).double()
    twin.load_state_dict(tower.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused = create_optimizer(tower, cfg)
    default = torch.optim.AdamW(param_groups(twin, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    assert all(group["fused"] for group in fused.param_groups) and not default.param_groups[0]["fused"]
    initial = [p.detach().clone() for p in tower.parameters()]
    pixels, labels = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    for _ in range(3):
        for model, optimizer in ((tower, fused), (twin, default)):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(pixels), labels).backward()
            optimizer.step()
    apart = max((p - q).abs().max().item() for p, q in zip(tower.parameters(), twin.parameters()))
    moved = max((p - q).abs().max().item() for p, q in zip(tower.parameters(), initial))
    assert apart < 1e-10 and moved > 1e-3, (apart, moved)
    on_meta = create_optimizer(create_image_tower("soft-test-4e", num_classes=3, device="meta"), cfg)
    assert not any(group["fused"] for group in on_meta.param_groups)
