"""An export's weights on disk: each tensor stored once, in the files and under the names its
config.json records (`"weights"`: {file name: "open_clip" | "lit_softmoe"}), read back under
LiTModel's names.

Two layouts, one copy of the weights in each:

- open_clip's (a pair open_clip can load): `open_clip_model.safetensors` holds every tensor under
  the names of open_clip's `CustomTextCLIP` (`visual.trunk.*` = our `image_tower.*`,
  `visual.head.proj.*` = our `image_head.*`, `text.*` = our `text_tower.transformer.*`,
  `logit_scale`, `logit_bias`), because `open_clip.create_model_and_transforms("local-dir:EXPORT")`
  loads that file strictly (every key its model has, no other) and reads no other.
  `image_tower_extra.safetensors`, under our names, holds what open_clip's model has no place for:
  the pretraining class head (`image_tower.head.*`), and a gray tower's own 1-channel patch
  embedding, which open_clip's file holds widened to RGB (a derived tensor, 3 × d·p·p numbers: the
  original cannot be recovered from it bit for bit). Our tensors take precedence over the open_clip
  forms of the same name.
- ours (a Hugging Face text tower, a Tokens Choice tower, an image tower alone, `--no-open-clip`):
  `image_encoder.safetensors` (`image_tower.*`, `image_head.*`) + `text_encoder.safetensors` (the
  rest).

`ExportWeights` reads either one tensor at a time, so a paper-scale tower is never held twice (nor
whole, to hash it).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lit_softmoe.errors import UserError

IMAGE_WEIGHTS, TEXT_WEIGHTS = "image_encoder.safetensors", "text_encoder.safetensors"
OPEN_CLIP_WEIGHTS, IMAGE_EXTRA_WEIGHTS = ("open_clip_model.safetensors",
                                          "image_tower_extra.safetensors")
# the names either layout uses
WEIGHTS_FILES = (OPEN_CLIP_WEIGHTS, IMAGE_EXTRA_WEIGHTS, IMAGE_WEIGHTS, TEXT_WEIGHTS)
OURS, OPEN_CLIP = "lit_softmoe", "open_clip"  # the names a weights file holds its tensors under
# Our name prefix → open_clip's CustomTextCLIP's; names under neither (logit_scale, logit_bias) are
# the same.
OPEN_CLIP_PREFIXES = (("image_tower.", "visual.trunk."), ("image_head.", "visual.head.proj."),
                      ("text_tower.transformer.", "text."))


def open_clip_name(name: str) -> str:
    """A LiTModel tensor's name in open_clip's CustomTextCLIP."""
    for ours, theirs in OPEN_CLIP_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def our_name(name: str) -> str:
    """An open_clip CustomTextCLIP tensor's name in LiTModel."""
    for ours, theirs in OPEN_CLIP_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}: {err}); the folder is "
                        "incomplete or damaged: copy it again or write it anew") from None


class ExportWeights(Mapping):
    """The tensors of an export's weights `files` ({file name: OURS | OPEN_CLIP}) under LiTModel's
    names, those starting with `prefix` under their names without it; each read from its file when
    asked for.

    Opening reads the files' headers only: a file missing or truncated is one UserError line naming
    it.
    """

    def __init__(self, folder: str | Path, files: Mapping[str, str], prefix: str = ""):
        self._files = {name: _open(Path(folder) / name) for name in files}
        # our name without prefix → (file, name stored under)
        self._where: dict[str, tuple[str, str]] = {}
        # ours last: they take precedence (a gray tower's own patch embedding)
        for ordering in (OPEN_CLIP, OURS):
            for file, names in files.items():
                if names != ordering:
                    continue
                for stored in self._files[file].keys():
                    name = our_name(stored) if names == OPEN_CLIP else stored
                    if name.startswith(prefix):
                        self._where[name[len(prefix):]] = (file, stored)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, stored = self._where[name]
        return self._files[file].get_tensor(stored)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def stored_as(self, name: str) -> tuple[str, str]:
        """(file, name in it) of the tensor `name`."""
        return self._where[name]


def load_export_weights(folder: str | Path, files: Mapping[str, str],
                        prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of an export (those starting with `prefix`, without it) under LiTModel's names,
    upcast to fp32 (bf16/fp16 exports upcast exactly)."""
    weights = ExportWeights(folder, files, prefix)
    return {name: (tensor.float() if tensor.is_floating_point() else tensor)
            for name, tensor in ((name, weights[name]) for name in weights)}
