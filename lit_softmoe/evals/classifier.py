"""Zero-shot classifiers as pure functions (as open_clip's `zero_shot_classifier.py` and big_vision's
evaluator do): every (class, template) prompt is encoded, the normalized embeddings of one class
are averaged over its templates and renormalized, giving a (D, C) matrix; an image's logits are its
normalized embedding times that matrix.

All prompts go through the text tower in large batches (not one class per forward pass, the
slowness CLIP_benchmark's users report).

Templates write the class name as `{c}`, as CLIP_benchmark's template files and this package's
metadata do (OpenAI CLIP's and big_vision's lists write `{}`: replace it with `{c}`).
"""
from __future__ import annotations

import string
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lit_softmoe.errors import UserError


def check_templates(templates: Sequence[str], source: str = "templates") -> None:
    """Raise a UserError naming the first template that does not put the class name in as `{c}`.

    Checked up front, since a bad template otherwise fails only when the classifier is built (for
    LiT: after training), and one without a placeholder gives every class the same prompt.
    """
    if not templates:
        raise UserError(f"{source} holds no templates; give one prompt per line, such as 'a photo of a {{c}}.'")
    for template in templates:
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
        except ValueError as err:  # a lone brace
            problem = f"is not a format string ({err})"
        else:
            others = [field for field in fields if field != "c"]
            if others:
                problem = f"has the placeholder {{{others[0]}}}"
            elif not fields:
                problem = "has no {c}, so every class would get the same prompt"
            else:
                continue
        raise UserError(f"{source}: template {template!r} {problem}; write the class name as {{c}}, "
                        "e.g. 'a photo of a {c}.' (a literal brace as {{ or }})")


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
