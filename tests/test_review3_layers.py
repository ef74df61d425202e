"""Review 3 of the layers and towers (nn/, models/vit.py, upcycle, convert): each test failed before its fix."""
from __future__ import annotations

import pytest


def test_pretrain_names_an_impossible_tower_option_in_one_line():
    from lit_softmoe.config import PretrainConfig
    from lit_softmoe.errors import UserError
    from lit_softmoe.train.pretrain import _validate_tower
    cfg = PretrainConfig()
    cfg.tower.name, cfg.tower.options = "soft-test-4e", {"num_heads": 0}
    with pytest.raises(UserError, match="num_heads must be a positive integer, got 0"):
        _validate_tower(cfg)
