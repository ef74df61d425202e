"""Zero-shot classifiers as pure functions (as open_clip's `zero_shot_classifier.py` and
big_vision's evaluator do): every (class, template) prompt is encoded, the normalized embeddings of
one class are averaged over its templates and renormalized, giving a (D, C) matrix; an image's
logits are its normalized embedding times that matrix.

All prompts go through the text tower in large batches (not one class per forward pass, the
slowness CLIP_benchmark's users report).

Templates write the class name as `{c}`, as CLIP_benchmark's template files and this package's
metadata do (OpenAI CLIP's and big_vision's lists write `{}`: replace it with `{c}`);
`metadata.check_templates` says so (it lives there because the data writers check caption templates
too).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lit_softmoe.metadata import check_templates


@torch.no_grad()
def build_zeroshot_classifier(encode_text: Callable[[torch.Tensor], torch.Tensor], tokenizer,
                              classnames: Sequence[str], templates: Sequence[str],
                              batch_size: int = 1024, device=None) -> torch.Tensor:
    """(D, C) classifier: column c is the renormalized mean of class c's prompt embeddings."""
    check_templates(templates)
    prompts = [template.format(c=name) for name in classnames for template in templates]  # C·T
    embeddings = []
    for start in range(0, len(prompts), batch_size):
        ids = tokenizer(prompts[start:start + batch_size])
        embeddings.append(F.normalize(encode_text(ids.to(device)).float(), dim=-1))
    per_prompt = torch.cat(embeddings).view(len(classnames), len(templates), -1)  # (C, T, D)
    return F.normalize(per_prompt.mean(dim=1), dim=-1).T  # (D, C)
