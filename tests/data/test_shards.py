"""lit_softmoe.data.shards: the shard layout (nshards.txt, sizes.json; img2dataset's _stats.json), shard urls,
shard sizes (listed or counted), writing splits, sample keys, and one shard read with what it lost counted
(`tar_samples`)."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_files import LIMIT, copy_split, cut_at_sample, png_bytes, read_split, seeded_png
from img2dataset_shards import write_img2dataset_output
from lit_softmoe.data import shards, tar_reading
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import is_safe_key, read_classnames, shard_urls, write_split
from lit_softmoe.data.tar_reading import BadSampleCounter, count_samples, listed_sizes, num_samples, tar_samples
from lit_softmoe.errors import UserError


def test_nshards_sizes_and_urls(fmnist_shards):
    out, summary, _ = fmnist_shards
    split = out / "train"
    # 200 samples at 64 per shard: 64 + 64 + 64 + 8, named as CLIP_benchmark expands {0..N-1}.tar.
    assert (split / "nshards.txt").read_text() == "4\n"
    assert json.loads((split / "sizes.json").read_text()) == {"0.tar": 64, "1.tar": 64, "2.tar": 64, "3.tar": 8}
    assert summary["shards"] == {"train": 4, "test": 4}
    assert num_samples(split) == LIMIT
    urls = [str(split / f"{i}.tar") for i in range(4)]
    assert shard_urls(split) == urls
    assert shard_urls(f"{split}/{{0..3}}.tar") == urls
    assert shard_urls(f"{split}/{{0..1}}.tar::{split}/{{2..3}}.tar") == urls
    assert shard_urls([urls[0], f"{split}/{{1..3}}.tar"]) == urls


def test_write_split_rolls_over_by_count_and_bytes(tmp_path):
    samples = [{"png": png_bytes(np.full((8, 8), i, np.uint8)), "cls": i} for i in range(7)]
    assert write_split(samples, tmp_path, "train", samples_per_shard=3) == {"0.tar": 3, "1.tar": 3, "2.tar": 1}
    # Byte cap checked before each sample: every shard takes one 2 kB sample, then rolls over.
    big = [{"bin": bytes(2000), "cls": i} for i in range(3)]
    assert write_split(big, tmp_path, "big", max_bytes=1000) == {"0.tar": 1, "1.tar": 1, "2.tar": 1}
    with tarfile.open(tmp_path / "train" / "2.tar") as tar:
        assert tar.getnames() == ["s0000006.cls", "s0000006.png"]
        info = tar.getmember("s0000006.png")
        assert (info.mtime, info.uname, info.mode) == (0, "lit-softmoe", 0o644)
        assert not info.pax_headers  # an int mtime keeps members at one header block


def test_write_split_killed_midway_leaves_no_final_shard(tmp_path):
    def samples():
        for i in range(5):
            if i == 4:
                raise KeyboardInterrupt  # as if the run were killed here
            yield {"cls": i}

    write_split([{"cls": 0}], tmp_path, "train")  # an earlier complete run
    with pytest.raises(KeyboardInterrupt):
        write_split(samples(), tmp_path, "train", samples_per_shard=3)
    split = tmp_path / "train"
    # The first shard (3 samples) was complete and published; the half one was deleted; the markers
    # are gone, so the split is not mistaken for complete.
    assert sorted(p.name for p in split.iterdir()) == ["0.tar"]
    with pytest.raises(UserError, match="no nshards.txt"):
        shard_urls(split)
    with pytest.raises(UserError, match="no nshards.txt"):  # no _stats.json either: not img2dataset's output
        num_samples(split)


def test_missing_shards_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(UserError, match=f"shards not found: {tmp_path}/nope.*nshards.txt"):
        shard_urls(tmp_path / "nope")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "nshards.txt").write_text("2\n")
    with pytest.raises(UserError, match="pass .*/test"):  # the dataset folder instead of a split
        shard_urls(tmp_path)
    with pytest.raises(UserError, match="says 2 shards but 2 or more are missing"):
        shard_urls(tmp_path / "test")
    with pytest.raises(UserError, match="classnames.txt"):
        read_classnames(tmp_path)


def test_write_split_keep_keys_rejects_unusable_keys(tmp_path):
    assert write_split([{"__key__": "a/b", "cls": b"1"}], tmp_path, "ok", keep_keys=True) == {"0.tar": 1}
    assert list(read_split(tmp_path / "ok")) == ["a/b"]
    for keys in (["x.y"], ["a", "a"]):
        with pytest.raises(ValueError):
            write_split([{"__key__": key, "cls": b"1"} for key in keys], tmp_path, "bad", keep_keys=True)
    # Each refused for its own reason (a bare ValueError is met by any crash on the way).
    plain = "is not a relative path of plain parts without a dot in its last part"
    for keys, reason in ((["x.y"], f"'x.y' {plain}"), (["a", "a"], "'a' repeats"), ([7], f"7 {plain}"),
                         ([""], f"'' {plain}"), (["../x"], f"'../x' {plain}"), (["/abs/x"], f"'/abs/x' {plain}")):
        with pytest.raises(ValueError, match=re.escape(f"sample key {reason}")):
            write_split([{"__key__": key, "cls": b"1"} for key in keys], tmp_path, "bad", keep_keys=True)


def test_split_folders_joined_with_double_colon(tmp_path):
    # The documented `::` list works for split folders too (two datasets in one stream), with the
    # epoch length from both sizes.json; it used to end in "shards not found: DIR/train".
    from lit_softmoe.data.shards import shard_urls, write_split
    for name, count in (("a", 5), ("b", 7)):
        write_split([{"png": seeded_png(i), "txt": f"{name} {i}".encode()} for i in range(count)], tmp_path / name,
                    "train", samples_per_shard=3)
    spec = f"{tmp_path / 'a' / 'train'}::{tmp_path / 'b' / 'train'}"
    assert len(shard_urls(spec)) == 2 + 3
    assert shard_urls(spec + "::") == shard_urls(spec)  # a trailing separator adds nothing
    assert shard_urls(f"{tmp_path / 'a' / 'train'}::") == shard_urls(tmp_path / "a" / "train")
    with pytest.raises(UserError, match="no shards"):
        shard_urls("::")
    loader = create_shard_loader(ShardDataConfig(urls=spec, workers=0, batch_size=4), "image-caption")
    assert loader.num_samples == 12
    exact = create_shard_loader(ShardDataConfig(urls=spec, workers=0, exact_epoch=True), "image-caption")
    captions = [caption for batch in exact for caption in batch["caption"]]
    assert sorted(captions) == sorted([f"a {i}" for i in range(5)] + [f"b {i}" for i in range(7)])


@pytest.mark.parametrize("width", [5, 6])
def test_split_folder_with_padded_shard_names(tmp_path, width):
    # img2dataset names its shards 00000.tar (5 digits), webdataset's ShardWriter 000000.tar (6).
    from lit_softmoe.data.shards import shard_urls, write_split
    write_split([{"png": seeded_png(i), "txt": b"x"} for i in range(4)], tmp_path, "train", samples_per_shard=2)
    split = tmp_path / "train"
    for index in range(2):
        (split / f"{index}.tar").rename(split / f"{index:0{width}d}.tar")
    assert shard_urls(split) == [str(split / f"{index:0{width}d}.tar") for index in range(2)]


@pytest.mark.parametrize("key", ["../x", "/abs/x", "a/../../b", "a/./b", "a//b", "a/", "..", "a\\b", "a\nb", "x.y",
                                 "", None, 7])
def test_hostile_or_unreadable_sample_keys_are_unsafe(key):
    """Keys read from someone else's shards become file names (`embed` writes its feature shards under
    them): one that climbs out (`../x`, `a/../../b`) or is absolute must never be used."""
    assert not is_safe_key(key)


@pytest.mark.parametrize("key", ["s0000001", "images/a", "cat/dog/0001", "a b", "x-y_z"])
def test_plain_relative_sample_keys_are_safe(key):
    assert is_safe_key(key)


def test_tar_samples_counts_what_a_shard_cut_at_a_sample_boundary_lost(fmnist_shards, tmp_path):
    """Python's tarfile reads a tar cut at a member boundary as a complete archive without a word: only
    the count its sizes.json lists tells the 44 missing samples."""
    out, _, _ = fmnist_shards
    split = copy_split(out / "train", tmp_path / "train")
    cut_at_sample(split / "1.tar", 20)
    with tarfile.open(split / "1.tar") as tar:  # a valid tar of 20 samples
        assert len({name.rsplit(".", 1)[0] for name in tar.getnames()}) == 20
    urls = shard_urls(split)
    listed = listed_sizes(urls)
    assert listed == {urls[0]: 64, urls[1]: 64, urls[2]: 64, urls[3]: 8}
    counter = BadSampleCounter()
    keys = [sample["__key__"] for url in urls for sample in tar_samples(url, counter, listed[url])]
    assert keys == [f"s{i:07d}" for i in [*range(64 + 20), *range(128, 200)]]
    assert dict(counter.counts) == {"truncated_shard": 1, "missing_samples": 44}
    # Without a listed count (hand-made tars) there is nothing to compare with.
    counter = BadSampleCounter()
    assert len(list(tar_samples(urls[1], counter))) == 20 and not counter.counts


def test_a_split_writer_deletes_only_partial_shards_of_writers_that_are_gone(tmp_path):
    """A second writer's start deleted every `.N.tar.partial` of the split: the shards a first writer,
    still at work, was writing. Temporary names carry the pid now; a live writer's are kept."""
    split = tmp_path / "train"
    split.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    try:
        names = {"live": f".0.tar.{live.pid}.partial", "gone": f".0.tar.{gone.stdout.strip()}.partial",
                 "old version": ".1.tar.partial", "this process": f".2.tar.{os.getpid()}.partial"}
        for name in names.values():
            (split / name).write_bytes(b"half a tar")
        assert write_split([{"cls": b"1"}], tmp_path, "train") == {"0.tar": 1}
        assert sorted(p.name for p in split.glob(".*")) == [names["live"]]
        assert (split / names["live"]).read_bytes() == b"half a tar"
    finally:
        live.stdin.close()
        live.wait(timeout=30)


# ---------------------------------------------------------------------------------- img2dataset's output


def test_img2dataset_output_folder_is_a_split_of_its_finished_shards(tmp_path, caplog):
    """00000.tar … with their _stats.json, no nshards.txt: the stats list the shards and their sizes. A
    tar still without its stats (a shard img2dataset was writing when killed) is left out, with a warning."""
    out = write_img2dataset_output(tmp_path / "laion", rows=50, rows_per_shard=20, unfinished_rows=5)
    folder = out.folder
    assert not (folder / "nshards.txt").exists() and not (folder / "sizes.json").exists()
    with caplog.at_level("WARNING"):
        urls = shard_urls(folder)
    assert urls == [str(folder / f"{i:05d}.tar") for i in range(3)]  # 00003.tar has no _stats.json
    assert "1 tar(s) have no _stats.json" in caplog.text and "00003.tar" in caplog.text
    # 20 + 20 + 10 rows, every 7th a failed download: 18 + 17 + 8 samples, as "successes" says.
    assert out.successes == [18, 17, 8]
    assert listed_sizes(urls) == dict(zip(urls, [18, 17, 8]))
    assert num_samples(folder) == 43
    counter = BadSampleCounter()
    samples = [sample for url in urls for sample in tar_samples(url, counter, 20)]
    # Failed downloads are absent: keys skip them (shard number, then the row in the shard).
    assert [sample["__key__"] for sample in samples] == out.keys
    assert "000000006" in out.failed and "000000006" not in out.keys
    assert {key for sample in samples for key in sample if not key.startswith("__")} == {"jpg", "txt", "json"}
    assert json.loads(samples[0]["json"])["status"] == "success"
    # The failed rows are in the .parquet beside the tar, with their error.
    pq = pytest.importorskip("pyarrow.parquet")
    rows = pq.read_table(folder / "00000.parquet").to_pylist()
    assert [row["key"] for row in rows if row["status"] == "failed_to_download"] == ["000000006", "000000013"]
    assert len(rows) == 20


def test_a_tar_shorter_than_its_stats_is_truncated(tmp_path):
    """"successes" is what the tar should hold: a tar cut at a sample boundary reads as a clean, shorter
    archive, and only the count its _stats.json gives tells the loss (as sizes.json does for ours)."""
    out = write_img2dataset_output(tmp_path / "laion", rows=40, rows_per_shard=20, failed_every=0)
    cut_at_sample(out.shards[1], 12)
    urls = shard_urls(out.folder)
    listed = listed_sizes(urls)
    assert listed == {urls[0]: 20, urls[1]: 20}  # from the stats, not a count of the cut tar (12)
    counter = BadSampleCounter()
    assert sum(1 for url in urls for _ in tar_samples(url, counter, listed[url])) == 32
    assert dict(counter.counts) == {"truncated_shard": 1, "missing_samples": 8}


def test_stats_without_a_successes_count_fall_back_to_counting_the_tar(tmp_path, caplog):
    out = write_img2dataset_output(tmp_path / "laion", rows=30, rows_per_shard=15)
    stats = out.shards[0].with_name("00000_stats.json")
    stats.write_text("{not json")
    out.shards[1].with_name("00001_stats.json").write_text(json.dumps({"count": 15}))
    with caplog.at_level("WARNING"):
        assert listed_sizes(shard_urls(out.folder)) == dict(zip(map(str, out.shards), [13, 13]))
    assert f"{stats} holds no \"successes\" count" in caplog.text


def test_stats_of_a_missing_tar_name_the_fix(tmp_path):
    out = write_img2dataset_output(tmp_path / "laion", rows=30, rows_per_shard=15)
    out.shards[1].unlink()
    with pytest.raises(UserError, match=r"00001_stats.json describes a shard whose tar 00001.tar is missing .*"
                                        r"--incremental_mode incremental"):
        shard_urls(out.folder)


def test_numbered_tars_without_stats_or_nshards_are_no_split_but_a_pattern_reads_them(tmp_path):
    """A numbered folder without _stats.json is what a killed `write_split` leaves: not taken for a
    complete split. Named by a pattern, its tars are read, and their sizes counted."""
    out = write_img2dataset_output(tmp_path / "laion", rows=30, rows_per_shard=15)
    for tar in out.shards:
        tar.with_name(tar.stem + "_stats.json").unlink()
    with pytest.raises(UserError, match="no nshards.txt"):
        shard_urls(out.folder)
    urls = shard_urls(f"{out.folder}/{{00000..00001}}.tar")
    assert listed_sizes(urls) == dict(zip(urls, [13, 13]))


def test_a_tar_listed_nowhere_is_counted_once_as_webdataset_groups_it(tmp_path, monkeypatch):
    """No sizes.json, no _stats.json: each tar's samples are counted from its member headers, once per
    file (path, size, mtime, ctime), and the count is what webdataset then reads (its metadata members
    and members without an extension are no samples)."""
    tar_path = tmp_path / "hand.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, data in (("__meta__", b"x"), ("a.jpg", b"1"), ("a.txt", b"1"), ("README", b"no sample"),
                           ("b.jpg", b"2"), ("dir/c.jpg", b"3"), ("dir/c.json", b"{}"), ("d.txt", b"4")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    counter = BadSampleCounter()
    read = [sample["__key__"] for sample in tar_samples(str(tar_path), counter)]
    assert read == ["a", "b", "dir/c", "d"] and not counter.counts
    opened = []
    real_open = tar_reading.tarfile.open
    monkeypatch.setattr(tar_reading.tarfile, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    assert listed_sizes([str(tar_path)]) == {str(tar_path): 4}
    assert count_samples(str(tar_path)) == 4 and len(opened) == 1  # counted once
    with real_open(tar_path, "a") as tar:  # rewritten: counted again
        info = tarfile.TarInfo("e.jpg")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"5"))
    assert count_samples(str(tar_path)) == 5 and len(opened) == 2
    assert count_samples(str(tmp_path / "gone.tar")) == 0  # the reading pass counts a missing shard


def _damaged_copies(source, folder):
    """Copies of a good shard, each damaged another way: {name: path}."""
    data = Path(source).read_bytes()
    with tarfile.open(source) as tar:
        member = tar.getmembers()[len(tar.getmembers()) // 2]
        inside = member.offset_data + member.size // 2
    middle = len(data) // 2 // 512 * 512  # a block boundary
    folder.mkdir()
    damaged = {
        "whole": data,
        "cut inside a member": data[:inside],
        "cut inside a header": data[:(len(data) // 1024) * 512 + 100],
        "garbage in the middle": data[:middle] + b"\x17" * 2048 + data[middle + 2048:],
        "zero bytes": b"",
        "not a tar": b"this is not a tar archive\n" * 40,
    }
    paths = {}
    for name, content in damaged.items():
        path = folder / f"{name.replace(' ', '-')}.tar"
        path.write_bytes(content)
        paths[name] = path
    return paths


def test_local_tars_read_as_webdatasets_stream_reader_reads_them(fmnist_shards, tmp_path, monkeypatch):
    """Local .tar shards are read at random, from their member headers (`tar_reading._local_tar_files`: plain
    ustar headers directly, others by tarfile), others by webdataset's stream reader: the same samples, bytes
    and bad-shard counts on whole and damaged tars, on every kind of header (ustar prefixes, pax and GNU long
    names, folders, links, names in another encoding) and with a select_files filter."""
    out, _, _ = fmnist_shards
    paths = _damaged_copies(shard_urls(out / "train")[0], tmp_path / "damaged")
    long_names = tmp_path / "long.tar"  # a name over 100 characters: a pax or GNU long-name header
    with tarfile.open(long_names, "w", format=tarfile.PAX_FORMAT) as tar:
        meta = tarfile.TarInfo("__meta__/info.json")  # webdataset's metadata folder: not a sample
        meta.size = 2
        tar.addfile(meta, io.BytesIO(b"{}"))
        for index in range(3):
            for extension, payload in (("png", seeded_png(index)), ("cls", str(index).encode())):
                info = tarfile.TarInfo(f"{'deep/' * 30}{index:03d}.{extension}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    paths["long names"] = long_names
    paths.update(_tars_of_every_header_kind(tmp_path / "kinds"))

    def read(url, select_files=None):
        counter = BadSampleCounter()
        samples = [{k: v for k, v in sample.items() if k != "__url__"}
                   for sample in tar_samples(url, counter, select_files=select_files)]
        return samples, {reason: count for reason, count in counter.counts.items() if count}

    def by_webdataset(url, select_files=None):  # the same shard through webdataset's opener and stream reader
        with monkeypatch.context() as patch:
            patch.setattr(tar_reading, "_is_local_tar", lambda url: False)
            return read(url, select_files)

    for name, path in paths.items():
        fast, streamed = read(str(path)), by_webdataset(str(path))
        assert fast == streamed, name
        assert (len(fast[0]) > 0) == (name not in ("zero bytes", "not a tar")), name
    whole, counts = read(str(paths["whole"]))
    assert len(whole) == 64 and not counts and all({"__key__", "png", "cls", "json"} <= set(sample) for sample in whole)
    assert read(str(paths["cut inside a member"]))[1] == {"bad_shard": 1}
    long_keys = [sample["__key__"] for sample in read(str(paths["long names"]))[0]]
    assert long_keys == [f"{'deep/' * 30}{i:03d}" for i in range(3)]
    only_labels = read(str(paths["whole"]), lambda name: name.endswith(".cls"))
    assert only_labels == by_webdataset(str(paths["whole"]), lambda name: name.endswith(".cls"))
    assert [set(sample) for sample in only_labels[0]] == [{"__key__", "cls"}] * 64
    # Plain ustar headers are read without tarfile: every member's of the whole shard, and those before the
    # first header of another kind.
    plain, real = [], tar_reading._plain_member
    with tarfile.open(paths["whole"]) as tar:
        members = len(tar.getmembers())
    with monkeypatch.context() as patch:
        patch.setattr(tar_reading, "_plain_member", lambda header: plain.append(real(header)) or plain[-1])
        read(str(paths["whole"]))
        assert sum(member is not None for member in plain) == members and plain[-1] is None  # the end: tarfile's
        plain.clear()
        assert len(read(str(paths["a pax header after plain ones"]))[0]) == 5
        assert [member is not None for member in plain] == [True, True, False]
        plain.clear()
        assert len(read(str(paths["a signed-char checksum"]))[0]) == 4
        assert [member is not None for member in plain] == [True] * 8 + [False]  # the end: tarfile's


def _tars_of_every_header_kind(folder: Path) -> dict:
    """Tars whose headers are of each kind a writer makes, or damaged in the middle: {name: path}."""
    folder.mkdir()
    payloads = [(f"{index:03d}.{extension}", payload) for index in range(4)
                for extension, payload in (("png", seeded_png(index)), ("cls", str(index).encode()))]

    def write(name, members, **options):
        with tarfile.open(folder / f"{name}.tar", "w", **options) as tar:
            for info, payload in members:
                tar.addfile(info, io.BytesIO(payload) if payload is not None else None)
        return folder / f"{name}.tar"

    def file(name, payload):
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        return info, payload

    def entry(name, kind, **fields):
        info = tarfile.TarInfo(name)
        info.type = kind
        for key, value in fields.items():
            setattr(info, key, value)
        return info, None

    paths = {
        # a ustar name past 100 characters keeps its head in the prefix field
        "ustar prefix names": write("ustar", [file(f"{'d' * 60}/{'e' * 60}/{n}", p) for n, p in payloads],
                                    format=tarfile.USTAR_FORMAT),
        "gnu long names": write("gnu", [file(f"{'deep/' * 30}{n}", p) for n, p in payloads],
                                format=tarfile.GNU_FORMAT),
        "folders and links": write("links", [
            entry("shards", tarfile.DIRTYPE), *[file(f"shards/{n}", p) for n, p in payloads[:4]],
            entry("shards/000.txt", tarfile.SYMTYPE, linkname="000.cls"),
            entry("shards/001.txt", tarfile.LNKTYPE, linkname="shards/001.cls"),
            *[file(f"shards/{n}", p) for n, p in payloads[4:]]], format=tarfile.USTAR_FORMAT),
        "a pax header after plain ones": write("pax", [
            *[file(n, p) for n, p in payloads[:2]], file(f"{'x' * 120}.png", payloads[2][1]),
            *[file(n, p) for n, p in payloads[3:]]], format=tarfile.PAX_FORMAT),
        "a name that is not UTF-8": write("latin1", [file(n.replace(".", "é."), p) for n, p in payloads],
                                          format=tarfile.USTAR_FORMAT, encoding="latin-1"),
    }
    data = paths["ustar prefix names"].read_bytes()
    with tarfile.open(paths["ustar prefix names"]) as tar:
        third = tar.getmembers()[2]
    header = bytearray(data[third.offset:third.offset + 512])
    header[148:156] = b"0000000\0"  # the third header's checksum
    pad_end = third.offset_data + third.size + (-third.size % 512)
    # Old Sun and NeXT tars summed the header as signed chars: tarfile accepts either sum. A name with bytes past
    # 127 (latin-1 é) makes the two differ.
    latin1 = paths["a name that is not UTF-8"].read_bytes()
    signed = bytearray(latin1[:512])
    unsigned_sum, signed_sum = tarfile.calc_chksums(bytes(signed))
    assert signed_sum != unsigned_sum
    signed[148:156] = b"%06o\0 " % signed_sum
    for name, content in {"a bad checksum in the middle": data[:third.offset] + header + data[third.offset + 512:],
                          "a signed-char checksum": bytes(signed) + latin1[512:],
                          "cut inside the padding": data[:pad_end - 1]}.items():
        paths[name] = folder / f"{name.replace(' ', '-')}.tar"
        paths[name].write_bytes(content)
    return paths


def _with_checksum(header: bytearray, spelling: str = "%06o\0") -> bytes:
    unsigned_sum = tarfile.calc_chksums(bytes(header))[0]  # the checksum field counted as spaces
    header[148:156] = b" " * 8
    header[148:148 + len(spelling % 0)] = (spelling % unsigned_sum).encode()
    return bytes(header)


def _frombuf(header: bytes):
    """What tarfile reads from one header block: (name, size, regular) for a file, "folder", or None (refused)."""
    try:
        info = tarfile.TarInfo.frombuf(header, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return None
    return (info.name, info.size, True) if info.isreg() else "folder" if info.isdir() else "other"


def _plain(header: bytes):
    member = tar_reading._plain_member(header)
    return member if member is None or member[2] else "folder"


def test_a_plain_header_is_read_as_tarfile_reads_it_in_every_spelling_of_its_numbers():
    # The header reader takes the number fields as tarfile, webdataset and GNU tar write them in one match and
    # every other spelling through tarfile's own readers: both must read what TarInfo.frombuf reads.
    headers = {}
    for form in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        for name, size, kind in [("000.png", 300, tarfile.REGTYPE), ("a/b/000.cls", 8 ** 11 - 1, tarfile.REGTYPE),
                                 ("folder", 0, tarfile.DIRTYPE), ("link", 0, tarfile.SYMTYPE),
                                 (f"{'deep/' * 25}0.txt", 5, tarfile.REGTYPE)]:  # a ustar prefix
            info = tarfile.TarInfo(name)
            info.size, info.type, info.mtime, info.mode, info.uid = size, kind, 1_700_000_000, 0o644, 1000
            if kind == tarfile.SYMTYPE:
                info.linkname = "000.png"
            headers[f"{form} {name[:12]} {kind}"] = info.tobuf(form)[-512:]  # a pax record's own header aside
    base = bytearray(headers[f"{tarfile.USTAR_FORMAT} 000.png {tarfile.REGTYPE}"])
    spellings = {"spaces": (108, b"   1750 "), "spaces, no NUL": (100, b" 000644 "),
                 "size with spaces": (124, b" " * 8 + b"454 "),
                 "base-256 size": (124, b"\x80" + (300).to_bytes(11, "big")), "no digits": (116, b"\0" * 8),
                 "an 8 in the mtime": (136, b"00000000008\0"), "a letter in the mode": (100, b"000064x\0"),
                 "device numbers": (329, b"0000001\0"), "devices with spaces": (337, b"     2 \0"),
                 "a letter in a device number": (337, b"00000x2\0")}
    for label, (start, field) in spellings.items():
        header = bytearray(base)
        header[start:start + len(field)] = field
        headers[label] = _with_checksum(header)
    headers["checksum of 7 digits"] = _with_checksum(bytearray(base), "%07o\0")
    headers["checksum with spaces"] = _with_checksum(bytearray(base), " %05o \0")
    for off_by in (1, 65521, -65521, 131042):
        header = bytearray(_with_checksum(bytearray(base)))
        header[148:155] = b"%06o\0" % (int(header[148:154], 8) + off_by)
        headers[f"checksum off by {off_by}"] = bytes(header)
    for label, header in headers.items():
        expected = _frombuf(header)
        assert _plain(header) == (expected if expected != "other" else None), label
    refused = {label for label, header in headers.items() if _frombuf(header) is None}
    assert refused == {"an 8 in the mtime", "a letter in the mode", "a letter in a device number", "checksum off by 1",
                       "checksum off by 65521", "checksum off by -65521", "checksum off by 131042"}


def test_the_unsigned_checksum_is_the_sum_of_the_header_bytes_alone():
    # Adler-32 gives the bytes' sum modulo 65,521 and the count of odd bytes its parity: together the exact sum of
    # 512 bytes, whatever the bytes and whatever number the checksum field claims.
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, 512, dtype=np.uint8).tobytes() for _ in range(300)]
    blocks += [bytes(512), b"\xff" * 512, b"\x01" * 512, b"\xfe" * 256 + b"\x01" * 256]
    for block in blocks:
        total = tarfile.calc_chksums(block)[0]
        for claimed in (total, total + 1, total - 1, total + 65521, total - 65521, total + 131042, total - 131042,
                        0, 8 ** 6 - 1, 8 ** 8 - 1):
            assert tar_reading._is_unsigned_checksum(block, claimed) == (claimed == total), (claimed, total)


def _dataset_with_classnames(root: Path, text: str) -> Path:
    write_split([{"png": png_bytes(np.zeros((8, 8), np.uint8)), "cls": b"0"}], root, "test")
    (root / "classnames.txt").write_bytes(text.encode())
    return root


@pytest.mark.parametrize("text", ["cat\ndog", "cat\ndog\n", "cat\ndog\n  \n\n", "cat\r\ndog\r\n\r\n", " cat \n\tdog\n"])
def test_pretraining_and_evaluation_read_the_same_class_names(tmp_path, text):
    """Pretraining (`read_classnames`) kept a blank last line with spaces, or of a CRLF file, as a class
    named "", which LiT's eval set and the zero-shot suite dropped."""
    from lit_softmoe.evals.prompts import _read_list
    from lit_softmoe.evals.readers import read_wds

    root = _dataset_with_classnames(tmp_path, text)
    assert read_classnames(root) == read_classnames(root / "test") == ["cat", "dog"]
    assert shards.read_classnames_file(root / "classnames.txt") == ["cat", "dog"]  # LiT's eval set
    assert read_wds(root, "test", lambda image: image).classnames == ["cat", "dog"]
    assert _read_list(str(root / "classnames.txt"), "classnames") == ["cat", "dog"]


@pytest.mark.parametrize("text, line", [("cat\n\ndog\n", 2), ("cat\n   \ndog\n", 2), ("\ncat\ndog\n", 1)])
def test_a_blank_line_before_a_class_name_is_refused_in_one_line(tmp_path, text, line):
    """Pretraining read a blank line as a class named "" and LiT and the suite skipped it, so every
    later class had another label in each; now every reader refuses the file, naming the line."""
    from lit_softmoe.evals.readers import read_wds

    root = _dataset_with_classnames(tmp_path, text)
    for read in (lambda: read_classnames(root), lambda: read_wds(root, "test", lambda image: image)):
        with pytest.raises(UserError, match=f"classnames.txt line {line} is blank: .*write class {line - 1}'s name"
                           ) as refused:
            read()
        assert "\n" not in str(refused.value)


def test_templates_and_other_metadata_files_skip_blank_lines(tmp_path):
    (tmp_path / "t.txt").write_text("\na photo of a {c}.\n\n  a {c}  \n\n")
    assert shards.read_lines(tmp_path / "t.txt") == ["a photo of a {c}.", "a {c}"]
    assert shards.read_lines(tmp_path / "absent.txt") is None and shards.read_classnames_file(tmp_path / "x") is None


def test_a_split_whose_nshards_counts_fewer_shards_than_sizes_lists_is_refused(fmnist_shards, tmp_path):
    """`echo 2 > SPLIT/nshards.txt` on a 4-shard split: every reader took the first two shards as the whole
    split (eval published top-1 on half the samples, unmarked). The shards that would not be read are named."""
    split = tmp_path / "train"
    shutil.copytree(fmnist_shards[0] / "train", split)
    assert len(shard_urls(split)) == 4
    (split / "nshards.txt").write_text("2\n")
    with pytest.raises(UserError, match=r"sizes.json lists 4 shards, .*nshards.txt counts 2: 2 would not be read "
                                        r"\(first: 2.tar\); rewrite the split's shards"):
        shard_urls(split)
    (split / "nshards.txt").write_text("4\n")
    assert len(shard_urls(split)) == 4


@pytest.mark.parametrize("count, says", [("0", "counts 0 shards, but a split holds at least one"),
                                         ("-3", "counts -3 shards, but a split holds at least one"),
                                         ("abc", "does not hold a number"), ("2.5", "does not hold a number")])
def test_an_nshards_that_is_no_count_of_shards_is_refused_in_its_own_words(fmnist_shards, tmp_path, count, says):
    """Without a sizes.json to compare with, 0 and -3 read as a split of no shards: the readers then said the
    shards were not found and told the user to write Fashion-MNIST."""
    split = tmp_path / "train"
    shutil.copytree(fmnist_shards[0] / "train", split)
    (split / "sizes.json").unlink()
    (split / "nshards.txt").write_text(f"{count}\n")
    with pytest.raises(UserError, match=rf"nshards.txt {says}; rewrite the split's shards$"):
        shard_urls(split)


def test_an_nshards_beyond_the_tars_in_the_folder_is_refused_without_naming_them_all(fmnist_shards, tmp_path):
    """`echo 100000000000000000000 > nshards.txt` built a list of 10**20 shard names: the reader filled the
    memory (8 GB before it was killed) instead of saying the shards are missing."""
    split = tmp_path / "train"
    shutil.copytree(fmnist_shards[0] / "train", split)
    (split / "nshards.txt").write_text(f"{10**20}\n")
    with pytest.raises(UserError, match=rf"nshards.txt says {10**20} shards but {10**20 - 4} or more are missing "
                                        rf"\(first: {split / '4.tar'}\); rewrite the split's shards$"):
        shard_urls(split)


@pytest.mark.parametrize("sizes", ["[1, 2]", '{"0.tar": "many"}', '{"0.tar": -1}', "7"])
def test_a_sizes_json_that_is_no_table_of_counts_is_refused(fmnist_shards, tmp_path, sizes):
    """A sizes.json holding a list (or a number) was taken for no sizes.json at all, which turned off the check
    of every shard against its count; a count that is no number ended in int()'s ValueError."""
    split = tmp_path / "train"
    shutil.copytree(fmnist_shards[0] / "train", split)
    (split / "sizes.json").write_text(sizes)
    with pytest.raises(UserError, match=r"sizes.json is not a mapping of shard names to sample counts; rewrite the "
                                        r"split's shards or delete it and set data.samples_per_epoch$"):
        listed_sizes(shard_urls(split))


def test_a_tar_cut_inside_a_member_or_a_header_is_damaged(fmnist_shards, tmp_path):
    """tarfile takes a file cut inside a member's data, or inside the next header, for the end of the archive;
    its samples count stops there, and `is_damaged_tar` says the tar lost what followed."""
    import tarfile

    from lit_softmoe.data.tar_reading import count_samples, is_damaged_tar
    whole = sorted((fmnist_shards[0] / "train").glob("*.tar"))[0]
    with tarfile.open(whole) as archive:
        members = archive.getmembers()
    data = whole.read_bytes()
    cuts = {"inside a member's data": members[5].offset_data + 10,
            "inside a header": members[5].offset + 100,
            "at a sample's end, padding and all": members[4].offset_data + -(-members[4].size // 512) * 512}
    keys = [member.name.split(".")[0] for member in members]
    assert not is_damaged_tar(str(whole))
    for name, cut in cuts.items():
        path = tmp_path / f"{name.replace(' ', '_')}.tar"
        path.write_bytes(data[:cut])
        headers_read = 6 if name == "inside a member's data" else 5  # a whole header of the cut member is read
        assert count_samples(str(path)) == len(set(keys[:headers_read])), name
        assert is_damaged_tar(str(path)) == (name != "at a sample's end, padding and all"), name
