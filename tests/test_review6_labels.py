"""Review 6: every torchvision reader's label i must be the shipped class name i. Each test lays out a
tiny fake copy of the dataset in torchvision's own on-disk format and reads it end to end."""
from __future__ import annotations

import PIL.Image

from lit_softmoe.evals.readers import read_benchmark
from lit_softmoe.metadata import benchmark_info

from sun397 import _SUN397_CLASSES

# Country211's class folders (ISO 3166 codes); torchvision reads them as an ImageFolder, sorted.
_COUNTRY211_CODES = """
AD AE AF AG AI AL AM AO AQ AR AT AU AW AX AZ BA BB BD BE BF BG BH BJ BM BN BO BQ BR BS BT BW BY BZ CA CD CF CH
CI CK CL CM CN CO CR CU CV CW CY CZ DE DK DM DO DZ EC EE EG ES ET FI FJ FK FO FR GA GB GD GE GF GG GH GI GL GM
GP GR GS GT GU GY HK HN HR HT HU ID IE IL IM IN IQ IR IS IT JE JM JO JP KE KG KH KN KP KR KW KY KZ LA LB LC LI
LK LR LT LU LV LY MA MC MD ME MF MG MK ML MM MN MO MQ MR MT MU MV MW MX MY MZ NA NC NG NI NL NO NP NZ OM PA PE
PF PG PH PK PL PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SS SV SX SY SZ TG TH
TJ TL TM TN TO TR TT TW TZ UA UG US UY UZ VA VE VG VI VN VU WS XK YE ZA ZM ZW
""".split()


def test_sun397_labels_follow_classname_txt_jail_indoor_before_jail_cell(tmp_path):
    # torchvision numbers SUN397's classes by ClassName.txt, where /j/jail/indoor comes before
    # /j/jail_cell ("/" < "_"); the shipped list (CLIP's prompts.md, sorted after "_" and "/" became
    # spaces) had "jail cell" first, so both classes were scored against each other's prompt.
    assert len(_SUN397_CLASSES) == 397 and _SUN397_CLASSES == sorted(_SUN397_CLASSES)
    base = tmp_path / "SUN397"
    base.mkdir()
    (base / "ClassName.txt").write_text("".join(f"/{c[0]}/{c}\n" for c in _SUN397_CLASSES))
    picked = ["abbey", "jacuzzi/indoor", "jail/indoor", "jail_cell", "jewelry_shop", "youth_hostel"]
    for shade, cls in enumerate(picked):  # each folder's image has its own shade, to tell them apart
        path = base / cls[0] / cls / f"sun_{shade:04d}.jpg"
        path.parent.mkdir(parents=True)
        PIL.Image.new("L", (4, 4), 40 * shade).save(path, quality=100)
    data = read_benchmark("sun397", tmp_path, "test", lambda image: image, format="torchvision")
    classnames = benchmark_info("sun397").classnames
    got = {}
    for i in range(len(data.dataset)):
        _, image, target = data.dataset[i]
        got[picked[round(image.convert("L").getpixel((0, 0)) / 40)]] = classnames[target]
    assert got == {cls: cls.replace("_", " ").replace("/", " ") for cls in picked}


def _names_of(data, benchmark: str) -> list[str]:
    """The shipped class name each sample of `data` is scored against, in dataset order."""
    classnames = benchmark_info(benchmark).classnames
    return [classnames[target] for _, _, target in (data.dataset[i] for i in range(len(data.dataset)))]


def _image(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.new("RGB", (8, 8), "gray").save(path)


def test_pets_class_ids_line_up_with_the_shipped_breeds(tmp_path):
    # annotations/test.txt: "IMAGE CLASS-ID SPECIES BREED-ID", CLASS-ID 1..37 (1-based).
    base = tmp_path / "oxford-iiit-pet"
    rows = [("Abyssinian_1", 1, 1), ("american_bulldog_10", 2, 2), ("Bengal_3", 6, 1), ("german_shorthaired_4", 15, 2),
            ("Maine_Coon_5", 21, 1), ("Sphynx_6", 34, 1), ("yorkshire_terrier_7", 37, 2)]
    (base / "annotations").mkdir(parents=True)
    (base / "annotations" / "test.txt").write_text("".join(f"{i} {c} {s} 1\n" for i, c, s in rows))
    for image_id, _, _ in rows:
        _image(base / "images" / f"{image_id}.jpg")
    data = read_benchmark("pets", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "pets") == ["Abyssinian", "American Bulldog", "Bengal", "German Shorthaired",
                                       "Maine Coon", "Sphynx", "Yorkshire Terrier"]


def test_eurosat_folders_line_up_with_the_shipped_names(tmp_path):
    folders = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
               "PermanentCrop", "Residential", "River", "SeaLake"]
    for folder in reversed(folders):
        _image(tmp_path / "eurosat" / "2750" / folder / f"{folder}_1.jpg")
    data = read_benchmark("eurosat", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "eurosat") == [
        "annual crop land", "forest", "brushland or shrubland", "highway or road",
        "industrial buildings or commercial buildings", "pasture land", "permanent crop land",
        "residential buildings or homes or apartments", "river", "lake or sea"]


def test_country211_iso_folders_line_up_with_the_shipped_countries(tmp_path):
    assert len(_COUNTRY211_CODES) == 211
    for code in _COUNTRY211_CODES:
        _image(tmp_path / "country211" / "test" / code / "1.jpg")
    data = read_benchmark("country211", tmp_path, "test", lambda image: image, format="torchvision")
    names = dict(zip(_COUNTRY211_CODES, _names_of(data, "country211")))
    assert {c: names[c] for c in ("AD", "AX", "CD", "CW", "DZ", "ES", "GB", "KP", "KR", "SZ", "US", "XK", "ZW")} == {
        "AD": "Andorra", "AX": "Aland Islands", "CD": "DR Congo", "CW": "Curacao", "DZ": "Algeria", "ES": "Spain",
        "GB": "United Kingdom", "KP": "North Korea", "KR": "South Korea", "SZ": "Eswatini", "US": "United States",
        "XK": "Kosovo", "ZW": "Zimbabwe"}


def test_stl10_one_based_label_file_lines_up_with_the_shipped_names(tmp_path, monkeypatch):
    import numpy as np
    import torchvision.datasets.stl10 as stl10
    monkeypatch.setattr(stl10, "check_integrity", lambda *args, **kwargs: True)  # our files are not STL's md5
    base = tmp_path / "stl10_binary"
    base.mkdir()
    labels = np.arange(1, 11, dtype=np.uint8)  # test_y.bin holds 1..10
    np.zeros((10, 3, 96, 96), dtype=np.uint8).tofile(base / "test_X.bin")
    labels.tofile(base / "test_y.bin")
    (base / "class_names.txt").write_text("airplane\nbird\ncar\ncat\ndeer\ndog\nhorse\nmonkey\nship\ntruck\n")
    data = read_benchmark("stl10", tmp_path, "test", lambda image: image, format="torchvision")
    assert _names_of(data, "stl10") == (base / "class_names.txt").read_text().split()


def test_labels_kept_beside_the_images_are_read_without_decoding_them(tmp_path, monkeypatch):
    # Rendered SST2 (like GTSRB, FER2013 and Cars) keeps (path, label) pairs in `_samples`; listing the
    # labels through dataset[i] decoded every image first (about 8,000 JPEGs for Cars).
    import torchvision.datasets
    for name, count in (("negative", 2), ("positive", 3)):
        for i in range(count):
            _image(tmp_path / "rendered-sst2" / "test" / name / f"{name}_{i}.png")
    decoded = []
    original = torchvision.datasets.RenderedSST2.__getitem__
    monkeypatch.setattr(torchvision.datasets.RenderedSST2, "__getitem__",
                        lambda self, i: decoded.append(i) or original(self, i))
    data = read_benchmark("renderedsst2", tmp_path, "test", lambda image: image, format="torchvision")
    assert decoded == []  # nothing decoded until the images themselves are read
    assert _names_of(data, "renderedsst2") == ["negative"] * 2 + ["positive"] * 3
    assert sorted(decoded) == list(range(5))
