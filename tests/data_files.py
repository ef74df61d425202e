"""Image, shard and table files the data tests write and read back."""
import contextlib
import csv
import io
import json
import os
import tarfile

import numpy as np
import PIL.Image
import pytest

from lit_softmoe.data.shards import shard_urls
from lock_holders import in_thread

LIMIT = 200


def rng_image(seed, size=(12, 8), mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": None, "LA": 2}[mode]
    shape = (size[1], size[0]) if channels is None else (size[1], size[0], channels)
    return PIL.Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def encode_image(image, pil_format="PNG", **settings):
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **settings)
    return buffer.getvalue()


def pixels_of(data):
    return np.asarray(PIL.Image.open(io.BytesIO(data)))


def png_bytes(array):
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def seeded_png(seed):
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (8, 8), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def gray_png(path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.new("L", (8, 8), value).save(path)


def read_split(split_dir):
    """{key: {extension: bytes}} over every shard of a split, in shard order."""
    samples = {}
    for url in shard_urls(split_dir):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                key, extension = member.name.rsplit(".", 1)
                samples.setdefault(key, {})[extension] = tar.extractfile(member).read()
    return samples


ROWS = [  # image, caption, an extra column; the third names no file, the fourth has an empty caption
    ("images/a.png", "a red square", "1"),
    ("images/b.jpg", "two cats", "2"),
    ("images/gone.png", "missing image", "3"),
    ("images/c.png", "", "4"),
    ("images/d.png", "a dog, again", "5"),
]


def write_table(folder, kind):
    (folder / "images").mkdir(parents=True)
    (folder / "images/a.png").write_bytes(encode_image(rng_image(20)))
    (folder / "images/b.jpg").write_bytes(encode_image(rng_image(21), "JPEG"))
    (folder / "images/c.png").write_bytes(encode_image(rng_image(22)))
    (folder / "images/d.png").write_bytes(encode_image(rng_image(23)))
    header = ("filepath", "title", "score")
    table = folder / f"table.{kind}"
    if kind in ("csv", "tsv"):
        with open(table, "w", newline="", encoding="utf-8") as file:
            csv.writer(file, delimiter="," if kind == "csv" else "\t").writerows([header, *ROWS])
    elif kind == "jsonl":
        table.write_text("".join(json.dumps(dict(zip(header, row))) + "\n" for row in ROWS))
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        pq.write_table(pa.table({name: [row[i] for row in ROWS] for i, name in enumerate(header)}), table)
    return table


def cut_at_sample(tar_path, index: int, into: int = 0) -> int:
    """Cut a tar shard just before the first member of its `index`-th sample (0-based): what is left is
    a complete, valid archive of the first `index` samples, as a copy or a download cut short at a
    member boundary leaves it. `into` > 0 keeps that many bytes of the sample (a cut inside a member:
    a damaged tar). Returns the offset cut at."""
    keys = []
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            key = member.name.rsplit(".", 1)[0]
            if key not in keys:
                keys.append(key)
                if len(keys) == index + 1:
                    offset = member.offset  # the member's header block
                    break
        else:
            raise ValueError(f"{tar_path} holds {len(keys)} samples, not more than {index}")
    with open(tar_path, "r+b") as file:
        file.truncate(offset + into)
    return offset + into


def copy_split(split_dir, target):
    """A copy of a split folder (its shards, nshards.txt and sizes.json; no decoded cache)."""
    target.mkdir(parents=True)
    for path in split_dir.iterdir():
        if not path.name.startswith("."):
            (target / path.name).write_bytes(path.read_bytes())
    return target


def run_past_fifos(fifos, target, *args, timeout: float = 20, **kwargs):
    """`target(*args, **kwargs)`, run in a thread so that a reader blocked on one of `fifos` (a FIFO's
    open waits for a writer forever) fails the test instead of hanging it: past `timeout` seconds each
    FIFO is opened for writing and closed, which lets the reader go on, and the test fails."""
    thread, outcome = in_thread(target, *args, **kwargs)
    thread.join(timeout)
    if thread.is_alive():
        for _ in range(10):
            for fifo in fifos:
                with contextlib.suppress(OSError):  # ENXIO: nobody is reading this one
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(0.5)
        pytest.fail(f"{target.__name__} blocked reading a FIFO for {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
