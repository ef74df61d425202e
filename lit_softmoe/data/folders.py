"""A folder of images as samples (`lit-softmoe data from-folder`): captioned images or class
folders.

- captions: each image with a same-stem `.txt` caption beside it (img2dataset's output,
  `00000/000000001.jpg` + `00000/000000001.txt`);
- classes: one subfolder per class (torchvision's ImageFolder: `cat/1.jpg`, `dog/1.jpg`), numbered
  in sorted folder-name order as ImageFolder numbers them, each class named by its folder, or by
  ImageNet's class name where the folders are ImageNet wnids (`data.imagenet_folders`); with caption
  templates, each sample also gets a caption from its class name (`data.captions`), so the set can
  train a text tower.
"""
from __future__ import annotations

import os
import unicodedata
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Mapping, Sequence

from lit_softmoe.data.captions import class_caption
from lit_softmoe.data.imagenet_folders import CLASS_NAMES, imagenet_classnames
from lit_softmoe.data.listing import (
    Candidate,
    Listing,
    drop_duplicate_keys,
    files_fingerprint,
    in_shuffled_order,
    sample_key,
)
from lit_softmoe.data.shards import class_name_difference, class_name_key
from lit_softmoe.data.tar_reading import BadSampleCounter
from lit_softmoe.errors import UserError, setting
from lit_softmoe.metadata import check_templates

LAYOUTS = ("auto", "captions", "classes")
# Files read as images; anything else in a folder (img2dataset's .json, a README) is not a sample.
SOURCE_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _walk_files(src: Path, exclude: Path | None) -> list[PurePosixPath]:
    """Every non-hidden file under `src` as a relative path, sorted by path parts (not by string:
    `a/x` comes before `a-b/y`, as a tree listing shows them).

    Linked folders are followed, as ImageFolder follows them (a class folder is often a link into a
    bigger dataset; skipping it dropped its images uncounted and renumbered the other classes); a
    link to a folder already on its own path would loop, so it is not entered.
    """
    found = []
    on_path = {src: {src.resolve()}}  # folder → the real folders from `src` down to it
    for root, dirs, files in os.walk(src, followlinks=True):
        root_path = Path(root)
        above = on_path.pop(root_path)
        kept = []
        for name in dirs:
            real = (root_path / name).resolve()
            if not name.startswith(".") and real != exclude and real not in above:
                on_path[root_path / name] = above | {real}
                kept.append(name)
        dirs[:] = kept
        relative_root = PurePosixPath(root_path.relative_to(src).as_posix())
        found.extend(relative_root / name for name in files if not name.startswith("."))
    return sorted(found, key=lambda path: path.parts)


def _detect_layout(src: Path, images: list[PurePosixPath],
                   caption_stems: set[PurePosixPath]) -> str:
    if any(image.with_suffix("") in caption_stems for image in images):
        return "captions"
    if any(len(image.parts) > 1 for image in images):
        return "classes"
    raise UserError(f"{src} holds {len(images)} images but no .txt caption beside any (x.jpg + "
                    "x.txt) and no class subfolders; add captions, sort the images into one folder "
                    "per class, or use `lit-softmoe data from-table` with a caption column")


def list_folder(src: str | Path, layout: str = "auto", exclude: str | Path | None = None,
                caption_templates: Sequence[str] | None = None, class_names: str = "auto", *,
                setting_names: Mapping[str, str] | None = None) -> Listing:
    """The samples of a folder; `layout` is "captions", "classes" or "auto".

    Captions layout: the key is the file stem (img2dataset's numbered subfolders only bucket
    unique keys), so the same stem in two subfolders is a duplicate_key; an image with no caption
    is missing_caption, a caption with no image is missing_image. Classes layout: the key is the
    path from the class folder down, so `cat/1.jpg` and `dog/1.jpg` are both kept; images lying
    beside the class folders are outside_class_folder. `class_names` "auto" names classes whose
    folders are ImageNet wnids by ImageNet's class names (`data.imagenet_folders`), "folders" keeps
    every folder's name. `caption_templates` (`{c}` templates, classes layout only) give each sample
    a caption from its class name, the template cycled along each class's images in path order
    (`data.captions.class_caption`).
    Captioned images are listed in path order, class folders' images in a seeded random order
    (`data.listing.in_shuffled_order`: in path order every shard would hold one class).
    `setting_names`: what messages call the parameters, {parameter: the caller's name}
    (`errors.setting`).
    """
    src = Path(src)
    if not src.exists():
        raise UserError(f"source folder {src} not found; pass a folder of images")
    if not src.is_dir():
        raise UserError(f"{src} is not a folder; for a table use "
                        f"`lit-softmoe data from-table {src} …`")
    if layout not in LAYOUTS:
        raise UserError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if class_names not in CLASS_NAMES:
        raise UserError(f"unknown class names {class_names!r}; choose one of "
                        f"{', '.join(CLASS_NAMES)}")
    if caption_templates is not None:
        caption_templates = list(caption_templates)
        check_templates(caption_templates, "caption templates")
        _check_not_captions(src, layout, setting_names)
    # The output folder may lie inside the source: its files are not inputs.
    exclude = Path(exclude).resolve() if exclude is not None else None
    files = _walk_files(src, exclude)  # compared to real paths: the output may lie behind a link
    images = [path for path in files if path.suffix.lower() in SOURCE_IMAGE_SUFFIXES]
    captions = {path.with_suffix(""): path for path in files if path.suffix.lower() == ".txt"}
    if not images:
        raise UserError(f"no image files ({', '.join(SOURCE_IMAGE_SUFFIXES)}) in {src}; "
                        "pass the folder holding them")
    if layout == "auto":
        layout = _detect_layout(src, images, set(captions))
        if caption_templates is not None:
            _check_not_captions(src, layout, setting_names, detected=True)
    counter = BadSampleCounter()
    classnames, note = None, None
    if layout == "captions":
        candidates = _caption_candidates(src, images, captions, counter)
    else:
        # From the images, not the listing of `src`: an excluded output folder is not a class.
        folders = sorted({image.parts[0] for image in images if len(image.parts) > 1})
        _check_classnames(src, folders)
        _check_no_empty_class_folders(src, folders, exclude)
        found = imagenet_classnames(src, folders, setting_names) if class_names == "auto" else None
        classnames, note = found if found is not None else (folders, None)
        candidates = _class_candidates(src, images, folders, classnames, counter)
    read = images + (list(captions.values()) if layout == "captions" else [])
    fingerprint = files_fingerprint((str(path), src / path) for path in read)
    candidates = drop_duplicate_keys(candidates, counter)
    if caption_templates is not None:
        # The i-th image of a class in path order (after the duplicates went) gets template i mod T:
        # every template in equal shares (±1) within each class, whatever order the samples are
        # written in.
        seen = Counter()
        for candidate in candidates:
            candidate.caption = class_caption(caption_templates, candidate.meta["class"],
                                              seen[candidate.label])
            seen[candidate.label] += 1
    if layout == "classes":  # one class after another otherwise: see `in_shuffled_order`
        candidates = in_shuffled_order(candidates)
    return Listing(candidates, counter, fingerprint, classnames, caption_templates, note)


def _check_not_captions(src: Path, layout: str, names: Mapping[str, str] | None,
                        detected: bool = False) -> None:
    """Caption templates name classes: a captions-layout folder has none (and captions of its
    own)."""
    if layout == "captions":
        found = " (found .txt captions beside its images)" if detected else ""
        raise UserError(f"caption templates write captions from class folder names, but {src} is "
                        f"read in the captions layout{found}; pass "
                        f"{setting(names, 'layout', 'classes')}, or drop "
                        f"{setting(names, 'caption_templates')} to keep the .txt captions")


def _check_classnames(src: Path, classnames: list[str]) -> None:
    """classnames.txt holds one name per line: a folder name with a newline (or another control
    character) would shift every later class onto another's name, and a blank one is refused by its
    readers. Two names that are one (`shards.class_name_difference`: `café` composed and decomposed,
    `cat` and `cat `, `Cat` and `cat`) would be two classes with identical prompts."""
    seen: dict[str, str] = {}
    for name in classnames:
        if not name.strip():
            raise UserError(f"class folder {name!r} in {src} has a blank name, which "
                            "classnames.txt (one class name per line) cannot hold; "
                            "rename the folder")
        if any(unicodedata.category(char) in ("Cc", "Zl", "Zp") for char in name):
            raise UserError(f"class folder {name!r} in {src} has a control character or line break "
                            "in its name, which classnames.txt (one class name per line) cannot "
                            "hold; rename the folder")
        other = seen.setdefault(class_name_key(name), name)
        if other != name:
            how = class_name_difference(other, name)
            raise UserError(f"class folders {ascii(other)} and {ascii(name)} in {src} are one name "
                            f"{how} ({name.strip()!r}), which would be two classes with the same "
                            "prompts; merge them into one folder or rename one")


def _check_no_empty_class_folders(src: Path, folders: list[str], exclude: Path | None) -> None:
    """A folder without images is no class of the listing: dropped, it would renumber every later
    class against the user's folder list. Refused, as torchvision's ImageFolder refuses it; but a
    folder of shards (an earlier `--out` inside the source: `.tar` files in it or its splits) is not
    a class."""
    real_src = src.resolve()
    empty = sorted(entry.name for entry in os.scandir(src)
                   if entry.is_dir() and not entry.name.startswith(".")
                   and entry.name not in folders
                   and Path(entry.path).resolve() not in (exclude, real_src)
                   and not any(Path(entry.path).glob("*.tar"))
                   and not any(Path(entry.path).glob("*/*.tar")))
    if empty:
        raise UserError(f"class folder{'s' if len(empty) > 1 else ''} "
                        f"{', '.join(map(repr, empty))} in {src} "
                        f"hold{'' if len(empty) > 1 else 's'} no image files "
                        f"({', '.join(SOURCE_IMAGE_SUFFIXES)}); add images, or move "
                        f"{'them' if len(empty) > 1 else 'it'} out of {src}")


def _caption_candidates(src: Path, images: list[PurePosixPath],
                        captions: dict[PurePosixPath, PurePosixPath],
                        counter: BadSampleCounter) -> list[Candidate]:
    candidates, captioned = [], set()
    for image in images:
        caption = captions.get(image.with_suffix(""))
        if caption is None:
            counter.skip("missing_caption",
                         f"{image} has no {image.with_suffix('.txt').name} beside it")
            continue
        captioned.add(caption)
        candidates.append(Candidate(sample_key(image.stem), str(image), src / image, src / caption))
    for caption in captions.values():
        if caption not in captioned:
            counter.skip("missing_image", f"{caption} has no image beside it")
    return candidates


def _class_candidates(src: Path, images: list[PurePosixPath], folders: list[str],
                      classnames: list[str], counter: BadSampleCounter) -> list[Candidate]:
    """Candidates of the images in class folders: label = the folder's place in `folders`, "class"
    its name in `classnames` (the folder's own, or ImageNet's for a wnid)."""
    label_of = {name: label for label, name in enumerate(folders)}
    candidates = []
    for image in images:
        if len(image.parts) == 1:
            counter.skip("outside_class_folder",
                         f"{image} lies beside the class folders, not in one")
            continue
        label = label_of[image.parts[0]]
        candidates.append(Candidate(sample_key(image.with_suffix("")), str(image), src / image,
                                    None, label=label, meta={"class": classnames[label]}))
    return candidates
