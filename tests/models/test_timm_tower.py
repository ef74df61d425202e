"""lit_softmoe.models.timm_tower: a timm model named `timm:NAME?file=PATH` becomes a tower folder in the
cache that loads to timm's own model (its pre-logits features, bit for bit), that timm's `local-dir:` builds,
whose identity follows the checkpoint file, and that LiT locks and unlocks as it does our towers. timm's
test models are built offline (`pretrained=False`, weights saved to a file): never the network."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.timm_tower import TimmTower, folder_for, parse_timm_spec
from lit_softmoe.models.tower_folder import load_tower, read_tower_meta, tower_fingerprint
from lit_softmoe.utils.hashing import weights_sha256

timm = pytest.importorskip("timm")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_SOFTMOE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _checkpoint(path, name: str = "test_vit", seed: int = 0):
    """A timm model with random weights, saved as a user's local checkpoint (its class head included)."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False)
    save_file(model.state_dict(), path)
    return model.eval()


def test_a_spec_loads_to_the_timm_model_its_checkpoint_holds(cache, tmp_path):
    reference = _checkpoint(tmp_path / "vit.safetensors")
    spec = f"timm:test_vit?file={tmp_path / 'vit.safetensors'}"
    tower, meta = load_tower(spec)
    assert isinstance(tower, TimmTower) and isinstance(tower, type(reference))
    assert meta["tower"] == {"timm_model_name": "test_vit", "image_size": 160, "in_channels": 3, "width": 64,
                             "model_args": {}}
    assert meta["preprocess"] == {"image_size": 160, "mean": [0.5] * 3, "std": [0.5] * 3}  # timm's data config
    assert "head.weight" not in tower.state_dict()  # built with num_classes=0: features, no classes
    pixels = torch.randn(3, 3, 160, 160)
    with torch.no_grad():
        expected = reference.forward_head(reference.forward_features(pixels), pre_logits=True)
        assert torch.equal(tower.forward_pooled(pixels), expected)
    assert tower.embed_dim == 64 and tower.cfg.in_channels == 3
    # The folder's identity is the weights the tower holds.
    assert tower_fingerprint(spec)["tower_sha256"] == weights_sha256(tower.state_dict())
    # timm's own loader builds the same model from the folder: no lit_softmoe class in it.
    folder = folder_for(spec)
    stock = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert type(stock) is type(reference)
    with torch.no_grad():
        assert torch.equal(stock(pixels), expected)


def test_the_cache_folder_follows_the_checkpoint_file(cache, tmp_path):
    checkpoint = tmp_path / "vit.safetensors"
    _checkpoint(checkpoint, seed=0)
    spec = f"timm:test_vit?file={checkpoint}"
    first = tower_fingerprint(spec)["tower_sha256"]
    written = (folder_for(spec) / "config.json").stat().st_mtime_ns
    assert tower_fingerprint(spec)["tower_sha256"] == first  # read again, not written again
    assert (folder_for(spec) / "config.json").stat().st_mtime_ns == written
    _checkpoint(checkpoint, seed=1)  # the user retrains and overwrites the file
    os.utime(checkpoint, ns=(written + 10**9, written + 10**9))
    assert tower_fingerprint(spec)["tower_sha256"] != first
    assert len(list((cache / "towers" / "timm").iterdir())) == 2


@pytest.mark.parametrize("spec, says", [
    ("timm:", "is not a timm spec"),
    ("timm:test_vit?size=3", "is not a timm spec"),
    ("timm:test_vit?file=/no/such.safetensors", "/no/such.safetensors is not a file"),
])
def test_a_wrong_spec_is_one_line(cache, spec, says):
    with pytest.raises(UserError, match=says):
        parse_timm_spec(spec)
    with pytest.raises(UserError, match=says):
        read_tower_meta(spec)


def test_an_unknown_model_is_one_line(cache, tmp_path):
    _checkpoint(tmp_path / "vit.safetensors")
    with pytest.raises(UserError, match=r"timm cannot build .*no_such_model.*timm.list_models\(\)"):
        load_tower(f"timm:no_such_model?file={tmp_path / 'vit.safetensors'}")
    assert not (cache / "towers" / "timm").exists() or not any((cache / "towers" / "timm").iterdir())


def test_a_cached_folder_holding_another_folders_weights_is_written_again(cache, tmp_path, caplog):
    """The cache folder of one checkpoint with another's model.safetensors copied in embedded the other's weights
    under this one's name. A cache that does not verify is said and made again, as every cache is."""
    import shutil
    first = _checkpoint(tmp_path / "a.safetensors", seed=0)
    _checkpoint(tmp_path / "b.safetensors", seed=1)
    spec_a, spec_b = (f"timm:test_vit?file={tmp_path / name}" for name in ("a.safetensors", "b.safetensors"))
    expected = tower_fingerprint(spec_a)["tower_sha256"]
    assert tower_fingerprint(spec_b)["tower_sha256"] != expected
    shutil.copy(folder_for(spec_b) / "model.safetensors", folder_for(spec_a) / "model.safetensors")
    with caplog.at_level("WARNING"):
        tower, _ = load_tower(spec_a)
    assert f"the cached tower of {spec_a} is damaged" in caplog.text
    assert tower_fingerprint(spec_a)["tower_sha256"] == expected
    pixels = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        assert torch.equal(tower.forward_pooled(pixels),
                           first.forward_head(first.forward_features(pixels), pre_logits=True))


def test_a_checkpoint_of_another_architecture_is_one_line(cache, tmp_path):
    """test_vit2's weights for test_vit: timm loads without the class head non-strictly and only logged (at INFO,
    which the CLI hides) that cls_token and the final norm were missing: they stayed randomly initialized, and
    the tower embedded without a word."""
    _checkpoint(tmp_path / "vit2.safetensors", name="test_vit2")
    spec = f"timm:test_vit?file={tmp_path / 'vit2.safetensors'}"
    with pytest.raises(UserError, match=r"^image tower 'timm:test_vit\?file=.*vit2\.safetensors': the weights hold no "
                                        r"cls_token, norm\.weight, norm\.bias of test_vit, which would stay randomly "
                                        r"initialized; give a checkpoint of this architecture$"):
        load_tower(spec)
    assert not (cache / "towers" / "timm").exists() or not any((cache / "towers" / "timm").iterdir())
    _checkpoint(tmp_path / "vit.safetensors")  # its own architecture's, class head and all: loads
    assert isinstance(load_tower(f"timm:test_vit?file={tmp_path / 'vit.safetensors'}")[0], TimmTower)


@pytest.mark.parametrize("name, final_norm", [("test_vit", "norm"), ("test_vit2", "fc_norm")])
def test_lit_locks_a_timm_tower_but_its_unlocked_blocks_and_final_norm(cache, tmp_path, name, final_norm):
    """test_vit pools its class token after `norm`; test_vit2 averages the tokens and norms after (`fc_norm`)."""
    _checkpoint(tmp_path / "vit.safetensors", name=name)
    tower, _ = load_tower(f"timm:{name}?file={tmp_path / 'vit.safetensors'}")
    text = create_text_tower(TextTowerConfig(width=32, layers=1, heads=2, context_length=16), embed_dim=tower.embed_dim)
    model = LiTModel(tower, text, unlocked_blocks=1)
    trained = {n for n, p in model.image_tower.named_parameters() if p.requires_grad}
    last = len(tower.blocks) - 1
    assert trained and all(n.startswith((f"blocks.{last}.", f"{final_norm}.")) for n in trained)
    assert any(n.startswith(f"{final_norm}.") for n in trained)
    locked = LiTModel(load_tower(f"timm:{name}?file={tmp_path / 'vit.safetensors'}")[0], text)
    assert not any(p.requires_grad for p in locked.image_tower.parameters())
    features = locked.encode_image(torch.randn(2, 3, 160, 160))
    assert features.shape == (2, tower.embed_dim) and not features.requires_grad


def test_the_memory_plan_counts_a_timm_tower(cache, tmp_path):
    """`train --plan` on a timm tower: its weights are the locked bytes, its last block and final norm train."""
    from lit_softmoe.config import LiTConfig
    from lit_softmoe.config_loading import load_config
    from lit_softmoe.train.model_count import count_lit

    reference = _checkpoint(tmp_path / "vit.safetensors")
    spec = f"timm:test_vit?file={tmp_path / 'vit.safetensors'}"
    overrides = [f"image_tower={spec}", f"data.train={tmp_path / 'images'}", "precision=bf16", "text.width=64",
                 "text.layers=1", "text.heads=2"]
    locked = count_lit(load_config(LiTConfig, None, overrides))
    tower_params = sum(p.numel() for name, p in reference.named_parameters() if not name.startswith("head."))
    assert locked.frozen_bytes == tower_params * 2  # held in bf16, as it runs
    unlocked = count_lit(load_config(LiTConfig, None, [*overrides, "unlocked_blocks=1"]))
    last = sum(p.numel() for module in (reference.blocks[-1], reference.norm) for p in module.parameters())
    assert unlocked.trainable - locked.trainable == last
    assert unlocked.frozen_bytes == (tower_params - last) * 2  # the locked rest is held in bf16 too
    assert len(unlocked.saved.blocks) == len(locked.saved.blocks) + 1  # the unlocked block keeps activations


def test_writing_the_cache_folder_draws_no_random_numbers(cache, tmp_path):
    """timm initializes a model randomly before loading its checkpoint: the run that writes the tower folder
    must go on with the random numbers a run that finds it written gets (its text tower's init), or its
    results would depend on the cache being warm."""
    _checkpoint(tmp_path / "vit.safetensors")
    spec = f"timm:test_vit?file={tmp_path / 'vit.safetensors'}"
    draws = []
    for _ in ("cold", "warm"):
        torch.manual_seed(0)
        load_tower(spec)
        draws.append(torch.rand(4))
    assert len(list((cache / "towers" / "timm").iterdir())) == 1
    assert torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_local_checkpoint_is_one_line(cache, tmp_path, damage):
    """A `timm:NAME?file=F` whose F was cut short or whose header was garbled ended in safetensors'
    traceback (embed, train); now one line naming the file, and no cache folder is written."""
    from lit_softmoe.errors import UserError

    _checkpoint(tmp_path / "vit.safetensors")
    data = (tmp_path / "vit.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # a flipped byte inside the JSON header
        data = data[:8] + data[8:header_end].replace(b'"dtype"', b'"dtypX"', 1) + data[header_end:]
    (tmp_path / "vit.safetensors").write_bytes(data)
    with pytest.raises(UserError, match=rf"cannot read {tmp_path / 'vit.safetensors'} .*the checkpoint is damaged or "
                                        r"incomplete: download or copy it again") as raised:
        load_tower(f"timm:test_vit?file={tmp_path / 'vit.safetensors'}")
    assert "\n" not in str(raised.value)
    assert not (cache / "towers" / "timm").exists() or not any((cache / "towers" / "timm").iterdir())
