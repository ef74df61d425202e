"""lit_softmoe.data.folders: what a source folder holds: class folders (links included), folder mistakes,
captions written from class names (`--caption-templates`), and ImageNet wnid folders named by ImageNet's class
names (`--class-names`)."""
from __future__ import annotations

import json
import os
import tarfile

import PIL.Image
import pytest
import torchvision

from data_files import encode_image, gray_png, read_split, rng_image
from evalkit import foolbox_images, needs_foolbox
from lit_softmoe.cli import main
from lit_softmoe.data.captions import load_caption_templates
from lit_softmoe.data.class_split import iter_class_samples
from lit_softmoe.data.fashion_mnist import read_fashion_mnist
from lit_softmoe.data.folders import list_folder
from lit_softmoe.data.shards import read_classnames, read_lines, shard_urls
from lit_softmoe.data.write_options import WriteOptions
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES, benchmark_info, imagenet_wnids


def test_folder_mistakes_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        list_folder(tmp_path / "nowhere")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat/a.png").write_bytes(encode_image(rng_image(0)))
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
        gray_png(tmp_path / "elsewhere" / "cat" / f"{index}.png", 10 * index)
    gray_png(tmp_path / "src" / "dog" / "0.png", 200)
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
    gray_png(tmp_path / "src" / f"cat{mark}tabby" / "0.png", 10)
    gray_png(tmp_path / "src" / "dog" / "0.png", 200)
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


def test_class_folders_whose_names_differ_only_by_spaces_around_them_are_refused_in_one_line(tmp_path):
    """`cat` and `cat ` are two folders, but classnames.txt's readers strip each line: they were two
    classes of one name, scored against each other without a word."""
    for name in ("cat", "cat ", " dog", "dog"):
        gray_png(tmp_path / "src" / name / "0.png", 10)
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert str(raised.value) == (
        f"class folders 'cat' and 'cat ' in {tmp_path / 'src'} are one name but for the spaces around it ('cat'), "
        "which would be two classes with the same prompts; merge them into one folder or rename one")
    assert not (tmp_path / "out" / "train").exists()


@pytest.mark.parametrize("other", ["Cat", "\uff43\uff41\uff54"], ids=["case", "full-width"])
def test_class_folders_whose_names_differ_only_in_letter_case_or_width_are_refused(tmp_path, other):
    """`Cat` and `cat` (or full-width `ｃａｔ`) are two folders and became two classes, whose prompts CLIP's tokenizer
    (it lowercases, and reads width-variants as ASCII) made identical."""
    for index, name in enumerate(("cat", other, "dog")):
        gray_png(tmp_path / "src" / name / "0.png", 10 * index)
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    first, second = sorted(["cat", other])
    assert str(raised.value) == (
        f"class folders {ascii(first)} and {ascii(second)} in {tmp_path / 'src'} are one name but for letter case or "
        f"letter width ({second!r}), which would be two classes with the same prompts; merge them into one folder "
        "or rename one")
    assert not (tmp_path / "out" / "train").exists()


def test_class_folders_whose_names_differ_only_in_unicode_form_are_refused_in_one_line(tmp_path):
    """`café` composed (NFC, as macOS and most keyboards write it) and decomposed (NFD) are two folders
    on Linux: they became two classes whose prompts were identical."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    gray_png(tmp_path / "src" / composed / "0.png", 10)
    gray_png(tmp_path / "src" / decomposed / "0.png", 100)
    gray_png(tmp_path / "src" / "dog" / "0.png", 200)
    assert len(list((tmp_path / "src").iterdir())) == 3  # the file system keeps both
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert str(raised.value) == (
        f"class folders 'cafe\\u0301' and 'caf\\xe9' in {tmp_path / 'src'} are one name in two Unicode forms "
        f"({composed!r}), which would be two classes with the same prompts; merge them into one folder or rename one")
    assert not (tmp_path / "out" / "train").exists()
    for path in (tmp_path / "src" / decomposed).iterdir():  # merged, the folder is one class
        path.rename(tmp_path / "src" / composed / "1.png")
    (tmp_path / "src" / decomposed).rmdir()
    write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert read_classnames(tmp_path / "out") == [composed, "dog"]


@pytest.mark.parametrize("content", [None, "notes.txt"], ids=["empty", "no-images"])
def test_a_class_folder_without_images_is_refused_as_imagefolder_refuses_it(tmp_path, content):
    """An empty class folder was dropped without a word: the classes after it took labels one lower
    than the user's folder list (and ImageFolder's, which raises FileNotFoundError for it)."""
    gray_png(tmp_path / "src" / "ant" / "0.png", 10)
    (tmp_path / "src" / "bee").mkdir()
    if content:
        (tmp_path / "src" / "bee" / content).write_text("not an image")
    gray_png(tmp_path / "src" / "cat" / "0.png", 200)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes bee"):
        torchvision.datasets.ImageFolder(str(tmp_path / "src"))
    with pytest.raises(UserError) as raised:
        write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert str(raised.value) == (
        f"class folder 'bee' in {tmp_path / 'src'} holds no image files (.png, .jpg, .jpeg, .webp, .bmp, .gif, "
        f".tif, .tiff); add images, or move it out of {tmp_path / 'src'}")
    assert not (tmp_path / "out" / "train").exists()
    gray_png(tmp_path / "src" / "bee" / "0.png", 100)  # with an image, bee is label 1 as ImageFolder has it
    write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert read_classnames(tmp_path / "out") == torchvision.datasets.ImageFolder(str(tmp_path / "src")).classes
    assert sorted(label for _, label in iter_class_samples(tmp_path / "out" / "train")) == [0, 1, 2]
    # Shards written inside the source earlier hold no images but are no class folder.
    write_folder_shards(tmp_path / "src", tmp_path / "src" / "shards", layout="classes")
    assert write_folder_shards(tmp_path / "src", tmp_path / "src" / "shards-2", layout="classes").samples == 3


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
    samples = read_split(split_dir)
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
    # Template i mod 80 for the i-th image of a class in path order, whatever the (shuffled) write order.
    found = {path: (caption, label) for path, caption, label in _captions_in_write_order(out / "train")}
    assert sorted(found) == [path for _, path in written]
    in_class = {path: [p for n, p in written if n == name].index(path) for name, path in written}
    assert found == {path: (templates[in_class[path]].format(c=name), classnames.index(name)) for name, path in written}
    assert [found[path] for path in ("ankle boot/00000.png", "ankle boot/00023.png", "bag/00018.png")] == [
        ("a bad photo of a ankle boot.", 0), ("a photo of many ankle boot.", 0), ("a bad photo of a bag.", 1)]
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
            gray_png(src / name / f"{index}.png", 40 * index)
    file.write_text("a photo of my {c}.\n\n  {c}, seen from above  \n")  # blank lines and spaces go
    write_folder_shards(src, out, caption_templates=load_caption_templates(file))  # auto: class folders
    found = {path: caption for path, caption, _ in _captions_in_write_order(out / "train")}
    templates = ("a photo of my {}.", "{}, seen from above")
    assert found == {f"{name}/{index}.png": templates[index % 2].format(name)
                     for name in ("cat", "dog") for index in range(3)}  # cycled along each class's images
    assert read_lines(out / "zeroshot_classification_templates.txt") == ["a photo of my {c}.", "{c}, seen from above"]

    file.write_text("a drawing of a {c}\n")  # the same source with other templates: rewritten, not refused
    summary = write_folder_shards(src, out, caption_templates=load_caption_templates(file))
    assert not summary.already_complete
    assert {caption for _, caption, _ in _captions_in_write_order(out / "train")} == {"a drawing of a cat",
                                                                                      "a drawing of a dog"}
    assert read_lines(out / "zeroshot_classification_templates.txt") == ["a drawing of a {c}"]
    # Without templates the classes layout writes no captions, as before.
    plain = write_folder_shards(src, tmp_path / "plain")
    assert all("txt" not in sample for sample in read_split(tmp_path / "plain" / "train").values())
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
    gray_png(tmp_path / "src" / "a.png", 10)
    (tmp_path / "src" / "a.txt").write_text("a gray square")
    gray_png(tmp_path / "src" / "cat" / "0.png", 10)
    for layout, found in (("captions", ""), ("auto", r" \(found .txt captions beside its images\)")):
        # A Python caller's words (the command line's: test_cli).
        with pytest.raises(UserError, match=rf"read in the captions layout{found}; pass "
                                            "layout=classes, or drop caption_templates"):
            write_folder_shards(tmp_path / "src", tmp_path / "out", layout=layout, caption_templates=["a {c}"])
    with pytest.raises(UserError, match="has no {c}"):  # checked for library callers too, not only by the CLI
        list_folder(tmp_path / "src", "classes", caption_templates=["a photo"])
    assert list_folder(tmp_path / "src", "classes", caption_templates=["a {c}"]).candidates[0].caption == "a cat"
    assert not (tmp_path / "out").exists()


# ---- ImageNet wnid class folders (`--class-names`) ------------------------------------------------

def _wnid_folders(src):
    """foolbox's 20 real ImageNet images, each in the folder of its class's wnid (19 classes, one twice);
    returns {relative path: ImageNet-1k label}."""
    wnids = imagenet_wnids()
    written = {}
    for path, label in foolbox_images("imagenet"):
        (src / wnids[label]).mkdir(parents=True, exist_ok=True)
        (src / wnids[label] / path.name).write_bytes(path.read_bytes())
        written[f"{wnids[label]}/{path.name}"] = label
    return written


def _classes_written(split_dir):
    """{image path: (.cls, .json's class)} of a written split."""
    return {json.loads(sample["json"])["path"]: (int(sample["cls"]), json.loads(sample["json"])["class"])
            for sample in read_split(split_dir).values()}


@needs_foolbox
def test_wnid_class_folders_are_named_by_imagenet_class_names_in_sorted_wnid_order(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    written = _wnid_folders(src)
    names = benchmark_info("imagenet1k").classnames
    labels = sorted(set(written.values()))  # sorted wnids = sorted ImageNet indices

    assert main(["data", "from-folder", str(src), "--layout", "classes", "--out", str(out)]) == 0

    assert capsys.readouterr().out.splitlines() == [
        "class folders are 19 of ImageNet-1k's WordNet ids: classnames.txt holds their shipped ImageNet class names, "
        "numbered in sorted wnid order (--class-names folders keeps the folder names)",
        f"written 20 samples in 1 shard to {out / 'train'}; skipped 0"]
    assert read_classnames(out) == [names[label] for label in labels]
    assert read_classnames(out)[:3] == ["bald eagle", "goose", "spoonbill"]  # 22 n01614925, 99, 129
    assert _classes_written(out / "train") == {path: (labels.index(label), names[label])
                                                for path, label in written.items()}
    # The subset's labels are ImageFolder's: its classes in sorted folder order.
    imagefolder = torchvision.datasets.ImageFolder(str(src))
    assert sorted(label for label, _ in _classes_written(out / "train").values()) == sorted(imagefolder.targets)


@needs_foolbox
def test_wnid_folders_caption_with_the_class_names_and_folders_keeps_the_ids(tmp_path):
    src = tmp_path / "src"
    written = _wnid_folders(src)
    write_folder_shards(src, tmp_path / "named", caption_templates=["a photo of a {c}."])
    captions = {path: caption for path, caption, _ in _captions_in_write_order(tmp_path / "named" / "train")}
    assert captions[f"{imagenet_wnids()[22]}/imagenet_17_22.jpg"] == "a photo of a bald eagle."  # not n01614925

    summary = write_folder_shards(src, tmp_path / "ids", class_names="folders")
    assert summary.classnames_note is None
    assert read_classnames(tmp_path / "ids") == sorted({path.split("/")[0] for path in written})
    assert {cls for cls, _ in _classes_written(tmp_path / "ids" / "train").values()} == set(range(19))


def test_all_1000_wnid_folders_give_the_standard_imagenet_labels(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    wnids = imagenet_wnids()
    image = encode_image(rng_image(7, size=(4, 4)))
    for wnid in reversed(wnids):  # made in another order: the folders' names, not their ages, give the order
        (src / wnid).mkdir(parents=True)
        (src / wnid / "0.png").write_bytes(image)

    summary = write_folder_shards(src, out, layout="classes")

    assert summary.classnames_note == ("class folders are ImageNet-1k's 1000 WordNet ids: classnames.txt holds the "
                                       "shipped ImageNet class names and .cls the standard ImageNet label index "
                                       "(class_names=folders keeps the folder names)")
    classnames = read_classnames(out)
    assert classnames == list(benchmark_info("imagenet1k").classnames)
    assert (classnames[0], classnames[1], classnames[207]) == ("tench", "goldfish", "Golden Retriever")
    written = _classes_written(out / "train")
    assert {path.split("/")[0]: cls for path, (cls, _) in written.items()} == {wnid: i for i, wnid in enumerate(wnids)}
    assert written["n02099601/0.png"] == (207, "Golden Retriever")


def test_unknown_wnid_folders_among_imagenet_ones_are_one_error_line(tmp_path, capsys):
    src = tmp_path / "src"
    for index, wnid in enumerate(("n01440764", "n01443537", "n99999999")):  # tench, goldfish, no ImageNet-1k class
        gray_png(src / wnid / "0.png", 60 * index)
    command = ["data", "from-folder", str(src), "--layout", "classes", "--out", str(tmp_path / "out")]

    assert main(command) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"lit-softmoe data: error: {src} holds 2 ImageNet-1k class folders (WordNet ids) and 1 wnid-named folder "
        "that ImageNet-1k does not have, e.g. 'n99999999'; remove or rename it, or pass --class-names folders to "
        "keep every folder's name as its class name"]
    assert not (tmp_path / "out").exists()

    assert main([*command, "--class-names", "folders"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("written 3 samples")
    assert read_classnames(tmp_path / "out") == ["n01440764", "n01443537", "n99999999"]


@pytest.mark.parametrize("folders", [("n01440764", "cat"), ("n99999998", "n99999999"), ("n0144076",)],
                         ids=["a folder of another name", "no ImageNet-1k wnid", "not a wnid"])
def test_folders_not_all_imagenet_wnids_keep_their_names(tmp_path, folders):
    for index, folder in enumerate(folders):
        gray_png(tmp_path / "src" / folder / "0.png", 60 * index)
    summary = write_folder_shards(tmp_path / "src", tmp_path / "out", layout="classes")
    assert summary.classnames_note is None and read_classnames(tmp_path / "out") == sorted(folders)


def test_class_folders_are_written_in_a_seeded_shuffled_order_so_every_shard_holds_many_classes(tmp_path):
    """Written in path order, each shard held one class: a shard shuffle and a shuffle buffer cannot
    mix that, and a streamed training batch saw a few classes (4 points of top-1 lost on Fashion-MNIST).
    The order is random but fixed: a rerun writes the same shards."""
    src = tmp_path / "src"
    _fmnist_class_folders(src, per_class=20)  # 200 images, one class folder after another
    for out in ("one", "two"):
        write_folder_shards(src, tmp_path / out, WriteOptions(samples_per_shard=20), layout="classes")
    shards = shard_urls(tmp_path / "one" / "train")
    assert len(shards) == 10
    for shard in shards:
        with tarfile.open(shard) as tar:
            classes = {json.loads(tar.extractfile(member).read())["class"]
                       for member in tar.getmembers() if member.name.endswith(".json")}
        assert len(classes) >= 5, (shard, classes)  # in path order: 1 class a shard
    first, second = (sorted((tmp_path / out / "train").glob("*.tar")) for out in ("one", "two"))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    manifest = json.loads((tmp_path / "one" / "train" / "manifest.json").read_text())
    assert manifest["order"] == "shuffled"
