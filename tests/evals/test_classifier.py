"""lit_softmoe.evals.classifier: the zero-shot classifier as a pure function, on a toy text encoder whose
right answers are known by construction, and the template checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier
from lit_softmoe.evals.classifier import check_templates

CLASSNAMES = ["cat", "dog", "bird"]
TEMPLATES = ["a photo of a {c}.", "a drawing of a {c}.", "my {c}!", "{c}"]
C, T = len(CLASSNAMES), len(TEMPLATES)


class ToyText:
    """A tokenizer + text encoder pair: a prompt's ids are (class index, template index), found by
    reading the prompt back, and its embedding is `vector(class, template)`."""

    def __init__(self, vector):
        self.vector = vector
        self.prompts: list[str] = []
        self.batch_sizes: list[int] = []

    def tokenizer(self, prompts: list[str]) -> torch.Tensor:
        self.prompts += prompts
        ids = [[c, t] for prompt in prompts for c, name in enumerate(CLASSNAMES) for t, template in
               enumerate(TEMPLATES) if template.format(c=name) == prompt]
        assert len(ids) == len(prompts), "a prompt that no (class, template) pair makes"
        return torch.tensor(ids)  # (B, 2)

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(len(ids))
        return torch.stack([self.vector(int(c), int(t)) for c, t in ids])  # (B, D), not normalized


def test_columns_are_the_normalized_class_vectors():
    # Every template of class c embeds to a positive multiple of v_c (scale 1, 2, 3, 4):
    # normalizing each prompt before averaging makes the column exactly v_c / |v_c|.
    class_vectors = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0], [-1.0, 0.0, 0.0, 2.0]])
    toy = ToyText(lambda c, t: (t + 1) * class_vectors[c])
    classifier = build_zeroshot_classifier(toy.encode_text, toy.tokenizer, CLASSNAMES, TEMPLATES)
    assert classifier.shape == (4, C)  # (D, C)
    torch.testing.assert_close(classifier, F.normalize(class_vectors, dim=-1).T)
    assert toy.prompts == [t.format(c=c) for c in CLASSNAMES for t in TEMPLATES]  # each prompt once


def _onehot(i: int, dim: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(i), dim).float()


def test_templates_are_averaged_after_normalization_then_renormalized():
    # Prompt (c, t) → s_t · (e_c + e_{C+t}): a class direction plus a template direction, scaled by
    # 10 for the first template (a longer embedding must not outweigh the others). Each normalized
    # prompt is (e_c + e_{C+t}) / √2; their mean over T templates, renormalized, is
    # (e_c + Σ_t e_{C+t} / T) / √(1 + 1/T).
    dim = C + T
    toy = ToyText(lambda c, t: (10.0 if t == 0 else 1.0) * (_onehot(c, dim) + _onehot(C + t, dim)))
    classifier = build_zeroshot_classifier(toy.encode_text, toy.tokenizer, CLASSNAMES, TEMPLATES)
    template_mean = sum(_onehot(C + t, dim) for t in range(T)) / T
    expected = torch.stack([(_onehot(c, dim) + template_mean) / math.sqrt(1 + 1 / T) for c in range(C)]).T
    torch.testing.assert_close(classifier, expected)
    torch.testing.assert_close(classifier.norm(dim=0), torch.ones(C))


@pytest.mark.parametrize("template, problem", [
    ("a photo of a {}.", "has the placeholder {}"),  # OpenAI CLIP's and big_vision's lists
    ("a photo of a {classname}.", "has the placeholder {classname}"),
    ("a photo of a {0}.", "has the placeholder {0}"),
    ("a photo.", "has no {c}"),  # every class would get the same prompt
    ("a {c} in {braces}", "has the placeholder {braces}"),
    ("a {c", "is not a format string"),
    ("a } {c}", "is not a format string"),
])
def test_a_template_without_c_for_the_class_name_is_a_user_error(template, problem):
    toy = ToyText(lambda c, t: _onehot(c, C))
    with pytest.raises(UserError) as err:
        build_zeroshot_classifier(toy.encode_text, toy.tokenizer, CLASSNAMES, [TEMPLATES[0], template])
    message = str(err.value)
    assert f"template {template!r} {problem}" in message and "write the class name as {c}" in message
    assert not toy.prompts  # refused before anything was encoded
    with pytest.raises(UserError, match="my_templates.txt holds no templates"):
        check_templates([], "my_templates.txt")


def test_literal_braces_and_repeated_c_are_fine():
    check_templates(["a {c}.", "a {{literal}} {c}", "{c}, a kind of {c}"], "templates")


def test_prompt_batches_do_not_change_the_classifier():
    vectors = torch.randn(C, T, 6, generator=torch.Generator().manual_seed(0))
    whole = ToyText(lambda c, t: vectors[c, t])
    in_fives = ToyText(lambda c, t: vectors[c, t])
    a = build_zeroshot_classifier(whole.encode_text, whole.tokenizer, CLASSNAMES, TEMPLATES)
    b = build_zeroshot_classifier(in_fives.encode_text, in_fives.tokenizer, CLASSNAMES, TEMPLATES, batch_size=5)
    assert whole.batch_sizes == [C * T] and in_fives.batch_sizes == [5, 5, 2]
    torch.testing.assert_close(a, b)
    # Column c is class c's mean: the classifier ranks each class's own mean prompt first.
    means = F.normalize(F.normalize(vectors, dim=-1).mean(dim=1), dim=-1)  # (C, D)
    assert torch.equal((means @ a).argmax(dim=1), torch.arange(C))
