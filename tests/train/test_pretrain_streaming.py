"""lit_softmoe.train.pretrain with data.loader=stream: class shards of any image size and mode read by
loader workers; a killed run resumes exactly; two processes train as one does on the same global
batches; bad samples are skipped and counted; the evaluation reads streamed splits as it reads them
in memory."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import time

import numpy as np
import PIL.Image
import pytest
import torch

from cli_errors import one_line_error
from launch import kill_process, python_command, torchrun_args
from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.data.class_batches import StreamedClassBatches
from lit_softmoe.data.fashion_mnist import _png_bytes, read_fashion_mnist, write_fashion_mnist_shards
from lit_softmoe.data.shards import shard_urls, write_split
from lit_softmoe.data.tar_reading import BadSampleCounter, tar_samples
from lit_softmoe.data.transforms import BatchNormalize, train_transform
from lit_softmoe.errors import UserError
from lit_softmoe.models.preprocess import Preprocess
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import load_tower
from lit_softmoe.train.class_data import memory_class_data, streamed_class_data
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import _embed, _validate_tower, pretrain

SMALL_TOWER = ["tower.name=soft-tiny-p7-16e", "tower.options.width=64", "tower.options.num_heads=2",
               "tower.options.mlp_dim=128", "tower.options.depth=4", "tower.options.moe_layers=[2,3]"]
# The ViT recipe's augmentation, all of it random per sample or per batch.
RECIPE = ["data.augment=true", "data.crop=random_resized", "data.crop_scale=[0.4,1.0]", "data.randaugment=[2,9]",
          "data.mixup=0.5"]


def _overrides(data, run_dir, *extra):
    return [f"data.train={data / 'train'}", f"data.test={data / 'test'}", f"run_dir={run_dir}", "data.loader=stream",
            "batch_size=64", "optim.warmup=5", "log_every=1", "log_with=[]", "data.shuffle_buffer=200",
            *SMALL_TOWER, *extra]


def _cfg(data, run_dir, *extra):
    return load_config(PretrainConfig, None, _overrides(data, run_dir, *extra))


def _cli(data, run_dir, *extra, launcher=()):
    """`lit-softmoe pretrain` in a subprocess with `_cfg`'s config (an empty YAML file + the same overrides)."""
    empty = run_dir.parent / "empty.yaml"
    empty.write_text("{}\n")
    return [*python_command(), *launcher, "-m", "lit_softmoe.cli", "pretrain", "--config", str(empty),
            *_overrides(data, run_dir, *extra)]


def _jpeg(array: np.ndarray, size: tuple[int, int], mode: str = "L") -> bytes:
    image = PIL.Image.fromarray(array).resize(size, PIL.Image.BICUBIC).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Real Fashion-MNIST images as JPEGs of random sizes (20 to 90 px, not square), some in RGB: 768
    train images in 6 shards, 256 test images."""
    out = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    for split, count in (("train", 768), ("test", 256)):
        images, labels = read_fashion_mnist(split, allow_download=False)

        def samples():
            for i in range(count):
                size = (int(rng.integers(20, 91)), int(rng.integers(20, 91)))
                yield {"jpg": _jpeg(images[i], size, "RGB" if i % 5 == 0 else "L"), "cls": str(int(labels[i])).encode()}

        write_split(samples(), out, split, samples_per_shard=128)
    (out / "classnames.txt").write_text("\n".join(f"class {i}" for i in range(10)) + "\n")
    return out


def test_streamed_pretraining_learns_mixed_size_jpegs_and_auto_streams_them(mixed, tmp_path):
    results = pretrain(_cfg(mixed, tmp_path / "run", "steps=36", "optim.lr=3e-3", "fewshot_shots=5",
                            "data.loader=auto"))
    # 36 steps of 64 on 768 images: far above chance (0.1), on test images of other sizes.
    assert results["test_top1"] > 0.4, results
    assert 0.3 < results["fewshot5_top1"] <= 1.0
    assert results["bad_samples"] == {"train": {}, "test": {}}
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert records[-1]["epoch"] == pytest.approx(36 / 12)  # 768 / 64 = 12 steps an epoch
    tower, meta = load_tower(tmp_path / "run" / "tower")
    assert tower.cfg.image_size == 28 and meta["preprocess"]["image_size"] == 28
    # The mean and std come from the first training images, as the tower will see them.
    assert 0.15 < meta["preprocess"]["mean"][0] < 0.45 and 0.2 < meta["preprocess"]["std"][0] < 0.5


def test_auto_streams_images_of_other_sizes_without_decoding_a_split_into_memory_first(mixed, tmp_path, monkeypatch,
                                                                                        caplog):
    """data.loader=auto decides before any split is decoded (from the images' headers): a small split of
    other sizes was decoded whole into memory, then thrown away for the stream."""
    from lit_softmoe.train import class_data

    def no_memory_decode(*args, **kwargs):
        raise AssertionError("a split was decoded into memory")

    monkeypatch.setattr(class_data, "load_class_split", no_memory_decode)
    cfg = _cfg(mixed, tmp_path / "run", "data.loader=auto", "data.mean=[0.3]", "data.std=[0.3]")
    tower_cfg = _validate_tower(cfg)
    with caplog.at_level("INFO", logger=class_data.__name__):
        data = class_data.setup_class_data(cfg, tower_cfg, 0, 1)
    assert data.streamed and data.train.steps_per_epoch == 768 // 64
    size = tower_cfg.image_size
    assert caplog.messages == [f"data.loader=auto: the images are not all {size}×{size} px with "
                               f"{tower_cfg.in_channels} channels: streaming them"]


def test_in_memory_loading_of_mixed_sizes_is_one_line_naming_the_stream(mixed, tmp_path):
    with pytest.raises(UserError, match="different sizes .* set data.loader=stream"):
        pretrain(_cfg(mixed, tmp_path / "run", "steps=2", "data.loader=memory"))


@pytest.mark.parametrize("extra, expected", [
    (["data.max_train_samples=100"], "with data.loader=stream, write a smaller split instead"),
    (["data.loader=disk"], "data.loader"),
    (["data.crop=inception"], "data.crop"),
])
def test_stream_setting_mistakes_are_one_user_error(mixed, tmp_path, extra, expected):
    with pytest.raises(UserError, match=expected):
        pretrain(_cfg(mixed, tmp_path / "run", "steps=2", *extra))


def test_a_stream_without_class_names_is_one_line_with_exit_code_2(mixed, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for split in ("train", "test"):
        shutil.copytree(mixed / split, bare / split)
    argv = _cli(bare, tmp_path / "run", "steps=2")
    assert "needs its classnames.txt" in one_line_error(capsys, argv[argv.index("lit_softmoe.cli") + 1:])


def _bad_split(tmp_path, source):
    """Fashion-MNIST PNGs with, among them: a truncated JPEG, a zero-byte image (both bad: skipped,
    counted), a CMYK JPEG, a 16-bit PNG and a 3×3 image smaller than any crop (all usable)."""
    images, labels = read_fashion_mnist("train", allow_download=False)
    sixteen = io.BytesIO()
    PIL.Image.fromarray(images[3].astype(np.uint16) * 257).save(sixteen, format="PNG")
    assert PIL.Image.open(io.BytesIO(sixteen.getvalue())).mode in ("I;16", "I")
    special = {
        1: {"jpg": _jpeg(images[1], (60, 60))[:300]},  # truncated
        2: {"jpg": b""},  # zero bytes
        3: {"png": sixteen.getvalue()},
        4: {"jpg": _jpeg(images[4], (50, 40), "CMYK")},
        5: {"png": _png_bytes(np.asarray(PIL.Image.fromarray(images[5]).resize((3, 3))))},
    }

    def samples():
        for i in range(320):
            sample = special.get(i, {"png": _png_bytes(images[i])})
            yield {**sample, "cls": str(int(labels[i])).encode()}

    write_split(samples(), tmp_path / "bad", "train", samples_per_shard=80)
    write_split(samples(), tmp_path / "bad", "test", samples_per_shard=80)
    (tmp_path / "bad" / "classnames.txt").write_text((source / "classnames.txt").read_text())
    return tmp_path / "bad"


def test_bad_samples_are_skipped_and_counted_and_odd_ones_train(mixed, tmp_path):
    data = _bad_split(tmp_path, mixed)
    common = ["steps=6", "fewshot_shots=0", "data.workers=2", *RECIPE[:3]]
    with pytest.raises(UserError, match=r"2 of \d+ samples were bad \(bad_image: 2\), over max_bad_fraction=0.001"):
        pretrain(_cfg(data, tmp_path / "refused", *common, "data.max_bad_fraction=0.001"))
    results = pretrain(_cfg(data, tmp_path / "run", *common))
    # Two bad ones in each split; the CMYK, 16-bit and 3×3 images are decoded, converted and trained on.
    assert results["bad_samples"]["train"] == {"bad_image": 2}, results["bad_samples"]
    assert results["bad_samples"]["test"] == {"bad_image": 2}
    odd = {"s0000003", "s0000004", "s0000005"}
    transform = train_transform(28, 1, random_resized_crop=True, normalize=False)
    stream = StreamedClassBatches(str(data / "train"), 64, transform, seed=0, rank=0, world_size=1, workers=0)
    seen = {key: image for batch in stream.epoch(0) for key, image in zip(batch.keys, batch.images)}
    assert odd <= seen.keys() and not {"s0000001", "s0000002"} & seen.keys()
    assert all(seen[key].shape == (1, 28, 28) and seen[key].float().std() > 0 for key in odd)


def test_streamed_and_in_memory_evaluations_agree(mixed, tmp_path):
    """The test top-1 and the few-shot probe's shots of a tower, read from the shards by the stream
    and from the decoded split in memory: the same images, the same numbers."""
    data_dir = tmp_path / "fm"
    write_fashion_mnist_shards(data_dir, limit=400, samples_per_shard=100, allow_download=False)
    cfg = load_config(PretrainConfig, None, [f"data.train={data_dir / 'train'}", f"data.test={data_dir / 'test'}",
                                             *SMALL_TOWER, "batch_size=50"])
    tower_cfg = _validate_tower(cfg)
    memory = memory_class_data(cfg, tower_cfg, 0, 1)
    streamed = streamed_class_data(cfg, tower_cfg, 0, 1)
    assert memory.mean == pytest.approx(streamed.mean, abs=1e-6) and memory.std == pytest.approx(streamed.std, abs=1e-6)
    torch.manual_seed(0)
    tower = create_image_tower(cfg.tower.name, num_classes=10, **cfg.tower.options)
    normalize = BatchNormalize(Preprocess(28, 1, tuple(memory.mean), tuple(memory.std)))

    class CPU:
        device = torch.device("cpu")

        @staticmethod
        def autocast():
            return torch.autocast("cpu", enabled=False)

    a = _embed(tower, memory.test_batches(64), normalize, CPU)
    b = _embed(tower, streamed.test_batches(64), normalize, CPU)
    # Two loader workers interleave their shards' batches: the same rows, in another order.
    order_a, order_b = a[0][:, 0].argsort(), b[0][:, 0].argsort()
    assert torch.equal(a[2][order_a], b[2][order_b])
    assert torch.allclose(a[0][order_a], b[0][order_b], atol=1e-5) and torch.allclose(a[1][order_a], b[1][order_b],
                                                                                        atol=1e-5)
    assert (a[1].argmax(1) == a[2]).sum() == (b[1].argmax(1) == b[2]).sum()
    shots_a, shots_b = memory.shots(5, 3), streamed.shots(5, 3)
    assert torch.equal(shots_a[0], shots_b[0]) and torch.equal(shots_a[1], shots_b[1])
    assert memory.shots(60, 3).startswith("the 60-shot linear probe is skipped") and streamed.shots(60, 3) == \
        memory.shots(60, 3)


def test_killed_streamed_run_resumes_exactly(mixed, tmp_path):
    """SIGKILL mid-epoch with two loader workers and every random augmentation on: the resumed run logs
    the losses of the uninterrupted one, step by step, and ends with the same weights."""
    common = ["steps=30", "checkpoint_every=4", "keep_checkpoints=50", "fewshot_shots=0", "data.workers=2", *RECIPE]
    pretrain(_cfg(mixed, tmp_path / "straight", *common))
    straight = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r}

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(mixed, killed, *common), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while not [p for p in (killed / "checkpoints").glob("step_*") if int(p.name[5:]) >= 14] and time.time() < deadline:
        time.sleep(0.02)
    kill_process(proc)  # its loader workers end when they find their parent gone
    assert not (killed / "tower").exists(), "the run finished before it could be killed"
    resumed_from = max(int(p.name[5:]) for p in (killed / "checkpoints").glob("step_*"))
    assert 14 <= resumed_from < 30 and resumed_from % 12  # mid-epoch (12 steps an epoch)

    pretrain(_cfg(mixed, killed, *common))
    resumed = {r["step"]: r["loss"] for r in read_metrics(killed / "metrics.jsonl") if "loss" in r}
    assert sorted(resumed) == sorted(straight)
    for step in straight:
        assert resumed[step] == straight[step], f"loss differs at step {step} (resumed from {resumed_from})"
    a, _ = load_tower(tmp_path / "straight" / "tower")
    b, _ = load_tower(killed / "tower")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_two_processes_train_as_one_does_on_the_same_global_batches(mixed, tmp_path):
    """torchrun, 2 gloo processes, each streaming its own shards: the union of the keys each process
    reads in an epoch is the training set, and the losses are those of one process trained on the
    same global batches (their samples written in that order into one shard, read unshuffled; each
    sample's crop is a function of its key, so both runs see the same pixels)."""
    common = ["steps=12", "fewshot_shots=0", "data.workers=1", "checkpoint_every=1000", "data.augment=true",
              "data.crop=random_resized", "data.mean=[0.3]", "data.std=[0.35]"]
    # What each process reads: the stream the recipe builds for its rank (the same class and arguments).
    transform = train_transform(28, 1, random_resized_crop=True, scale=(0.08, 1.0), normalize=False)
    ranks = [StreamedClassBatches(str(mixed / "train"), 64, transform, seed=0, rank=rank, world_size=2, workers=1,
                                  shuffle_buffer=200) for rank in range(2)]
    steps = [list(r.epoch(0)) for r in ranks]
    assert len(steps[0]) == len(steps[1]) == 12
    raw = {s["__key__"]: s for url in shard_urls(str(mixed / "train")) for s in tar_samples(url, BadSampleCounter())}
    keys = set(raw)
    assert {k for rank in steps for batch in rank for k in batch.keys} == keys

    double = tmp_path / "double"
    result = subprocess.run(_cli(mixed, double, *common, launcher=torchrun_args()),
                            capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]

    # The global batches in order, as one shard, read in order by one process.
    order = [k for a, b in zip(*steps) for k in a.keys + b.keys]
    assert len(set(order)) == len(order) == 768  # no padding at this size: each sample once
    replay = tmp_path / "replay"
    write_split(({"__key__": k, **{e: v for e, v in raw[k].items() if not e.startswith("__")}} for k in order),
                replay, "train", samples_per_shard=1000, keep_keys=True)
    os.symlink(mixed / "test", replay / "test")
    (replay / "classnames.txt").write_text((mixed / "classnames.txt").read_text())
    single = tmp_path / "single"
    pretrain(_cfg(replay, single, *common, "data.shuffle_buffer=0", "data.workers=0", "threads=1"))

    one = [r["loss"] for r in read_metrics(single / "metrics.jsonl") if "loss" in r]
    two = [r["loss"] for r in read_metrics(double / "metrics.jsonl") if "loss" in r]
    assert len(one) == len(two) == 12 and one[-1] < one[0]
    for a, b in zip(one, two):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)

