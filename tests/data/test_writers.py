"""lit_softmoe.data.writers: `lit-softmoe data from-folder|from-table` round-trips (kept bytes equal the
files), bad input is skipped or normalized and counted by reason, reruns are byte-identical or skipped,
and a split holding other data is never replaced silently.
Real images: foolbox's bundled ImageNet / CIFAR / MNIST files (read from its folder, not imported)."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import webdataset.writer

from data_files import encode_image, gray_png, pixels_of, read_split, rng_image, run_past_fifos, seeded_png, write_table
from launch import kill_tree, python_command
from lit_softmoe.cli import build_parser, main
from lit_softmoe.data import sample_encoding, writers
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.fashion_mnist import find_fashion_mnist
from lit_softmoe.data.shards import read_classnames
from lit_softmoe.data.write_options import WriteOptions, parse_byte_size
from lit_softmoe.data.writers import write_folder_shards
from lit_softmoe.errors import UserError
from lit_softmoe.metadata import FASHION_MNIST_CLASSNAMES
from lit_softmoe.utils.locks import folder_lock
from lock_holders import in_thread

CIFAR10_CLASSNAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def test_parse_byte_size(tmp_path, capsys):
    sizes = [parse_byte_size(text) for text in ("1048576", "64k", "500M", "1G", "2GiB")]
    assert sizes == [1 << 20, 64 << 10, 500 << 20, 1 << 30, 2 << 30]
    with pytest.raises(UserError):
        parse_byte_size("lots")
    with pytest.raises(UserError, match="unknown image format 'gif'"):
        WriteOptions(image_format="gif")
    with pytest.raises(UserError, match=r"^split '../train' is not a plain folder name; "
                                        r"pass e.g. split=train$"):
        WriteOptions(split="../train")
    assert main(["data", "from-folder", str(tmp_path), "--out", str(tmp_path / "out"),
                 "--split", "../train"]) == 2
    assert capsys.readouterr().err == ("lit-softmoe data: error: --split '../train' is not a plain "
                                       "folder name; pass e.g. --split train\n")


def _captioned_folder(root, count=5):
    """`count` RGB PNGs with captions, in two img2dataset-style bucket folders; {stem: (path, caption)}."""
    made = {}
    for index in range(count):
        folder = root / f"{index // 3:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{index:09d}"
        (folder / f"{stem}.png").write_bytes(encode_image(rng_image(index)))
        caption = f"picture number {index}, café"
        (folder / f"{stem}.txt").write_text(f"  {caption}\n", encoding="utf-8")
        made[stem] = (folder / f"{stem}.png", caption)
    return made


def test_captions_folder_round_trips_with_rollover(tmp_path):
    made = _captioned_folder(tmp_path / "src", count=5)
    summary = write_folder_shards(tmp_path / "src", tmp_path / "out", WriteOptions(samples_per_shard=2))
    assert summary.sizes == {"0.tar": 2, "1.tar": 2, "2.tar": 1}
    assert (tmp_path / "out/train/nshards.txt").read_text() == "3\n"
    assert json.loads((tmp_path / "out/train/sizes.json").read_text()) == summary.sizes
    assert summary.line() == f"written 5 samples in 3 shards to {tmp_path / 'out/train'}; skipped 0"
    samples = read_split(tmp_path / "out/train")
    assert list(samples) == sorted(made)
    for stem, (path, caption) in made.items():
        sample = samples[stem]
        assert sorted(sample) == ["json", "png", "txt"]
        assert sample["png"] == path.read_bytes()  # kept, not re-encoded
        assert sample["txt"].decode("utf-8") == caption  # stripped
        meta = json.loads(sample["json"])
        assert meta == {"key": stem, "path": str(path.relative_to(tmp_path / "src")), "width": 12, "height": 8,
                        "file_bytes": path.stat().st_size}

    # Rollover by bytes (checked before each sample): a limit just above the largest sample's
    # payload lets a second sample in, never a third.
    largest = max(sum(len(value) for value in sample.values()) for sample in samples.values())
    by_bytes = write_folder_shards(tmp_path / "src", tmp_path / "out",
                                   WriteOptions(split="bytes", max_shard_bytes=largest + 1))
    assert by_bytes.sizes == {"0.tar": 2, "1.tar": 2, "2.tar": 1}


def test_every_bad_input_is_skipped_or_normalized_and_counted(tmp_path):
    src = tmp_path / "src"
    _captioned_folder(src / "good", count=3)
    bad = src / "bad"
    bad.mkdir()

    def planted(name, data, caption=b"a caption"):
        (bad / name).write_bytes(data)
        if caption is not None:
            (bad / name).with_suffix(".txt").write_bytes(caption)

    jpeg = encode_image(rng_image(4, size=(64, 64)), "JPEG", quality=90)
    planted("truncated.jpg", jpeg[: len(jpeg) // 2])
    planted("not_an_image.png", b"hello, I am text")
    planted("no_caption.png", encode_image(rng_image(5)), caption=None)
    (bad / "orphan.txt").write_text("a caption without its image")
    planted("empty.png", encode_image(rng_image(6)), caption=b" \n\t ")
    planted("latin1.png", encode_image(rng_image(7)), caption="caf\xe9".encode("latin-1"))
    (bad / "sub").mkdir()
    planted("sub/000000001.png", encode_image(rng_image(8)))  # the stem of good/00000/000000001.png again
    planted("rgba.png", encode_image(rng_image(9, mode="RGBA")))
    planted("palette.png", encode_image(rng_image(10).convert("P", palette=PIL.Image.Palette.ADAPTIVE)))
    planted("sixteen.png", encode_image(PIL.Image.fromarray(np.full((5, 5), 40000, np.uint16))))
    planted("cmyk.jpg", encode_image(PIL.Image.new("CMYK", (6, 6), (10, 20, 30, 40)), "JPEG"))
    planted("big.png", encode_image(rng_image(11, size=(90, 30))))
    (src / "notes.json").write_text("{}")  # neither image nor caption: not a sample
    (src / ".hidden.png").write_bytes(b"never read")

    summary = write_folder_shards(src, tmp_path / "out", WriteOptions(max_size=45))
    assert summary.skipped == {"bad_image": 2, "duplicate_key": 1, "empty_caption": 1, "missing_caption": 1,
                               "missing_image": 1, "non_utf8_text": 1}
    assert summary.normalized == {"16bit": 1, "alpha": 1, "cmyk": 1, "palette": 1, "resized": 1}
    assert summary.samples == 3 + 5 and summary.reencoded == 5
    assert summary.line().endswith(
        "; 5 images re-encoded (16bit 1, alpha 1, cmyk 1, palette 1, resized 1); skipped 7 (bad_image 2, "
        "duplicate_key 1, empty_caption 1, missing_caption 1, missing_image 1, non_utf8_text 1)")
    samples = read_split(tmp_path / "out/train")
    kept = ["000000000", "000000001", "000000002", "rgba", "palette", "sixteen", "cmyk", "big"]
    assert sorted(samples) == sorted(kept)
    assert pixels_of(samples["sixteen"]["png"]).tolist() == [[156] * 5] * 5  # round(40000 * 255 / 65535)
    assert PIL.Image.open(io.BytesIO(samples["big"]["png"])).size == (45, 15)
    assert PIL.Image.open(io.BytesIO(samples["cmyk"]["jpg"])).mode == "RGB"
    # The first of the two 000000001 in path order (bad/ before good/) is the one kept.
    assert json.loads(samples["000000001"]["json"])["path"] == "bad/sub/000000001.png"


def _hashes(split_dir):
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in Path(split_dir).iterdir()}


def test_reruns_are_skipped_or_byte_identical(tmp_path, monkeypatch):
    src = tmp_path / "src"
    _captioned_folder(src, count=4)
    (src / "rgba.png").write_bytes(encode_image(rng_image(1, mode="RGBA")))
    (src / "rgba.txt").write_text("see-through")
    options = WriteOptions(samples_per_shard=3, image_format="jpg")
    first = write_folder_shards(src, tmp_path / "out", options)
    hashes = _hashes(tmp_path / "out/train")
    mtimes = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out/train").iterdir()}

    again = write_folder_shards(src, tmp_path / "out", options)
    assert again.already_complete and again.sizes == first.sizes and again.skipped == first.skipped
    # What the first write did is told as that write's, not as this run's (it said "nothing written; 5
    # images re-encoded").
    assert again.line() == (f"{tmp_path / 'out/train'} already holds these 5 samples in 2 shards; nothing written "
                            "(when they were written: 5 images re-encoded (alpha 1); skipped 0)")
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out/train").iterdir()} == mtimes

    # A run killed after its first shard leaves a manifest without a summary (not complete, but
    # naming its source): the rerun writes everything again, to the same bytes.
    calls, prepare = [], sample_encoding.prepare_image

    def killed_at_the_fifth_image(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return prepare(*args, **kwargs)

    monkeypatch.setattr(sample_encoding, "prepare_image", killed_at_the_fifth_image)
    (tmp_path / "out/train/1.tar").unlink()  # no longer complete: not skipped
    with pytest.raises(KeyboardInterrupt):
        write_folder_shards(src, tmp_path / "out", options)
    monkeypatch.undo()
    assert "summary" not in json.loads((tmp_path / "out/train/manifest.json").read_text())
    redone = write_folder_shards(src, tmp_path / "out", options)
    assert not redone.already_complete and _hashes(tmp_path / "out/train") == hashes

    # A changed input is a rewrite, not a skip.
    (src / "rgba.txt").write_text("see-through, changed")
    changed = write_folder_shards(src, tmp_path / "out", options)
    assert not changed.already_complete
    assert read_split(tmp_path / "out/train")["rgba"]["txt"] == b"see-through, changed"


def test_an_output_folder_inside_the_source_is_not_read(tmp_path):
    _captioned_folder(tmp_path / "src", count=3)
    first = write_folder_shards(tmp_path / "src", tmp_path / "src/shards")
    again = write_folder_shards(tmp_path / "src", tmp_path / "src/shards")
    assert first.samples == again.samples == 3 and again.skipped == {} and again.already_complete


def test_class_folders_round_trip_like_imagefolder(tmp_path):
    src = tmp_path / "src"
    sources = {}
    for label, name in enumerate(["cat", "dog"]):
        for index in range(3):
            image = rng_image(10 * label + index, size=(8, 8), mode="L")
            (src / name).mkdir(parents=True, exist_ok=True)
            (src / name / f"{index}.png").write_bytes(encode_image(image))  # the same names in both classes
            sources[f"{name}/{index}"] = (np.asarray(image), label)
    (src / "stray.png").write_bytes(encode_image(rng_image(0, size=(8, 8), mode="L")))

    summary = write_folder_shards(src, tmp_path / "out", WriteOptions(split="test"))
    assert summary.samples == 6 and summary.skipped == {"outside_class_folder": 1}
    assert read_classnames(tmp_path / "out") == ["cat", "dog"]
    images, labels, counts = load_class_split(tmp_path / "out/test", cache=False)
    assert sum(counts.values()) == 0
    written = list(read_split(tmp_path / "out/test"))  # the keys in write order (shuffled: see in_shuffled_order)
    assert sorted(written) == sorted(sources)
    expected = [sources[key] for key in written]
    assert np.array_equal(images[:, 0].numpy(), np.stack([pixels for pixels, _ in expected]))
    assert labels.tolist() == [label for _, label in expected]
    samples = read_split(tmp_path / "out/test")
    assert json.loads(samples["dog/2"]["json"])["class"] == "dog" and samples["dog/2"]["cls"] == b"1"

    # Another split with other classes would renumber them: refused.
    (src / "bird").mkdir()
    (src / "bird/0.png").write_bytes(encode_image(rng_image(1, size=(8, 8), mode="L")))
    with pytest.raises(UserError, match="classnames.txt lists 2 classes"):
        write_folder_shards(src, tmp_path / "out", WriteOptions(split="train"))


def test_cli_writes_and_prints_the_summary(tmp_path, capsys):
    _captioned_folder(tmp_path / "src", count=2)
    assert main(["data", "from-folder", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--split", "val",
                 "--image-format", "webp", "--max-shard-bytes", "1M"]) == 0
    out = capsys.readouterr().out
    assert out == (f"written 2 samples in 1 shard to {tmp_path / 'out/val'}; 2 images re-encoded; skipped 0\n")
    assert sorted(read_split(tmp_path / "out/val")["000000000"]) == ["json", "txt", "webp"]
    args = build_parser().parse_args(["data", "fashion-mnist", "--out", "d", "--limit", "5"])
    assert (args.dataset, args.out, args.limit, args.source) == ("fashion-mnist", "d", 5, None)


def test_cli_mistakes_are_one_line_with_exit_code_2(tmp_path, capsys):
    table = write_table(tmp_path, "csv")
    out = ["--out", str(tmp_path / "o")]
    cases = {  # the text the one line must hold → the command
        f"source folder {tmp_path / 'nowhere'} not found":
            ["data", "from-folder", str(tmp_path / "nowhere"), *out],
        "has no column 'caption' (its columns: filepath, title, score); pass --caption-col":
            ["data", "from-table", str(table), "--image-col", "filepath", "--caption-col", "caption", *out],
        f"table {tmp_path / 'nowhere.csv'} not found":
            ["data", "from-table", str(tmp_path / "nowhere.csv"), "--image-col", "a", "--caption-col", "b",
             *out],
    }
    for expected, argv in cases.items():
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
        assert captured.err.startswith("lit-softmoe data: error: ") and expected in captured.err


def _class_folder(root, classes=("cat", "dog"), count=2):
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            (root / name / f"{index}.png").write_bytes(encode_image(rng_image(10 * label + index, mode="L")))
    return root


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_split_holding_other_data_is_refused_unless_overwrite(tmp_path, capsys):
    # A 60k Fashion-MNIST split was replaced by 600 images without a word, and a
    # class dataset by caption shards with the old classnames.txt left beside them.
    out = tmp_path / "mine-cls"
    assert main(["data", "from-folder", str(_class_folder(tmp_path / "labelled")), "--layout", "classes",
                 "--out", str(out)]) == 0
    _captioned_folder(tmp_path / "photos", count=3)
    table = write_table(tmp_path / "tab", "csv")
    before = _tree(out)
    for argv in (["from-folder", str(tmp_path / "photos")],
                 ["from-table", str(table), "--image-col", "filepath", "--caption-col", "title"]):
        capsys.readouterr()
        assert main(["data", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (f"lit-softmoe data: error: {out / 'train'} already holds 4 samples of "
                       f"{(tmp_path / 'labelled').resolve()}; pass --overwrite to replace that split, "
                       "or choose another --out or --split\n")
        assert _tree(out) == before  # nothing written, nothing deleted

    # The same command again is still skipped (or rewritten after a change): its own split.
    assert main(["data", "from-folder", str(tmp_path / "labelled"), "--layout", "classes", "--out", str(out)]) == 0
    assert "nothing written" in capsys.readouterr().out and _tree(out) == before

    # --overwrite: the whole split is replaced, and the class list of the replaced data goes too.
    assert main(["data", "from-folder", str(tmp_path / "photos"), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".lit-softmoe.lock", "train"]  # the writers' lock file
    assert sorted(p.name for p in (out / "train").iterdir()) == ["0.tar", "manifest.json", "nshards.txt",
                                                                 "sizes.json"]
    assert all("cls" not in sample for sample in read_split(out / "train").values())
    assert len(read_split(out / "train")) == 3


def test_fashion_mnist_and_folders_do_not_replace_each_other(tmp_path, capsys):
    from lit_softmoe.data.fashion_mnist import write_fashion_mnist_shards
    out = tmp_path / "data"
    write_fashion_mnist_shards(out, samples_per_shard=8, limit=20, allow_download=False)
    _captioned_folder(tmp_path / "photos", count=3)
    before = _tree(out)
    with pytest.raises(UserError, match=rf"^{re.escape(str(out / 'train'))} already holds 20 samples of "
                                        r"fashion-mnist; pass overwrite=True"):  # a Python caller's
        write_folder_shards(tmp_path / "photos", out)
    assert _tree(out) == before
    # Replacing train keeps test and the class list it still uses; no shard of the old train is left.
    write_folder_shards(tmp_path / "photos", out, overwrite=True)
    assert sorted(p.name for p in (out / "train").glob("*.tar")) == ["0.tar"] and len(read_split(out / "train")) == 3
    assert read_classnames(out) == list(FASHION_MNIST_CLASSNAMES) and (out / "test" / "2.tar").is_file()
    # Fashion-MNIST back over the folder's split: refused, then replaced whole with --overwrite.
    with pytest.raises(UserError, match=rf"^{re.escape(str(out / 'train'))} already holds 3 samples of "
                                        rf"{re.escape(str((tmp_path / 'photos').resolve()))}; "
                                        "pass overwrite=True"):
        write_fashion_mnist_shards(out, samples_per_shard=8, limit=20, allow_download=False)
    capsys.readouterr()
    # The command line's words: its flags.
    assert main(["data", "fashion-mnist", "--out", str(out), "--limit", "20"]) == 2
    photos = (tmp_path / "photos").resolve()
    assert capsys.readouterr().err == (f"lit-softmoe data: error: {out / 'train'} already holds 3 "
                                       f"samples of {photos}; pass --overwrite to replace it with "
                                       "Fashion-MNIST, or choose another --out\n")
    assert main(["data", "fashion-mnist", "--out", str(out), "--limit", "20", "--overwrite"]) == 0
    assert len(read_split(out / "train")) == 20 and not (out / "train" / "manifest.json").exists()


def _foolbox_data():
    spec = importlib.util.find_spec("foolbox")  # locates the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("foolbox is not installed (pip install --no-deps foolbox)")
    return Path(spec.origin).parent / "data"


def test_foolbox_images_through_from_folder(tmp_path):
    files = sorted(path for path in _foolbox_data().iterdir() if path.suffix in (".png", ".jpg"))
    assert len(files) == 100
    src = tmp_path / "foolbox"
    by_class = tmp_path / "cifar10"
    for path in files:
        dataset, index, label = re.fullmatch(r"(\w+?)_(\d+)_(\d+)", path.stem).groups()
        name = {"cifar10": CIFAR10_CLASSNAMES, "fashionMNIST": FASHION_MNIST_CLASSNAMES}.get(dataset)
        caption = f"a {dataset} image of {name[int(label)] if name else f'class {label}'}"
        (src / dataset).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, src / dataset / path.name)
        (src / dataset / f"{path.stem}.txt").write_text(caption + "\n")
        if dataset == "cifar10":
            (by_class / CIFAR10_CLASSNAMES[int(label)]).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, by_class / CIFAR10_CLASSNAMES[int(label)] / path.name)

    summary = write_folder_shards(src, tmp_path / "out", WriteOptions(samples_per_shard=40))
    # All are RGB or L PNGs and JPEGs already: every file is stored as its own bytes.
    assert summary.sizes == {"0.tar": 40, "1.tar": 40, "2.tar": 20} and summary.skipped == {}
    assert summary.reencoded == 0
    assert summary.line() == f"written 100 samples in 3 shards to {tmp_path / 'out/train'}; skipped 0"
    samples = read_split(tmp_path / "out/train")
    for path in files:
        sample = samples[path.stem]
        assert sample[path.suffix[1:]] == path.read_bytes()
        assert json.loads(sample["json"])["path"] == f"{path.stem.split('_')[0]}/{path.name}"
    assert samples["cifar10_00_3"]["txt"] == b"a cifar10 image of cat"

    classes = write_folder_shards(by_class, tmp_path / "out", WriteOptions(split="cifar10"))
    assert classes.samples == 20 and classes.skipped == {}
    images, labels, _ = load_class_split(tmp_path / "out/cifar10", cache=False)
    assert images.shape == (20, 3, 32, 32)
    classnames = read_classnames(tmp_path / "out")
    written = list(read_split(tmp_path / "out/cifar10"))  # keys in write order: class/stem
    assert sorted(written) == sorted(f"{path.parent.name}/{path.stem}" for path in by_class.glob("*/*.png"))
    assert [classnames[label] for label in labels.tolist()] == [key.split("/")[0] for key in written]


def test_out_equal_to_the_source_is_not_read_back(tmp_path):
    # `from-folder photos --out photos`: the rerun read photos/train/nshards.txt as a caption without
    # an image (skipped 1) and, that file being rewritten each time, never found the output complete.
    src = tmp_path / "photos"
    src.mkdir()
    for seed in range(3):
        (src / f"{seed}.png").write_bytes(seeded_png(seed))
        (src / f"{seed}.txt").write_text(f"caption {seed}")
    first = write_folder_shards(src, src)
    again = write_folder_shards(src, src)
    assert first.samples == again.samples == 3 and not first.skipped and not again.skipped
    assert again.already_complete


def test_a_file_where_the_split_folder_goes_is_one_line(tmp_path, capsys):
    # mkdir raised FileExistsError: a traceback instead of exit code 2.
    gray_png(tmp_path / "src" / "x.png", 0)
    (tmp_path / "src" / "x.txt").write_text("a photo")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train").write_text("not a folder")
    fmnist = str(find_fashion_mnist(allow_download=False))
    for command in (["from-folder", str(tmp_path / "src")], ["fashion-mnist", "--source", fmnist, "--limit", "2"]):
        assert main(["data", *command, "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{tmp_path / 'out' / 'train'} is a file, not a split folder" in error
    assert (tmp_path / "out" / "train").read_text() == "not a folder"


# ---------------------------------------------------------------------------------------- two writers


@pytest.mark.parametrize("first_source", ["the same", "another"])
def test_a_second_writer_of_a_dataset_folder_waits_then_checks_what_the_first_wrote(tmp_path, monkeypatch, caplog,
                                                                                     first_source):
    """Two writers with one --out ran at once: a second run of one command deleted the first's shards,
    and splits of two sources each passed the "split holds other data" check made before either wrote.
    Now the second waits for the folder's lock, then finds the first's split complete, or refuses it."""
    out, labelled = tmp_path / "out", _class_folder(tmp_path / "labelled")
    _captioned_folder(tmp_path / "photos", count=3)
    with folder_lock(out):  # the first writer, at work
        thread, outcome = in_thread(writers.write_folder_shards, labelled, out, layout="classes")
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline and not any(
                record.getMessage().startswith(f"waiting for process {os.getpid()}") for record in caplog.records):
            time.sleep(0.05)
        assert thread.is_alive() and [p.name for p in out.iterdir()] == [".lit-softmoe.lock"]  # waiting
        # What the first writer writes meanwhile, under the lock this block holds.
        monkeypatch.setattr(writers, "folder_lock", lambda folder: contextlib.nullcontext())
        if first_source == "the same":
            first = writers.write_folder_shards(labelled, out, layout="classes")
        else:
            first = writers.write_folder_shards(tmp_path / "photos", out)
        monkeypatch.undo()
        written = _tree(out / "train")
        assert thread.is_alive()
    thread.join(30)
    assert not thread.is_alive()
    if first_source == "the same":
        second = outcome["result"]
        assert second.already_complete and second.sizes == first.sizes == {"0.tar": 4}
    else:
        photos = (tmp_path / "photos").resolve()
        assert str(outcome["error"]) == (f"{out / 'train'} already holds 3 samples of {photos}; "
                                         "pass overwrite=True to replace that split, or choose "
                                         "another out_dir or split")
    assert _tree(out / "train") == written  # the first's split, untouched


def test_the_shards_and_class_names_are_written_under_the_dataset_folders_lock(tmp_path, monkeypatch):
    """The lock covered the checks only: the shards, classnames.txt and the templates were written after
    it was released, so a second writer could pass its checks before the first's manifest existed."""
    out, labelled = tmp_path / "out", _class_folder(tmp_path / "labelled")
    real_split, real_text, held = writers.write_split, writers.write_text_atomic, []

    def locked() -> bool:
        try:
            with folder_lock(out, refuse="busy"):
                return False
        except UserError:
            return True

    def write_split(*args, **kwargs):
        held.append(("shards", locked()))
        return real_split(*args, **kwargs)

    def write_text_atomic(path, *args, **kwargs):
        held.append((Path(path).name, locked()))
        return real_text(path, *args, **kwargs)

    monkeypatch.setattr(writers, "write_split", write_split)
    monkeypatch.setattr(writers, "write_text_atomic", write_text_atomic)
    write_folder_shards(labelled, out, layout="classes", caption_templates=["a photo of a {c}."])
    assert held == [("manifest.json", True), ("shards", True), ("manifest.json", True), ("classnames.txt", True),
                    ("zeroshot_classification_templates.txt", True)]


@pytest.mark.parametrize("close_fails", [False, True], ids=["write fails", "write and close fail"])
def test_a_write_that_fails_leaves_no_partial_shard(tmp_path, monkeypatch, close_fails):
    """A writer's temporary shard carries its pid (a second writer's start deletes none of the first's),
    and a writer that fails deletes its own, even when a full disk fails closing the tar as well."""
    source = _class_folder(tmp_path / "src", count=3)
    real_read, real_close = sample_encoding._read_file, webdataset.writer.TarWriter.close
    disk_full, read = [], []

    def read_until_the_disk_is_full(path, missing):
        read.append(path)
        if len(read) == 4:  # the 4th image: the 2nd shard's 2nd sample
            partial = [p.name for p in (tmp_path / "out" / "train").glob(".*.partial")]
            assert partial == [f".1.tar.{os.getpid()}.partial"]  # the shard being written, named by its writer
            disk_full.append(True)
            raise OSError(28, "No space left on device")
        return real_read(path, missing)

    def close(self):
        real_close(self)
        if disk_full and close_fails:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sample_encoding, "_read_file", read_until_the_disk_is_full)
    monkeypatch.setattr(webdataset.writer.TarWriter, "close", close)
    with pytest.raises(OSError, match="No space left"):
        writers.write_folder_shards(source, tmp_path / "out", WriteOptions(samples_per_shard=2), layout="classes")
    assert disk_full and not [p for p in (tmp_path / "out").rglob("*") if ".partial" in p.name]
    assert sorted(p.name for p in (tmp_path / "out" / "train").glob("*.tar")) == ["0.tar"]  # the complete one


# ---------------------------------------------------------------------------------------- what is read


def test_a_fifo_among_the_images_or_captions_is_counted_never_read(tmp_path):
    """Reading a FIFO blocks until something writes to it: a named pipe in a photo folder hung
    `data from-folder` forever. Only regular files are read now."""
    made = _captioned_folder(tmp_path / "src", count=3)
    bucket = tmp_path / "src" / "00000"
    fifos = [bucket / "fifo.png", bucket / "z.txt"]
    for fifo in fifos:
        os.mkfifo(fifo)
    (bucket / "fifo.txt").write_text("a pipe, not a picture")
    (bucket / "z.png").write_bytes(encode_image(rng_image(9)))  # its caption is the FIFO
    summary = run_past_fifos(fifos, writers.write_folder_shards, tmp_path / "src", tmp_path / "out")
    assert summary.samples == 3 and summary.skipped == {"not_a_regular_file": 2}
    samples = read_split(tmp_path / "out" / "train")
    assert sorted(samples) == sorted(made)  # the three real pairs, nothing of the FIFOs' samples
    assert all(samples[stem]["png"] == image.read_bytes() for stem, (image, _) in made.items())


def test_files_over_the_input_cap_are_counted_as_too_large(tmp_path, monkeypatch):
    """Nothing bounded a read: a disk image or a huge file among the photos was read whole into memory."""
    made = _captioned_folder(tmp_path / "src", count=4)
    big_image = made["000000001"][0]
    big_image.write_bytes(encode_image(rng_image(1, size=(64, 64))))
    big_caption = made["000000002"][0].with_suffix(".txt")
    big_caption.write_text("a long caption " * 400)
    small = max(path.stat().st_size for stem, (image, _) in made.items() if stem in ("000000000", "000000003")
                for path in (image, image.with_suffix(".txt")))
    cap = small + 100
    assert big_image.stat().st_size > cap and big_caption.stat().st_size > cap
    monkeypatch.setattr(sample_encoding, "MAX_INPUT_BYTES", cap, raising=False)  # (the old code had no cap)
    summary = writers.write_folder_shards(tmp_path / "src", tmp_path / "out")
    assert summary.samples == 2 and summary.skipped == {"too_large": 2}
    assert sorted(read_split(tmp_path / "out" / "train")) == ["000000000", "000000003"]


def _photo_folder(root, count: int, side: int = 700):
    """`count` captioned photo-sized JPEGs (smooth gradients plus noise, as photos compress), some of them
    broken or uncaptioned so that skips are counted on the way."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    height = side * 3 // 4
    across, down = np.linspace(0, 255, side, dtype=np.float32), np.linspace(0, 255, height, dtype=np.float32)
    for index in range(count):  # at their size in float32: 160 of 700 px in 2.5 s, 5.8 s in float64 and resized
        base = (across[None, :, None] * rng.uniform(0.2, 1.0, 3).astype(np.float32)
                + down[:, None, None] * rng.uniform(0, 0.5, 3).astype(np.float32))  # (height, side, 3)
        noise = rng.standard_normal((height, side, 3), dtype=np.float32) * 9
        pixels = np.clip(base / 1.5 + noise, 0, 255).astype(np.uint8)
        data = encode_image(PIL.Image.fromarray(pixels), "JPEG", quality=90)
        if index % 17 == 5:
            data = data[: len(data) // 3]  # truncated: bad_image
        (root / f"{index:05d}.jpg").write_bytes(data)
        if index % 13 != 7:  # else missing_caption
            (root / f"{index:05d}.txt").write_text(f"photo {index}")


def _split_contents(split) -> tuple[dict, dict]:
    """(each file's hash but the manifest's, the manifest without the one thing that differs between two
    output folders: where it was written)."""
    manifest = json.loads((split / "manifest.json").read_text())
    del manifest["summary"]["split_dir"]
    return {name: digest for name, digest in _hashes(split).items() if name != "manifest.json"}, manifest


@pytest.mark.parametrize("image_format", ["jpg", "keep"])
def test_any_number_of_workers_writes_the_same_bytes(tmp_path, image_format):
    """Decoding, resizing and encoding in 1, 2 or 3 processes: the same shards, manifest and counts, the
    skip messages in the same order."""
    _photo_folder(tmp_path / "src", 40, side=300)
    options = WriteOptions(samples_per_shard=7, image_format=image_format, max_size=96)
    written = {}
    for workers in (1, 2, 3):
        summary = write_folder_shards(tmp_path / "src", tmp_path / f"out{workers}", options, workers=workers)
        written[workers] = (_split_contents(tmp_path / f"out{workers}" / "train"), summary.skipped,
                            summary.normalized, summary.reencoded)
    assert written[1][1] == {"bad_image": 3, "missing_caption": 3}
    assert written[1][2] == {"resized": 34} and written[1][3] == 34
    assert written[2] == written[1] and written[3] == written[1]


def test_more_workers_than_images_or_fewer_than_one(tmp_path, capsys):
    _captioned_folder(tmp_path / "src", count=2)
    summary = write_folder_shards(tmp_path / "src", tmp_path / "out", workers=8)
    assert summary.samples == 2
    with pytest.raises(UserError, match="workers must be at least 1, got 0"):
        write_folder_shards(tmp_path / "src", tmp_path / "out2", workers=0)
    assert main(["data", "from-folder", str(tmp_path / "src"), "--out", str(tmp_path / "out3"),
                 "--workers", "-1"]) == 2
    assert "workers must be at least 1, got -1" in capsys.readouterr().err


def test_a_jpeg_shrunk_by_max_size_is_decoded_at_a_reduced_scale_as_sharp(tmp_path, monkeypatch):
    """A 1,200 px JPEG brought to 256 px is decoded by libjpeg at 1/2 scale (≥ 2 × 256 kept): the pixels
    stay within 40 dB PSNR of a full decode's resize; a truncated one still fails to decode."""
    from lit_softmoe.data.images import prepare_image

    _photo_folder(tmp_path / "src", 6, side=1200)
    data = (tmp_path / "src" / "00000.jpg").read_bytes()
    drafts = []
    from PIL.JpegImagePlugin import JpegImageFile

    draft = JpegImageFile.draft

    def recorded(image, mode, size):
        drafts.append(size)
        return draft(image, mode, size)

    monkeypatch.setattr(JpegImageFile, "draft", recorded)
    reduced = pixels_of(prepare_image(data, "png", 256).data).astype(float)
    assert drafts == [(512, 384)]  # longer side 1,200 → 2 × 256: libjpeg's 1/2 scale (600 × 450) fits
    monkeypatch.undo()
    full = PIL.Image.open(io.BytesIO(data))
    full.load()
    full = np.asarray(full.resize((256, 192), PIL.Image.Resampling.LANCZOS)).astype(float)
    assert reduced.shape == full.shape
    assert 10 * np.log10(255**2 / ((reduced - full) ** 2).mean()) > 40
    assert prepare_image(data, "png", 800).source_size == (1200, 900)  # 800 × 2 > 1,200: no draft, full decode
    with pytest.raises(sample_encoding.BadImageError):
        prepare_image(data[: len(data) // 2], "jpg", 256)


@pytest.mark.slow
def test_a_killed_parallel_write_reruns_to_the_same_bytes(tmp_path):
    """`data from-folder --workers 2` killed (-9, workers and all) once its first shards are in place, then
    rerun: the shards of an uninterrupted run, byte for byte."""
    import subprocess

    _photo_folder(tmp_path / "src", 160, side=700)
    command = [*python_command(), "-m", "lit_softmoe.cli", "data", "from-folder", str(tmp_path / "src"),
               "--max-size", "128", "--image-format", "jpg", "--samples-per-shard", "20", "--workers", "2"]
    assert subprocess.run([*command, "--out", str(tmp_path / "straight")], capture_output=True).returncode == 0
    killed = subprocess.Popen([*command, "--out", str(tmp_path / "killed")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / "killed/train/2.tar").exists():
        assert killed.poll() is None and time.time() < deadline, "ended or stalled before its second shard"
        time.sleep(0.01)
    kill_tree(killed)  # the pool's workers too
    assert not (tmp_path / "killed/train/sizes.json").exists()  # it really was cut short
    # The shards its progress file names are kept (one renamed into place just before the kill may not be named
    # yet: it is written again, to the same bytes).
    recorded = json.loads((tmp_path / "killed/train/.progress.json").read_text())["shards"]
    kept = {name: (tmp_path / "killed/train" / name).stat().st_mtime_ns for name in recorded}
    assert kept
    rerun = subprocess.run([*command, "--out", str(tmp_path / "killed")], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _split_contents(tmp_path / "killed/train") == _split_contents(tmp_path / "straight/train")
    # Resumed: the shards the killed run finished were kept, not written again.
    assert {name: (tmp_path / "killed/train" / name).stat().st_mtime_ns for name in kept} == kept
    assert not (tmp_path / "killed/train/.progress.json").exists()


def _stopped_at(candidate: int, monkeypatch, src, out, options) -> None:
    """A write of `src` to `out` interrupted (KeyboardInterrupt) while it encodes its `candidate`-th candidate,
    in one process (where the patch holds)."""
    calls, encode = [], sample_encoding._encode_candidate

    def stopped(each, **kwargs):
        calls.append(1)
        if len(calls) == candidate:
            raise KeyboardInterrupt
        return encode(each, **kwargs)

    monkeypatch.setattr(sample_encoding, "_encode_candidate", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_folder_shards(src, out, options)
    monkeypatch.undo()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_write_resumes_after_its_finished_shards(tmp_path, monkeypatch, workers):
    """Stopped while encoding the 23rd candidate (shards 0-1 of 7 samples in place; skips and resized
    images counted on the way), the rerun keeps those shards and ends with a straight run's bytes and
    counts."""
    _photo_folder(tmp_path / "src", 40, side=200)
    options = WriteOptions(samples_per_shard=7, image_format="jpg", max_size=64)
    straight = write_folder_shards(tmp_path / "src", tmp_path / "straight", options)
    _stopped_at(23, monkeypatch, tmp_path / "src", tmp_path / "out", options)
    split = tmp_path / "out" / "train"
    progress = json.loads((split / ".progress.json").read_text())
    assert progress["shards"] == {"0.tar": 7, "1.tar": 7} and sum(progress["skipped"].values()) > 0
    kept = {name: (split / name).stat().st_mtime_ns for name in progress["shards"]}
    resumed = write_folder_shards(tmp_path / "src", tmp_path / "out", options, workers=workers)
    assert {name: (split / name).stat().st_mtime_ns for name in kept} == kept
    assert _split_contents(split) == _split_contents(tmp_path / "straight" / "train")
    assert (resumed.skipped, resumed.normalized, resumed.reencoded) == \
        (straight.skipped, straight.normalized, straight.reencoded)


def test_a_damaged_finished_shard_is_written_again_not_resumed_from(tmp_path, monkeypatch):
    _photo_folder(tmp_path / "src", 30, side=120)
    options = WriteOptions(samples_per_shard=5, image_format="png")
    write_folder_shards(tmp_path / "src", tmp_path / "straight", options)
    _stopped_at(20, monkeypatch, tmp_path / "src", tmp_path / "out", options)
    shard = tmp_path / "out/train/0.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])  # cut short after the run: not what was recorded
    write_folder_shards(tmp_path / "src", tmp_path / "out", options)
    assert _split_contents(tmp_path / "out/train") == _split_contents(tmp_path / "straight/train")
