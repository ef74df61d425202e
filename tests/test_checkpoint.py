"""Checkpoints: exact round trips, loud shape checks, atomic writes, nothing pickled."""
import json

import pytest
import torch

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import latest_checkpoint
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.train.checkpoint import load_training_state, prune_checkpoints, save_training_state
from lit_softmoe.train.optim import create_optimizer
from lit_softmoe.utils.atomic import FolderTakenError, write_folder_atomically


def test_failed_write_leaves_nothing_under_the_final_name(tmp_path):
    def write(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert list(tmp_path.iterdir()) == []
    # An older complete checkpoint survives a failed overwrite.
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "ok").write_text("1"))
    with pytest.raises(OSError):
        write_folder_atomically(tmp_path / "ckpt", write)
    assert (tmp_path / "ckpt" / "ok").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_without_replace_a_folder_filled_meanwhile_is_kept(tmp_path):
    def write(text):
        return lambda tmp: (tmp / "f").write_text(text)

    (tmp_path / "empty").mkdir()
    write_folder_atomically(tmp_path / "empty", write("new"), replace=False)  # an empty folder is taken
    assert (tmp_path / "empty" / "f").read_text() == "new"

    def filled_meanwhile(tmp):
        (tmp / "f").write_text("mine")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "f").write_text("theirs")  # another writer, after any check at the start

    with pytest.raises(FolderTakenError):
        write_folder_atomically(tmp_path / "out", filled_meanwhile, replace=False)
    assert (tmp_path / "out" / "f").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]  # no temporary folder left
    write_folder_atomically(tmp_path / "out", write("replaced"))  # replace=True swaps it
    assert (tmp_path / "out" / "f").read_text() == "replaced"


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_saved_folders_follow_the_umask_not_mkdtemps_private_mode(tmp_path, umask, folder_mode, file_mode):
    # mkdtemp makes 0700 folders and safetensors 0600 files: other users could not read a saved tower.
    import os
    import stat
    old = os.umask(umask)
    try:
        save_tower(tmp_path / "tower", create_image_tower("soft-test-4e", num_classes=10))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tower").stat().st_mode) == folder_mode
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tower").iterdir()} == \
        {"model.safetensors": file_mode, "config.json": file_mode}


def test_training_state_restores_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = create_image_tower("soft-test-4e", num_classes=10)
    opt = create_optimizer(model, OptimConfig(lr=1e-2))
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    save_training_state(tmp_path / "step_00000001", 1, model, opt)
    expected_draw = torch.rand(3)

    model2 = create_image_tower("soft-test-4e", num_classes=10)
    opt2 = create_optimizer(model2, OptimConfig(lr=1e-2))
    info = load_training_state(tmp_path / "step_00000001", model2, opt2)
    assert info["step"] == 1
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    # One more identical step keeps them identical (the moments really were restored).
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


class _TextWithPooler(torch.nn.Module):
    """A BERT-like shape: the pooler sits between other trained parameters in named_parameters()."""
    def __init__(self):
        super().__init__()
        self.embed, self.pooler, self.proj = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.proj(self.pooler(self.embed(x)).tanh())


def _pair_with_pooler() -> torch.nn.Module:
    torch.manual_seed(0)
    pair = torch.nn.Module()
    pair.text, pair.head = _TextWithPooler(), torch.nn.Linear(2, 2)
    return pair


def _trained_pair_checkpoint(path, legacy: bool, freeze_pooler: bool = False) -> torch.nn.Module:
    """Two AdamW steps with every parameter trained (the pooler too, unless `freeze_pooler`), saved at
    `path`; `legacy`: state.json without parameter names, as checkpoints were written before them."""
    pair = _pair_with_pooler()
    pair.text.pooler.requires_grad_(not freeze_pooler)
    opt = create_optimizer(pair, OptimConfig(lr=1e-2))
    for _ in range(2):
        opt.zero_grad()
        pair.head(pair.text(torch.randn(6, 4))).square().mean().backward()
        opt.step()
    save_training_state(path, 2, pair, opt)
    if legacy:
        info = json.loads((path / "state.json").read_text())
        del info["param_names"]
        (path / "state.json").write_text(json.dumps(info))
    return pair, opt


@pytest.mark.parametrize("legacy", [False, True])
def test_a_parameter_frozen_since_the_checkpoint_leaves_the_others_their_moments(tmp_path, legacy):
    # LiT's HF text towers froze their unused pooler after checkpoints had its moments.
    old, old_opt = _trained_pair_checkpoint(tmp_path / "step_00000002", legacy)
    new = _pair_with_pooler()
    new.text.pooler.requires_grad_(False)
    opt = create_optimizer(new, OptimConfig(lr=1e-2))
    assert load_training_state(tmp_path / "step_00000002", new, opt)["step"] == 2
    old_params = dict(old.named_parameters())
    restored = 0
    for name, param in new.named_parameters():
        assert torch.equal(param, old_params[name])
        if param.requires_grad:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[param][key], old_opt.state[old_params[name]][key]), (name, key)
            restored += 1
        else:
            assert param not in opt.state
    assert restored == 6 and [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


def test_a_legacy_checkpoint_whose_scale_was_not_decayed_then_resumes_with_it_decayed(tmp_path):
    # LiT's groups used to leave every scalar undecayed, Soft MoE's `scale` of unlocked blocks too.
    def model():
        torch.manual_seed(0)
        pair = torch.nn.Module()
        pair.first, pair.moe, pair.last = torch.nn.Linear(4, 4), torch.nn.Module(), torch.nn.Linear(4, 2)
        pair.moe.scale = torch.nn.Parameter(torch.tensor(2.0))
        pair.forward = lambda x: pair.last(pair.first(x) * pair.moe.scale)
        return pair

    old = model()
    old_opt = torch.optim.AdamW([{"params": [p for p in old.parameters() if p.ndim >= 2], "weight_decay": 0.05},
                                 {"params": [p for p in old.parameters() if p.ndim < 2], "weight_decay": 0.0}])
    for _ in range(2):
        old_opt.zero_grad()
        old(torch.randn(6, 4)).square().mean().backward()
        old_opt.step()
    save_training_state(tmp_path / "ckpt", 2, old, old_opt)
    info = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    del info["param_names"]
    (tmp_path / "ckpt" / "state.json").write_text(json.dumps(info))

    new = model()
    opt = create_optimizer(new, OptimConfig(lr=1e-2))  # decays moe.scale
    assert len(opt.param_groups[0]["params"]) == 3
    load_training_state(tmp_path / "ckpt", new, opt)
    old_params = dict(old.named_parameters())
    for name, param in new.named_parameters():
        assert torch.equal(opt.state[param]["exp_avg"], old_opt.state[old_params[name]]["exp_avg"]), name


def test_an_optimizer_of_another_model_is_one_user_error(tmp_path):
    # Checkpoints of a run that never trained the pooler, resumed with the pooler trained.
    _trained_pair_checkpoint(tmp_path / "named", legacy=False, freeze_pooler=True)
    _trained_pair_checkpoint(tmp_path / "legacy", legacy=True, freeze_pooler=True)
    other = _pair_with_pooler()
    opt = create_optimizer(other, OptimConfig(lr=1e-2))
    with pytest.raises(UserError, match=r"named has no optimizer state for text.pooler.weight and 1 more, which "
                                        r"this model trains; resume with the run's own settings"):
        load_training_state(tmp_path / "named", other, opt)
    with pytest.raises(UserError, match=r"legacy holds the optimizer of another model \(6 trained tensors, this "
                                        r"one trains 8\)"):
        load_training_state(tmp_path / "legacy", other, opt)


def test_latest_and_prune(tmp_path):
    for step in (5, 10, 15):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "state.json").write_text("{}")
    (tmp_path / ".step_00000020.tmp-abc").mkdir()  # an interrupted write is never picked
    (tmp_path / "step_00000020").mkdir()  # nor a folder without its metadata
    assert latest_checkpoint(tmp_path).name == "step_00000015"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000015", "step_00000020"]


def _dead_pid() -> int:
    """The pid of a process that has ended (and, right after, is not reused)."""
    import subprocess
    import sys
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_killed_writes_are_removed_even_with_this_pid(tmp_path):
    """A run killed mid-replace leaves `.NAME.old-PID` / `.NAME.tmp-PID-…`; a rerun in a fresh
    container often has the same pid. The next write removes them instead of failing on them."""
    import os
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text("1"))
    for leftover in (f".ckpt.old-{os.getpid()}", f".ckpt.tmp-{os.getpid()}-abc", f".ckpt.old-{_dead_pid()}-xyz"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "v").write_text("stale")
    alive = tmp_path / f".ckpt.tmp-{os.getppid()}-def"  # another live process may be writing this one
    alive.mkdir()
    write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text("2"))
    assert (tmp_path / "ckpt" / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", alive.name])


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_replace_with_and_without_an_atomic_exchange(tmp_path, monkeypatch, atomic_exchange):
    from lit_softmoe.utils import atomic
    if not atomic_exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    for version in "123":
        write_folder_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "v").write_text(version))
        assert (tmp_path / "ckpt" / "v").read_text() == version
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_replace_killed_between_its_renames_is_recovered(tmp_path):
    """Without an atomic exchange the old folder is renamed away first; killed right then, only
    the old folder's holder is left, and loading (or the next save) puts it back."""
    tower = create_image_tower("vit-test", num_classes=3)
    save_tower(tmp_path / "prev", tower)
    holder = tmp_path / f".tower.old-{_dead_pid()}-k1ll3d"
    holder.mkdir()
    (tmp_path / "prev").rename(holder / "tower")
    loaded, _ = load_tower(tmp_path / "tower")
    assert torch.equal(loaded.state_dict()["pos_embed"], tower.state_dict()["pos_embed"])
    assert [p.name for p in tmp_path.iterdir()] == ["tower"]


def test_atomic_exchange_swaps_two_folders(tmp_path):
    from lit_softmoe.utils.atomic import _exchange
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / name / "v").write_text(name)
    if not _exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system or filesystem: two renames are used")
    assert (tmp_path / "a" / "v").read_text() == "b" and (tmp_path / "b" / "v").read_text() == "a"
