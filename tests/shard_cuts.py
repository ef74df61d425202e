"""A shard cut at a sample boundary, as a disk that filled or a copy cut short leaves it: the tar still
reads as a complete, shorter archive, and only the split's sizes.json tells that samples are missing."""
from __future__ import annotations

import tarfile
from pathlib import Path


def cut_before_sample(shard: Path, index: int) -> int:
    """Truncate `shard` at the offset of the first member of its `index`-th sample (0-based, in tar
    order); returns the number of samples left (`index`)."""
    keys, offset = [], None
    with tarfile.open(shard) as tar:
        for member in tar.getmembers():
            key = member.name.split(".", 1)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
                if len(keys) == index + 1:
                    offset = member.offset
                    break
    assert offset is not None, f"{shard} holds fewer than {index + 1} samples"
    with open(shard, "r+b") as file:
        file.truncate(offset)
    return index
