"""Training recipes as a demanding user reruns them (review 4), on 300 + 300 Fashion-MNIST images and a
soft-test-4e tower: a LiT probe without an eval set says it is skipped; a finished run rerun logs its
final evaluation once; pretrain's periodic evaluation runs in the main process only; the full linear
probe on a handful of samples picks its penalty by leave-one-out instead of an empty hold-out; a text
MLP of no width is refused."""
import json

import pytest

from lit_softmoe.config import LiTConfig, load_config
from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.train.lit import train_lit
from test_lit_robustness import data  # noqa: F401  (300 + 300 Fashion-MNIST images, a soft-test-4e tower)


def _lit(data, run_dir, *extra) -> LiTConfig:
    return load_config(LiTConfig, None, [
        f"run_dir={run_dir}", f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
        f"eval.shards={data / 'features' / 'test'}", "data.workers=0", "batch_size=50", "log_every=1",
        "precision=fp32", "text.width=64", "text.layers=1", "text.heads=2", *extra])


# ---- text tower settings --------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [0, -2])
def test_a_text_mlp_ratio_that_is_not_positive_is_one_line(ratio):
    """0 built a tower whose MLPs had no hidden unit (it trained, silently without them); a negative
    ratio ended in torch's traceback."""
    with pytest.raises(UserError) as err:
        create_text_tower(TextTowerConfig(width=64, layers=1, heads=2, mlp_ratio=ratio), embed_dim=32)
    assert str(err.value) == f"text.mlp_ratio must be above 0, got {ratio}; CLIP's is 4"
    # A small positive ratio still builds: 64 × 0.5 = 32 hidden units.
    tower = create_text_tower(TextTowerConfig(width=64, layers=1, heads=2, mlp_ratio=0.5), embed_dim=32)
    assert max(p.shape[0] for name, p in tower.named_parameters() if "c_fc.weight" in name) == 32


# ---- LiT: a probe set without an eval set -----------------------------------------------------------

SKIPPED = ("the linear probe on eval.probe_train is skipped: there is no eval set to score it on (eval.shards is "
           "empty); set eval.shards to a labelled split to run it")


def test_a_probe_set_without_an_eval_set_is_skipped_with_a_warning_and_recorded(data, tmp_path, caplog):
    """The README's own-data command (`eval.shards=` over fmnist-tiny.yaml, which names a probe set)
    trained and silently reported no probe. It still runs, and says the probe was skipped: before
    training, at the end and in results.json, as pretrain does for its few-shot probe."""
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="lit_softmoe.train.lit"):
        results = train_lit(_lit(data, run, "steps=2", "eval.shards=", f"eval.probe_train={data / 'features' / 'train'}"))
    assert results["steps"] == 2 and "linear_probe_top1" not in results
    assert results["probe_skipped"] == SKIPPED
    assert json.loads((run / "results.json").read_text())["probe_skipped"] == SKIPPED
    assert [r.getMessage() for r in caplog.records if r.name == "lit_softmoe.train.lit"] == [SKIPPED, SKIPPED]
    # With an eval set the probe runs, and nothing is said to be skipped.
    results = train_lit(_lit(data, tmp_path / "with-eval", "steps=2", f"eval.probe_train={data / 'features' / 'train'}"))
    assert 0.0 <= results["linear_probe_top1"] <= 1.0 and "probe_skipped" not in results
