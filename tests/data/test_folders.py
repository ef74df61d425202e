"""lit_softmoe.data.folders: what a source folder holds: class folders (links included), folder mistakes, and
captions written from class names (`--caption-templates`)."""
from __future__ import annotations

import json
import os

import PIL.Image
import pytest
import torchvision

from data_files import _encode, _gray_png, _read_split, _rng_image
from lit_softmoe.data.captions import load_caption_templates
from lit_softmoe.data.class_split import iter_class_samples
from lit_softmoe.data.fashion_mnist import read_fashion_mnist
from lit_softmoe.data.folders import list_folder
from lit_softmoe.data.shards import read_classnames, read_lines
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES, benchmark_info


def test_folder_mistakes_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        list_folder(tmp_path / "nowhere")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat/a.png").write_bytes(_encode(_rng_image(0)))
    with pytest.raises(UserError, match="no .txt caption beside any"):
        list_folder(tmp_path / "flat")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no image files"):
        list_folder(tmp_path / "empty")
    (tmp_path / "flat/b.png").write_bytes(b"broken")
    (tmp_path / "flat/b.txt").write_text("a caption")
    with pytest.raises(UserError, match=r"could be written: skipped 2 \(bad_image 1, missing_caption 1\)"):
        write_folder_shards(tmp_path / "flat", tmp_path / "out")


def test_linked_class_folders_are_read_and_numbered_like_imagefolder(tmp_path):
    # A class folder is often a link into a bigger dataset; os.walk did not enter it, so its images
    # were dropped without a count and the remaining classes were numbered differently from ImageFolder.
    for index in range(3):
        _gray_png(tmp_path / "elsewhere" / "cat" / f"{index}.png", 10 * index)
    _gray_png(tmp_path / "src" / "dog" / "0.png", 200)
    os.symlink(tmp_path / "elsewhere" / "cat", tmp_path / "src" / "cat")
    imagefolder = torchvision.datasets.ImageFolder(str(tmp_path / "src"))
    os.symlink(tmp_path / "src", tmp_path / "src" / "dog" / "loop")  # a link back up must not loop

    summary = write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")

    assert read_classnames(tmp_path / "out") == imagefolder.classes == ["cat", "dog"]
    assert summary.samples == 4 and sum(summary.skipped.values()) == 0
    labels = sorted(label for _, label in iter_class_samples(tmp_path / "out" / "train"))
    assert labels == sorted(imagefolder.targets) == [0, 0, 0, 1]


@pytest.mark.parametrize("mark", ["\n", "\r", "\t", "\x1b", "\u2028"], ids=["newline", "return", "tab", "escape",
                                                                               "line separator"])
def test_a_class_folder_named_with_a_control_character_is_refused_in_one_line(tmp_path, mark):
    """classnames.txt holds a class name a line: a folder `cat<newline>tabby` gave it one line more than
    there are classes, and every class after it read the name of the one before."""
    _gray_png(tmp_path / "src" / f"cat{mark}tabby" / "0.png", 10)
    _gray_png(tmp_path / "src" / "dog" / "0.png", 200)
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    message = str(raised.value)
    assert message == (f"class folder {f'cat{mark}tabby'!r} in {tmp_path / 'src'} has a control character or "
                       "line break in its name, which classnames.txt (one class name per line) cannot hold; "
                       "rename the folder")
    assert len(message.splitlines()) == 1
    assert not (tmp_path / "out" / "classnames.txt").exists() and not (tmp_path / "out" / "train").exists()
    # Renamed, the same folder is written, its classes numbered in order.
    os.rename(tmp_path / "src" / f"cat{mark}tabby", tmp_path / "src" / "cat tabby")
    write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert read_classnames(tmp_path / "out") == ["cat tabby", "dog"]


# ---- captions from class names (`--caption-templates`) -------------------------------------------

def _fmnist_class_folders(src, per_class=3):
    """Real Fashion-MNIST test images as PNGs in one folder per class (named after the class), the
    first `per_class` of each; returns [(class name, relative path)] in write order."""
    images, labels = read_fashion_mnist("test", allow_download=False)
    written = []
    for label, name in sorted(enumerate(FASHION_MNIST_CLASSNAMES), key=lambda pair: pair[1]):
        for index in [i for i in range(len(labels)) if labels[i] == label][:per_class]:
            (src / name).mkdir(parents=True, exist_ok=True)
            PIL.Image.fromarray(images[index]).save(src / name / f"{index:05d}.png")
            written.append((name, f"{name}/{index:05d}.png"))
    return sorted(written, key=lambda pair: pair[1].split("/"))  # path order, as list_folder sorts


def _captions_in_write_order(split_dir):
    samples = _read_split(split_dir)
    return [(json.loads(sample["json"])["path"], sample["txt"].decode(), int(sample["cls"]))
            for sample in samples.values()]


def test_class_folders_get_a_caption_per_sample_from_the_default_templates(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    written = _fmnist_class_folders(src)
    templates = load_caption_templates("default")
    assert templates == list(benchmark_info("imagenet1k").templates) and len(templates) == 80  # CLIP's

    summary = write_folder_shards(src, out, layout="classes", caption_templates=templates)

    assert summary.samples == 30 and sum(summary.skipped.values()) == 0
    classnames = sorted(FASHION_MNIST_CLASSNAMES)  # folders are numbered in sorted order, as ImageFolder does
    assert read_classnames(out) == classnames
    # Template i mod 80 for the i-th sample in write order: "ankle boot" takes the first three, "bag" the next.
    expected = [(path, templates[i % 80].format(c=name), classnames.index(name))
                for i, (name, path) in enumerate(written)]
    assert _captions_in_write_order(out / "train") == expected
    assert expected[:4] == [("ankle boot/00000.png", "a bad photo of a ankle boot.", 0),
                            ("ankle boot/00023.png", "a photo of many ankle boot.", 0),
                            ("ankle boot/00028.png", "a sculpture of a ankle boot.", 0),
                            ("bag/00018.png", "a photo of the hard to see bag.", 1)]
    # The templates are the zero-shot prompts beside the split, read as the evaluation reads them.
    assert read_lines(out / "zeroshot_classification_templates.txt") == templates


def test_caption_shards_are_byte_identical_when_written_twice(tmp_path):
    src = tmp_path / "src"
    _fmnist_class_folders(src, per_class=2)
    templates = load_caption_templates("default")
    for out in ("one", "two"):
        write_folder_shards(src, tmp_path / out, layout="classes", caption_templates=templates)
    first, second = (sorted((tmp_path / out / "train").glob("*.tar")) for out in ("one", "two"))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second] and first
    again = write_folder_shards(src, tmp_path / "one", layout="classes", caption_templates=templates)
    assert again.already_complete


def test_a_templates_file_gives_the_captions_and_other_templates_rewrite_the_split(tmp_path):
    src, out, file = tmp_path / "src", tmp_path / "out", tmp_path / "templates.txt"
    for name in ("cat", "dog"):
        for index in range(3):
            _gray_png(src / name / f"{index}.png", 40 * index)
    file.write_text("a photo of my {c}.\n\n  {c}, seen from above  \n")  # blank lines and spaces go
    write_folder_shards(src, out, caption_templates=load_caption_templates(file))  # auto: class folders
    assert [caption for _, caption, _ in _captions_in_write_order(out / "train")] == [
        "a photo of my cat.", "cat, seen from above", "a photo of my cat.",
        "dog, seen from above", "a photo of my dog.", "dog, seen from above"]
    assert read_lines(out / "zeroshot_classification_templates.txt") == ["a photo of my {c}.", "{c}, seen from above"]

    file.write_text("a drawing of a {c}\n")  # the same source with other templates: rewritten, not refused
    summary = write_folder_shards(src, out, caption_templates=load_caption_templates(file))
    assert not summary.already_complete
    assert {caption for _, caption, _ in _captions_in_write_order(out / "train")} == {"a drawing of a cat",
                                                                                      "a drawing of a dog"}
    assert read_lines(out / "zeroshot_classification_templates.txt") == ["a drawing of a {c}"]
    # Without templates the classes layout writes no captions, as before.
    plain = write_folder_shards(src, tmp_path / "plain")
    assert all("txt" not in sample for sample in _read_split(tmp_path / "plain" / "train").values())
    assert plain.samples == 6 and not (tmp_path / "plain" / "zeroshot_classification_templates.txt").exists()


def test_a_benchmark_name_gives_its_shipped_templates():
    assert load_caption_templates("cifar10") == list(benchmark_info("cifar10").templates)


@pytest.mark.parametrize("content, message", [
    (None, r"caption templates '.*nowhere\.txt': no such file, and not a shipped template set; give a file"),
    ("", r"holds no templates; give one prompt per line"),
    ("\n  \n", r"holds no templates; give one prompt per line"),
    ("a photo of a {c}.\na photo\n", r"template 'a photo' has no \{c\}, so every class would get the same prompt; "
                                     r"write the class name as \{c\}"),
    ("a photo of a {}.\n", r"template 'a photo of a \{\}\.' has the placeholder \{\}; write the class name as \{c\}"),
    ("a photo of a {c\n", r"is not a format string"),
], ids=["missing", "empty", "blank", "no placeholder", "empty braces", "lone brace"])
def test_bad_templates_files_are_one_line_user_errors(tmp_path, content, message):
    path = tmp_path / "nowhere.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message) as raised:
        load_caption_templates(path)
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="not a shipped template set"):
        load_caption_templates("defualt")


def test_caption_templates_refuse_the_captions_layout(tmp_path):
    _gray_png(tmp_path / "src" / "a.png", 10)
    (tmp_path / "src" / "a.txt").write_text("a gray square")
    _gray_png(tmp_path / "src" / "cat" / "0.png", 10)
    for layout, found in (("captions", ""), ("auto", r" \(found .txt captions beside its images\)")):
        with pytest.raises(UserError, match=rf"read in the captions layout{found}; pass --layout classes, or drop "
                                            "--caption-templates"):
            write_folder_shards(tmp_path / "src", tmp_path / "out", layout=layout, caption_templates=["a {c}"])
    with pytest.raises(UserError, match="has no {c}"):  # checked for library callers too, not only by the CLI
        list_folder(tmp_path / "src", "classes", caption_templates=["a photo"])
    assert list_folder(tmp_path / "src", "classes", caption_templates=["a {c}"]).candidates[0].caption == "a cat"
    assert not (tmp_path / "out").exists()
