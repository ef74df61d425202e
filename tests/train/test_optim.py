"""lit_softmoe.train.optim: the learning-rate schedule's warmup, given in steps or as a fraction of the run."""
import pytest

from lit_softmoe.config import OptimConfig
from lit_softmoe.errors import UserError
from lit_softmoe.train.optim import check_optim_settings, long_warmup_warning, lr_at, warmup_steps


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
