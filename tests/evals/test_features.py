"""lit_softmoe.evals.features: image features encoded in order by any number of workers, unreadable images
skipped and counted, and the feature cache: hit only when the tower, preprocessing, task and precision are
the same, verified by its checksum, and no reason to stop when it cannot be written."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from evalkit import (
    foolbox_images,
    needs_foolbox,
    raw_tar_samples,
    suite_config,
    tiny_pair,
    wds_set,
    write_wds_benchmark,
)
from img2dataset_shards import write_img2dataset_output
from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.evals.features import _collate, _streamed_batches, encode_eval_images
from lit_softmoe.evals.readers import read_benchmark
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info

pytestmark = needs_foolbox


def test_two_workers_give_the_same_features_in_the_same_order(fmnist):
    model, preprocess, _ = tiny_pair()
    data = read_benchmark("fashion-mnist", fmnist, "test", preprocess)
    one, labels_one, _ = encode_eval_images(model, data, 50, 0, torch.device("cpu"))
    two, labels_two, _ = encode_eval_images(model, data, 50, 2, torch.device("cpu"))
    assert labels_one == labels_two == [label for _, label in raw_tar_samples(fmnist / "test")]
    torch.testing.assert_close(one, two)


def test_the_progress_total_of_streamed_shards_is_the_batches_their_workers_yield(tmp_path):
    """Shards stream (no len()): the bar's total comes from the samples they list (img2dataset's
    _stats.json here: 52), split among the workers as they split the samples, each batching its own."""
    out = write_img2dataset_output(tmp_path / "downloads" / "laion", rows=60, rows_per_shard=20)
    data = read_benchmark("laion", out.folder.parent, out.folder.name, eval_transform(28, 1, 0.5, 0.25),
                          task="retrieval")
    assert data.listed_samples == 52
    for workers, batches in ((0, 11), (2, 12)):  # batches of 5: 52 → 11; 26 + 26 → 6 + 6, not ceil(52 / 5)
        loader = DataLoader(data.dataset, batch_size=5, num_workers=workers, collate_fn=_collate)
        assert _streamed_batches(data, 5, workers) == batches == len(list(loader))


def test_image_cache_reencodes_only_text(fmnist, tmp_path, monkeypatch):
    cfg = suite_config(fmnist, tmp_path / "cache")
    first = tiny_pair(seed=0)
    cold = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=first)["results"][0]
    # A new text tower against the same locked image tower: images come from the cache.
    second = tiny_pair(seed=1)
    second[0].image_tower.load_state_dict(first[0].image_tower.state_dict())
    calls = []
    forward = second[0].image_tower.forward_pooled
    monkeypatch.setattr(second[0].image_tower, "forward_pooled", lambda x: calls.append(len(x)) or forward(x))
    warm = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=second)["results"][0]
    assert (cold["image_cache"], warm["image_cache"]) == ("miss", "hit") and calls == []
    fresh = run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=second, use_cache=False)["results"][0]
    assert calls and fresh["image_cache"] == "off"
    assert warm["metrics"] == pytest.approx(fresh["metrics"], abs=1e-6)
    assert warm["metrics"] != cold["metrics"]  # the text tower did change the answers


def test_cache_misses_when_the_tower_or_preprocessing_changes(fmnist, tmp_path):
    cfg = suite_config(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    with torch.no_grad():
        model.image_tower.patch_embed.weight[0, 0, 0, 0] += 1.0
    changed = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=(model, preprocess, tokenizer))
    assert changed["results"][0]["image_cache"] == "miss"
    model.pretrained_info = {"image_tower_sha256": "abc", "preprocess": {"mean": [0.5]}}
    run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=(model, preprocess, tokenizer))
    model.pretrained_info = {"image_tower_sha256": "abc", "preprocess": {"mean": [0.4]}}
    other = run_suite("m", cfg, out=tmp_path / "d.json", model_bundle=(model, preprocess, tokenizer))
    assert other["results"][0]["image_cache"] == "miss"


def test_unreadable_images_are_skipped_and_counted(tmp_path):
    images = foolbox_images("cifar10")[:5]
    samples = [(p.read_bytes(), "png", label) for p, label in images]
    samples[2] = (samples[2][0][:60], "png", samples[2][2])  # truncated PNG
    root = write_wds_benchmark(tmp_path / "c10", samples, classnames=list(benchmark_info("cifar10").classnames))
    report = run_suite("m", suite_config(root, tmp_path / "cache", name="cifar10"), out=tmp_path / "r.json",
                       model_bundle=tiny_pair(in_channels=3, image_size=32))
    entry = report["results"][0]
    assert entry["num_samples"] == 4 and entry["bad_samples"] == 1
    assert entry["templates"]["from"] == "cifar10" and entry["templates"]["borrowed"] is False


def test_bf16_is_cached_apart_and_stays_close(fmnist, tmp_path):
    bundle = tiny_pair()
    fp32 = run_suite("m", suite_config(fmnist, tmp_path / "cache"), out=tmp_path / "a.json", model_bundle=bundle)
    cfg = suite_config(fmnist, tmp_path / "cache")
    cfg.precision = "bf16"
    bf16 = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)
    assert bf16["results"][0]["image_cache"] == "miss"  # other numbers, other cache entry
    assert abs(bf16["results"][0]["metrics"]["top1"] - fp32["results"][0]["metrics"]["top1"]) < 0.05


def test_a_handed_in_model_is_keyed_by_its_weights_not_its_recorded_hash(fmnist, tmp_path):
    cfg = suite_config(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    model.pretrained_info = {"image_tower_sha256": "recorded", "preprocess": {}}
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    with torch.no_grad():
        model.image_tower.patch_embed.weight.mul_(2)  # changed in memory; the recorded hash is now stale
    again = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=(model, preprocess, tokenizer))
    assert again["results"][0]["image_cache"] == "miss"


def test_the_cache_is_keyed_by_task(fmnist, tmp_path):
    # The cache holds the targets too: the same shards read as classification (class indices) and as
    # retrieval (captions) must not share an entry, in either order.
    bundle = tiny_pair()
    for first, second in (("classification", "retrieval"), ("retrieval", "classification")):
        cache = tmp_path / f"cache-{first}"
        a = run_suite("m", suite_config(fmnist, cache, task=first), out=tmp_path / f"{first}-a.json",
                      model_bundle=bundle)
        b = run_suite("m", suite_config(fmnist, cache, task=second), out=tmp_path / f"{first}-b.json",
                      model_bundle=bundle)
        assert [e["task"] for e in (a["results"][0], b["results"][0])] == [first, second]
        assert b["results"][0]["status"] == "ok" and b["results"][0]["image_cache"] == "miss"


def test_the_cache_is_keyed_by_the_transform_of_a_handed_in_model(fmnist, tmp_path):
    # No pretrained_info, so no recorded preprocessing: the transform the images went through decides.
    cfg = suite_config(fmnist, tmp_path / "cache")
    model, preprocess, tokenizer = tiny_pair()
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=(model, preprocess, tokenizer))
    same = run_suite(
        "m", cfg, out=tmp_path / "b.json", model_bundle=(model, eval_transform(28, 1, 0.5, 0.25), tokenizer)
    )
    other = run_suite("m", cfg, out=tmp_path / "c.json",
                      model_bundle=(model, eval_transform(28, 1, 0.4, 0.25), tokenizer))
    assert same["results"][0]["image_cache"] == "hit" and other["results"][0]["image_cache"] == "miss"


def test_a_cache_that_cannot_be_written_does_not_end_the_suite(tmp_path, caplog):
    # A read-only ~/.cache (containers) or a cache_dir that is a file raised after every image was encoded.
    root = wds_set(tmp_path / "cifar10")
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(blocker),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and entry["image_cache"] == "off"
    assert "not cached" in caplog.text and str(blocker) in caplog.text


def _replace_with_zeros(entry) -> None:
    """A valid safetensors file of the right shape holding other numbers: only the checksum tells."""
    from safetensors.torch import load_file, save_file
    features = load_file(entry / "features.safetensors")["features"]
    save_file({"features": torch.zeros_like(features)}, entry / "features.safetensors")


def _truncate(entry) -> None:
    data = (entry / "features.safetensors").read_bytes()
    (entry / "features.safetensors").write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage", [_replace_with_zeros, _truncate], ids=["other-numbers", "truncated"])
def test_a_damaged_cache_entry_is_said_and_encoded_again_to_a_fresh_evals_numbers(fmnist, tmp_path, caplog, damage):
    """A truncated entry crashed every later eval of its benchmark; one holding other numbers was a
    silent "hit" with wrong metrics."""
    cfg, bundle = suite_config(fmnist, tmp_path / "cache"), tiny_pair()
    run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=bundle)
    [entry] = [p.parent for p in (tmp_path / "cache").glob("*/features.safetensors")]
    damage(entry)
    with caplog.at_level("WARNING"):
        rebuilt = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)["results"][0]
    fresh = run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=bundle, use_cache=False)["results"][0]
    assert rebuilt["status"] == "ok" and rebuilt["image_cache"] == "miss"
    assert rebuilt["metrics"] == fresh["metrics"] and rebuilt["num_samples"] == fresh["num_samples"] == 300
    assert f"ignoring the damaged image-feature cache entry {entry}" in caplog.text
    again = run_suite("m", cfg, out=tmp_path / "d.json", model_bundle=bundle)["results"][0]
    assert again["image_cache"] == "hit" and again["metrics"] == fresh["metrics"]  # written anew, whole


def test_a_cache_entry_holding_another_entrys_files_is_said_and_encoded_again(fmnist, tmp_path, caplog):
    """Both files of an entry copied from another entry (another tower's features): each verified the other,
    and the eval reported the other tower's top-1 as this one's."""
    import shutil
    cfg = suite_config(fmnist, tmp_path / "cache")
    bundle, other = tiny_pair(), tiny_pair()
    with torch.no_grad():
        other[0].image_tower.patch_embed.weight.add_(0.5)
    fresh = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=bundle)["results"][0]
    [entry] = [p.parent for p in (tmp_path / "cache").glob("*/features.safetensors")]
    run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=other)
    [other_entry] = [p.parent for p in (tmp_path / "cache").glob("*/features.safetensors") if p.parent != entry]
    for name in ("meta.json", "features.safetensors"):
        shutil.copy(other_entry / name, entry / name)
    with caplog.at_level("WARNING"):
        again = run_suite("m", cfg, out=tmp_path / "c.json", model_bundle=bundle)["results"][0]
    assert again["image_cache"] == "miss" and again["metrics"] == fresh["metrics"]
    assert f"ignoring the damaged image-feature cache entry {entry} (ValueError: meta.json is of the entry " \
           f"{other_entry.name} (copied from another entry))" in caplog.text


@pytest.mark.parametrize("error", ["safetensors", "oserror"])
def test_a_full_disk_while_caching_features_still_returns_the_result(fmnist, tmp_path, caplog, monkeypatch, error):
    """safetensors reports a full disk in its own SafetensorError, not an OSError: it ended the eval in a
    traceback after all the images were encoded (an OSError was already a warning)."""
    import errno

    from safetensors import SafetensorError

    from lit_softmoe.evals import features

    def full(tensors, path, *args, **kwargs):
        if error == "safetensors":
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    cfg, bundle = suite_config(fmnist, tmp_path / "cache"), tiny_pair()
    fresh = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=bundle, use_cache=False)["results"][0]
    monkeypatch.setattr(features, "save_file", full)
    entry = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)["results"][0]
    assert entry["status"] == "ok" and entry["image_cache"] == "off" and entry["metrics"] == fresh["metrics"]
    assert "image features of fashion-mnist not cached" in caplog.text and "No space left" in caplog.text
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no half entry left


def test_the_images_are_read_once(fmnist, monkeypatch):
    """tqdm.auto's class calls iter() on what it wraps in its constructor and again when iterated: the
    DataLoader started its workers (or read its first samples) twice for every benchmark."""
    from lit_softmoe.evals import readers
    model, preprocess, _ = tiny_pair()
    data = read_benchmark("fashion-mnist", fmnist, "test", preprocess)
    calls = []
    real_iter = type(data.dataset).__iter__
    monkeypatch.setattr(type(data.dataset), "__iter__", lambda self: calls.append(1) or real_iter(self))
    features, labels, _ = encode_eval_images(model, data, 50, 0, torch.device("cpu"), progress=True)
    assert len(calls) == 1 and len(labels) == features.shape[0] > 0
    assert isinstance(data.dataset, readers._TarSamples)


def test_a_damaged_shard_is_warned_about_by_one_of_the_workers(tmp_path, monkeypatch, caplog):
    """Every worker reads every tar of a webdataset split (each decodes its share): each warned about the
    same damaged shard, once per worker."""
    import tarfile
    import types

    from lit_softmoe.evals import readers
    root = wds_set(tmp_path / "cifar10")
    tar = root / "test" / "0.tar"
    with tarfile.open(tar) as archive:
        cut = archive.getmembers()[4].offset_data + 10
    tar.write_bytes(tar.read_bytes()[:cut])  # cut inside a member's data
    data = read_benchmark("cifar10", root, "test", eval_transform(32, 3))
    warned = {}
    for worker in (0, 1):
        monkeypatch.setattr(readers, "get_worker_info", lambda worker=worker: types.SimpleNamespace(id=worker,
                                                                                                  num_workers=2))
        caplog.clear()
        list(data.dataset)
        warned[worker] = [r.getMessage() for r in caplog.records if "bad_shard" in r.getMessage()]
    assert len(warned[0]) == 1 and str(tar) in warned[0][0] and warned[1] == []


def test_a_shard_cut_inside_a_sample_marks_the_result_partial(tmp_path):
    """Without a sizes.json the samples of a cut tar are counted up to the cut, so reading fewer than listed
    never showed: the result was published as whole, the damaged shard in no count."""
    import tarfile
    root = wds_set(tmp_path / "cifar10")
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    whole = run_suite("m", cfg, out=tmp_path / "whole.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert whole["bad_shards"] == 0 and "partial" not in whole
    tar = root / "test" / "0.tar"
    with tarfile.open(tar) as archive:
        cut = archive.getmembers()[4].offset_data + 10
    tar.write_bytes(tar.read_bytes()[:cut])
    entry = run_suite("m", cfg, out=tmp_path / "cut.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and entry["bad_shards"] == 1 and entry["num_samples"] < whole["num_samples"]
    assert entry["partial"].startswith(f"1 shard(s) end inside a sample (first: {tar})")


@pytest.mark.parametrize("content", [b"", b"<html>404 Not Found</html>\n" * 40], ids=["zero bytes", "a text file"])
def test_a_shard_that_is_no_tar_at_all_is_said_to_be_none(tmp_path, content):
    """An empty file or a saved error page under a shard's name was described as a shard that "ends inside
    a sample"; it is no tar archive, and gave no sample."""
    images = foolbox_images("cifar10")[:6]
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label) for p, label in images],
                               classnames=list(benchmark_info("cifar10").classnames),
                               templates=["a photo of a {c}."], per_shard=3)
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    tar = root / "test" / "1.tar"
    tar.write_bytes(content)
    entry = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "ok" and entry["bad_shards"] == 1 and entry["num_samples"] == 3
    assert entry["partial"].startswith(f"1 shard(s) are no tar archive at all (empty, or another kind of file; "
                                       f"first: {tar}) and gave no sample")
    assert "end inside a sample" not in entry["partial"]


def test_a_set_whose_every_shard_is_unreadable_is_skipped_naming_no_false_count(tmp_path):
    """A set whose one shard is no tar (a gzip of it) was skipped as "no readable images (0 unreadable)", right
    after the shard was counted and named as bad."""
    import gzip
    images = foolbox_images("cifar10")[:3]
    root = write_wds_benchmark(tmp_path / "cifar10", [(p.read_bytes(), "png", label) for p, label in images],
                               classnames=list(benchmark_info("cifar10").classnames),
                               templates=["a photo of a {c}."], per_shard=3)
    tar = root / "test" / "0.tar"
    tar.write_bytes(gzip.compress(tar.read_bytes()))
    cfg = EvalSuiteConfig(name="s", workers=0, cache_dir=str(tmp_path / "c"),
                          benchmarks=[BenchmarkConfig(name="cifar10", root=str(root))])
    entry = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["status"] == "skipped"
    assert entry["reason"] == (f"no readable images in {root} (no sample could be read: see the shards named "
                               "above)")
