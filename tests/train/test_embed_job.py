"""lit_softmoe.train.embed_job: embed's job protocol (feature shards written into the work folder by
a thread of their own, their records); the whole command is tested in tests/train/test_embed.py."""
from __future__ import annotations

import numpy as np
import pytest

import lit_softmoe.train.embed_job as embed_job
from lit_softmoe.data.feature_cache import feature_sample
from lit_softmoe.data.samples import npy_bytes
from lit_softmoe.train.embed_job import FeatureShardWriter, finished_shard


def test_the_shard_writer_keeps_records_in_order_and_raises_a_failed_write(tmp_path, monkeypatch):
    """Shards written by the writer's thread: their records in `finished` in the order handed over,
    each the one a rerun finds; a write that fails (a full disk) is raised in the caller, and no
    record is kept."""
    def samples(index):
        return [feature_sample(f"k{index}-{n}", npy_bytes(np.full(4, n, np.float16)), "a caption",
                               None) for n in range(index + 1)]

    finished = [{"index": -1}]  # a killed run's shard comes first
    with FeatureShardWriter(tmp_path, finished) as writer:
        for index in range(4):
            writer.write(index, samples(index), {"index": index, "read": index + 1, "bad": {}})
    assert [record["index"] for record in finished] == [-1, 0, 1, 2, 3]
    assert [record["num_samples"] for record in finished[1:]] == [1, 2, 3, 4]
    assert [finished_shard(tmp_path, index) for index in range(4)] == finished[1:]

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(embed_job, "write_feature_shard", full_disk)
    failed: list[dict] = []
    with pytest.raises(OSError, match="No space left"):
        with FeatureShardWriter(tmp_path / "other", failed) as writer:
            writer.write(0, samples(0), {"read": 1, "bad": {}})
    assert failed == []
