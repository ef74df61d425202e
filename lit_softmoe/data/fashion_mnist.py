"""Fashion-MNIST (Xiao et al., 2017) → shards: the small real set every demo uses.

Fashion-MNIST ships as four gzipped idx files (the MNIST format); they are read with numpy, so
no torchvision dataset class (and no download) is needed when the files are on disk. The shards
follow CLIP_benchmark's layout (see `data.shards`), so the same folder serves classification
pretraining (`.png` + `.cls`), LiT training (`.png` + `.txt` caption) and zero-shot evaluation
(`classnames.txt` + `zeroshot_classification_templates.txt`).
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import math
import os
import time
import zlib
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import PIL.Image
import torch
from tqdm import tqdm

from lit_softmoe.data.captions import class_caption
from lit_softmoe.data.class_split import cache_decoded_split
from lit_softmoe.data.shards import (
    CLASSNAMES_FILE,
    SIZES_FILE,
    TEMPLATES_FILE,
    same_classnames,
    splits_beside,
    write_split,
)
from lit_softmoe.data.writers import other_split_data
from lit_softmoe.errors import UserError, setting
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES, ZEROSHOT_TEMPLATES
from lit_softmoe.utils.atomic import write_folder_atomically, write_text_atomic
from lit_softmoe.utils.locks import folder_lock
from lit_softmoe.utils.paths import check_writable

logger = logging.getLogger(__name__)

# "the"/"my" instead of "a": several names start with a vowel or are plural ("an ankle boot",
# "trousers"). Captions (training text) and zero-shot prompts (evaluation) are kept apart.
CAPTION_TEMPLATES = (
    "a photo of the {c}.",
    "a black and white photo of the {c}.",
    "a small grayscale picture of my {c}.",
    "the {c}, photographed for a catalogue.",
    "a low resolution image of the {c}.",
)
FASHION_MNIST_FILES = {  # split → (images, labels), without the .gz
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
CACHE_DIR = Path("~/.cache/lit_softmoe").expanduser()  # where torchvision's download goes
MANIFEST_FILE = "manifest.json"
_FORMAT_VERSION = 2  # bump when the shard content changes, so old sets get rewritten
_INSTALL_HINT = ("install it with `apt-get install -y dataset-fashion-mnist` or set "
                 "LIT_SOFTMOE_DATA=DIR")


# ---------------------------------------------------------------------------------------- finding

def _file_in(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def _holding_folder(root: Path) -> Path | None:
    """The folder under `root` holding the four idx files (itself, `fashion-mnist/`, or
    torchvision's)."""
    for folder in (root, root / "fashion-mnist", root / "FashionMNIST" / "raw"):
        if all(_file_in(folder, name) for names in FASHION_MNIST_FILES.values() for name in names):
            return folder
    return None


def find_fashion_mnist(source: str | Path | None = None, allow_download: bool = True) -> Path:
    """The folder holding Fashion-MNIST's four idx files (gzipped or not).

    Looks in `source` (if given, only there), then `$LIT_SOFTMOE_DATA` (the files or a
    `fashion-mnist/` folder), then /usr/share/datasets/fashion-mnist, then ~/.cache/lit_softmoe,
    where it last tries torchvision's download (needs internet; skipped if `allow_download` is
    False).
    """
    if source is not None:
        found = _holding_folder(Path(source))
        if found is None:
            raise UserError(f"Fashion-MNIST not found in {source} (the source given): it needs the "
                            "four files train-images-idx3-ubyte.gz … t10k-labels-idx1-ubyte.gz; "
                            f"{_INSTALL_HINT}")
        return found
    tried = []
    for root in (os.environ.get("LIT_SOFTMOE_DATA"), SYSTEM_DIR, CACHE_DIR):
        if root:
            tried.append(str(root))
            found = _holding_folder(Path(root))
            if found is not None:
                return found
    if allow_download:
        try:
            import torchvision

            torchvision.datasets.FashionMNIST(root=str(CACHE_DIR), train=True, download=True)
            torchvision.datasets.FashionMNIST(root=str(CACHE_DIR), train=False, download=True)
        except Exception as exn:  # no internet is the usual case; the message below says what to do
            logger.info("Fashion-MNIST download failed: %s", exn)
        found = _holding_folder(CACHE_DIR)
        if found is not None:
            return found
    downloaded = " (and its download failed)" if allow_download else ""
    raise UserError(f"Fashion-MNIST not found in {', '.join(tried)}{downloaded}; {_INSTALL_HINT} "
                    "(a folder holding its four .gz files)")


# ---------------------------------------------------------------------------------------- reading

def read_idx(path: str | Path, limit: int | None = None) -> np.ndarray:
    """Read an idx file (gzipped or not; the MNIST format) holding uint8 data: its first `limit`
    items (all of them by default). A limited read stops there: the rest of the file is neither
    decompressed nor checked (60k training images are 47 MB of gzip to inflate)."""
    path = Path(path)
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
            # Header: two zero bytes, a type code (0x08 = uint8), the number of dims, then each
            # dim as a big-endian uint32.
            head = file.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] != 0x08:
                raise UserError(f"{path} is not a uint8 idx file; reinstall the dataset "
                                f"({_INSTALL_HINT})")
            ndim = head[3]
            dims = file.read(4 * ndim)
            # cut off inside the header: numpy would raise a bare ValueError
            if len(dims) < 4 * ndim:
                raise UserError(f"{path} is truncated ({4 + len(dims)} bytes, its header alone "
                                f"needs {4 + 4 * ndim}); reinstall the dataset ({_INSTALL_HINT})")
            # Python ints: a damaged header cannot overflow
            shape = tuple(int(d) for d in np.frombuffer(dims, ">u4"))
            if limit is not None and ndim and limit < shape[0]:
                shape = (limit, *shape[1:])
                data = file.read(math.prod(shape))
            else:  # all of it: nothing may follow the last item
                data = file.read()
    # a cut-off download, or not gzip at all
    except (EOFError, zlib.error, gzip.BadGzipFile) as exn:
        raise UserError(f"{path} is a damaged gzip file ({exn}); reinstall the dataset "
                        f"({_INSTALL_HINT})") from None
    if len(data) != math.prod(shape):
        raise UserError(f"{path} is truncated or padded ({4 + 4 * ndim + len(data)} bytes for "
                        f"shape {shape}); reinstall the dataset ({_INSTALL_HINT})")
    return np.frombuffer(data, np.uint8).reshape(shape)


def read_fashion_mnist(split: str, source: str | Path | None = None, allow_download: bool = True,
                       limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) uint8 of the "train" (60k) or "test" (10k) split,
    or of its first `limit` samples (only those are read)."""
    if split not in FASHION_MNIST_FILES:
        raise UserError(f"unknown Fashion-MNIST split {split!r}; choose one of "
                        f"{sorted(FASHION_MNIST_FILES)}")
    folder = find_fashion_mnist(source, allow_download)
    images_name, labels_name = FASHION_MNIST_FILES[split]
    images, labels = (read_idx(_file_in(folder, images_name), limit),
                      read_idx(_file_in(folder, labels_name), limit))
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise UserError(f"{folder}: {split} images {images.shape} do not match labels "
                        f"{labels.shape}; reinstall the dataset ({_INSTALL_HINT})")
    return images, labels


# ---------------------------------------------------------------------------------------- writing

def _png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    # Fixed settings: PIL writes no timestamp, so equal pixels give equal bytes.
    PIL.Image.fromarray(image).save(  # (28, 28) uint8 → mode "L"
        buffer, format="PNG", compress_level=6, optimize=False)
    return buffer.getvalue()


def _fashion_mnist_samples(images: np.ndarray, labels: np.ndarray, split: str,
                           progress: bool) -> Iterator[dict[str, bytes]]:
    for index in tqdm(range(len(labels)), desc=f"fashion-mnist {split}", disable=not progress):
        label = int(labels[index])
        # cycled: see data.captions
        caption = class_caption(CAPTION_TEMPLATES, FASHION_MNIST_CLASSNAMES[label], index)
        meta = {"source": "fashion-mnist", "split": split, "index": index}
        yield {
            "png": _png_bytes(images[index]),
            "cls": str(label).encode("ascii"),
            "txt": caption.encode("utf-8"),
            "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
        }


def _is_complete(out_dir: Path, manifest: dict) -> bool:
    """True if `out_dir` holds the set `manifest` describes (same arguments, every file in
    place)."""
    try:
        written = json.loads((out_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    if {k: v for k, v in written.items() if k != "splits"} != manifest:
        return False
    for split, recorded in written.get("splits", {}).items():
        try:
            if json.loads((out_dir / split / SIZES_FILE).read_text()) != recorded["sizes"]:
                return False
        except (OSError, ValueError):
            return False
        for name, nbytes in recorded["bytes"].items():
            path = out_dir / split / name
            if not path.is_file() or path.stat().st_size != nbytes:
                return False
    metadata = (CLASSNAMES_FILE, TEMPLATES_FILE, "dataset_type.txt")
    return set(written.get("splits", {})) == set(FASHION_MNIST_FILES) and all(
        (out_dir / name).is_file() for name in metadata)


def write_fashion_mnist_shards(
    out_dir: str | Path,
    source: str | Path | None = None,
    samples_per_shard: int = 10_000,
    limit: int | None = None,
    allow_download: bool = True,
    progress: bool = False,
    overwrite: bool = False,
    *,
    setting_names: Mapping[str, str] | None = None,
) -> dict:
    """Write Fashion-MNIST as `out_dir/{train,test}/` shards + class names, templates, dataset type.

    Each sample holds `.png` (28×28 grayscale), `.cls` (label digits), `.txt` (a caption from the
    class name) and `.json` ({"source", "split", "index"}). `limit` keeps the first N samples of
    each split (for quick tests). Rerunning with the same arguments rewrites identical bytes, and
    is skipped if `out_dir` already holds the complete set (its manifest.json, completed last,
    matches the arguments, and every sizes.json and shard is in place). A train/ or test/ folder
    holding other data (written by `data from-folder`, `embed`, …) is refused unless `overwrite`;
    then it is replaced whole, in one swap. `setting_names`: what messages call the parameters,
    {parameter: the caller's name} (`errors.setting`; the CLI passes its flags, {"out_dir":
    "--out", ...}).

    Returns:
        {"out_dir", "samples": {split: count}, "shards": {split: count}, "skipped", "seconds"}.
    """
    start = time.perf_counter()
    out_dir, names = Path(out_dir), setting_names
    # images[:0] would write empty shards, images[:-5] drop the last five
    if limit is not None and limit < 1:
        raise UserError(f"{setting(names, 'limit')} must be at least 1 (the first N images of each "
                        f"split), got {limit}")
    folder = find_fashion_mnist(source, allow_download)
    manifest = {
        "format": _FORMAT_VERSION, "dataset": "fashion-mnist", "limit": limit,
        "samples_per_shard": samples_per_shard,
        # Source file sizes tell a different dataset in the same file names (e.g. MNIST) apart.
        "source_bytes": {name: _file_in(folder, name).stat().st_size
                         for names in FASHION_MNIST_FILES.values() for name in names},
    }
    if _is_complete(out_dir, manifest):
        written = json.loads((out_dir / MANIFEST_FILE).read_text())["splits"]
        logger.info("%s already holds these Fashion-MNIST shards; nothing written", out_dir)
        return _summary(out_dir, written, skipped=True, start=start)

    out_setting = setting(names, "out_dir")
    # A file there, or no permission: one line, not a traceback.
    check_writable(out_dir, out_setting, folder=True)
    for split in FASHION_MNIST_FILES:
        # mkdir would raise FileExistsError
        if (out_dir / split).exists() and not (out_dir / split).is_dir():
            raise UserError(f"{out_dir / split} is a file, not a split folder; move it away or "
                            f"choose another {out_setting}")
    _check_free(out_dir, overwrite, names)
    # one writer of a dataset folder at a time; the checks again under the lock
    with folder_lock(out_dir):
        if _is_complete(out_dir, manifest):  # the same command, finished meanwhile
            return _summary(out_dir, json.loads((out_dir / MANIFEST_FILE).read_text())["splits"],
                            skipped=True, start=start)
        others = _check_free(out_dir, overwrite, names)
        # Before any shard, without "splits" (which mark the set complete): tells a rerun that the
        # splits here are Fashion-MNIST's, so an interrupted run is rewritten, not refused.
        write_text_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
        splits = {}
        for split in FASHION_MNIST_FILES:
            images, labels = read_fashion_mnist(split, folder, limit=limit)

            def write(split_dir: Path) -> None:
                sizes = write_split(_fashion_mnist_samples(images, labels, split, progress),
                                    split_dir.parent, split_dir.name,
                                    samples_per_shard=samples_per_shard)
                # The PNGs are lossless, so these arrays are what decoding the shards gives: cache
                # them now and the first `load_class_split` of this split costs no decoding.
                cache_decoded_split(split_dir, torch.from_numpy(images[:, None].copy()),
                                    torch.from_numpy(labels.astype(np.int64)))
                nbytes = {name: (split_dir / name).stat().st_size for name in sizes}
                splits[split] = {"sizes": sizes, "bytes": nbytes}

            if others[split]:  # another dataset's split: replaced whole, nothing of it left behind
                write_folder_atomically(out_dir / split, write)
            else:
                write(out_dir / split)
        write_text_atomic(out_dir / CLASSNAMES_FILE, "\n".join(FASHION_MNIST_CLASSNAMES) + "\n")
        write_text_atomic(out_dir / TEMPLATES_FILE, "\n".join(ZEROSHOT_TEMPLATES) + "\n")
        write_text_atomic(out_dir / "dataset_type.txt", "classification\n")
        write_text_atomic(out_dir / MANIFEST_FILE,
                          json.dumps({**manifest, "splits": splits}, indent=1) + "\n")
        return _summary(out_dir, splits, skipped=False, start=start)


def _check_free(out_dir: Path, overwrite: bool,
                names: Mapping[str, str] | None) -> dict[str, str | None]:
    """{split: what train/ or test/ holds besides Fashion-MNIST}, refused without `overwrite`; and
    no other split here may have other class names. Messages call the parameters by `names`."""
    others = {split: _other_data(out_dir, split) for split in FASHION_MNIST_FILES}
    for split, other in others.items():
        if other and not overwrite:
            raise UserError(f"{out_dir / split} already holds {other}; pass "
                            f"{setting(names, 'overwrite', True)} to replace it with "
                            f"Fashion-MNIST, or choose another {setting(names, 'out_dir')}")
    _check_other_classnames(out_dir, names)
    return others


def _check_other_classnames(out_dir: Path, names: Mapping[str, str] | None) -> None:
    """Refuse to rename the classes of a split here that is not train/ or test/ (`data from-folder`
    refuses the same for its splits): classnames.txt beside the splits describes them all."""
    others = splits_beside(out_dir, exclude=FASHION_MNIST_FILES)
    if (same_classnames(out_dir / CLASSNAMES_FILE, list(FASHION_MNIST_CLASSNAMES)) is False
            and others):
        raise UserError(f"{out_dir / CLASSNAMES_FILE} lists other classes than Fashion-MNIST's for "
                        f"the split(s) {', '.join(others)}; write Fashion-MNIST to another "
                        f"{setting(names, 'out_dir')}")


def _other_data(out_dir: Path, split: str) -> str | None:
    """What `out_dir/split` holds other than Fashion-MNIST written here (None: nothing, or ours).

    Ours: the set's manifest.json (written before the first shard) names Fashion-MNIST, and the
    split has no manifest of its own (`data from-folder|from-table` write one) or embed.json.
    """
    try:
        ours = json.loads((out_dir / MANIFEST_FILE).read_text()).get("dataset") == "fashion-mnist"
    except (OSError, ValueError, AttributeError):
        ours = False
    if (ours and not (out_dir / split / MANIFEST_FILE).exists()
            and not (out_dir / split / "embed.json").exists()):
        return None
    return other_split_data(out_dir / split, lambda written: False)


def _summary(out_dir: Path, splits: dict, skipped: bool, start: float) -> dict:
    return {
        "out_dir": str(out_dir),
        "samples": {split: sum(s["sizes"].values()) for split, s in splits.items()},
        "shards": {split: len(s["sizes"]) for split, s in splits.items()},
        "skipped": skipped,
        "seconds": round(time.perf_counter() - start, 3),
    }
