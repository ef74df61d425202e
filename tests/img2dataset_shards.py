"""img2dataset's webdataset output, written the way img2dataset writes it (rom1504/img2dataset: writer.py's
WebDatasetSampleWriter, logger.py's write_stats, downloader.py's keys), around real Fashion-MNIST images.

    OUT/  00000.tar 00000.parquet 00000_stats.json  00001.tar …

- a sample is `KEY.jpg` (RGB JPEG, as img2dataset's resizer re-encodes), `KEY.txt` (the caption) and
  `KEY.json` (url, caption, key, status, sizes…); KEY is the shard number (5 digits) then the row's
  index in the shard (4 digits, for 10,000 rows a shard), so failed rows leave gaps in the keys;
- a failed download is a row of the `.parquet` (status "failed_to_download", its error message) and
  no sample of the tar;
- `NNNNN_stats.json` is written after the tar is closed: "count" rows, "successes" samples in the tar,
  "failed_to_download", "failed_to_resize", "duration", "status_dict", …;
- no nshards.txt, no sizes.json.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds

from lit_softmoe.data.fashion_mnist import CAPTION_TEMPLATES, read_fashion_mnist
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES

_PARQUET_SCHEMA = pa.schema([("url", pa.string()), ("caption", pa.string()), ("key", pa.string()),
                             ("status", pa.string()), ("error_message", pa.string()), ("width", pa.int64()),
                             ("height", pa.int64()), ("original_width", pa.int64()),
                             ("original_height", pa.int64()), ("exif", pa.string()), ("sha256", pa.string())])


@dataclass
class Img2datasetOutput:
    """What was written: the folder, and per finished shard its tar, its samples' keys and captions."""

    folder: Path
    shards: list[Path] = field(default_factory=list)  # the finished shards' tars, in order
    keys: list[str] = field(default_factory=list)  # the samples of the finished shards, in shard order
    captions: dict[str, str] = field(default_factory=dict)  # {key: caption}
    labels: dict[str, int] = field(default_factory=dict)  # {key: Fashion-MNIST class}
    failed: list[str] = field(default_factory=list)  # keys of the failed downloads (the .parquet's only)
    unfinished: list[Path] = field(default_factory=list)  # tars without their _stats.json

    @property
    def successes(self) -> list[int]:
        return [json.loads(_stats_path(tar).read_text())["successes"] for tar in self.shards]


def _stats_path(tar: Path) -> Path:
    return tar.with_name(tar.stem + "_stats.json")


def _jpeg(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).convert("RGB").save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def write_img2dataset_output(folder: Path, rows: int, rows_per_shard: int, failed_every: int = 7,
                             unfinished_rows: int = 0, split: str = "train") -> Img2datasetOutput:
    """`rows` Fashion-MNIST images (of `split`) downloaded as img2dataset does, `rows_per_shard` a shard.

    Every `failed_every`-th row (0 for none) failed to download. `unfinished_rows` > 0 adds one more
    shard of that many rows whose tar was written but not its _stats.json: a shard img2dataset was
    still writing (or was killed in).
    """
    images, labels = read_fashion_mnist(split, allow_download=False)
    folder.mkdir(parents=True, exist_ok=True)
    out = Img2datasetOutput(folder)
    starts = list(range(0, rows, rows_per_shard))
    for shard_id, start in enumerate(starts + ([rows] if unfinished_rows else [])):
        count = min(rows_per_shard, rows - start) if start < rows else unfinished_rows
        finished = start < rows
        tar = folder / f"{shard_id:05d}.tar"
        metas = []
        with wds.TarWriter(str(tar)) as sink:
            for row in range(count):
                index = start + row
                key = f"{shard_id:05d}{row:04d}"
                label = int(labels[index])
                caption = CAPTION_TEMPLATES[index % len(CAPTION_TEMPLATES)].format(c=FASHION_MNIST_CLASSNAMES[label])
                meta = {"url": f"https://img.example/{index}.jpg", "caption": caption, "key": key,
                        "status": "success", "error_message": None, "width": 28, "height": 28,
                        "original_width": 28, "original_height": 28, "exif": None, "sha256": None}
                if failed_every and index % failed_every == failed_every - 1:
                    meta.update(status="failed_to_download", error_message="HTTP Error 404: Not Found",
                                width=None, height=None, original_width=None, original_height=None)
                    if finished:
                        out.failed.append(key)
                else:
                    sink.write({"__key__": key, "jpg": _jpeg(images[index]), "txt": caption,
                                "json": json.dumps(meta, indent=4)})
                    if finished:
                        out.keys.append(key)
                        out.captions[key], out.labels[key] = caption, label
                metas.append(meta)
        pq.write_table(pa.Table.from_pylist(metas, schema=_PARQUET_SCHEMA), folder / f"{shard_id:05d}.parquet")
        if not finished:
            out.unfinished.append(tar)
            continue
        successes = sum(meta["status"] == "success" for meta in metas)
        stats = {"count": count, "successes": successes, "failed_to_download": count - successes,
                 "failed_to_resize": 0, "duration": 1.5, "start_time": 1700000000.0, "end_time": 1700000001.5,
                 "status_dict": {status: n for status, n in (("success", successes),
                                                            ("failed_to_download", count - successes)) if n}}
        _stats_path(tar).write_text(json.dumps(stats, indent=4))
        out.shards.append(tar)
    return out
