"""Class folders named by ImageNet WordNet ids (`n01440764/`, … as ImageNet's train and val folders,
ImageNet-V2, -R and -A come), read under the shipped ImageNet class names instead of the ids.

The classes stay in sorted folder order, as ImageFolder numbers them. ImageNet-1k's label order is
the sorted order of its 1,000 wnids (`metadata.imagenet_wnids`), so for all 1,000 folders `.cls` is
the standard ImageNet label index (0 tench, 1 goldfish, …, 207 golden retriever) and classnames.txt
is the shipped ImageNet list (`benchmark_info("imagenet1k").classnames`); for a subset of the
wnids, the subset's sorted order, each named as ImageNet names it. Names rather than ids because
they are what captions and zero-shot prompts need: "a photo of a tench.", not "a photo of a
n01440764.".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from lit_softmoe.errors import UserError, setting
from lit_softmoe.metadata import benchmark_info, imagenet_wnids

# class_names: ImageNet's names for wnid folders (auto), or the folders' own.
CLASS_NAMES = ("auto", "folders")
_WNID = re.compile(r"n\d{8}")


def imagenet_classnames(src: Path, folders: list[str],
                        setting_names: Mapping[str, str] | None = None
                        ) -> tuple[list[str], str] | None:
    """(the ImageNet class names of `folders`, in their order; one line saying so), or None when the
    folders are not all wnids (a folder with another name, or no wnid ImageNet-1k knows: an
    ImageNet-21k set keeps its folder names). Known and unknown wnids mixed are one error line:
    the unknown ones would otherwise keep their ids among names. The error and the note name the
    fix as `setting_names` calls `class_names` (`errors.setting`; the CLI passes --class-names)."""
    keep_folders = setting(setting_names, "class_names", "folders")
    if not folders or not all(_WNID.fullmatch(name) for name in folders):
        return None
    index_of = {wnid: index for index, wnid in enumerate(imagenet_wnids())}
    unknown = [name for name in folders if name not in index_of]
    if len(unknown) == len(folders):
        return None
    if unknown:
        known, other = len(folders) - len(unknown), len(unknown)
        raise UserError(f"{src} holds {known} ImageNet-1k class folder{'s' * (known != 1)} "
                        f"(WordNet ids) and {other} wnid-named folder{'s' * (other != 1)} that "
                        f"ImageNet-1k does not have, e.g. {unknown[0]!r}; remove or rename "
                        f"{'those' if other != 1 else 'it'}, or pass {keep_folders} to keep every "
                        "folder's name as its class name")
    names = benchmark_info("imagenet1k").classnames
    classnames = [names[index_of[name]] for name in folders]
    if len(folders) == len(names):
        note = (f"class folders are ImageNet-1k's {len(names)} WordNet ids: classnames.txt holds "
                "the shipped ImageNet class names and .cls the standard ImageNet label index")
    else:
        note = (f"class folders are {len(folders)} of ImageNet-1k's WordNet ids: classnames.txt "
                "holds their shipped ImageNet class names, numbered in sorted wnid order")
    return classnames, f"{note} ({keep_folders} keeps the folder names)"
