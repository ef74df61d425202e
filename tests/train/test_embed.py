"""lit_softmoe.train.embed: the frozen-embedding cache: feature shards equal the tower's output on the source
images, keep every key, caption and class, are skipped on a rerun, and are refused for another tower."""
from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import time

import numpy as np
import PIL.Image
import pytest
import torch
import webdataset as wds

from launch import kill_process, python_command, torchrun_args
from lit_softmoe.cli import main
from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
from lit_softmoe.data.feature_cache import check_feature_cache
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import shard_urls, write_split
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower, tower_fingerprint
from lit_softmoe.train.embed import embed_shards, rerun_command
from shard_cuts import cut_before_sample
from shared_builds import built_once

LIMIT = 300
PREPROCESS = {"image_size": 28, "mean": [0.286], "std": [0.353]}


def _read_raw(spec) -> dict[str, dict]:
    """{key: {extension: bytes}} of every sample in the shards, asserting each key appears once."""
    samples = {}
    for sample in wds.DataPipeline(wds.SimpleShardList(shard_urls(spec)), wds.tarfile_to_samples()):
        assert sample["__key__"] not in samples
        samples[sample["__key__"]] = sample
    return samples


def _save_test_tower(path, seed: int):
    torch.manual_seed(seed)
    tower = create_image_tower("soft-test-4e", num_classes=10).eval()
    save_tower(path, tower, extra={"preprocess": PREPROCESS})
    return tower


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    write_fashion_mnist_shards(root / "fmnist", samples_per_shard=128, limit=LIMIT, allow_download=False)
    tower = _save_test_tower(root / "tower", seed=0)
    summary = embed_shards(root / "tower", str(root / "fmnist" / "test"), root / "features", batch_size=64)
    return {"root": root, "tower": tower, "summary": summary}


def test_a_split_folder_holding_another_splits_cache_is_refused(cache, tmp_path):
    """train's split folder with the test split's feature shards and embed.json copied in: every file verified
    against the other, and `train` trained on the test split's features without a word."""
    root = cache["root"]
    shutil.copytree(root / "features" / "test", tmp_path / "train")
    with pytest.raises(UserError) as refused:
        check_feature_cache(tmp_path / "train", root / "tower", rerun_command)  # as `train` does
    assert str(refused.value).startswith(
        f"feature cache {tmp_path / 'train'} holds the split 'test' (so says its embed.json: another split's cache "
        "copied or moved here); rename the folder back to test, or rerun `lit-softmoe embed")
    check_feature_cache(root / "features" / "test", root / "tower")  # where it was embedded, it verifies


def test_features_equal_the_tower_on_the_source_images(cache):
    root, tower = cache["root"], cache["tower"]
    assert cache["summary"]["split_dir"] == str(root / "features" / "test")  # split named after the source's
    assert cache["summary"]["num_samples"] == LIMIT and not cache["summary"]["skipped"]
    source, features = _read_raw(root / "fmnist" / "test"), _read_raw(root / "features" / "test")
    assert sorted(features) == sorted(source)  # every key once, none made up

    transform = eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"])
    keys = sorted(source)
    images = torch.stack([transform(PIL.Image.open(io.BytesIO(source[key]["png"]))) for key in keys])
    with torch.inference_mode():
        expected = tower.forward_pooled(images)  # (N, 32)
    cached = np.stack([np.load(io.BytesIO(features[key]["npy"])) for key in keys])
    assert cached.dtype == np.float16 and cached.shape == (LIMIT, 32)
    torch.testing.assert_close(torch.from_numpy(cached).float(), expected, rtol=2e-3, atol=2e-3)
    for key in keys:
        assert features[key]["txt"] == source[key]["txt"]
        assert features[key]["cls"] == source[key]["cls"]


def test_embedding_pipeline_reads_the_cache(cache):
    data = ShardDataConfig(urls=str(cache["root"] / "features" / "test"), batch_size=128, workers=0,
                           shuffle=False, exact_epoch=True)
    batches = list(create_shard_loader(data, "embedding-caption"))
    assert sum(len(batch["key"]) for batch in batches) == LIMIT
    assert batches[0]["embedding"].dtype == torch.float32 and batches[0]["embedding"].shape[1] == 32


def test_embed_json_holds_the_fingerprint_and_metadata_is_copied(cache):
    root = cache["root"]
    info = json.loads((root / "features" / "test" / "embed.json").read_text())
    fingerprint = tower_fingerprint(root / "tower")
    assert {key: info[key] for key in fingerprint} == fingerprint
    assert len(fingerprint["tower_sha256"]) == 64 and fingerprint["preprocess"] == PREPROCESS
    assert fingerprint["tower"]["num_experts"] == 4
    assert info["source"] == str(root / "fmnist" / "test") and info["num_samples"] == LIMIT and info["dim"] == 32
    assert check_feature_cache(root / "features" / "test", root / "tower")["num_samples"] == LIMIT
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        assert (root / "features" / name).read_text() == (root / "fmnist" / name).read_text()


def test_rerun_with_the_same_tower_is_skipped(cache):
    root = cache["root"]
    tars = sorted((root / "features" / "test").glob("*.tar"))
    before = [path.stat().st_mtime_ns for path in tars]
    again = embed_shards(root / "tower", str(root / "fmnist" / "test"), root / "features")
    assert again["skipped"] and again["num_samples"] == LIMIT
    assert [path.stat().st_mtime_ns for path in tars] == before


def test_another_tower_is_refused_then_rewritten(cache, tmp_path):
    root = cache["root"]
    other = _save_test_tower(tmp_path / "other", seed=1)
    with pytest.raises(UserError, match=r"made with another tower \(sha \w+ vs \w+\) or preprocessing; "
                                        r"rerun `lit-softmoe embed --tower .*other --shards .*test --out "):
        check_feature_cache(root / "features" / "test", tmp_path / "other", rerun_command)
    with pytest.raises(UserError) as refused:  # a Python caller's words: no command's flags
        check_feature_cache(root / "features" / "test", tmp_path / "other")
    assert str(refused.value).endswith(
        f"or preprocessing; embed {root / 'fmnist' / 'test'} with the tower {tmp_path / 'other'} "
        f"into {root / 'features' / 'test'} again")

    out = tmp_path / "features"
    embed_shards(root / "tower", str(root / "fmnist" / "test"), out)
    rewritten = embed_shards(tmp_path / "other", str(root / "fmnist" / "test"), out)
    assert not rewritten["skipped"]
    check_feature_cache(out / "test", tmp_path / "other")  # now the cache matches the new tower
    first = sorted(_read_raw(out / "test").items())[0][1]
    image = PIL.Image.open(io.BytesIO(_read_raw(root / "fmnist" / "test")[first["__key__"]]["png"]))
    with torch.inference_mode():
        expected = other.forward_pooled(eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"])(image)[None])
    torch.testing.assert_close(torch.from_numpy(np.load(io.BytesIO(first["npy"]))).float(), expected[0],
                               rtol=2e-3, atol=2e-3)


def test_changed_preprocessing_is_refused(cache, tmp_path):
    shutil.copytree(cache["root"] / "tower", tmp_path / "tower")
    config = json.loads((tmp_path / "tower" / "config.json").read_text())
    config["preprocess"]["mean"] = [0.5]  # same weights, other normalization: other embeddings
    (tmp_path / "tower" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="made with another tower .* or preprocessing"):
        check_feature_cache(cache["root"] / "features" / "test", tmp_path / "tower")


def test_a_rewritten_source_is_refused_and_a_deleted_one_is_not(cache, tmp_path):
    # A copy of the source, so the shared fixture's shards stay as they are.
    source = tmp_path / "fmnist" / "test"
    shutil.copytree(cache["root"] / "fmnist" / "test", source)
    embed_shards(cache["root"] / "tower", str(source), tmp_path / "features", batch_size=64)
    features = tmp_path / "features" / "test"
    recorded = json.loads((features / "embed.json").read_text())["source_stats"]
    assert sorted(recorded) == sorted(str(path.resolve()) for path in source.glob("*.tar"))
    assert check_feature_cache(features, cache["root"] / "tower")["num_samples"] == LIMIT

    rewritten = sorted(source.glob("*.tar"))[1]
    stat = rewritten.stat()
    os.utime(rewritten, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten: same size, newer
    with pytest.raises(UserError, match=rf"is older than its source: .*{rewritten.name} changed since it was "
                                        r"embedded; rerun `lit-softmoe embed --tower "):
        check_feature_cache(features, cache["root"] / "tower", rerun_command)

    shutil.rmtree(source)  # the images dropped once their features are cached: the cache still serves
    assert check_feature_cache(features, cache["root"] / "tower")["num_samples"] == LIMIT


def test_a_same_size_edit_whose_mtime_was_put_back_is_embedded_again(cache, tmp_path):
    """Tools that keep mtimes (`touch -r`, `os.utime`, some syncs) leave size and mtime as they were: the
    cache keys each source by its ctime too, which any write changes."""
    import tarfile
    source = tmp_path / "fmnist" / "test"
    shutil.copytree(cache["root"] / "fmnist" / "test", source)
    embed_shards(cache["root"] / "tower", str(source), tmp_path / "features", batch_size=64)
    features = tmp_path / "features" / "test"

    edited = sorted(source.glob("*.tar"))[0]
    with tarfile.open(edited) as tar:
        member = next(member for member in tar.getmembers() if member.name.endswith(".txt"))
        key, caption = member.name[:-len(".txt")], tar.extractfile(member).read()
    stat = edited.stat()
    with open(edited, "r+b") as stream:  # one byte of one caption, in place: same size
        stream.seek(member.offset_data)
        stream.write(b"X")
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (edited.stat().st_size, edited.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    with pytest.raises(UserError, match=rf"is older than its source: .*{edited.name} changed since it was embedded"):
        check_feature_cache(features, cache["root"] / "tower")
    summary = embed_shards(cache["root"] / "tower", str(source), tmp_path / "features", batch_size=64)
    assert not summary["skipped"] and summary["num_samples"] == LIMIT
    assert _read_raw(features)[key]["txt"] == b"X" + caption[1:]  # the cache holds the edited caption
    assert check_feature_cache(features, cache["root"] / "tower")["num_samples"] == LIMIT


def test_a_folder_without_embed_json_is_refused(cache, tmp_path):
    with pytest.raises(UserError, match="has no embed.json"):
        check_feature_cache(cache["root"] / "fmnist" / "test", cache["root"] / "tower")


def test_bad_samples_are_skipped_and_counted(cache, tmp_path):
    source = _read_raw(cache["root"] / "fmnist" / "train")
    samples = [{key: value for key, value in sample.items() if not key.startswith("__")} | {"__key__": key}
               for key, sample in sorted(source.items())[:20]]
    samples[3]["png"] = b"not a png"
    del samples[7]["txt"]
    write_split(samples, tmp_path / "broken", "train", keep_keys=True)
    summary = embed_shards(cache["root"] / "tower", str(tmp_path / "broken" / "train"), tmp_path / "out",
                           max_bad_fraction=0.5)
    assert summary["num_samples"] == 18 and summary["bad"] == {"bad_image": 1, "missing_txt": 1}
    assert len(_read_raw(tmp_path / "out" / "train")) == 18


def test_cli_summary_line_and_missing_tower(cache, tmp_path, capsys):
    root = cache["root"]
    args = ["embed", "--shards", str(root / "fmnist" / "test"), "--out", str(root / "features")]
    assert main([*args, "--tower", str(root / "tower")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{LIMIT} embeddings (dim 32") and "already there" in out[0]

    assert main([*args, "--tower", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lit-softmoe embed: error:") and "not a tower checkpoint" in err[0]


@pytest.mark.parametrize("images,seconds,shown", [(10_000, 3.0, "3,333 images/s"), (3, 75.0, "0.04 images/s")])
def test_the_summary_line_shows_slow_rates_too(cache, tmp_path, capsys, monkeypatch, images, seconds, shown):
    """A large tower on a CPU embeds under one image a second: the rate was rounded to one decimal, then
    printed whole, as '0 images/s'."""
    import lit_softmoe.train.embed as embed_module
    from lit_softmoe.train.embed import per_second
    rate = per_second(images, seconds)
    assert rate == pytest.approx(images / seconds, rel=1e-2) and rate > 0
    summary = {"rank": 0, "world_size": 1, "resumed_shards": 0, "skipped": False, "seconds": seconds,
               "images_per_second": rate, "bad": {}, "num_samples": images, "dim": 32, "split_dir": "out/test"}
    monkeypatch.setattr(embed_module, "embed_shards", lambda *args, **kwargs: summary)
    assert main(["embed", "--tower", str(cache["root"] / "tower"), "--shards", str(cache["root"] / "fmnist" / "test"),
                 "--out", str(tmp_path / "out")]) == 0
    assert f"({shown})" in capsys.readouterr().out


def test_rewritten_source_shards_are_embedded_again(cache, tmp_path):
    # Same tower, same source path, new data there: the old features must not be kept.
    root = cache["root"]
    source = tmp_path / "fmnist"
    write_fashion_mnist_shards(source, samples_per_shard=128, limit=LIMIT, allow_download=False)
    first = embed_shards(root / "tower", str(source / "test"), tmp_path / "features", batch_size=64)
    write_fashion_mnist_shards(source, samples_per_shard=50, limit=100, allow_download=False)  # regenerated
    second = embed_shards(root / "tower", str(source / "test"), tmp_path / "features", batch_size=64)
    assert (first["num_samples"], first["skipped"]) == (LIMIT, False)
    assert (second["num_samples"], second["skipped"]) == (100, False)
    assert len(_read_raw(tmp_path / "features" / "test")) == 100
    assert embed_shards(root / "tower", str(source / "test"), tmp_path / "features")["skipped"]  # unchanged now


def test_feature_shards_as_source_are_refused_in_one_line(cache, tmp_path, capsys):
    # This said "raise data.max_bad_fraction", an option embed does not have.
    root = cache["root"]
    args = ["embed", "--tower", str(root / "tower"), "--out", str(tmp_path / "out")]
    assert main([*args, "--shards", str(root / "features" / "test")]) == 2
    err = capsys.readouterr().err
    assert err == (f"lit-softmoe embed: error: {root / 'features' / 'test'} holds feature shards written by "
                   f"`lit-softmoe embed`, not images; pass the image shards to embed (these came from --shards "
                   f"{root / 'fmnist' / 'test'})\n")
    # Without their embed.json (copied elsewhere), the samples themselves tell.
    shutil.copytree(root / "features" / "test", tmp_path / "copied")
    (tmp_path / "copied" / "embed.json").unlink()
    with pytest.raises(UserError, match=r"copied holds feature shards written by `lit-softmoe embed`, not "
                                        r"images; pass the image shards to embed$"):
        embed_shards(root / "tower", str(tmp_path / "copied"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_too_many_bad_samples_name_no_option_embed_lacks(cache, tmp_path):
    source = _read_raw(cache["root"] / "fmnist" / "train")
    samples = [{key: value for key, value in sample.items() if not key.startswith("__")} | {"__key__": key}
               for key, sample in sorted(source.items())[:40]]
    for sample in samples[:20]:
        sample["png"] = b"not a png"
    write_split(samples, tmp_path / "broken", "train", keep_keys=True)
    with pytest.raises(UserError) as raised:
        embed_shards(cache["root"] / "tower", str(tmp_path / "broken" / "train"), tmp_path / "out")
    assert "max_bad_fraction=0.01" in str(raised.value) and "data.max_bad_fraction" not in str(raised.value)
    assert str(raised.value).endswith("; fix or rewrite the source shards")


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
    ("--workers", "-1", "--workers must be at least 0, got -1"),
    ("--split", "a/b", "--split 'a/b' must be a folder name (e.g. train), not a path; give the parent folder as --out"),
    ("--split", "..", "--split '..' must be a folder name"),
])
def test_bad_flags_are_named_as_the_command_spells_them(cache, tmp_path, capsys, flag, value, message):
    root = cache["root"]
    assert main(["embed", "--tower", str(root / "tower"), "--shards", str(root / "fmnist" / "test"),
                 "--out", str(tmp_path / "out"), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lit-softmoe embed: error: {message}") and err.count("\n") == 1 and "data." not in err
    assert not (tmp_path / "out").exists()


def test_a_second_dataset_does_not_rename_the_first_ones_classes(cache, tmp_path):
    root = cache["root"]
    other = tmp_path / "other"
    shutil.copytree(root / "fmnist", other)
    (other / "classnames.txt").write_text("".join(f"digit {i}\n" for i in range(10)))
    out = tmp_path / "features"
    embed_shards(root / "tower", str(root / "fmnist" / "test"), out, batch_size=100)
    names = (out / "classnames.txt").read_text()
    with pytest.raises(UserError, match=r"classnames.txt differs from .*other/classnames.txt and the feature "
                                        r"split\(s\) test in .* use it; embed another dataset into its own --out"):
        embed_shards(root / "tower", str(other / "train"), out, batch_size=100)
    assert (out / "classnames.txt").read_text() == names and not (out / "train").exists()
    # Re-embedding the split that uses them (the same dataset, its class names since corrected) takes them.
    embed_shards(root / "tower", str(other / "test"), out, batch_size=100)
    assert (out / "classnames.txt").read_text().startswith("digit 0\n")


def test_class_shards_without_captions_are_cached_for_zero_shot_eval(cache, tmp_path):
    # `data from-folder --layout classes` writes image + .cls only: a labelled eval set.
    root, tower = cache["root"], cache["tower"]
    source = _read_raw(root / "fmnist" / "test")
    samples = [{"__key__": key, "png": sample["png"], "cls": sample["cls"]} for key, sample in sorted(source.items())]
    write_split(samples, tmp_path / "labelled", "test", keep_keys=True)
    summary = embed_shards(root / "tower", str(tmp_path / "labelled" / "test"), tmp_path / "features", batch_size=64)
    assert summary["num_samples"] == LIMIT and summary["bad"] == {}
    cached = _read_raw(tmp_path / "features" / "test")
    assert all(set(sample) == {"__key__", "__url__", "npy", "cls"} for sample in cached.values())
    assert all(cached[key]["cls"] == source[key]["cls"] for key in source)

    loader = create_shard_loader(ShardDataConfig(urls=str(tmp_path / "features" / "test"), batch_size=LIMIT,
                                                 workers=0, shuffle=False, exact_epoch=True), "embedding-class")
    batch = next(iter(loader))
    images = create_shard_loader(ShardDataConfig(urls=str(root / "fmnist" / "test"), batch_size=LIMIT, workers=0,
                                                 shuffle=False, exact_epoch=True), "image-class",
                                 transform=eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"]))
    reference = next(iter(images))
    order = {key: i for i, key in enumerate(reference["key"])}
    rows = [order[key] for key in batch["key"]]
    assert torch.equal(batch["label"], reference["label"][rows])
    with torch.no_grad():
        expected = tower.forward_pooled(reference["image"][rows])
    assert torch.allclose(batch["embedding"], expected, atol=2e-3, rtol=1e-2)  # float16 storage
    check_feature_cache(tmp_path / "features" / "test", root / "tower")


def test_embed_refuses_to_replace_an_image_split(data, tmp_path):
    """`embed --shards DATA/train --out DATA` (the dataset folder, not a new one) replaced the user's
    image shards by their features: the images were gone. A split that is not a feature cache is
    refused; an earlier feature split is still replaced as before."""
    shutil.copytree(data / "fmnist", tmp_path / "fmnist")
    before = {p.name: p.read_bytes() for p in (tmp_path / "fmnist" / "train").iterdir()}
    with pytest.raises(UserError, match="not a feature cache"):
        embed_shards(data / "tower", str(tmp_path / "fmnist" / "train"), tmp_path / "fmnist")
    with pytest.raises(UserError, match="not a feature cache"):  # another split of image shards
        embed_shards(data / "tower", str(tmp_path / "fmnist" / "train"), tmp_path / "fmnist", split="test")
    assert {p.name: p.read_bytes() for p in (tmp_path / "fmnist" / "train").iterdir()} == before
    assert not (tmp_path / "fmnist" / "train" / "embed.json").exists()
    # A feature split of its own is rewritten (here: with the features of another source).
    shutil.copytree(data / "features" / "train", tmp_path / "features" / "train")
    summary = embed_shards(data / "tower", str(data / "fmnist" / "test"), tmp_path / "features",
                           split="train")
    assert summary["skipped"] is False and summary["num_samples"] == 300


def _copy_split(cache, tmp_path):
    """A copy of the fixture's test split (3 shards: 128 + 128 + 44), so the shared one stays whole."""
    source = tmp_path / "fmnist" / "test"
    shutil.copytree(cache["root"] / "fmnist" / "test", source)
    return source


def test_a_split_truncated_at_a_sample_boundary_is_not_cached_as_complete(cache, tmp_path):
    """A tar cut at a sample boundary reads as a complete, shorter one: embed wrote a "finished" cache of
    a third of the split, with an empty bad count, and LiT trained on it without a word."""
    source = _copy_split(cache, tmp_path)
    cut_before_sample(source / "1.tar", 28)  # 100 of its 128 samples gone
    with pytest.raises(UserError) as refused:
        embed_shards(cache["root"] / "tower", str(source), tmp_path / "features", batch_size=64)
    # What should have been read: the 200 samples read, the 100 lost and the truncated shard itself.
    assert str(refused.value) == (f"101 of 301 samples of {source} were bad (missing_samples: 100, "
                                  "truncated_shard: 1), over max_bad_fraction=0.01; fix or rewrite the source shards")
    assert not (tmp_path / "features" / "test" / "embed.json").exists()
    # Past the limit on purpose: the missing samples are recorded, and the cache holds what was read.
    summary = embed_shards(cache["root"] / "tower", str(source), tmp_path / "features", batch_size=64,
                           max_bad_fraction=0.5)
    assert summary["num_samples"] == LIMIT - 100
    assert summary["bad"] == {"truncated_shard": 1, "missing_samples": 100}
    info = json.loads((tmp_path / "features" / "test" / "embed.json").read_text())
    assert info["num_samples"] == LIMIT - 100 and info["bad"] == summary["bad"]


def _flip_a_byte(shard) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside an embedding: the tar still reads, the numbers are other ones
    shard.write_bytes(bytes(data))


def _replace_with_another(shard) -> None:
    shutil.copyfile(shard.parent / "0.tar", shard)  # a valid feature shard, of other samples


@pytest.mark.parametrize("damage", [_flip_a_byte, _replace_with_another], ids=["flipped-byte", "replaced"])
def test_a_damaged_feature_shard_is_refused_by_train_and_embedded_again_by_embed(cache, tmp_path, capsys, damage):
    """The feature cache was trusted by its embed.json alone: a shard damaged or replaced since was
    trained on, and a rerun of embed said "already there"."""
    source, features = cache["root"] / "fmnist" / "test", tmp_path / "features"
    embed_shards(cache["root"] / "tower", str(source), features, batch_size=64)
    original = (features / "test" / "1.tar").read_bytes()
    recorded = json.loads((features / "test" / "embed.json").read_text())["shard_sha256"]
    assert sorted(recorded) == ["0.tar", "1.tar", "2.tar"]
    damage(features / "test" / "1.tar")
    with pytest.raises(UserError, match=rf"^feature cache {features / 'test'}: its shard 1\.tar is not the one "
                                        r"embed wrote \(damaged or replaced since\); rerun `lit-softmoe embed "):
        check_feature_cache(features / "test", cache["root"] / "tower", rerun_command)
    (tmp_path / "c.yaml").write_text(f"run_dir: {tmp_path / 'run'}\n")
    capsys.readouterr()  # embed's own start line
    assert main(["train", "--config", str(tmp_path / "c.yaml"), f"image_tower={cache['root'] / 'tower'}",
                 f"data.train={features / 'test'}", "data.workers=0", "steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its shard 1.tar is not the one embed wrote" in err[0], err
    assert "; rerun `lit-softmoe embed --tower " in err[0], err  # train names the command to run
    again = embed_shards(cache["root"] / "tower", str(source), features, batch_size=64)
    assert not again["skipped"] and again["num_samples"] == LIMIT
    assert (features / "test" / "1.tar").read_bytes() == original  # embedded again, to the same bytes
    assert check_feature_cache(features / "test", cache["root"] / "tower")["num_samples"] == LIMIT


def test_a_missing_feature_shard_is_refused(cache, tmp_path):
    features = tmp_path / "features"
    embed_shards(cache["root"] / "tower", str(cache["root"] / "fmnist" / "test"), features, batch_size=64)
    (features / "test" / "2.tar").unlink()
    with pytest.raises(UserError, match=r"its shard 2\.tar is missing; rerun `lit-softmoe embed "):
        check_feature_cache(features / "test", cache["root"] / "tower", rerun_command)


def test_hostile_sample_keys_are_never_written_into_feature_shards(cache, tmp_path):
    """Keys from someone else's shards (`../x`, `/abs/x`) were written as they came: a tool
    extracting our feature shards would write outside its folder."""
    import tarfile
    source = sorted(_read_raw(cache["root"] / "fmnist" / "train").items())[:10]
    keys = [key for key, _ in source]
    hostile = {"../../escape": source[0][1], "/tmp/abs/x": source[1][1], "a/../../up": source[2][1]}
    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "0.tar", "w") as tar:
        for key, sample in [*source, *hostile.items()]:
            for ext in ("png", "txt"):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(sample[ext])
                tar.addfile(info, io.BytesIO(sample[ext]))
    summary = embed_shards(cache["root"] / "tower", str(tmp_path / "src" / "0.tar"), tmp_path / "out",
                           max_bad_fraction=0.5)
    assert summary["num_samples"] == 10 and summary["bad"] == {"unsafe_key": 3}
    [split] = [p.parent for p in (tmp_path / "out").glob("*/embed.json")]
    assert sorted(_read_raw(split)) == sorted(keys)
    names = [name for shard in split.glob("*.tar") for name in tarfile.open(shard).getnames()]
    assert len(names) == 20 and not [n for n in names if n.startswith("/") or ".." in n.split("/")]


def test_a_full_disk_while_embedding_is_one_line_and_leaves_no_cache_a_rerun_would_trust(cache, tmp_path, capsys,
                                                                                        monkeypatch):
    import errno
    import tarfile
    real_addfile = tarfile.TarFile.addfile

    def addfile(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "full"))

    monkeypatch.setattr(tarfile.TarFile, "addfile", addfile)
    root = cache["root"]
    argv = ["embed", "--tower", str(root / "tower"), "--shards", str(root / "fmnist" / "test"),
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    start, *err = capsys.readouterr().err.strip().splitlines()
    assert start.startswith(f"embed: tower {root / 'tower'} on cpu")  # what runs, said before the work
    assert err == [f"lit-softmoe embed: error: no space left on the device while writing {tmp_path / 'out' / 'full'}; "
                   "free some space (or write to another disk) and rerun the same command"]
    assert not (tmp_path / "out" / "test").exists()
    # The dataset's class names and templates may be copied already, and the (empty) work folder a rerun
    # resumes in made: no shard, temporary or not, is there.
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert left[1:] == ["classnames.txt", "dataset_type.txt", "zeroshot_classification_templates.txt"]
    assert left[0].startswith(".test.work-") and not any((tmp_path / "out" / left[0]).iterdir())
    monkeypatch.setattr(tarfile.TarFile, "addfile", real_addfile)
    assert main(argv) == 0 and "already there" not in capsys.readouterr().out
    assert check_feature_cache(tmp_path / "out" / "test", root / "tower")["num_samples"] == LIMIT


# ---- scale: shard by shard, resumable, many processes ----------------------------------------------------

@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """Fashion-MNIST's first 300 test images in 15 shards of 20, the `cache` tower, and one process's
    uninterrupted feature cache of them: what every way of running embed must reproduce."""
    def build(root):
        write_fashion_mnist_shards(root / "fmnist", samples_per_shard=20, limit=LIMIT, allow_download=False)
        _save_test_tower(root / "tower", seed=0)
        embed_shards(root / "tower", str(root / "fmnist" / "test"), root / "reference", batch_size=16)
    return built_once(tmp_path_factory, "embed-many-shards", build)


def _shard_bytes(split_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(split_dir.glob("*.tar"))}


def test_feature_shard_i_holds_source_shard_i_in_order(many_shards):
    source = _read_raw(many_shards / "fmnist" / "test")
    split = many_shards / "reference" / "test"
    assert (split / "nshards.txt").read_text() == "15\n"
    assert json.loads((split / "sizes.json").read_text()) == {f"{i}.tar": 20 for i in range(15)}
    for index in (0, 7, 14):
        keys = [sample["__key__"] for sample in wds.DataPipeline(wds.SimpleShardList([str(split / f"{index}.tar")]),
                                                                  wds.tarfile_to_samples())]
        assert keys == [f"s{n:07d}" for n in range(20 * index, 20 * index + 20)]
        assert all(source[key]["cls"] for key in keys)


def test_two_ranks_write_disjoint_shards_and_rank_0_the_same_split_as_one_process(many_shards, tmp_path):
    tower, shards = many_shards / "tower", str(many_shards / "fmnist" / "test")
    # Rank 1 first: it embeds shards 1, 3, …, 13 into the work folder and leaves; rank 0 then finds them.
    other = embed_shards(tower, shards, tmp_path / "out", batch_size=16, rank=1, world_size=2)
    work = next((tmp_path / "out").glob(".test.work-*"))
    assert sorted(int(p.stem) for p in work.glob("*.tar")) == list(range(1, 15, 2))
    assert other["num_samples"] == 7 * 20 and not (tmp_path / "out" / "test").exists()
    summary = embed_shards(tower, shards, tmp_path / "out", batch_size=16, rank=0, world_size=2)
    assert summary["num_samples"] == LIMIT and summary["world_size"] == 2
    assert _shard_bytes(tmp_path / "out" / "test") == _shard_bytes(many_shards / "reference" / "test")
    assert json.loads((tmp_path / "out" / "test" / "embed.json").read_text())["processes"] == 2
    assert not work.exists()  # removed once the split is in place
    check_feature_cache(tmp_path / "out" / "test", tower)


def test_rank_0_stops_with_the_error_of_another_process(many_shards, tmp_path):
    import threading
    tower, shards = many_shards / "tower", str(many_shards / "fmnist" / "test")

    def fail_rank_1():
        work = next((tmp_path / "out").glob(".test.work-*"))
        (work / ".error-1").write_text("3 of 4 samples of X were bad; fix or rewrite the source shards\n")

    threading.Timer(2.0, fail_rank_1).start()  # while rank 0 waits for rank 1's shards
    with pytest.raises(UserError, match=r"^another embed process stopped: 3 of 4 samples of X were bad; fix"):
        embed_shards(tower, shards, tmp_path / "out", batch_size=16, rank=0, world_size=2)
    assert not (tmp_path / "out" / "test").exists()


_SLOW_EMBED = """
import sys, time
import lit_softmoe.train.embed_process as embed_process
embed_batch = embed_process._embed_batch
def slow(*args, **kwargs):  # a slower tower: the test's SIGKILL lands mid-run
    time.sleep(0.25)
    return embed_batch(*args, **kwargs)
embed_process._embed_batch = slow
from lit_softmoe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_embed_resumes_keeping_its_finished_shards(many_shards, tmp_path):
    import signal
    import subprocess
    import time
    script = tmp_path / "slow_embed.py"
    script.write_text(_SLOW_EMBED)
    argv = ["embed", "--tower", str(many_shards / "tower"), "--shards", str(many_shards / "fmnist" / "test"),
            "--out", str(tmp_path / "out"), "--batch-size", "16"]
    process = subprocess.Popen([*python_command(), str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        # Finished records only: a record being written is a dot-named temporary file, ending in .json too.
        finished = list((tmp_path / "out").glob(".test.work-*/[0-9]*.json"))
        if len(finished) >= 4:
            break
        time.sleep(0.02)
    kill_process(process)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    work = next((tmp_path / "out").glob(".test.work-*"))
    # Finished records only: a kill can land while one is written (its temporary file, dot-named, stays).
    kept = {path.stem: path.stat().st_mtime_ns for path in work.glob("[0-9]*.json")}
    assert 4 <= len(kept) < 15 and not (tmp_path / "out" / "test").exists()
    kept_tars = {index: (work / f"{index}.tar").stat() for index in kept}

    summary = embed_shards(many_shards / "tower", str(many_shards / "fmnist" / "test"), tmp_path / "out",
                           batch_size=16)
    assert summary["resumed_shards"] == len(kept) and summary["num_samples"] == LIMIT
    split = tmp_path / "out" / "test"
    for index, stat in kept_tars.items():  # not rewritten: the very files the killed run wrote
        final = (split / f"{index}.tar").stat()
        assert (final.st_ino, final.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert _shard_bytes(split) == _shard_bytes(many_shards / "reference" / "test")
    check_feature_cache(split, many_shards / "tower")


def test_a_work_folder_of_another_tower_is_not_resumed(many_shards, tmp_path):
    shards = str(many_shards / "fmnist" / "test")
    other_tower = tmp_path / "other_tower"
    _save_test_tower(other_tower, seed=1)
    embed_shards(other_tower, shards, tmp_path / "out", batch_size=16, rank=1, world_size=2)  # leaves a work folder
    stale = next((tmp_path / "out").glob(".test.work-*"))
    summary = embed_shards(many_shards / "tower", shards, tmp_path / "out", batch_size=16)
    assert summary["resumed_shards"] == 0 and not stale.exists()
    assert _shard_bytes(tmp_path / "out" / "test") == _shard_bytes(many_shards / "reference" / "test")


def test_the_progress_bar_counts_images_and_shards(many_shards, tmp_path, capsys):
    embed_shards(many_shards / "tower", str(many_shards / "fmnist" / "test"), tmp_path / "out", batch_size=16,
                 progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("embed: 100%") and "300/300" in bar and "shards=15/15" in bar and "img/s" in bar


@pytest.mark.slow
def test_two_processes_under_torchrun_equal_one(many_shards, tmp_path):
    import subprocess
    result = subprocess.run(
        [*python_command(), *torchrun_args(2), "-m", "lit_softmoe.cli", "embed", "--tower", str(many_shards / "tower"),
         "--shards", str(many_shards / "fmnist" / "test"), "--out", str(tmp_path / "out"), "--batch-size", "16",
         "--workers", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()  # rank 0 alone says what was written
    assert len(lines) == 1 and lines[0].startswith(f"{LIMIT} embeddings (dim ") and "by 2 processes" in lines[0]
    one, two = many_shards / "reference" / "test", tmp_path / "out" / "test"
    reference = {key: sample for key, sample in _read_raw(one).items()}
    both = _read_raw(two)
    assert sorted(both) == sorted(reference)
    for key, sample in both.items():
        assert sample["txt"] == reference[key]["txt"] and sample["cls"] == reference[key]["cls"]
        ours, theirs = (np.load(io.BytesIO(s["npy"])).astype(np.float32) for s in (sample, reference[key]))
        # Within fp16 rounding: one unit in the last place of the larger value.
        assert np.all(np.abs(ours - theirs) <= np.spacing(np.maximum(abs(ours), abs(theirs)).astype(np.float16)))
    check_feature_cache(two, many_shards / "tower")


def test_a_tower_that_decodes_reduced_is_embedded_as_eval_decodes(tmp_path):
    """Large JPEGs (Fashion-MNIST upscaled to 240 px) and a tower whose preprocess says decode=reduced: the
    cache holds the features of the reduced decode that eval and a loaded model's preprocess use."""
    from lit_softmoe.data.fashion_mnist import read_fashion_mnist
    from lit_softmoe.data.transforms import image_transform
    from lit_softmoe.models.preprocess import Preprocess
    images, _ = read_fashion_mnist("test", allow_download=False)
    jpegs = []
    for image in images[:40]:
        buffer = io.BytesIO()
        PIL.Image.fromarray(image).resize((240, 240), PIL.Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    write_split(({"jpg": data, "txt": f"item {i}".encode()} for i, data in enumerate(jpegs)), tmp_path / "jpegs",
                "train", samples_per_shard=20)
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=10).eval()
    preprocess = {**PREPROCESS, "decode": "reduced"}
    save_tower(tmp_path / "tower", tower, extra={"preprocess": preprocess})
    embed_shards(tmp_path / "tower", str(tmp_path / "jpegs" / "train"), tmp_path / "features", batch_size=16)
    cached = _read_raw(tmp_path / "features" / "train")
    keys = sorted(cached)
    got = torch.from_numpy(np.stack([np.load(io.BytesIO(cached[key]["npy"])) for key in keys])).float()
    by_key = dict(zip((f"s{i:07d}" for i in range(len(jpegs))), jpegs))

    def features(decode: str) -> torch.Tensor:
        transform = image_transform(Preprocess.from_settings({**PREPROCESS, "decode": decode}, 1, "test"))
        with torch.inference_mode():  # the file as PIL opens it: the transform's first step decodes it
            return tower.forward_pooled(torch.stack([transform(PIL.Image.open(io.BytesIO(by_key[k]))) for k in keys]))

    reduced, full = features("reduced"), features("full")
    torch.testing.assert_close(got, reduced, rtol=2e-3, atol=2e-3)
    assert (got - full).abs().max() > 10 * (got - reduced).abs().max()  # the decode made a difference


def _photo_like_jpegs(count: int, seed: int) -> list[bytes]:
    """Noisy RGB and grayscale JPEGs of 70-150 px per side, each its own aspect: resizing, cropping, reduced
    decoding and the gray → RGB step all shape the pixels, and no two images are alike."""
    rng = np.random.default_rng(seed)
    jpegs = []
    for index in range(count):
        width, height = (int(side) for side in rng.integers(70, 151, size=2))
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        image = PIL.Image.fromarray(pixels, "RGB")
        image = image.convert("L") if index % 5 == 0 else image
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=85)
        jpegs.append(buffer.getvalue())
    return jpegs


@pytest.mark.parametrize("in_channels, workers", [(3, 0), (3, 2), (1, 0)])
def test_each_feature_is_bitwise_the_towers_output_on_its_shards_batch_in_order(tmp_path, in_channels, workers):
    """The cache's values, not only close ones: every feature equals, bit for bit, the tower's fp16-rounded output
    on the batch embed forms (a source shard's samples in its order, `batch_size` at a time) of images each
    preprocessed by the tower's own transform, as eval and a loaded model's preprocess do, and each shard keeps its
    source shard's keys in order. Any change in the pixels, their normalization or the order fails here."""
    from lit_softmoe.data.transforms import image_transform
    from lit_softmoe.models.preprocess import Preprocess
    jpegs = _photo_like_jpegs(50, seed=in_channels)
    write_split(({"jpg": data, "txt": f"item {i}".encode()} for i, data in enumerate(jpegs)), tmp_path / "jpegs",
                "train", samples_per_shard=20)  # shards of 20, 20, 10: batches of 8, 8, 4 and 8, 2
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", image_size=32, patch_size=8, in_channels=in_channels).eval()
    preprocess = {"image_size": 32, "mean": [0.481, 0.458, 0.408][:in_channels],
                  "std": [0.269, 0.261, 0.276][:in_channels], "decode": "reduced"}
    save_tower(tmp_path / "tower", tower, extra={"preprocess": preprocess})
    embed_shards(tmp_path / "tower", str(tmp_path / "jpegs" / "train"), tmp_path / "features", batch_size=8,
                 workers=workers)

    transform = image_transform(Preprocess.from_settings(preprocess, in_channels, "test"))
    source = tmp_path / "jpegs" / "train"
    for index in range(3):
        read = list(wds.DataPipeline(wds.SimpleShardList([str(source / f"{index}.tar")]), wds.tarfile_to_samples()))
        written = list(wds.DataPipeline(wds.SimpleShardList([str(tmp_path / "features" / "train" / f"{index}.tar")]),
                                        wds.tarfile_to_samples()))
        assert [s["__key__"] for s in written] == [s["__key__"] for s in read]
        images = [transform(PIL.Image.open(io.BytesIO(sample["jpg"]))) for sample in read]
        with torch.inference_mode():
            expected = torch.cat([tower.forward_pooled(torch.stack(images[start:start + 8])).to(torch.float16)
                                  for start in range(0, len(images), 8)]).numpy()
        got = np.stack([np.load(io.BytesIO(sample["npy"])) for sample in written])
        assert got.dtype == np.float16 and got.shape == expected.shape
        assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))


# ---- the fast path: bf16 weights, workers, compile, JPEGs decoded on the GPU --------------------------

def _photo_split(root, broken: bool = True):
    """Real photos (foolbox's ImageNet JPEGs, re-encoded baseline at differing crops) as image + caption
    shards, with a PNG among them and, if `broken`, one JPEG cut short (header whole, data not)."""
    from evalkit import FOOLBOX_DATA
    photos = [PIL.Image.open(path).convert("RGB") for path in sorted(FOOLBOX_DATA.glob("imagenet_*.jpg"))]
    samples = []
    for index, photo in enumerate(photos):
        crop = photo.crop((0, 0, 512 - 37 * (index % 5), 512 - 61 * (index % 3)))
        buffer = io.BytesIO()
        crop.save(buffer, "PNG" if index == 3 else "JPEG", quality=90)
        data = buffer.getvalue()
        if broken and index == 7:
            data = data[: len(data) // 3]
        samples.append({"__key__": f"{index:04d}", "png" if index == 3 else "jpg": data, "txt": b"a photo"})
    write_split(iter(samples), root, "train", samples_per_shard=8)
    return root / "train"


def _photo_tower(path, decode: str = "reduced"):
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", in_channels=3, image_size=35, num_classes=0).eval()
    save_tower(path, tower, extra={"preprocess": {"image_size": 35, "mean": 0.5, "std": 0.5, "decode": decode}})
    return path


def _features(split_dir) -> dict[str, np.ndarray]:
    return {key: np.load(io.BytesIO(sample["npy"])).astype(np.float32) for key, sample in _read_raw(split_dir).items()}


def _cosines(first: dict, second: dict) -> np.ndarray:
    assert sorted(first) == sorted(second)
    a, b = (np.stack([features[key] for key in sorted(first)]) for features in (first, second))
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.skipif(not __import__("evalkit").FOOLBOX_DATA.is_dir(), reason="needs foolbox's photos")
def test_bf16_weights_give_the_fp32_features_within_cosine_0999(tmp_path):
    tower = _photo_tower(tmp_path / "tower")
    source = _photo_split(tmp_path / "photos", broken=False)
    fp32 = embed_shards(tower, str(source), tmp_path / "fp32", precision="fp32", workers=0)
    bf16 = embed_shards(tower, str(source), tmp_path / "bf16", precision="bf16", workers=0)
    assert fp32["num_samples"] == bf16["num_samples"] == 20
    recorded = json.loads((tmp_path / "bf16" / "train" / "embed.json").read_text())
    assert recorded["precision"] == "bf16 weights" and recorded["jpeg_decoder"] == "cpu"
    first, second = _features(tmp_path / "fp32" / "train"), _features(tmp_path / "bf16" / "train")
    cosines = _cosines(first, second)
    assert cosines.min() >= 0.999, cosines.min()
    assert any(not np.array_equal(first[key], second[key]) for key in first)  # the tower did run in bf16


@pytest.mark.skipif(not __import__("evalkit").FOOLBOX_DATA.is_dir(), reason="needs foolbox's photos")
def test_jpegs_decoded_by_the_gpu_path_give_the_host_features_and_counts(tmp_path, monkeypatch, capsys):
    """The GPU path end to end — workers pass JPEG bytes on, the main process decodes a batch with
    torchvision's decode_jpeg, resizes and crops it — run on the CPU device (nvJPEG itself: test_cuda.py)."""
    from lit_softmoe.data import gpu_jpeg
    tower = _photo_tower(tmp_path / "tower")
    source = _photo_split(tmp_path / "photos")
    host = embed_shards(tower, str(source), tmp_path / "host", workers=2, batch_size=4, max_bad_fraction=0.1)
    monkeypatch.setattr(gpu_jpeg, "gpu_decoder_works", lambda device: None)  # "this device decodes JPEGs"
    decoded = []
    real_call = gpu_jpeg.JpegBatchDecoder.__call__
    monkeypatch.setattr(gpu_jpeg.JpegBatchDecoder, "__call__",
                        lambda self, packed: decoded.append(int(packed["on_gpu"].sum())) or real_call(self, packed))
    capsys.readouterr()
    gpu = embed_shards(tower, str(source), tmp_path / "gpu", workers=2, batch_size=4, jpeg_decoder="auto",
                       max_bad_fraction=0.1)
    assert "JPEGs decoded on the GPU (auto: nvJPEG; other images on the host)" in capsys.readouterr().err
    # 19 JPEGs went the GPU way (the PNG did not; the broken JPEG did, and was left out there).
    assert sum(decoded) == 19 and gpu["num_samples"] == host["num_samples"] == 19
    assert gpu["bad"] == host["bad"] == {"bad_image": 1}
    recorded = json.loads((tmp_path / "gpu" / "train" / "embed.json").read_text())
    assert recorded["jpeg_decoder"] == "gpu" and recorded["gpu_jpeg_share"] == 1.0
    # Full decode on the GPU path against the tower's reduced (DCT-scaled) decode on the host: the features
    # still agree within the bound the GPU decoder is held to.
    host_features = _features(tmp_path / "host" / "train")
    assert _cosines(host_features, _features(tmp_path / "gpu" / "train")).min() >= 0.999

    # --gpu-jpeg-share 0.5: the GPU takes half the JPEGs (by key), the workers decode the others.
    decoded.clear()
    shared = embed_shards(tower, str(source), tmp_path / "shared", workers=2, batch_size=4, gpu_jpeg_share=0.5,
                          max_bad_fraction=0.1)
    assert "JPEGs decoded on the GPU (50%) and by the workers" in capsys.readouterr().err
    to_gpu = [key for key, sample in _read_raw(source).items()
              if "jpg" in sample and gpu_jpeg._unit_hash(key) < 0.5]
    assert sum(decoded) == len(to_gpu) and 0 < len(to_gpu) < 19
    assert shared["num_samples"] == 19 and shared["bad"] == {"bad_image": 1}
    assert _cosines(host_features, _features(tmp_path / "shared" / "train")).min() >= 0.999


def test_gpu_jpeg_decoder_without_a_gpu_is_one_line(cache, tmp_path, capsys):
    root = cache["root"]
    assert main(["embed", "--tower", str(root / "tower"), "--shards", str(root / "fmnist" / "test"),
                 "--out", str(tmp_path / "out"), "--jpeg-decoder", "gpu", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lit-softmoe embed: error: --jpeg-decoder gpu: the tower runs on cpu; leave it at auto (or cpu) to decode "
        "on the host"]


def test_the_default_choices_are_printed_once_at_the_start(cache, tmp_path, capsys):
    root = cache["root"]
    capsys.readouterr()
    assert main(["embed", "--tower", str(root / "tower"), "--shards", str(root / "fmnist" / "test"),
                 "--out", str(tmp_path / "out")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("embed:")]
    workers = min(len(os.sched_getaffinity(0)), 3)  # a worker per available core, at most one per shard (3)
    assert err == [f"embed: tower {root / 'tower'} on cpu, fp32 weights, eager (auto: the tower runs on cpu), "
                   f"{workers} worker(s) reading shards, JPEGs decoded on the CPU (auto: the tower runs on cpu)"]


def test_a_tower_resized_to_another_image_size_says_so_in_the_start_line(cache, tmp_path, capsys):
    """A tower folder whose preprocess.image_size is not the size its position embeddings were built for was
    embedded at the new size without a word. A deliberate resolution change still runs."""
    from towers import resized_copy
    root = cache["root"]
    tower, built = resized_copy(root / "tower", tmp_path / "tower-56")
    capsys.readouterr()
    assert main(["embed", "--tower", str(tower), "--shards", str(root / "fmnist" / "test"),
                 "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    start = [line for line in capsys.readouterr().err.splitlines() if line.startswith("embed:")]
    assert len(start) == 1 and start[0].endswith(
        f", images at {2 * built} px (preprocess.image_size), not the {built} px the tower was built for"), start
    capsys.readouterr()
    assert main(["embed", "--tower", str(root / "tower"), "--shards", str(root / "fmnist" / "test"),
                 "--out", str(tmp_path / "same"), "--workers", "1"]) == 0
    assert "px the tower was built for" not in capsys.readouterr().err  # the size it was built for: nothing said
    resized, same = _features(tmp_path / "out" / "test"), _features(tmp_path / "same" / "test")
    assert all(np.isfinite(features).all() for features in resized.values())
    assert _cosines(resized, same).min() < 0.999  # embedded at the new size, not the old one


def test_compile_auto_waits_for_a_run_long_enough_to_pay():
    from lit_softmoe.train.embed import COMPILE_MIN_IMAGES, _choose_compile
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _choose_compile("auto", cpu, 10**9) == (False, "auto: the tower runs on cpu")
    assert _choose_compile("auto", cuda, COMPILE_MIN_IMAGES) == (True, "auto: a long run on a GPU")
    assert _choose_compile("auto", cuda, None)[0]  # remote shards of unknown size: assume a long run
    assert _choose_compile("auto", cuda, 16_384) == (
        False, f"auto: 16,384 images, fewer than the {COMPILE_MIN_IMAGES:,} that earn the compile back")
    assert _choose_compile("true", cpu, 10) == (True, "--compile true")
    assert _choose_compile("false", cuda, 10**9) == (False, "--compile false")


def test_the_rerun_hint_quotes_what_a_shell_would_rewrite(tmp_path):
    """The hint is a command to paste: a `timm:NAME?file=` tower (`?` is a glob) and brace-expanded shards
    (what embed recorded as the source) reach embed as written only quoted."""
    def hint(split, tower) -> list[str]:
        with pytest.raises(UserError) as err:
            check_feature_cache(split, tower, rerun_command)
        return shlex.split(str(err.value).split("rerun `")[1].rstrip("`"))

    split = tmp_path / "features" / "train"
    split.mkdir(parents=True)
    tower = f"timm:test_vit?file={tmp_path}/my tower.safetensors"
    assert hint(split, tower) == ["lit-softmoe", "embed", "--tower", tower, "--shards", "SHARDS",  # nothing recorded
                                  "--out", str(tmp_path / "features"), "--split", "train"]
    (split / "embed.json").write_text(json.dumps({"source": "data/{000..009}.tar", "tower_sha256": "0" * 64}))
    _save_test_tower(tmp_path / "tower", seed=0)  # not the tower the record names
    assert hint(split, tmp_path / "tower")[3:6] == [str(tmp_path / "tower"), "--shards", "data/{000..009}.tar"]


def test_the_steady_waits_say_what_bounds_the_run(cache, tmp_path, monkeypatch):
    """`steady_waits`: shares of the steady time the loop waited for pixels or for features, and the device
    thread spent preparing batches. Batches made slow to prepare (150 ms each, a fast tiny tower) show as
    pixels waited for, prepared for most of the time, and no feature waited for (on the CPU the tower's
    forward has finished when `ToHost` is made). The shares are of wall time: 150 ms keeps the preparation the
    slower side even when other processes slow the tower's forward down (with 50 ms, a loaded machine had
    its forward take longer than that, and `preparing` fell to 0.42)."""
    import lit_softmoe.train.embed_process as embed_module
    root = cache["root"]
    steady = cache["summary"]["steady_waits"]
    assert set(steady) == {"waiting_for_pixels", "waiting_for_features", "preparing"}
    assert all(0 <= share <= 1.05 for share in steady.values()), steady
    prepare = embed_module._pixels_on_device

    def slow(*args, **kwargs):
        time.sleep(0.15)
        return prepare(*args, **kwargs)
    monkeypatch.setattr(embed_module, "_pixels_on_device", slow)
    summary = embed_shards(root / "tower", str(root / "fmnist" / "test"), tmp_path / "out", batch_size=16, workers=0)
    waits = summary["steady_waits"]
    # The thread works two batches ahead: those it prepared before the first was embedded are not counted.
    assert waits["waiting_for_pixels"] > 0.5 and waits["preparing"] > 0.5 and waits["waiting_for_features"] < 0.1, waits
