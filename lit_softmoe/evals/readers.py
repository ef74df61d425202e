"""Readers for zero-shot benchmarks, all offline: whatever the files look like on disk, a reader
returns an `EvalData` (`evals.eval_data`) whose dataset yields `(index, image tensor, target)` —
target a class index (classification) or the image's captions joined by newlines (retrieval).

Layouts read (the network is never used; a benchmark whose files are absent raises `MissingData`
naming the path looked for, and the suite reports it as skipped):
- `wds`: the CLIP_benchmark webdataset layout (`SPLIT/nshards.txt`, `SPLIT/0.tar …`, samples with an
  image + `.cls` or `.txt` captions, and beside the splits `classnames.txt`,
  `zeroshot_classification_templates.txt`, `dataset_type.txt`) — also what `lit-softmoe data`
  writes, and img2dataset's output folder (`00000.tar` + `00000_stats.json` …; a caption set:
  `task: retrieval`);
- `imagefolder`: `ROOT[/SPLIT]/CLASS/*.jpg` (ImageNet-style wnid folders are mapped to the
  benchmark's classes, so ImageNet-R/-A with their 200 wnid folders line up with the 1000-class
  list; folders named after the classes, or by the benchmark's `folder_aliases` such as Kaggle
  FER2013's `disgust/`, too);
- `cifar`: CIFAR-10/100 python pickles, read with an unpickler that only builds numpy arrays (the
  house rule: nothing a user hands us is unpickled freely — torchvision's reader unpickles
  anything);
- `torchvision`: torchvision's dataset classes with `download=False`, for the benchmarks it knows;
- `karpathy`: COCO / Flickr30k retrieval from a Karpathy-split JSON (`dataset_coco.json`,
  `dataset_flickr30k.json`) and the image folder — only the `test` split (5k / 1k images), the
  split papers report (CLIP_benchmark's Flickr8k used the full set by mistake, its #48).
"""
from __future__ import annotations

import inspect
import json
import logging
import pickle
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import PIL.Image
from torch.utils.data import IterableDataset, get_worker_info

from lit_softmoe.data.folders import SOURCE_IMAGE_SUFFIXES
from lit_softmoe.data.images import open_undecoded
from lit_softmoe.data.samples import SampleSkip, decode_label, image_extension
from lit_softmoe.data.shards import (
    CLASSNAMES_FILE,
    NSHARDS_FILE,
    files_signature,
    is_local_url,
    is_split_folder,
    read_classnames_file,
    read_lines,
    shard_urls,
)
from lit_softmoe.data.tar_reading import BadSampleCounter, is_damaged_tar, listed_sizes, tar_samples
from lit_softmoe.data.transforms import to_l_or_rgb
from lit_softmoe.errors import UserError
from lit_softmoe.evals.eval_data import EvalData, IndexedImages, MissingData, transformed_image

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- wds

class _TarSamples(IterableDataset):
    """Every sample of a list of tar shards, in order, with its position as index.

    Workers share the decoding, not the shards: each reads every tar (cheap: bytes only) and decodes
    the samples whose index falls to it, so 2 workers halve the work even with one shard.
    """

    def __init__(self, urls: list[str], task: str, transform):
        self.urls, self.task, self.transform = urls, task, transform

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for index, sample in enumerate(self._samples(log=worker == 0)):
            if index % workers != worker:
                continue
            if self.task == "retrieval":
                # The raw text, blank lines and all: the suite splits it with str.splitlines as
                # CLIP_benchmark does, and counts the empty captions it leaves out.
                target = sample.get("txt", b"").decode("utf-8", "replace")
            else:
                # No .cls is a bad sample (skipped and counted) like a .cls without a class index;
                # as label -1 it failed the whole benchmark.
                try:
                    target = decode_label(sample)
                except SampleSkip:
                    target = None
            extension = image_extension(sample)
            # A sample without a usable image or class is skipped and counted (image None), like the
            # training pipeline's bad_cls: one bad sample must not end the suite.
            image = None if extension is None or target is None else \
                transformed_image(lambda: open_undecoded(sample[extension]), self.transform)
            yield index, image, target

    def _samples(self, log: bool) -> Iterator[dict]:
        """Raw samples of every shard in turn, read as the training pipeline reads them
        (`tar_reading.tar_samples`): a truncated or unreadable tar is warned about (once per shard)
        and the samples before the damage are kept; it ended the whole suite in a tarfile
        traceback."""
        counter = BadSampleCounter(log=log)  # every worker reads every tar: one of them warns
        for url in self.urls:
            yield from tar_samples(url, counter)


def read_wds(root: Path, split: str, transform, task: str = "") -> EvalData:
    split_dir = root / split
    if is_split_folder(split_dir):
        # The project's own shard resolution: padded names too, every listed shard must be there,
        # and of img2dataset's output the finished shards (those with their _stats.json).
        try:
            urls = shard_urls(split_dir)
        except UserError as err:
            raise MissingData(split_dir, f"webdataset shards ({err})") from None
    else:  # tars without nshards.txt (CLIP_benchmark itself requires the file)
        urls = sorted((str(p) for p in split_dir.glob("*.tar")), key=lambda p: (len(p), p))
    if not urls:
        raise MissingData(split_dir, "webdataset shards (nshards.txt + 0.tar …)")
    kind = (read_lines(root / "dataset_type.txt") or [task or "classification"])[0].lower()
    if kind == "multilabel":  # labels in .npy, scored by mAP: every sample would lack a .cls
        raise UserError(f"{root} is a multi-label set (dataset_type.txt says multilabel); "
                        "lit-softmoe scores single-label classification and retrieval only, so "
                        "leave it out of the suite")
    task = task or ("retrieval" if kind == "retrieval" else "classification")
    listed = listed_sizes(urls)
    return EvalData(task, _TarSamples(urls, task, transform), "wds",
                    classnames=read_classnames_file(root / CLASSNAMES_FILE),
                    templates=read_lines(root / "zeroshot_classification_templates.txt"),
                    signature={"files": files_signature([Path(u) for u in urls])},
                    listed_samples=sum(listed.values()) if listed else None,
                    damaged_shards=[url for url in urls
                                    if is_local_url(url) and is_damaged_tar(url)])


# ----------------------------------------------------------------------------------
# map-style readers

def read_image_folder(root: Path, split: str, transform, classnames: list[str] | None = None,
                      wnids: list[str] | None = None,
                      folder_aliases: dict[str, str] | None = None) -> EvalData:
    """ROOT/SPLIT/CLASS/img (or ROOT/CLASS/img). Folders named by wnids map onto `wnids`' order
    (the benchmark's classes), numeric folders are their labels, folders named after each of the
    benchmark's `classnames` (or by one of its `folder_aliases`, {folder name: class name}) take
    their class's index; other folders are classes in sorted order, named after the folder."""
    base = root / split if (root / split).is_dir() else root
    folders = (sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
               if base.is_dir() else [])
    if not folders:
        raise MissingData(base, "class folders")
    if len(folders) < 2:
        raise MissingData(base, "class folders (found only "
                          f"{folders[0].name if folders else 'none'}/; "
                          "is this another layout? set format:)")
    by_name = _match_names(folders, classnames, folder_aliases) \
        if classnames and len(classnames) == len(folders) else None
    if wnids and all(f.name in wnids for f in folders):
        labels = {f.name: wnids.index(f.name) for f in folders}
        names = classnames
    elif all(f.name.isdigit() for f in folders):
        # e.g. ImageNetV2's 0 … 999: the folder is the label
        labels = {f.name: int(f.name) for f in folders}
        names = classnames if classnames and len(classnames) > max(labels.values()) else None
    elif by_name is not None:
        # Folders named after the benchmark's classes ("ankle_boot", "T-shirt" …): each gets the
        # index of its own name, as wnid folders do. Sorted folder order is not the benchmark's
        # order (fashion-mnist).
        labels, names = by_name, classnames
    else:
        # Names that are not the benchmark's: the folders name their own classes. Taking the
        # benchmark's list by position because the counts agree would score a folder against another
        # class's prompt; a suite whose folders do follow that order can say so with `classnames:`.
        if classnames and len(classnames) == len(folders):
            logger.warning("%s: the class folders do not match the benchmark's %d class names; "
                           "using the folder names as class names (set classnames: in the suite "
                           "to use others)", base, len(classnames))
        labels = {f.name: i for i, f in enumerate(folders)}
        names = [f.name.replace("_", " ") for f in folders]
    # Regular files only: a FIFO among the images would block the reader forever.
    files = [(path, labels[f.name]) for f in folders for path in sorted(f.rglob("*"))
             if path.suffix.lower() in SOURCE_IMAGE_SUFFIXES and not path.name.startswith(".")
             and path.is_file()]
    items = [((lambda p=path: open_undecoded(p)), label) for path, label in files]
    return EvalData("classification", IndexedImages(items, transform), "imagefolder",
                    classnames=names, signature={"files": files_signature([p for p, _ in files])})


def _normalized(name: str) -> str:
    """A class name as folders spell it or as a list does: case, `_`, `-` and spacing ignored."""
    return " ".join(name.casefold().replace("_", " ").replace("-", " ").split())


def _match_names(folders: list[Path], classnames: list[str],
                 folder_aliases: dict[str, str] | None = None) -> dict[str, int] | None:
    """{folder: index of its class in `classnames`}, or None unless every folder names a distinct
    class, by its own name or by the benchmark's alias for it (FER2013's Kaggle `disgust/` holds
    "disgusted")."""
    index = {_normalized(n): i for i, n in enumerate(classnames)}
    if len(index) < len(classnames):
        # two classes that differ only in case or punctuation: ambiguous
        return None
    aliases = {_normalized(folder): _normalized(name)
               for folder, name in (folder_aliases or {}).items()}
    labels = {f.name: index.get(_normalized(f.name), index.get(aliases.get(_normalized(f.name))))
              for f in folders}
    if None in labels.values() or len(set(labels.values())) < len(labels):
        return None
    return labels


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Builds the dicts, lists, bytes and numpy arrays CIFAR's pickles hold, and nothing else."""
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as file:
            batch = _NumpyOnlyUnpickler(file, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        # truncated, or not CIFAR's
        raise UserError(f"{path} is not a CIFAR python pickle this reader accepts ({err}); "
                        "unpack the cifar-*-python.tar.gz from the CIFAR page again") from None
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in batch.items()}


def read_cifar(root: Path, split: str, transform, variant: str) -> EvalData:
    """CIFAR-10 (`cifar-10-batches-py/test_batch`) or CIFAR-100 (`cifar-100-python/test`)."""
    if split not in ("train", "test"):  # CIFAR-10 read its training batches for any other name
        raise UserError(f"{variant}'s python pickles hold the splits train and test, "
                        f"not {split!r}; set split: train or split: test")
    folder, files, meta, label_key, names_key = {
        "cifar10": ("cifar-10-batches-py",
                    ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)],
                    "batches.meta", "labels", "label_names"),
        "cifar100": ("cifar-100-python", [split], "meta", "fine_labels", "fine_label_names"),
    }[variant]
    base = root / folder if (root / folder).is_dir() else root
    paths = [base / name for name in files]
    if not all(p.is_file() for p in paths):
        raise MissingData(paths[0], f"{variant} python pickles")
    images, labels = [], []
    for path in paths:
        batch = _unpickle(path)
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                      .transpose(0, 2, 3, 1))
        labels.extend(int(label) for label in batch[label_key])
    pixels = np.concatenate(images)  # (N, 32, 32, 3)
    names = None
    if (base / meta).is_file():
        names = [n.decode() if isinstance(n, bytes) else n
                 for n in _unpickle(base / meta)[names_key]]
        names = [n.replace("_", " ") for n in names]
    items = [((lambda i=i: PIL.Image.fromarray(pixels[i])), label)
             for i, label in enumerate(labels)]
    return EvalData("classification", IndexedImages(items, transform), "cifar", classnames=names,
                    signature={"files": files_signature(paths)})


# torchvision's dataset classes for the test split of each benchmark they cover (download=False).
_TORCHVISION = {
    "mnist": ("MNIST", {"train": False}), "fashion-mnist": ("FashionMNIST", {"train": False}),
    "stl10": ("STL10", {"split": "test"}), "gtsrb": ("GTSRB", {"split": "test"}),
    "dtd": ("DTD", {"split": "test"}), "flowers": ("Flowers102", {"split": "test"}),
    "pets": ("OxfordIIITPet", {"split": "test"}), "food101": ("Food101", {"split": "test"}),
    "cars": ("StanfordCars", {"split": "test"}), "country211": ("Country211", {"split": "test"}),
    "fgvc_aircraft": ("FGVCAircraft", {"split": "test", "annotation_level": "variant"}),
    "fer2013": ("FER2013", {"split": "test"}), "pcam": ("PCAM", {"split": "test"}),
    "renderedsst2": ("RenderedSST2", {"split": "test"}), "eurosat": ("EuroSAT", {}),
    "caltech101": ("Caltech101", {}), "sun397": ("SUN397", {}),
}
# Where torchvision's label order is not the shipped class list's (CLIP_benchmark's, which reads
# these sets another way): torchvision label i is shipped class RELABEL[i]. FER2013: torchvision
# reads the CSV's emotion ids (angry, disgust, fear, happy, sad, surprise, neutral), CLIP_benchmark
# the Kaggle copy's class folders in sorted order (… happy, neutral, sad, surprised). Caltech101 is
# read apart (`_caltech101_items`).
_TORCHVISION_RELABEL = {"fer2013": (0, 1, 2, 3, 5, 6, 4)}


def _split_kwargs(class_name: str, kwargs: dict, split: str) -> dict:
    """The test-split kwargs of `_TORCHVISION` turned to `split`'s (CLIP_benchmark's #13: a split
    that is ignored gives the test set under another name)."""
    if "train" in kwargs:  # MNIST, FashionMNIST
        if split not in ("train", "test"):
            raise UserError(f"torchvision's {class_name} has the splits train and test, "
                            f"not {split!r}; set split: to one of them")
        return {**kwargs, "train": split == "train"}
    if "split" in kwargs:  # torchvision checks the name itself (a ValueError, caught by the caller)
        return {**kwargs, "split": split}
    if split != "test":  # EuroSAT, Caltech101, SUN397 come as one set
        raise UserError(f"torchvision's {class_name} has no splits (it reads the whole set), so "
                        f"split {split!r} cannot be read; leave split: test, or use format wds / "
                        "imagefolder")
    return kwargs


def read_torchvision(name: str, root: Path, transform, split: str = "test") -> EvalData:
    import torchvision.datasets
    if name not in _TORCHVISION:
        raise MissingData(root, f"a reader for {name!r} (torchvision has none here; use format wds "
                                "or imagefolder)")
    class_name, kwargs = _TORCHVISION[name]
    kwargs = _split_kwargs(class_name, kwargs, split)
    reader = getattr(torchvision.datasets, class_name)
    # FER2013 never downloads and takes no download argument (passing one was a TypeError).
    offline = ({"download": False} if "download" in inspect.signature(reader.__init__).parameters
               else {})
    try:
        dataset = reader(str(root), **offline, **kwargs)
    except ValueError as err:
        # verify_str_arg: "Unknown value 'tset' for argument split. Valid values are ..."
        raise UserError(f"{name}: split {split!r}: {' '.join(str(err).split())}") from None
    except (RuntimeError, FileNotFoundError, OSError) as err:  # torchvision's "Dataset not found"
        raise MissingData(root, f"torchvision {class_name} files "
                                f"({' '.join(str(err).split())[:120]})") from None

    def load(i: int) -> PIL.Image.Image:
        image = dataset[i][0]
        return to_l_or_rgb(image if isinstance(image, PIL.Image.Image)
                           else PIL.Image.fromarray(np.asarray(image)))

    if name == "caltech101":  # read apart: torchvision drops BACKGROUND_Google, the shipped class 0
        items = _caltech101_items(Path(dataset.root))
    else:
        targets = _torchvision_targets(dataset)
        if targets is None:
            # PCam: its labels sit in an HDF5 file beside the images, read per index
            targets = [dataset[i][1] for i in range(len(dataset))]
        if any(t is None for t in targets):
            # FER2013 read from Kaggle's test.csv, which has no labels
            raise UserError(f"{name}: torchvision's {class_name} found no labels for split "
                            f"{split!r} in {root}; it reads test labels only from fer2013.csv or "
                            f"icml_face_data.csv: put one of them in {root / 'fer2013'}")
        relabel = _TORCHVISION_RELABEL.get(name)
        items = [((lambda i=i: load(i)), relabel[int(t)] if relabel else int(t))
                 for i, t in enumerate(targets)]
    files = sorted(p for p in root.rglob("*") if p.is_file())[:10_000]
    return EvalData("classification", IndexedImages(items, transform), "torchvision",
                    # The split's kwargs too: caches written when the split was ignored (the test
                    # set under a split: train key) are not met again. "labels": caches of FER2013
                    # and Caltech101 written with torchvision's label order hold other targets.
                    signature={"files": files_signature(files), "class": class_name,
                               "kwargs": kwargs, "labels": "shipped order"})


def _torchvision_targets(dataset) -> Sequence | None:
    """The labels a torchvision dataset keeps beside its images, read without decoding an image:
    each dataset names them its own way (`targets`, `_labels`, `y`, STL10's `labels`, or the second
    half of `_samples`' (image, label) pairs: GTSRB, Rendered SST2, FER2013, Cars). None where it
    keeps none."""
    for attr in ("targets", "_labels", "y", "labels"):
        value = getattr(dataset, attr, None)
        if value is not None:  # a tensor or array has no truth value
            return value
    samples = getattr(dataset, "_samples", None)
    if isinstance(samples, list) and all(isinstance(s, tuple) and len(s) == 2 for s in samples):
        return [target for _, target in samples]
    return None


def _caltech101_items(root: Path) -> list[tuple[Callable[[], PIL.Image.Image], int]]:
    """Caltech101 as CLIP_benchmark reads it, whose 102 class names the package ships: every folder
    of 101_ObjectCategories in sorted order, BACKGROUND_Google ("background", label 0) included.
    torchvision's reader drops that folder, so its labels were one below the shipped names' (every
    image scored against the previous class's prompt) and the background images went unread."""
    folders = sorted(p for p in (root / "101_ObjectCategories").iterdir() if p.is_dir())
    return [((lambda p=path: open_undecoded(p)), label)
            for label, folder in enumerate(folders) for path in sorted(folder.glob("*.jpg"))]


def read_karpathy(root: Path, split: str, transform, annotations: str = "") -> EvalData:
    """Karpathy-split retrieval: the JSON's images of `split` with their sentences' raw text."""
    candidates = [Path(annotations)] if annotations else \
        [root / "dataset_coco.json", root / "dataset_flickr30k.json",
         root / "dataset_flickr8k.json"]
    ann = next((p for p in candidates if p.is_file()), None)
    if ann is None:
        raise MissingData(candidates[0], "Karpathy split annotations")
    images = [im for im in json.loads(ann.read_text())["images"] if im.get("split") == split]
    items, paths = [], []
    for im in images:
        for path in (root / im.get("filepath", "") / im["filename"],
                     root / "images" / im["filename"],
                     root / "flickr30k-images" / im["filename"]):
            if path.is_file():
                break
        # One line per sentence, each ended by a newline: an empty sentence stays an (empty) line
        # that the suite counts, also when it is the image's only one ("\n".join([""]) would be no
        # line).
        captions = "".join(f"{s['raw'].strip()}\n" for s in im["sentences"])
        items.append(((lambda p=path: open_undecoded(p)), captions))
        paths.append(path)
    if not items or not paths[0].is_file():
        raise MissingData(paths[0] if paths else root, f"{split} images of {ann.name}")
    return EvalData("retrieval", IndexedImages(items, transform), "karpathy",
                    signature={"files": files_signature([ann] + [p for p in paths if p.is_file()]),
                               "images": len(items)})


def _holds_class_folders(root: Path) -> bool:
    """Two or more subfolders with images directly inside: ROOT/CLASS/*.png. torchvision's own roots
    hold one dataset folder (FashionMNIST/, oxford-iiit-pet/, dtd/ …) with its images further
    down."""
    found = 0
    for folder in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found += any(f.suffix.lower() in SOURCE_IMAGE_SUFFIXES for f in folder.iterdir())
        if found >= 2:
            return True
    return False


def detect_format(root: Path, split: str, name: str = "") -> str:
    if (root / split / NSHARDS_FILE).is_file() or any((root / split).glob("*.tar")):
        return "wds"
    if name in _TORCHVISION and not (root / split).is_dir() and not _holds_class_folders(root):
        # torchvision's own folders (oxford-iiit-pet/, dtd/ …) are not class folders
        return "torchvision"
    if (root / "cifar-10-batches-py").is_dir() or (root / "cifar-100-python").is_dir():
        return "cifar"
    karpathy_files = ("dataset_coco.json", "dataset_flickr30k.json", "dataset_flickr8k.json")
    if any((root / name).is_file() for name in karpathy_files):
        return "karpathy"
    base = root / split if (root / split).is_dir() else root
    if base.is_dir() and any(p.is_dir() for p in base.iterdir()):
        return "imagefolder"
    return "torchvision"


def read_benchmark(name: str, root: str | Path, split: str, transform, format: str = "auto",
                   classnames: list[str] | None = None, wnids: list[str] | None = None,
                   annotations: str = "", task: str = "",
                   folder_aliases: dict[str, str] | None = None) -> EvalData:
    """The reader for `format` (or the one the files on disk call for) over ROOT/SPLIT.

    `task` overrides what a webdataset's dataset_type.txt says (or stands in for it when absent)."""
    root = Path(root)
    if not root.exists():
        raise MissingData(root, f"{name} data folder")
    others = (sorted(p.parent.name for p in root.glob(f"*/{NSHARDS_FILE}"))
              if not (root / split).exists() else [])
    if others and format in ("auto", "wds"):
        # e.g. imagenet1k: ImageFolder copies call ImageNet's labelled images val, CLIP_benchmark's
        # export (clip-benchmark/wds_imagenet1k) calls them test. Another split is never read in its
        # place.
        raise MissingData(root / split,
                          f"split {split!r} (webdataset split{'s' if len(others) > 1 else ''} "
                          f"here: {', '.join(others)}; set split: {others[0]} for {name} "
                          "in the suite)")
    format = detect_format(root, split, name) if format == "auto" else format
    if format == "wds":
        return read_wds(root, split, transform, task)
    if format == "imagefolder":
        return read_image_folder(root, split, transform, classnames, wnids, folder_aliases)
    if format == "cifar":
        # The folder says which CIFAR it is when the name does not (a benchmark of the user's own
        # name).
        only_cifar100 = ((root / "cifar-100-python").is_dir()
                         and not (root / "cifar-10-batches-py").is_dir())
        variant = ("cifar100" if name == "cifar100" or (name != "cifar10" and only_cifar100)
                   else "cifar10")
        return read_cifar(root, split, transform, variant)
    if format == "karpathy":
        return read_karpathy(root, split, transform, annotations)
    if format == "torchvision":
        return read_torchvision(name, root, transform, split)
    raise ValueError(f"unknown format {format!r}")
