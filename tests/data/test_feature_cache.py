"""lit_softmoe.data.feature_cache: the feature cache's format (its samples' byte layout); the cache as
`lit-softmoe embed` writes and LiT training checks it is tested in tests/train/test_embed.py,
embed's job protocol in tests/train/test_embed_job.py."""
from __future__ import annotations

import numpy as np
import pytest

from lit_softmoe.data.feature_cache import npy_rows
from lit_softmoe.data.samples import npy_bytes


@pytest.mark.parametrize("width", [1, 32, 768, 40_000])
def test_npy_rows_are_np_save_of_each_row(width):
    rows = np.random.default_rng(width).standard_normal((3, width)).astype(np.float16)
    assert npy_rows(rows) == [npy_bytes(row) for row in rows]
