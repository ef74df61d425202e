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
