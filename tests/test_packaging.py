"""The wheel users install: the package, its shipped configs, suites and metadata, and nothing else.

`make wheel-check` goes further (it installs the wheel outside the checkout and runs the demo); this
test keeps the wheel's contents right on every `make test`.
"""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_the_package_its_configs_and_metadata(tmp_path):
    pytest.importorskip("build")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(ROOT)], check=True,
                   capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("lit_softmoe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "lit_softmoe"
    shipped = {path.relative_to(ROOT).as_posix() for path in package.rglob("*")
               if path.is_file() and path.suffix in (".py", ".yaml", ".json", ".md")
               and "__pycache__" not in path.parts}
    assert shipped <= names, sorted(shipped - names)
    assert {f"lit_softmoe/configs/{name}.yaml" for name in ("pretrain/fmnist-soft-tiny", "lit/fmnist-tiny",
                                                             "suites/fashion-mnist")} <= names
    assert not [name for name in names if name.startswith(("tests/", "scripts/", "docs/", "configs/", "eval/"))]
