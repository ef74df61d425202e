"""lit_softmoe.data.class_batches: a classification split's training batches, streamed from its shards
by several processes and workers (each sample once per epoch, equal steps, exact mid-epoch restart,
a sample's random crop a function of its key), and the reads the evaluation makes of a streamed split."""
from __future__ import annotations

import collections

import pytest
import torch

from lit_softmoe.data.class_batches import StreamedClassBatches, read_samples, split_batches, split_labels
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.data.shards import shard_urls
from lit_softmoe.data.transforms import eval_transform, train_transform
from lit_softmoe.errors import UserError

NUM_TRAIN = 600  # in 5 shards of 128 (the last holds 88): shares of unequal size
SHARD = 128


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("class_batches")
    write_fashion_mnist_shards(out, limit=NUM_TRAIN, samples_per_shard=SHARD, allow_download=False)
    return out / "train"


def _crop():
    return train_transform(28, 1, random_resized_crop=True, scale=(0.3, 1.0), normalize=False)


def _stream(split, rank=0, world_size=1, workers=0, global_batch=64, transform=None, seed=3):
    return StreamedClassBatches(str(split), global_batch, transform or _crop(), seed=seed, rank=rank,
                                world_size=world_size, workers=workers, shuffle_buffer=100)


def _all_keys(split) -> set[str]:
    batches, _ = split_batches(str(split), eval_transform(28, 1, normalize=False), 256, workers=0)
    return {key for batch in batches for key in batch.keys}


def test_two_processes_read_each_sample_once_in_equal_steps_padding_only_what_equal_batches_need(split):
    keys = _all_keys(split)
    assert len(keys) == NUM_TRAIN
    ranks = [_stream(split, rank, 2, workers=2) for rank in range(2)]
    assert ranks[0].steps_per_epoch == ranks[1].steps_per_epoch
    for epoch in (0, 1):
        seen = [[key for batch in r.epoch(epoch) for key in batch.keys] for r in ranks]
        assert all(len(s) == ranks[0].steps_per_epoch * 32 for s in seen)  # equal steps of the local batch
        assert set(seen[0]) | set(seen[1]) == keys  # the union is the training set
        assert not set(seen[0]) & set(seen[1])  # shards are split between processes
        repeats = sum(count - 1 for s in seen for count in collections.Counter(s).values())
        # Padding: the two processes together yield this many more than the set, and no more.
        assert repeats == sum(map(len, seen)) - NUM_TRAIN
        # The largest share (3 shards of 128) fixes the steps: ceil(384 / 32) = 12.
        assert ranks[0].steps_per_epoch == 12


def test_a_restart_mid_epoch_yields_the_batches_the_uninterrupted_epoch_yields_from_there(split):
    stream = _stream(split, workers=2)
    whole = list(stream.epoch(1))
    resumed = list(_stream(split, workers=2).epoch(1, start=5))
    assert len(resumed) == len(whole) - 5 == stream.steps_per_epoch - 5
    for a, b in zip(whole[5:], resumed):
        assert a.keys == b.keys
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    # Another epoch is another order and other crops.
    other = next(stream.epoch(2))
    assert other.keys != whole[0].keys


def test_a_samples_random_crop_is_a_function_of_seed_epoch_and_key_alone(split):
    """Workers read other shards in another order, yet each sample gets the same crop."""
    def crops(workers, epoch=0, seed=3):
        return {key: image for batch in _stream(split, workers=workers, seed=seed).epoch(epoch)
                for key, image in zip(batch.keys, batch.images)}

    one, two = crops(0), crops(2)
    assert one.keys() == two.keys()
    assert all(torch.equal(one[key], two[key]) for key in one)
    # The crop is random: another epoch or seed moves it for most samples.
    for other in (crops(0, epoch=1), crops(0, seed=4)):
        assert sum(not torch.equal(one[key], other[key]) for key in one) > 0.8 * len(one)


def test_more_processes_than_shards_is_one_line(split):
    with pytest.raises(UserError, match="5 shards cannot feed 6 processes"):
        _stream(split, 0, 6, global_batch=60)


def test_the_labels_pass_and_the_shots_read_agree_with_the_split_in_memory(split):
    images, labels, _ = load_class_split(split, cache=False)
    assert torch.equal(split_labels(str(split)), labels)
    positions = [5, 0, 599, 130]
    got_images, got_labels = read_samples(str(split), positions, eval_transform(28, 1, normalize=False))
    assert torch.equal(got_labels, labels[positions])
    assert torch.equal(got_images, images[positions])  # 28 px: the eval transform keeps the pixels
    # A class index past the class names is left out of the labels (bad_cls), not passed on.
    assert len(split_labels(str(split), num_classes=5)) == int((labels < 5).sum())


def test_split_batches_read_a_split_once_in_shard_order(split):
    batches, loader = split_batches(str(split), eval_transform(28, 1, normalize=False), 100, workers=2)
    read = list(batches)
    images, labels, _ = load_class_split(split, cache=False)
    assert sum(len(b.labels) for b in read) == NUM_TRAIN
    assert len(shard_urls(str(split))) == 5 and loader.bad.total == 0
    # Two workers read alternate shards; by key the samples are the split's.
    by_key = {key: (image, label) for b in read for key, image, label in zip(b.keys, b.images, b.labels)}
    assert len(by_key) == NUM_TRAIN
    assert sorted(int(label) for _, label in by_key.values()) == sorted(labels.tolist())
