"""lit_softmoe.metadata: the shipped benchmark metadata: class counts, ImageNet subsets, templates,
provenance, aliases, errors.

Where the peer packages are installed the shipped data is compared with them (open_clip's ImageNet
lists, clip_benchmark's JSON, timm's ImageNet-A/-R indices), so a wrong file fails a test."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from lit_softmoe.errors import UserError
from lit_softmoe.metadata import benchmark_info, imagenet_wnids, list_benchmarks
from sun397 import _SUN397_CLASSES

METADATA_DIR = Path(__file__).resolve().parents[2] / "lit_softmoe" / "metadata"

EXPECTED_CLASS_COUNTS = {
    "imagenet1k": 1000, "imagenetv2": 1000, "imagenet_sketch": 1000, "imagenet-a": 200, "imagenet-r": 200,
    "imagenet-o": 200, "objectnet": 113, "cifar10": 10, "cifar100": 100, "pets": 37, "flowers": 102,
    "food101": 101, "dtd": 47, "eurosat": 10, "caltech101": 102, "sun397": 397, "cars": 196,
    "fgvc_aircraft": 100, "stl10": 10, "gtsrb": 43, "mnist": 10, "fashion-mnist": 10, "country211": 211,
    "resisc45": 45, "pcam": 2, "kitti_closest_vehicle_distance": 4, "clevr_count_all": 8,
    "clevr_closest_object_distance": 6, "fer2013": 7, "renderedsst2": 2, "voc2007": 20, "svhn": 10,
}

# Benchmarks without templates of their own, and whose templates they use instead.
BORROWED_TEMPLATES = {
    "imagenetv2": "imagenet1k", "imagenet_sketch": "imagenet1k", "imagenet-a": "imagenet1k",
    "imagenet-r": "imagenet1k", "imagenet-o": "imagenet1k", "objectnet": "imagenet1k",
    "caltech101_vtab": "caltech101",
}

CLASSIFICATION = list_benchmarks("classification")


@pytest.mark.parametrize("name,count", sorted(EXPECTED_CLASS_COUNTS.items()))
def test_class_counts(name, count):
    info = benchmark_info(name)
    assert info.task == "classification"
    assert len(info.classnames) == count
    # OpenAI's ImageNet names repeat two (missile 657/744, sunglasses 836/837); no other list may
    repeats = 2 if info.classnames[:1] == ("tench",) and count == 1000 else 0
    assert len(set(info.classnames)) == count - repeats, "duplicate class names"


def test_imagenet_matches_open_clip():
    zero_shot_metadata = pytest.importorskip("open_clip.zero_shot_metadata")
    info = benchmark_info("imagenet1k")
    assert info.classnames == tuple(zero_shot_metadata.IMAGENET_CLASSNAMES)
    assert len(info.templates) == 80
    assert info.templates == tuple(template("{c}") for template in zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES)
    assert info.templates_from == "imagenet1k"


def test_imagenet_wnids():
    wnids = imagenet_wnids()
    # torchvision's ImageFolder sorts folder names, so label order must be the sorted wnid order
    assert len(wnids) == 1000 and list(wnids) == sorted(set(wnids))
    assert wnids[0] == "n01440764" and wnids[-1] == "n15075141"  # tench … toilet tissue
    assert benchmark_info("imagenet1k").wnids == wnids


@pytest.mark.parametrize("name", ["imagenet-a", "imagenet-r", "imagenet-o"])
def test_imagenet_subsets(name):
    info = benchmark_info(name)
    imagenet = benchmark_info("imagenet1k")
    indices = info.imagenet_indices
    assert len(indices) == 200
    assert list(indices) == sorted(set(indices)) and 0 <= indices[0] and indices[-1] < 1000
    assert info.classnames == tuple(imagenet.classnames[i] for i in indices)
    assert info.wnids == tuple(imagenet_wnids()[i] for i in indices)
    # sorted wnids = the folder order of an ImageFolder over the benchmark's wnid folders
    assert list(info.wnids) == sorted(info.wnids)


@pytest.mark.parametrize("name", ["imagenet-a", "imagenet-r"])
def test_imagenet_subsets_match_timm(name):
    timm_data = pytest.importorskip("timm.data")
    info_dir = Path(timm_data.__file__).parent / "_info"
    stem = name.replace("-", "_")
    assert benchmark_info(name).imagenet_indices == tuple(
        int(i) for i in (info_dir / f"{stem}_indices.txt").read_text().split())
    assert benchmark_info(name).wnids == tuple((info_dir / f"{stem}_synsets.txt").read_text().split())


def test_known_imagenet_subset_members():
    # a few classes of each set, so a shifted index list fails even without timm
    assert "goldfish" in benchmark_info("imagenet-r").classnames
    assert "tench" not in benchmark_info("imagenet-a").classnames
    assert benchmark_info("imagenet-a").classnames[0] == "stingray"
    assert benchmark_info("imagenet-r").classnames[0] == "goldfish"


def test_objectnet_names():
    names = benchmark_info("objectnet").classnames
    assert names[0] == "alarm clock" and names[-1] == "wok"
    assert all(name == name.lower() for name in names)  # clip_benchmark lower-cases them


@pytest.mark.parametrize("name", CLASSIFICATION)
def test_templates_format(name):
    info = benchmark_info(name)
    assert info.templates
    for template in info.templates:
        assert "{c}" in template
        assert template.format(c="zebra") == template.replace("{c}", "zebra")  # no other fields


@pytest.mark.parametrize("name", CLASSIFICATION)
def test_templates_from_is_honest(name):
    info = benchmark_info(name)
    source = BORROWED_TEMPLATES.get(name, name)
    assert info.templates_from == source
    assert info.templates == benchmark_info(source).templates


def test_own_templates_match_clip_benchmark():
    datasets = pytest.importorskip("clip_benchmark.datasets")
    peer = json.loads((Path(datasets.__file__).parent / "en_zeroshot_classification_templates.json").read_text())
    for name in CLASSIFICATION:
        if name in peer:
            assert name not in BORROWED_TEMPLATES
            assert benchmark_info(name).templates == tuple(peer[name]), name
        elif name != "fashion-mnist":
            assert name in BORROWED_TEMPLATES, f"{name} has no clip_benchmark templates; say whose it uses"


def test_classnames_match_clip_benchmark():
    datasets = pytest.importorskip("clip_benchmark.datasets")
    peer = json.loads((Path(datasets.__file__).parent / "en_classnames.json").read_text())
    for key, names in peer.items():
        assert benchmark_info(key).classnames == tuple(names), key


def test_fashion_mnist_uses_our_lists():
    from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES, ZEROSHOT_TEMPLATES

    info = benchmark_info("fashion-mnist")
    assert info.classnames == tuple(FASHION_MNIST_CLASSNAMES)
    assert info.templates == tuple(ZEROSHOT_TEMPLATES)
    assert info.templates_from == "fashion-mnist"


@pytest.mark.parametrize("alias,name", [
    ("imagenet", "imagenet1k"), ("wds/imagenet1k", "imagenet1k"), ("vtab/cifar10", "cifar10"),
    ("wds/vtab/cifar100", "cifar100"), ("vtab/caltech101", "caltech101_vtab"), ("ImageNet-A", "imagenet-a"),
    ("imagenet_r", "imagenet-r"), ("wds/imagenet_sketch", "imagenet_sketch"), ("coco", "mscoco_captions"),
    ("wds/flickr30k", "flickr30k"), ("fashion_mnist", "fashion-mnist"), ("kitti", "kitti_closest_vehicle_distance"),
])
def test_aliases(alias, name):
    assert benchmark_info(alias).name == name


def test_unknown_benchmark_suggests():
    with pytest.raises(UserError, match=r"unknown benchmark 'cifar-100'; did you mean 'cifar100'\? \(known: .*"):
        benchmark_info("cifar-100")
    with pytest.raises(UserError, match="did you mean 'mscoco_captions'"):
        benchmark_info("mscoco_caption")
    with pytest.raises(UserError, match="unknown task"):
        list_benchmarks("detection")


def test_retrieval():
    assert list_benchmarks("retrieval") == ["flickr30k", "flickr8k", "mscoco_captions"]
    for name in list_benchmarks("retrieval"):
        info = benchmark_info(name)
        assert info.task == "retrieval"
        assert info.classnames is None and info.templates is None and info.templates_from == ""
    assert set(list_benchmarks()) == set(CLASSIFICATION) | set(list_benchmarks("retrieval"))
    assert set(EXPECTED_CLASS_COUNTS) <= set(CLASSIFICATION)


def test_every_entry_names_its_source():
    for name in list_benchmarks():
        assert benchmark_info(name).source


def test_package_data_is_declared():
    pyproject = tomllib.loads((METADATA_DIR.parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["lit_softmoe.metadata"]
    shipped = {path.name for path in METADATA_DIR.iterdir() if path.suffix in (".json", ".md")}
    assert {"classnames.json", "templates.json", "benchmarks.json", "SOURCES.md"} <= shipped
    assert all(any(Path(name).match(glob) for glob in globs) for name in shipped)


def test_every_folder_alias_names_a_shipped_class():
    from lit_softmoe.metadata import benchmark_info, list_benchmarks
    with_aliases = {}
    for name in list_benchmarks("classification"):
        info = benchmark_info(name)
        for folder, classname in info.folder_aliases:
            assert classname in info.classnames, (name, folder, classname)
            with_aliases.setdefault(name, []).append(folder)
    assert sorted(with_aliases["fer2013"]) == ["disgust", "fear", "surprise"]


def test_sun397_shipped_names_are_classname_txt_in_its_order():
    # CLIP_benchmark names SUN397's classes as torchvision's ClassName.txt with "_" and "/" as spaces.
    assert list(benchmark_info("sun397").classnames) == \
        [c.replace("_", " ").replace("/", " ") for c in _SUN397_CLASSES]


def test_imagenet_names_and_wnids_share_the_label_order():
    """`data from-folder` names wnid folders by the class name at the wnid's index: both lists must be in
    ImageNet-1k's label order, checked on known classes and against timm's and torchvision's lists."""
    info = benchmark_info("imagenet1k")
    for index, wnid, name in ((0, "n01440764", "tench"), (1, "n01443537", "goldfish"),
                              (207, "n02099601", "golden retriever")):
        assert info.wnids[index] == wnid and info.classnames[index].lower() == name
    timm_data = pytest.importorskip("timm.data")
    timm_info = timm_data.ImageNetInfo()
    assert info.wnids == tuple(timm_info.index_to_label_name(i) for i in range(1000))
    assert info.wnids == tuple((Path(timm_data.__file__).parent / "_info" / "imagenet_synsets.txt").read_text().split())
    assert timm_info.index_to_description(207) == "golden retriever"
    weights = pytest.importorskip("torchvision.models").ResNet18_Weights.IMAGENET1K_V1
    assert [weights.meta["categories"][i] for i in (0, 1, 207)] == ["tench", "goldfish", "golden retriever"]
