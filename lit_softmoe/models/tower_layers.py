"""A tower's layers as timm numbers them: which parameters form each block, and what "the last N
blocks" are.

LiT's `unlocked_blocks`, layer-wise lr decay, FSDP's units and the memory plan all ask a tower the
same question: which of its parameters belong to which layer. timm answers it for every model it has
with `group_matcher(coarse=False)` (the regexes its own `param_groups_layer_decay` and open_clip's
`--lock-image-unlocked-groups` use), and our towers answer it the same way, so one reading serves
ResNets, ConvNeXts, EfficientNets, Swins, EVAs and ViTs alike:

    layer 0                 the stem (patch embedding, position embeddings, a CNN's first
                            convolutions)
    layers 1 .. B           the blocks, in the order they run; what timm files after them (a
                            final norm, EfficientNet's conv_head) joins the last block (timm's
                            MATCH_PREV_GROUP)
    the layers above B      what no regex names: pooling heads, `fc_norm`, a classifier

Unlocking the last N blocks trains every parameter of layer B - N + 1 and above: the blocks, and
what sits after them (a frozen final norm or attention pool would pin the unlocked blocks' output).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from lit_softmoe.errors import UserError


@dataclass(frozen=True)
class TowerLayers:
    layer_ids: dict[str, int]  # parameter name (as in named_parameters()) → its layer
    blocks: tuple[int, ...]  # the layers that are blocks, in the order they run
    # the class head's parameters (`get_classifier()`): not features
    classifier: frozenset[str] = frozenset()

    def unlocked(self, count: int) -> set[str]:
        """The parameters that train when the last `count` blocks do (0: none): the blocks and what
        runs after them on the way to the features, not a class head (a pretrained tower's `head` is
        not in them)."""
        if not count:
            return set()
        first = self.blocks[-count]
        return {name for name, layer in self.layer_ids.items()
                if layer >= first and name not in self.classifier}

    def block_parameters(self, index: int) -> set[str]:
        """The parameters of block `index` (negative: from the end)."""
        layer = self.blocks[index]
        return {name for name, at in self.layer_ids.items() if at == layer}


def tower_layers(tower: nn.Module) -> TowerLayers:
    """`tower`'s layers from its `group_matcher` (timm's numbering:
    `timm.models.group_parameters`)."""
    from timm.models import group_parameters

    try:
        matcher = tower.group_matcher(coarse=False)
    except (AttributeError, NotImplementedError):
        raise UserError(f"{type(tower).__name__} does not name its layers (no timm group_matcher), "
                        "so its blocks cannot be unlocked one by one; set unlocked_blocks=0 (it "
                        "stays locked)") from None
    ids = group_parameters(tower, matcher, reverse=True)
    layers = set(ids.values())
    if isinstance(matcher, dict):
        named = _matched(ids, list(matcher.values()))
        stem = {ids[name] for name in _matched(ids, [matcher.get("stem")])}
        not_blocks = stem | {layer for name, layer in ids.items() if name not in named}
    else:  # a function: its first layer is the stem, as timm's own towers number them
        not_blocks = {min(layers, default=0)}
    blocks = tuple(sorted(layers - not_blocks))
    return TowerLayers(layer_ids=dict(ids), blocks=blocks, classifier=_classifier_parameters(tower))


def _classifier_parameters(tower: nn.Module) -> frozenset[str]:
    """The names of the parameters of timm's `get_classifier()` module (none for a tower built
    without one)."""
    classifier = tower.get_classifier() if hasattr(tower, "get_classifier") else None
    if not isinstance(classifier, nn.Module):
        return frozenset()
    prefix = next((name for name, module in tower.named_modules() if module is classifier), None)
    if prefix is None:
        return frozenset()
    return frozenset(f"{prefix}.{name}" if prefix else name
                     for name, _ in classifier.named_parameters())


def _matched(ids: dict[str, int], specs: list) -> set[str]:
    """The parameter names any regex of `specs` (group_matcher values: a regex or (regex, suffix)
    pairs) matches."""
    patterns = []
    for spec in specs:
        if spec is None:
            continue
        entries = spec if isinstance(spec, (list, tuple)) else [(spec, None)]
        patterns += [re.compile(entry[0]) for entry in entries]
    return {name for name in ids if any(p.match(name) for p in patterns)}


def modules_of(tower: nn.Module, names: set[str]) -> list[nn.Module]:
    """The fewest submodules of `tower` whose parameters are exactly `names` (each module holds only
    some of them, and together they hold all): what FSDP shards as one unit and the memory plan
    charges as one block."""
    chosen: list[str] = []
    modules = []
    for prefix, module in tower.named_modules():
        if not prefix or any(prefix.startswith(c + ".") for c in chosen):
            continue
        own = {f"{prefix}.{name}" for name, _ in module.named_parameters()}
        if own and own <= names:
            chosen.append(prefix)
            modules.append(module)
    return modules


def check_unlockable(tower: nn.Module, count: int) -> TowerLayers | None:
    """The tower's layers when `count` of its blocks can be unlocked; one UserError line saying why
    not."""
    if not count:
        return None
    layers = tower_layers(tower)
    if not 0 <= count <= len(layers.blocks):
        raise UserError(f"unlocked_blocks={count} but the image tower has {len(layers.blocks)} "
                        "blocks")
    return layers
