"""lit_softmoe.data.pipelines: streaming shard loaders: each sample of an epoch read exactly once across
simulated nodes and DataLoader workers, orders that are a function of (seed, epoch), bad samples and
shards counted by reason and stopped by max_bad_fraction, and all three sample kinds on real
Fashion-MNIST shards."""
from __future__ import annotations

import dataclasses
import io
import logging
import re
import tarfile

import numpy as np
import PIL.Image
import pytest
import torch
from omegaconf import OmegaConf
from torchvision.transforms import v2

from data_files import copy_split, cut_at_sample, png_bytes
from img2dataset_shards import write_img2dataset_output
from lit_softmoe.data.fashion_mnist import read_fashion_mnist, write_fashion_mnist_shards
from lit_softmoe.data.feature_cache import embedding_caption_sample
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import write_split
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lit_softmoe.models.tokenizers import create_tokenizer


def _png(value: int, size: int = 8, mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, (size, size), value).save(buffer, format="PNG")
    return buffer.getvalue()


def _caption_split(root, name, count, per_shard, caption="caption"):
    """`count` samples keyed s0000000…, sample i a uniform image of value i and the caption "caption i"."""
    samples = [{"png": _png(i), "txt": f"{caption} {i}".encode()} for i in range(count)]
    write_split(samples, root, name, samples_per_shard=per_shard)
    return root / name


def _index(key: str) -> int:
    return int(key[1:])


def _keys(batches):
    return [key for batch in batches for key in batch["key"]]


# ---------------------------------------------------------------------------------------- epochs


def test_exact_epoch_reads_each_sample_once_across_two_nodes_and_two_workers(tmp_path):
    split = _caption_split(tmp_path, "train", count=63, per_shard=10)  # 7 shards: 6 × 10 + 3
    seen, batch_counts = [], []
    for rank in (0, 1):
        cfg = ShardDataConfig(urls=str(split), batch_size=4, workers=2, shuffle_buffer=16, seed=3,
                              exact_epoch=True, rank=rank, world_size=2)
        loader = create_shard_loader(cfg, "image-caption")
        batches = list(loader)
        assert len(loader) == len(batches)  # computed from sizes.json and this epoch's shard split
        batch_counts.append(len(batches))
        for batch in batches:
            assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (1, 8, 8)
            for key, image, caption in zip(batch["key"], batch["image"], batch["caption"]):
                assert caption == f"caption {_index(key)}" and torch.all(image == _index(key))
        seen += _keys(batches)
        assert loader.metrics() == {"data/samples_read": len(_keys(batches)), "data/bad_samples": 0}
    assert sorted(seen) == [f"s{i:07d}" for i in range(63)]  # every sample, none twice
    assert min(batch_counts) > 0


def test_training_epoch_gives_every_worker_the_same_full_batches(tmp_path):
    split = _caption_split(tmp_path, "train", count=80, per_shard=10)  # 8 shards of 10
    seen = []
    for rank in (0, 1):
        cfg = ShardDataConfig(urls=str(split), batch_size=5, workers=2, shuffle_buffer=8, rank=rank, world_size=2)
        loader = create_shard_loader(cfg, "image-caption")
        batches = list(loader)
        # 80 samples / (5 × 2 nodes) = 8 global batches → 4 per worker, 8 per node, all full.
        assert loader.num_samples == 80 and len(loader) == 8 and len(batches) == 8
        assert all(len(batch["key"]) == 5 for batch in batches)
        seen += _keys(batches)
    assert sorted(seen) == [f"s{i:07d}" for i in range(80)]


def _read(cfg, kind="image-caption", **kwargs):
    """All batches of one epoch of a fresh loader."""
    return list(create_shard_loader(cfg, kind, **kwargs))


def test_training_epoch_rolls_over_to_fill_its_batches(tmp_path):
    split = _caption_split(tmp_path, "train", count=30, per_shard=10)
    cfg = ShardDataConfig(urls=str(split), batch_size=4, workers=2, samples_per_epoch=60, shuffle=False)
    batches = _read(cfg)
    # 60 / 4 = 15 batches → 8 per worker, 16 in all: each worker's shards are read again.
    assert len(batches) == 16 and all(len(batch["key"]) == 4 for batch in batches)
    assert set(_keys(batches)) == {f"s{i:07d}" for i in range(30)}


def test_same_seed_same_order_another_epoch_or_seed_another(tmp_path):
    split = _caption_split(tmp_path, "train", count=80, per_shard=10)

    def order(seed, epoch):
        loader = create_shard_loader(ShardDataConfig(urls=str(split), batch_size=5, workers=2,
                                                     shuffle_buffer=20, seed=seed), "image-caption")
        loader.set_epoch(epoch)
        return _keys(loader)

    first = order(seed=0, epoch=0)
    assert order(seed=0, epoch=0) == first  # fresh loader, fresh worker processes, same batches
    next_epoch, other_seed = order(seed=0, epoch=1), order(seed=1, epoch=0)
    assert next_epoch != first and other_seed != first
    assert sorted(next_epoch) == sorted(first) == sorted(other_seed) == [f"s{i:07d}" for i in range(80)]


def test_set_epoch_reaches_persistent_workers(tmp_path):
    split = _caption_split(tmp_path, "train", count=40, per_shard=10)
    loader = create_shard_loader(ShardDataConfig(urls=str(split), batch_size=5, workers=2, seed=7), "image-caption")
    epochs = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs.append(_keys(loader))
    assert epochs[0] != epochs[1] != epochs[2]
    again = create_shard_loader(ShardDataConfig(urls=str(split), batch_size=5, workers=2, seed=7), "image-caption")
    again.set_epoch(2)
    assert _keys(again) == epochs[2]


def test_resampled_stream_is_cut_into_repeatable_epochs(tmp_path):
    split = _caption_split(tmp_path, "train", count=20, per_shard=5)

    def order(epoch):
        cfg = ShardDataConfig(urls=str(split), batch_size=4, workers=2, resampled=True, samples_per_epoch=48,
                              shuffle_buffer=8, seed=1)
        loader = create_shard_loader(cfg, "image-caption")
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(loader) == 12 and len(batches) == 12  # 48 / 4 = 12 batches, 6 per worker
        return _keys(batches)

    first = order(0)
    assert len(first) == 48 and set(first) <= {f"s{i:07d}" for i in range(20)}
    assert len(set(first)) < 48  # drawn with replacement: an epoch repeats samples
    assert order(0) == first and order(1) != first


def test_urls_as_pattern_list_and_pipe(tmp_path):
    a = _caption_split(tmp_path, "a", count=20, per_shard=10)
    b = _caption_split(tmp_path, "b", count=10, per_shard=10)
    cfg = ShardDataConfig(urls=f"{a}/{{0..1}}.tar::{b}/0.tar", batch_size=5, workers=0, exact_epoch=True)
    loader = create_shard_loader(cfg, "image-caption")
    assert loader.num_samples == 30 and len(_keys(loader)) == 30  # sizes.json of both folders
    # A `pipe:` url has no sizes.json: a training epoch then needs its length.
    piped = f"pipe:cat {a}/0.tar::pipe:cat {a}/1.tar"
    with pytest.raises(UserError, match="set data.samples_per_epoch"):
        create_shard_loader(ShardDataConfig(urls=piped, batch_size=5, workers=2), "image-caption")
    loader = create_shard_loader(ShardDataConfig(urls=piped, batch_size=5, workers=2, samples_per_epoch=20,
                                                 shuffle=False), "image-caption")
    assert sorted(_keys(loader)) == [f"s{i:07d}" for i in range(20)]


def test_img2dataset_output_streams_with_its_epoch_length_from_the_stats(tmp_path):
    """img2dataset's folder as data.urls: 60 rows in shards of 20, every 7th a failed download (absent
    from the tars), and a fourth tar without its _stats.json (unfinished). The epoch length is the
    stats' successes (18 + 17 + 17 = 52), the `.json` members are read past, nothing counts as bad."""
    out = write_img2dataset_output(tmp_path / "laion", rows=60, rows_per_shard=20, unfinished_rows=4)
    assert out.successes == [18, 17, 17]
    training = create_shard_loader(ShardDataConfig(urls=str(out.folder), batch_size=8, workers=0), "image-caption")
    # 52 samples → ceil(52 / 8) = 7 batches of 8: the length a progress bar and the LR schedule take.
    assert (training.num_samples, training.num_batches, training.smallest_pass) == (56, 7, 52)
    exact = create_shard_loader(ShardDataConfig(urls=str(out.folder), batch_size=8, workers=2, shuffle=False,
                                                exact_epoch=True), "image-caption")
    # Worker 0 reads shards 0 and 2 (35 samples: 5 batches), worker 1 shard 1 (17: 3 batches).
    assert exact.num_samples == 52 and exact.num_batches == 8
    batches = list(exact)
    assert len(batches) == 8
    assert sorted(_keys(batches)) == out.keys  # every sample of the finished shards, none of the unfinished
    for batch in batches:
        assert set(batch) == {"image", "caption", "key"}  # the .json is not a field
        assert batch["image"].shape[1:] == (3, 28, 28)  # RGB JPEGs, as img2dataset writes them
        assert batch["caption"] == [out.captions[key] for key in batch["key"]]
    assert exact.metrics() == {"data/samples_read": 52, "data/bad_samples": 0}


def test_tars_listed_nowhere_take_their_epoch_length_from_a_count(tmp_path):
    out = write_img2dataset_output(tmp_path / "laion", rows=60, rows_per_shard=20)
    for tar in out.shards:
        tar.with_name(tar.stem + "_stats.json").unlink()
    urls = f"{out.folder}/{{00000..00002}}.tar"
    training = create_shard_loader(ShardDataConfig(urls=urls, batch_size=8, workers=0), "image-caption")
    assert (training.num_samples, training.num_batches) == (56, 7)  # 52 counted samples
    exact = create_shard_loader(ShardDataConfig(urls=urls, batch_size=8, workers=0, exact_epoch=True),
                                "image-caption")
    assert exact.num_batches == 7 and len(_keys(exact)) == 52 == len(out.keys)


# ---------------------------------------------------------------------------------------- bad samples


def _planted_split(tmp_path):
    """30 samples in 3 shards with 5 bad ones, plus a truncated 10-sample shard in another folder."""
    samples = [{"png": _png(i), "txt": f"caption {i}".encode()} for i in range(30)]
    del samples[3]["txt"], samples[14]["txt"]  # missing_txt ×2, in shards read by different workers
    samples[5]["png"] = b"\x89PNG\r\n\x1a\n but not an image"  # bad_image
    del samples[7]["png"]  # missing_image
    samples[21]["txt"] = b"\xff\xfe caption"  # bad_txt: not UTF-8
    write_split(samples, tmp_path, "planted", samples_per_shard=10)
    _caption_split(tmp_path, "damaged", count=10, per_shard=10, caption="damaged")
    tar = tmp_path / "damaged" / "0.tar"
    with tarfile.open(tar) as opened:
        cut = opened.getmember("s0000002.png").offset_data + 10
    tar.write_bytes(tar.read_bytes()[:cut])  # cut inside its 3rd sample's image
    return f"{tmp_path}/planted/{{0..2}}.tar::{tmp_path}/damaged/0.tar"


def test_bad_samples_and_shards_are_skipped_counted_and_warned_once(tmp_path, caplog):
    urls = _planted_split(tmp_path)
    cfg = ShardDataConfig(urls=urls, batch_size=4, workers=2, exact_epoch=True, max_bad_fraction=0.5, seed=5)
    loader = create_shard_loader(cfg, "image-caption")
    with caplog.at_level(logging.WARNING):
        captions = [caption for batch in loader for caption in batch["caption"]]
    bad = (3, 5, 7, 14, 21)
    expected = [f"caption {i}" for i in range(30) if i not in bad] + ["damaged 0", "damaged 1"]  # 2 before the cut
    assert sorted(captions) == sorted(expected)
    # The damaged shard: counted once, and the 8 samples its sizes.json lists after the cut as missing.
    assert loader.metrics() == {
        "data/samples_read": 32, "data/bad_samples": 14, "data/bad/bad_image": 1, "data/bad/bad_shard": 1,
        "data/bad/bad_txt": 1, "data/bad/missing_image": 1, "data/bad/missing_samples": 8, "data/bad/missing_txt": 2,
    }
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert sum(message.startswith("skipping missing_txt") for message in warnings) == 1  # 2 workers, 1 warning
    assert len(warnings) == 6  # one per reason
    assert any("s0000005" in message and "bad_image" in message for message in warnings)


def test_too_many_bad_samples_stop_the_run(tmp_path):
    urls = _planted_split(tmp_path)
    cfg = ShardDataConfig(urls=urls, batch_size=4, workers=2, exact_epoch=True, max_bad_fraction=0.05)
    # 32 read, 1 damaged shard, 8 samples it lost: 41 that should have been read.
    message = ("14 of 41 samples were bad (bad_image: 1, bad_shard: 1, bad_txt: 1, missing_image: 1, "
               "missing_samples: 8, missing_txt: 2), over max_bad_fraction=0.05; fix the shards or raise "
               "data.max_bad_fraction")
    with pytest.raises(UserError, match=re.escape(message)):
        _read(cfg)


def test_an_endless_stream_of_unusable_samples_stops(tmp_path):
    samples = [{"png": _png(i)} for i in range(40)]  # no captions at all
    write_split(samples, tmp_path, "nocaptions", samples_per_shard=10)
    cfg = ShardDataConfig(urls=str(tmp_path / "nocaptions"), batch_size=4, workers=2, max_bad_fraction=1.0)
    with pytest.raises(UserError, match=r"none of the first 1000 samples could be used \(missing_txt: 1000\)"):
        _read(cfg)
    (tmp_path / "junk").mkdir()
    for i in range(2):
        (tmp_path / "junk" / f"{i}.tar").write_bytes(b"not a tar file" * 100)
    cfg = ShardDataConfig(urls=f"{tmp_path}/junk/{{0..1}}.tar", batch_size=4, workers=1, samples_per_epoch=8,
                          max_bad_fraction=1.0)
    with pytest.raises(UserError, match="no sample could be read from 2 shards"):
        _read(cfg)


def test_a_shard_cut_at_a_sample_boundary_is_counted_and_stops_the_run(fmnist, tmp_path):
    """A tar cut at a member boundary reads as a complete, shorter archive: an epoch of 160 of the 200
    samples went by without a count, and training went on with a fifth of the split gone."""
    out, _, labels = fmnist
    split = copy_split(out / "test", tmp_path / "test")  # 4 shards of 50
    cut_at_sample(split / "2.tar", 10)
    kept = [*range(100 + 10), *range(150, 200)]
    cfg = ShardDataConfig(urls=str(split), batch_size=16, workers=2, exact_epoch=True, max_bad_fraction=0.5)
    loader = create_shard_loader(cfg, "image-class")
    batches = list(loader)
    keys = _keys(batches)
    assert sorted(keys) == [f"s{i:07d}" for i in kept]
    order = np.array([_index(key) for key in keys])
    assert torch.equal(torch.cat([batch["label"] for batch in batches]), torch.from_numpy(labels[order]).long())
    assert loader.metrics() == {"data/samples_read": 160, "data/bad_samples": 41, "data/bad/missing_samples": 40,
                                "data/bad/truncated_shard": 1}
    # 160 read + 1 truncated shard + 40 samples it lost: 201 that should have been read, 41 bad.
    message = ("41 of 201 samples were bad (missing_samples: 40, truncated_shard: 1), over max_bad_fraction=0.01; "
               "fix the shards or raise data.max_bad_fraction")
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        _read(dataclasses.replace(cfg, max_bad_fraction=0.01), "image-class")


# ---------------------------------------------------------------------------------------- config


def test_config_mistakes_are_one_clear_error(tmp_path):
    split = _caption_split(tmp_path, "train", count=20, per_shard=10)
    with pytest.raises(UserError, match="data.urls is empty"):
        create_shard_loader(ShardDataConfig(), "image-caption")
    with pytest.raises(UserError, match="unknown sample kind 'image-text'"):
        create_shard_loader(ShardDataConfig(urls=str(split)), "image-text")
    with pytest.raises(UserError, match="set only one of them"):
        create_shard_loader(ShardDataConfig(urls=str(split), exact_epoch=True, resampled=True), "image-caption")
    with pytest.raises(UserError, match="2 shards cannot feed 2 processes × 2 workers"):
        create_shard_loader(ShardDataConfig(urls=str(split), workers=2, rank=0, world_size=2), "image-caption")
    with pytest.raises(UserError, match="shards not found"):
        create_shard_loader(ShardDataConfig(urls=f"{split}/{{0..5}}.tar"), "image-caption")
    with pytest.raises(UserError, match=r"rank 2 is not in \[0, world_size=2\)"):
        create_shard_loader(ShardDataConfig(urls=str(split), rank=2, world_size=2), "image-caption")


def test_config_nests_in_a_typed_omegaconf_config():
    merged = OmegaConf.merge(OmegaConf.structured(ShardDataConfig),
                             OmegaConf.create({"urls": "d/{0..3}.tar", "batch_size": 8, "max_bad_fraction": 0.1}))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, ShardDataConfig) and (cfg.batch_size, cfg.max_bad_fraction) == (8, 0.1)


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist_shards(out, samples_per_shard=50, limit=200, allow_download=False)
    images, labels = read_fashion_mnist("test", allow_download=False)
    return out, images[:200], labels[:200]


def test_fashion_mnist_through_the_class_pipeline(fmnist):
    out, images, labels = fmnist
    cfg = ShardDataConfig(urls=str(out / "test"), batch_size=32, workers=2, exact_epoch=True)
    batches = _read(cfg, "image-class")
    keys = _keys(batches)
    assert sorted(keys) == [f"s{i:07d}" for i in range(200)]
    order = torch.tensor([_index(key) for key in keys])
    decoded = torch.cat([batch["image"] for batch in batches])  # (200, 1, 28, 28) uint8
    assert torch.equal(decoded[:, 0], torch.from_numpy(images[order.numpy()]))
    assert torch.equal(torch.cat([batch["label"] for batch in batches]), torch.from_numpy(labels[order.numpy()]).long())

    # A 3-channel tower at 32 px: the grayscale image resized once, copied to 3 channels, normalized.
    transform = eval_transform(32, in_channels=3, mean=0.5, std=0.25)
    batch = next(iter(create_shard_loader(ShardDataConfig(urls=str(out / "test"), batch_size=8, workers=0,
                                                          shuffle=False, exact_epoch=True),
                                          "image-class", transform=transform)))
    assert batch["image"].shape == (8, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert torch.equal(batch["image"][:, 0], batch["image"][:, 2])
    first = v2.functional.resize(torch.from_numpy(images[0].copy())[None], 32, antialias=True)
    assert torch.allclose(batch["image"][0, 0], (first[0] / 255 - 0.5) / 0.25, atol=1e-6)
    assert batch["label"].tolist() == labels[:8].tolist()


def test_fashion_mnist_captions_are_tokenized_in_the_workers(fmnist):
    out, _, labels = fmnist
    tokenizer = create_tokenizer("openclip-bpe", context_length=16)
    cfg = ShardDataConfig(urls=str(out / "train"), batch_size=16, workers=2, seed=2)
    loader = create_shard_loader(cfg, "image-caption", transform=eval_transform(28, in_channels=1), tokenizer=tokenizer)
    train_labels = read_fashion_mnist("train", allow_download=False)[1]
    batches = list(loader)
    assert len(batches) == len(loader) == 14  # ceil(ceil(200 / 16) / 2) = 7 per worker
    for batch in batches:
        assert batch["image"].shape == (16, 1, 28, 28) and batch["text"].shape == (16, 16)
        assert torch.equal(batch["text"], tokenizer(batch["caption"]))
        assert (batch["text"][:, 0] == 49406).all()
        for key, caption in zip(batch["key"], batch["caption"]):
            assert FASHION_MNIST_CLASSNAMES[train_labels[_index(key)]] in caption


def test_embedding_caption_shards_round_trip(tmp_path):
    embeddings = np.random.default_rng(0).standard_normal((24, 6)).astype(np.float32)
    samples = [embedding_caption_sample(embeddings[i], f"text {i}") for i in range(24)]
    samples[3]["npy"] = embedding_caption_sample(np.full(6, np.nan), "")["npy"]  # non-finite
    buffer = io.BytesIO()
    np.save(buffer, np.arange(6))
    samples[8]["npy"] = buffer.getvalue()  # integers
    samples[12]["npy"] = embedding_caption_sample(np.zeros(5), "")["npy"]  # another width
    samples[17]["npy"] = b"\x93NUMPY garbage"
    samples[20] = {"txt": b"text 20"}  # no embedding
    write_split(samples, tmp_path, "features", samples_per_shard=8)
    tokenizer = create_tokenizer("openclip-bpe", 16)
    cfg = ShardDataConfig(urls=str(tmp_path / "features"), batch_size=5, workers=1, exact_epoch=True,
                          shuffle=False, max_bad_fraction=0.25)
    loader = create_shard_loader(cfg, "embedding-caption", tokenizer=tokenizer)
    batches = list(loader)
    keys = _keys(batches)
    good = [i for i in range(24) if i not in (3, 8, 12, 17, 20)]
    assert keys == [f"s{i:07d}" for i in good]  # in order: no shuffle, one worker
    assert torch.equal(torch.cat([batch["embedding"] for batch in batches]), torch.from_numpy(embeddings[good]))
    assert [c for batch in batches for c in batch["caption"]] == [f"text {i}" for i in good]
    assert torch.equal(batches[0]["text"], tokenizer([f"text {i}" for i in good[:5]]))
    assert loader.metrics() == {"data/samples_read": 24, "data/bad_samples": 5, "data/bad/bad_npy": 4,
                                "data/bad/missing_npy": 1}
    with pytest.raises(UserError, match="reads no images"):
        create_shard_loader(cfg, "embedding-caption", transform=eval_transform(28))


def test_world_size_set_alone_takes_the_rank_from_the_launcher(tmp_path, monkeypatch):
    # Setting data.world_size without data.rank gave rank 0 to every process: all read the same shards.
    samples = [{"png": png_bytes(np.full((8, 8), i, np.uint8)), "txt": f"caption {i}".encode()} for i in range(8)]
    write_split(samples, tmp_path, "a", samples_per_shard=2)
    keys = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        cfg = ShardDataConfig(urls=str(tmp_path / "a"), batch_size=8, workers=0, shuffle=False, exact_epoch=True,
                              world_size=2)
        loader = create_shard_loader(cfg, "image-caption")
        keys[rank] = [key for batch in loader for key in batch["key"]]
        assert loader.rank == rank and loader.world_size == 2
    assert keys[0] == ["s0000000", "s0000001", "s0000004", "s0000005"]  # shards 0 and 2
    assert keys[1] == ["s0000002", "s0000003", "s0000006", "s0000007"]  # shards 1 and 3


def _npy(array, allow_pickle=False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def test_a_float64_feature_past_the_float32_range_is_a_bad_sample(tmp_path):
    """1e300 is finite as float64 and inf as the float32 that trains: it passed the finiteness check made
    before the cast, and a run on such a shard ended in "training diverged" far from its cause."""
    embeddings = np.arange(24, dtype=np.float64).reshape(4, 6) / 7  # float64 in range: read as float32
    samples = [{"npy": _npy(embeddings[i]), "txt": f"text {i}".encode()} for i in range(4)]
    samples[1]["npy"] = _npy(np.array([0.5, 1e300, 0, 0, 0, 0]))
    samples[2]["npy"] = _npy(np.array([0, 0, 0, -1e39, 0, 0]))  # just past float32's -3.4e38
    write_split(samples, tmp_path, "features")
    cfg = ShardDataConfig(urls=str(tmp_path / "features"), batch_size=4, workers=0, exact_epoch=True,
                          shuffle=False, max_bad_fraction=0.5)
    loader = create_shard_loader(cfg, "embedding-caption")
    batches = list(loader)
    assert _keys(batches) == ["s0000000", "s0000003"]
    embedding = torch.cat([batch["embedding"] for batch in batches])
    assert embedding.dtype == torch.float32
    assert torch.equal(embedding, torch.from_numpy(embeddings[[0, 3]].astype(np.float32)))
    assert loader.metrics() == {"data/samples_read": 4, "data/bad_samples": 2, "data/bad/bad_npy": 2}


def test_a_pickled_npy_is_a_bad_sample_whose_reason_never_suggests_allow_pickle(tmp_path, caplog):
    """numpy's error for an object array advises `allow_pickle=True`, which would run code from the
    shard's author: relayed in the warning, it read as the fix."""
    samples = [{"npy": _npy(np.ones(3, np.float32)), "txt": b"good"},
               {"npy": _npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), "txt": b"pickled"}]
    write_split(samples, tmp_path, "features")
    cfg = ShardDataConfig(urls=str(tmp_path / "features"), batch_size=2, workers=0, exact_epoch=True,
                          shuffle=False, max_bad_fraction=0.5)
    loader = create_shard_loader(cfg, "embedding-caption")
    with caplog.at_level(logging.WARNING):
        assert _keys(loader) == ["s0000000"]
    assert loader.metrics() == {"data/samples_read": 2, "data/bad_samples": 1, "data/bad/bad_npy": 1}
    (warning,) = [record.getMessage() for record in caplog.records if "bad_npy" in record.getMessage()]
    assert warning == "skipping bad_npy: s0000001 in {}: ValueError: holds Python objects, which are never " \
                      "unpickled (further ones are counted, not logged)".format(tmp_path / "features" / "0.tar")
    assert "allow_pickle" not in warning and "pickle.load" not in warning
