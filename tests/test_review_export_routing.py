"""Review of `lit-softmoe inspect-routing` as a user meets it: an --out that is not an image file matplotlib
can write, or cannot be written at all, is one line with exit code 2 (not a traceback after the work)."""
from __future__ import annotations

import PIL.Image
import pytest
import torch

from lit_softmoe.cli import main
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower


@pytest.fixture(scope="module")
def tower_and_image(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    torch.manual_seed(0)
    save_tower(root / "tower", create_image_tower("soft-test-4e", num_classes=3),
               extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]}, "classnames": ["a", "b", "c"]})
    PIL.Image.new("L", (28, 28), 120).save(root / "img.png")
    return root / "tower", root / "img.png"


@pytest.mark.parametrize("name, message", [("routing.json", "cannot write a .json figure"),
                                           ("routing.txt", "cannot write a .txt figure"),
                                           ("routing", "has no file suffix")])
def test_out_that_is_not_an_image_file_is_one_line(tower_and_image, tmp_path, capsys, name, message):
    tower, image = tower_and_image
    code = main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "routing.png" in err, err
    assert list(tmp_path.iterdir()) == []


def test_out_that_cannot_be_written_is_one_line(tower_and_image, tmp_path, capsys):
    tower, image = tower_and_image
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    for out, message in [(tmp_path / "a-file" / "routing.png", "is a file, not a folder"),
                         (tmp_path / "a-folder", "is a folder")]:
        code = main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder"]


def test_pdf_and_svg_figures_still_work(tower_and_image, tmp_path, capsys):
    tower, image = tower_and_image
    for name in ("routing.pdf", "routing.svg"):
        assert main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 0 and (tmp_path / "routing.json").is_file()
    capsys.readouterr()
