"""lit_softmoe.models.tower_layers and the timm adapter's answers: a tower of any timm family names its layers
as timm's own layer decay does (`param_groups_layer_decay`), decays weights as timm's `param_groups_weight_decay`
does, unlocks its last layer group with what runs after it, and says in one line when it cannot be unlocked."""
from __future__ import annotations

import pytest
import torch

from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.timm_tower import fill_computed_buffers
from lit_softmoe.models.tower_layers import modules_of, tower_layers
from lit_softmoe.train.optim import param_groups
from timm_families import TIMM_FAMILIES, random_timm_tower

timm = pytest.importorskip("timm")


def _text(width: int):
    return create_text_tower(TextTowerConfig(width=32, layers=1, heads=2, context_length=16), embed_dim=width)


def _by_parameter(groups: list[dict], model: torch.nn.Module, key: str) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: group[key] for group in groups for p in group["params"]}


@pytest.mark.parametrize("family", TIMM_FAMILIES)
def test_layer_decay_and_weight_decay_are_timms_own(family):
    """With every block unlocked, each tower parameter's lr scale and weight decay are those timm's own
    `param_groups_layer_decay` gives the same model."""
    from timm.optim import param_groups_layer_decay

    tower = random_timm_tower(TIMM_FAMILIES[family])
    reference = random_timm_tower(TIMM_FAMILIES[family])
    own = reference.no_weight_decay() if hasattr(type(reference).__mro__[2], "no_weight_decay") else ()
    theirs = param_groups_layer_decay(reference, weight_decay=0.1, layer_decay=0.5, no_weight_decay_list=own)
    model = LiTModel(tower, _text(tower.embed_dim), unlocked_blocks=len(tower_layers(tower).blocks))
    ours = param_groups(model, weight_decay=0.1, layer_decay=0.5)
    for key in ("lr_scale", "weight_decay"):
        expected = _by_parameter(theirs, reference, key)
        got = {name.removeprefix("image_tower."): value for name, value in _by_parameter(ours, model, key).items()
               if name.startswith("image_tower.")}
        stem = tower_layers(tower).layer_ids
        trained = {name for name in expected if stem[name] > 0}  # all but the stem train
        assert {name: got[name] for name in trained} == {name: expected[name] for name in trained}, key
    assert len(set(_by_parameter(ours, model, "lr_scale").values())) > 2  # the layers are told apart


@pytest.mark.parametrize("family, after_the_blocks", [
    ("resnet", ()), ("convnext", ("head.norm.",)), ("efficientnet", ("conv_head.", "bn2.")), ("swin", ("norm.",)),
    ("vit-registers", ("fc_norm.",)), ("vit-attention-pool", ("attn_pool.", "norm.")), ("eva", ("fc_norm.",))])
def test_unlocking_the_last_block_trains_it_and_what_runs_after_it(family, after_the_blocks):
    tower = random_timm_tower(TIMM_FAMILIES[family])
    layers = tower_layers(tower)
    model = LiTModel(tower, _text(tower.embed_dim), unlocked_blocks=1)
    trained = {n for n, p in tower.named_parameters() if p.requires_grad}
    assert trained == layers.unlocked(1) and layers.block_parameters(-1) <= trained
    assert {n for n in trained - layers.block_parameters(-1) if not n.startswith(after_the_blocks)} == set()
    for prefix in after_the_blocks:
        assert any(n.startswith(prefix) for n in trained), prefix
    block = modules_of(tower, layers.block_parameters(-1))
    assert {f"{prefix}.{n}" for prefix, module in tower.named_modules() if module in block
            for n, _ in module.named_parameters()} == layers.block_parameters(-1)
    # Two blocks: the one before joins, nothing of the stem does.
    assert layers.unlocked(2) == layers.unlocked(1) | layers.block_parameters(-2)
    assert model.locked_image_keys() and not set(model.locked_image_keys()) & {f"image_tower.{n}" for n in trained}


def test_our_towers_number_their_layers_as_before():
    """Our ViT through the same reading: blocks 1..depth, the final norm with the last block, as `layer_ids`."""
    tower = create_image_tower("soft-test-4e", num_classes=10, device="meta")
    layers = tower_layers(tower)
    assert layers.layer_ids == tower.layer_ids()
    assert len(layers.blocks) == len(tower.blocks)
    # The last block and the final norm; not the pretraining class head (it makes no feature).
    assert layers.unlocked(1) == {f"blocks.{len(tower.blocks) - 1}.{n}" for n, _ in tower.blocks[-1].named_parameters()
                                  } | {f"norm.{n}" for n, _ in tower.norm.named_parameters()}
    assert layers.classifier == {"head.weight", "head.bias"}


def test_too_many_blocks_and_a_model_without_layer_groups_are_one_line(monkeypatch):
    tower = random_timm_tower("test_resnet")
    with pytest.raises(UserError, match=r"unlocked_blocks=5 but the image tower has 4 blocks"):
        LiTModel(tower, _text(tower.embed_dim), unlocked_blocks=5)

    def no_groups(self, coarse=False):
        raise NotImplementedError

    monkeypatch.setattr(type(tower), "group_matcher", no_groups)
    with pytest.raises(UserError, match=r"does not name its layers .* set unlocked_blocks=0") as err:
        LiTModel(tower, _text(tower.embed_dim), unlocked_blocks=1)
    assert "\n" not in str(err.value)
    LiTModel(tower, _text(tower.embed_dim))  # locked whole, it needs no layers


def test_computed_buffers_without_timms_hook_come_from_the_model_built_on_the_device(monkeypatch):
    """Swin's relative-position indices after a meta-device build and a load: filled by timm's hook, and where a
    module has none, from the model built on the weights' device; equal to timm's own either way."""
    from timm.models.swin_transformer import WindowAttention

    reference = random_timm_tower(TIMM_FAMILIES["swin"])
    computed = {n for n, b in reference.named_buffers() if n not in reference.state_dict()}
    assert computed
    for hooked in (True, False):
        if not hooked:
            monkeypatch.delattr(WindowAttention, "init_non_persistent_buffers")
        with torch.device("meta"):
            tower = random_timm_tower(TIMM_FAMILIES["swin"])
        tower.load_state_dict(reference.state_dict(), assign=True)
        assert all(tower.get_buffer(n).is_meta for n in computed)
        fill_computed_buffers(tower)
        for name, buffer in reference.named_buffers():
            assert torch.equal(tower.get_buffer(name), buffer), (hooked, name)
