"""Captions written from class names, so a class-labelled image set can train a text tower (LiT from
labelled data: Zhai et al., 2022, train on such prompts as CLIP's zero-shot classifier is built from
them). `data fashion-mnist` and `data from-folder --layout classes --caption-templates` both write
their `.txt` captions with `class_caption`.

A caption is one of a list of `{c}` templates (the placeholder this package's metadata and
CLIP_benchmark use) filled with the sample's class name. The template is cycled: the i-th image of a
class in path order gets template i mod T (`data from-folder`; `data fashion-mnist` counts along the
split in the set's own order). Cycled rather than drawn by a hash of the sample key, because a class
then gets every template in equal shares (±1) and as many different ones as it has images, where a
hash repeats some and skips others; and the same input gives the same captions, so a rerun writes
the same bytes. The price, that adding an image shifts the captions after it in its class, costs
nothing here: any change to the inputs rewrites the whole split anyway.

The built-in set (`--caption-templates default`) is CLIP's 80 ImageNet templates (shipped in
`metadata/templates.json` as `imagenet1k`, with its source in SOURCES.md): a published set written
for any kind of object, not for one dataset (Fashion-MNIST's own captions say "grayscale"), whose
80 wordings vary the sentence so the text tower learns the class name rather than one sentence.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lit_softmoe.data.shards import read_lines
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import benchmark_info, check_templates

DEFAULT_TEMPLATES = "default"
_DEFAULT_SET = "imagenet1k"  # CLIP's 80 ImageNet templates
_HINT = (f"give a file with one template per line writing the class name as {{c}} "
         f"(e.g. 'a photo of a {{c}}.'), `{DEFAULT_TEMPLATES}` (CLIP's 80 ImageNet templates) or a "
         "benchmark's name such as cifar10")


def load_caption_templates(spec: str | Path) -> list[str]:
    """The `{c}` templates `spec` names, checked: a file with one per line, `default`, or a shipped
    benchmark's name (its zero-shot templates, e.g. `cifar10`); a file of that name comes first."""
    path = Path(spec)
    if path.is_file():
        try:
            templates, source = read_lines(path), str(path)
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read the caption templates file {path} ({err}); "
                            f"{_HINT}") from None
    elif path.is_dir():
        raise UserError(f"caption templates {path} is a folder; {_HINT}")
    else:
        name = _DEFAULT_SET if str(spec) == DEFAULT_TEMPLATES else str(spec)
        try:
            info = benchmark_info(name)
        except UserError:
            info = None
        if info is None or not info.templates:
            raise UserError(f"caption templates {str(spec)!r}: no such file, and not a shipped "
                            f"template set; {_HINT}")
        templates, source = (list(info.templates),
                             f"{spec} (shipped templates of {info.templates_from})")
    check_templates(templates, f"caption templates {source}")
    return templates


def class_caption(templates: Sequence[str], classname: str, position: int) -> str:
    """The caption of the sample at `position` (see the module docstring), whose class is
    `classname`."""
    return templates[position % len(templates)].format(c=classname)
