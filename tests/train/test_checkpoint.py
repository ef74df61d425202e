"""lit_softmoe.train.checkpoint: training state (optimizer moments, RNG) restored exactly, checkpoints pruned."""
import json
import shutil

import pytest
import torch

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import latest_checkpoint
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.train.checkpoint import load_training_state, prune_checkpoints, save_training_state
from lit_softmoe.train.optim import create_optimizer, param_groups


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


def _trained_pair_checkpoint(path, freeze_pooler: bool = False) -> torch.nn.Module:
    """Two AdamW steps with every parameter trained (the pooler too, unless `freeze_pooler`), saved at `path`."""
    pair = _pair_with_pooler()
    pair.text.pooler.requires_grad_(not freeze_pooler)
    opt = create_optimizer(pair, OptimConfig(lr=1e-2))
    for _ in range(2):
        opt.zero_grad()
        pair.head(pair.text(torch.randn(6, 4))).square().mean().backward()
        opt.step()
    save_training_state(path, 2, pair, opt)
    return pair, opt


def test_a_parameter_frozen_since_the_checkpoint_leaves_the_others_their_moments(tmp_path):
    # A pooler the checkpoint's optimizer trained, frozen now: its moments are dropped, the others' restored.
    old, old_opt = _trained_pair_checkpoint(tmp_path / "step_00000002")
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


def test_a_checkpoint_without_parameter_names_is_refused_in_one_line(tmp_path):
    """The optimizer's moments are matched to the parameters by the names state.json records: without them
    (another version wrote it) the resume is refused, not guessed."""
    import re
    path = tmp_path / "step_00000002"
    _trained_pair_checkpoint(path)
    info = json.loads((path / "state.json").read_text())
    del info["param_names"]
    (path / "state.json").write_text(json.dumps(info))
    new = _pair_with_pooler()
    opt = create_optimizer(new, OptimConfig(lr=1e-2))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path / 'state.json'))} has no param_names \(written by "
                                        r"another version of lit-softmoe\); its optimizer state cannot be matched "
                                        r"to the parameters by name; start this run with another run_dir=\.\.\.$"):
        load_training_state(path, new, opt)


def test_an_optimizer_of_another_model_is_one_user_error(tmp_path):
    # Checkpoints of a run that never trained the pooler, resumed with the pooler trained.
    _trained_pair_checkpoint(tmp_path / "named", freeze_pooler=True)
    other = _pair_with_pooler()
    opt = create_optimizer(other, OptimConfig(lr=1e-2))
    with pytest.raises(UserError, match=r"named has no optimizer state for text.pooler.weight and 1 more, which "
                                        r"this model trains; resume with the run's own settings"):
        load_training_state(tmp_path / "named", other, opt)
    one_group = torch.optim.AdamW(other.parameters(), lr=1e-2)  # the checkpoint's optimizer had two
    with pytest.raises(UserError, match=r"named holds the optimizer of another model \(6 trained tensors, this "
                                        r"one trains 8\)"):
        load_training_state(tmp_path / "named", other, one_group)


def test_latest_and_prune(tmp_path):
    for step in (5, 10, 15):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "state.json").write_text("{}")
    (tmp_path / ".step_00000020.tmp-abc").mkdir()  # an interrupted write is never picked
    (tmp_path / "step_00000020").mkdir()  # nor a folder without its metadata
    assert latest_checkpoint(tmp_path).name == "step_00000015"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000015", "step_00000020"]


def test_a_link_at_a_steps_name_is_not_counted_among_the_checkpoints_kept(tmp_path):
    """A looping link at step_00000020 counted as one of `keep`: keep=2 left one real checkpoint."""
    for step in (10, 30):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "state.json").write_text("{}")
    (tmp_path / "step_00000020").symlink_to("step_00000020")
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*") if not p.is_symlink()) == ["step_00000010", "step_00000030"]


def test_a_step_name_not_zero_padded_takes_its_steps_place(tmp_path):
    """Sorted by spelling, a hand-made step_5 was newer than step_00000020: resumed from, and pruning
    deleted step_00000010 and kept it."""
    for name in ("step_5", "step_00000010", "step_00000020"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step_00000020"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010", "step_00000020"]


def _three_checkpoints(folder) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at steps 1, 2, 3 of a tiny model trained one AdamW step between each; returns
    each step's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved = {}
    for step in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        save_training_state(folder / f"step_{step:08d}", step, model, opt)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _damage(ckpt, how: str) -> None:
    if how == "truncated tensors":  # a disk that filled while it was written, a copy cut short
        data = (ckpt / "state.safetensors").read_bytes()
        (ckpt / "state.safetensors").write_bytes(data[:len(data) // 2])
    elif how == "garbage json":
        (ckpt / "state.json").write_bytes(b"\x00\x17{not json")
    elif how == "tensors of the step before":  # `cp step_2/state.safetensors step_3/`: its weights are step 2's
        shutil.copy(ckpt.parent / "step_00000002" / "state.safetensors", ckpt / "state.safetensors")
    elif how.startswith("another run's"):  # the same step of another run: the step agrees, the run does not
        other = ckpt.parent / "other-run"
        _three_checkpoints(other)
        name = "state.safetensors" if how.endswith("tensors") else "state.json"
        shutil.copy(other / ckpt.name / name, ckpt / name)
        shutil.rmtree(other)
    else:  # a step of the wrong type, or another step than the folder's name says
        info = json.loads((ckpt / "state.json").read_text())
        (ckpt / "state.json").write_text(json.dumps({**info, "step": "ten" if how == "step not a number" else 1}))


@pytest.mark.parametrize("how", ["truncated tensors", "garbage json", "step not a number", "step not the folder's",
                                 "tensors of the step before", "another run's tensors", "another run's state.json"])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumes(tmp_path, caplog, how):
    """It crashed every rerun with a traceback (safetensors' or json's error, or comparing "ten" with
    the run's length), so the intact checkpoints before it were never used. A step that is not the
    folder's resumed the newest weights as an older step (pretraining's log then divided by zero), and
    another step's tensors in the folder resumed those weights as the folder's step, without a word."""
    from lit_softmoe.train.runtime import resume_state
    saved = _three_checkpoints(tmp_path)
    _damage(tmp_path / "step_00000003", how)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING"):
        step, meta, latest = resume_state(tmp_path, model, opt, total_steps=10)
    assert (step, meta["step"], latest) == (2, 2, tmp_path / "step_00000002")
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[2][name]) and not torch.equal(value, saved[3][name])
    assert opt.state[model.weight]["step"].item() == 2  # AdamW's moments of step 2 too
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{tmp_path / 'step_00000003'} is damaged" in warnings[0]


def test_every_checkpoint_damaged_is_one_user_error(tmp_path):
    from lit_softmoe.train.runtime import resume_state
    _three_checkpoints(tmp_path)
    for step, how in ((1, "step not a number"), (2, "garbage json"), (3, "truncated tensors")):
        _damage(tmp_path / f"step_{step:08d}", how)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(UserError, match=rf"every checkpoint in {tmp_path} is damaged \(the newest: "
                                        rf"{tmp_path / 'step_00000003'}\); restore them from a copy, or delete"):
        resume_state(tmp_path, model, torch.optim.AdamW(model.parameters()), total_steps=10)


@pytest.mark.parametrize("link", ["loop", "dangling", "another run's checkpoint"])
def test_a_link_at_a_checkpoints_name_is_passed_over_then_replaced_by_the_checkpoint(tmp_path, link):
    """`ln -s step_00000003 step_00000003`: the resume fell back to step 2, then saving step 3 raised
    `RuntimeError: Symlink loop` on every rerun, so the run could never finish (a dangling link had the
    checkpoint written wherever it pointed). A link to an intact checkpoint of another run was resumed
    from: that run's weights continued as this one's."""
    import shutil

    from lit_softmoe.train.runtime import resume_state
    other_run = tmp_path / "other"
    _three_checkpoints(other_run)
    tmp_path = tmp_path / "run"
    _three_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / "step_00000003")
    target = {"loop": "step_00000003", "dangling": tmp_path / "gone" / "x"}.get(link, other_run / "step_00000003")
    (tmp_path / "step_00000003").symlink_to(target)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert resume_state(tmp_path, model, opt, total_steps=10)[0] == 2
    save_training_state(tmp_path / "step_00000003", 3, model, opt)
    assert not (tmp_path / "step_00000003").is_symlink() and not (tmp_path / "gone").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]
    assert resume_state(tmp_path, model, opt, total_steps=10)[0] == 3
    assert sorted(p.name for p in other_run.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]


def test_a_lit_checkpoint_holding_the_log_scale_under_another_name_is_refused(tmp_path):
    """`logit_scale` is the one name of the log-scale, in the weights and in the optimizer's names."""
    from safetensors.torch import load_file, save_file

    from lit_softmoe.models.lit import LiTModel
    from lit_softmoe.models.text import create_text_tower
    from tiny_text import TINY_TEXT, token_ids

    def lit():
        torch.manual_seed(0)
        tower = create_image_tower("soft-test-4e")
        return LiTModel(tower, create_text_tower(TINY_TEXT, embed_dim=tower.embed_dim))

    model = lit()
    opt = create_optimizer(model, OptimConfig(lr=1e-2))
    zimg, ztxt, logit_scale = model(image_features=torch.randn(4, 32), text=token_ids())
    (logit_scale * zimg @ ztxt.T).logsumexp(-1).mean().backward()
    opt.step()
    ckpt = save_training_state(tmp_path / "step_00000001", 1, model, opt, skip_prefixes=("image_tower.",))
    # Rename the weight and the optimizer's name for it.
    tensors = load_file(ckpt / "state.safetensors")
    tensors["model.log_scale"] = tensors.pop("model.logit_scale")
    save_file(tensors, ckpt / "state.safetensors")
    info = json.loads((ckpt / "state.json").read_text())
    assert any("logit_scale" in names for names in info["param_names"])
    info["param_names"] = [["log_scale" if n == "logit_scale" else n for n in names] for names in info["param_names"]]
    (ckpt / "state.json").write_text(json.dumps(info))

    model2 = lit()
    opt2 = create_optimizer(model2, OptimConfig(lr=1e-2))
    with pytest.raises(UserError, match=r"does not fit the tower: missing 1 keys \(e\.g\. logit_scale\); "
                                        r"unexpected 1 keys \(e\.g\. log_scale\)"):
        load_training_state(ckpt, model2, opt2, skip_prefixes=("image_tower.",))


def test_a_resumed_optimizer_keeps_its_own_implementation(tmp_path):
    """The checkpoint brings back the hyperparameters and moments, not how the optimizer that saved it ran: a
    run saved with torch's default (multi-tensor) AdamW resumes fused, where this machine has the kernel."""
    torch.manual_seed(0)
    model = create_image_tower("soft-test-4e", num_classes=10)
    saved = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, foreach=True)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
    saved.step()
    save_training_state(tmp_path / "step_00000001", 1, model, saved)
    resumed = create_optimizer(model, OptimConfig(lr=5e-3, weight_decay=0.1))
    load_training_state(tmp_path / "step_00000001", model, resumed)
    assert [(g["fused"], g["foreach"], g["lr"]) for g in resumed.param_groups] == [(True, None, 1e-2)] * 2
    for param in model.parameters():
        assert torch.equal(resumed.state[param]["exp_avg"], saved.state[param]["exp_avg"])
