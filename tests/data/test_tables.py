"""lit_softmoe.data.tables: CSV, TSV, JSON-lines and Parquet tables of images and captions; rows naming what
is not a regular file, and rows outside `--root`; class columns (`--class-col`, `--classnames`), read back by
pretraining's and evaluation's readers."""
import csv
import json
import os
from pathlib import Path

import pytest

from data_files import ROWS, encode_image, read_split, rng_image, run_past_fifos, write_table
from evalkit import foolbox_images, needs_foolbox
from lit_softmoe.cli import main
from lit_softmoe.data.class_split import load_class_split
from lit_softmoe.data.shards import read_classnames
from lit_softmoe.data.write_options import WriteOptions
from lit_softmoe.data.writers import write_table_shards
from lit_softmoe.errors import UserError
from lit_softmoe.evals.readers import read_wds
from lit_softmoe.metadata import benchmark_info


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "parquet"])
def test_tables_round_trip(tmp_path, kind):
    table = write_table(tmp_path, kind)
    summary = write_table_shards(table, tmp_path / "out", "filepath", "title")
    assert summary.samples == 3 and summary.skipped == {"empty_caption": 1, "missing_image": 1}
    samples = read_split(tmp_path / "out/train")
    assert list(samples) == ["images/a", "images/b", "images/d"]
    for key, (name, caption, score) in zip(samples, [ROWS[0], ROWS[1], ROWS[4]]):
        extension = "jpg" if name.endswith(".jpg") else "png"
        assert samples[key][extension] == (tmp_path / name).read_bytes()
        assert samples[key]["txt"].decode() == caption
        meta = json.loads(samples[key]["json"])
        assert meta["path"] == name and meta["extra"] == {"score": score} and meta["width"] == 12


def test_table_bad_rows_are_counted(tmp_path):
    table = write_table(tmp_path, "csv")
    with open(table, "ab") as file:
        file.write(b"images/a.png,caf\xe9 in latin-1,6\n")  # not UTF-8
        file.write(b"images/a.png,too,many,fields\n")
        file.write(b"https://example.com/x.jpg,a remote image,7\n")
        file.write(b"images/d.png,the same image twice,8\n")
    summary = write_table_shards(table, tmp_path / "out", "filepath", "title")
    assert summary.skipped == {"bad_row": 1, "duplicate_key": 1, "empty_caption": 1, "missing_image": 1,
                               "non_utf8_text": 1, "remote_image": 1}
    # With a key column both captions of d.png are kept.
    keyed = write_table_shards(table, tmp_path / "out", "filepath", "title", WriteOptions(split="keyed"),
                               key_col="score")
    assert keyed.samples == 4 and "duplicate_key" not in keyed.skipped

    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(b'{"filepath": "images/a.png", "title": "ok"}\n'
                      b'\n'  # blank lines are not rows
                      b'{broken json\n'
                      b'[1, 2]\n'
                      b'{"filepath": "images/b.jpg", "title": "caf\xe9"}\n'  # Latin-1, not UTF-8
                      b'{"filepath": "images/c.png", "title": 5}\n')
    summary = write_table_shards(lines, tmp_path / "out", "filepath", "title", WriteOptions(split="jsonl"))
    assert summary.samples == 1 and summary.skipped == {"bad_caption": 1, "bad_row": 2, "non_utf8_text": 1}


def test_parquet_with_embedded_image_bytes(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    images = [encode_image(rng_image(30 + index)) for index in range(3)]
    column = [{"bytes": images[0], "path": "x/0.png"}, {"bytes": images[1], "path": None},
              {"bytes": None, "path": None}]
    pq.write_table(pa.table({"image": column, "caption": ["zero", "one", "two"]}), tmp_path / "hf.parquet")
    summary = write_table_shards(tmp_path / "hf.parquet", tmp_path / "out", "image", "caption")
    assert summary.samples == 2 and summary.skipped == {"missing_image": 1}
    samples = read_split(tmp_path / "out/train")
    assert samples["x/0"]["png"] == images[0] and samples["row0000001"]["png"] == images[1]


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="pip install pyarrow"):
        write_table_shards(tmp_path / "t.parquet", tmp_path / "out", "image", "caption")


def test_from_table_given_a_folder_points_to_from_folder(tmp_path, capsys):
    from lit_softmoe.cli import main
    (tmp_path / "photos").mkdir()
    code = main(["data", "from-table", str(tmp_path / "photos"), "--image-col", "path", "--caption-col", "text",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a folder" in err[0] and "data from-folder" in err[0]
    assert not (tmp_path / "out").exists()


def _csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows([("filepath", "title"), *rows])
    return path


def test_rows_naming_a_device_or_a_fifo_are_counted_never_read(tmp_path):
    """A row naming /dev/zero was read until memory ran out (MemoryError), and one naming a FIFO blocked
    forever: only regular files are read."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(encode_image(rng_image(0)))
    os.mkfifo(tmp_path / "images" / "pipe.png")
    table = _csv(tmp_path / "t.csv", [("images/a.png", "a picture"), ("/dev/zero", "endless zeros"),
                                      ("images/pipe.png", "a pipe"), ("images", "a folder")])
    summary = run_past_fifos([tmp_path / "images" / "pipe.png"], write_table_shards, table, tmp_path / "out",
                              "filepath", "title")
    assert summary.samples == 1 and summary.skipped == {"not_a_regular_file": 3}
    samples = read_split(tmp_path / "out" / "train")
    assert list(samples) == ["images/a"] and samples["images/a"]["png"] == (tmp_path / "images/a.png").read_bytes()


def _table_beside_an_outside_file(tmp_path):
    """tab/t.csv naming tab/images/a.png directly and through a link, and outside/secret.png through
    `..`, an absolute path and a link."""
    root, outside = tmp_path / "tab", tmp_path / "outside"
    (root / "images").mkdir(parents=True)
    outside.mkdir()
    (root / "images" / "a.png").write_bytes(encode_image(rng_image(1)))
    (outside / "secret.png").write_bytes(encode_image(rng_image(2)))
    os.symlink(outside / "secret.png", root / "images" / "link.png")
    os.symlink(root / "images" / "a.png", root / "images" / "inner.png")
    rows = [("images/a.png", "inside"), ("images/inner.png", "inside, through a link"),
            ("../outside/secret.png", "up and out"), ("images/../../outside/secret.png", "in, then up and out"),
            (str(outside / "secret.png"), "absolute"), ("images/link.png", "a link out")]
    return _csv(root / "t.csv", rows), root


def test_root_confines_a_tables_rows_to_a_folder(tmp_path, capsys):
    """Without --root a table reads any file its user can read (a table is as trusted as what it names):
    --root DIR skips and counts every row resolving outside DIR, by `..`, an absolute path or a link."""
    table, root = _table_beside_an_outside_file(tmp_path)
    summary = write_table_shards(table, tmp_path / "out", "filepath", "title", root=root)
    assert summary.samples == 2 and summary.skipped == {"outside_root": 4}
    samples = read_split(tmp_path / "out" / "train")
    assert list(samples) == ["images/a", "images/inner"]
    assert [samples[key]["txt"].decode() for key in samples] == ["inside", "inside, through a link"]
    assert all(sample["png"] == (root / "images" / "a.png").read_bytes() for sample in samples.values())

    # The command line's --root; and without it, all six rows are read.
    assert main(["data", "from-table", str(table), "--image-col", "filepath", "--caption-col", "title",
                 "--root", str(root), "--out", str(tmp_path / "cli")]) == 0
    assert list(read_split(tmp_path / "cli" / "train")) == ["images/a", "images/inner"]
    everything = write_table_shards(table, tmp_path / "all", "filepath", "title")
    assert everything.samples == 6 and not everything.skipped
    with pytest.raises(UserError, match="^root .* is not a folder"):
        write_table_shards(table, tmp_path / "none", "filepath", "title", root=tmp_path / "nowhere")
    capsys.readouterr()
    assert main(["data", "from-table", str(table), "--image-col", "filepath",
                 "--caption-col", "title", "--root", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == (f"lit-softmoe data: error: --root {tmp_path / 'nowhere'} "
                                       "is not a folder; give the folder the table's images must "
                                       "lie in\n")


# ---- class columns (`--class-col`, `--classnames`) ---------------------------------------------------

CIFAR10 = benchmark_info("cifar10").classnames


def _class_table(folder, kind="csv", cell=lambda label: CIFAR10[label], extra_rows=()):
    """foolbox's 20 real CIFAR-10 test images under folder/images and a table naming them: columns path,
    label (`cell(label)`: the class name by default) and note; `extra_rows` are (path, label cell) rows
    added after them. Returns (table, [(path, ImageNet-style CIFAR-10 label)] of the real rows)."""
    (folder / "images").mkdir(parents=True)
    written = []
    for path, label in foolbox_images("cifar10"):
        (folder / "images" / path.name).write_bytes(path.read_bytes())
        written.append((f"images/{path.name}", label))
    rows = [(path, cell(label), f"note {i}") for i, (path, label) in enumerate(written)]
    rows += [(path, label, "extra") for path, label in extra_rows]
    table = folder / f"t.{kind}"
    if kind == "csv":
        with open(table, "w", newline="", encoding="utf-8") as file:
            csv.writer(file).writerows([("path", "label", "note"), *rows])
    else:
        table.write_text("".join(json.dumps({"path": p, "label": c, "note": n}) + "\n" for p, c, n in rows))
    return table, written


def _labels_written(split_dir):
    """{path: (.cls, .json's class, has a .txt)} of a written split."""
    out = {}
    for sample in read_split(split_dir).values():
        meta = json.loads(sample["json"])
        out[meta["path"]] = (int(sample["cls"]), meta["class"], "txt" in sample)
    return out


@needs_foolbox
def test_a_class_column_of_names_writes_class_shards_that_pretraining_and_eval_read(tmp_path, capsys):
    table, written = _class_table(tmp_path, extra_rows=[("images/gone.png", "cat"), ("", "dog"),
                                                        ("images/cifar10_00_3.png", "  ")])
    out = tmp_path / "out"

    assert main(["data", "from-table", str(table), "--image-col", "path", "--class-col", "label",
                 "--out", str(out)]) == 0

    assert capsys.readouterr().out.splitlines() == [
        f"written 20 samples in 1 shard to {out / 'train'}; skipped 3 (empty_class 1, missing_image 2)"]
    classnames = sorted({CIFAR10[label] for _, label in written})  # the names met, sorted
    assert read_classnames(out) == classnames
    assert classnames == ["airplane", "automobile", "cat", "dog", "frog", "horse", "ship", "truck"]  # no bird, deer
    assert _labels_written(out / "train") == {path: (classnames.index(CIFAR10[label]), CIFAR10[label], False)
                                              for path, label in written}
    metas = [json.loads(sample["json"]) for sample in read_split(out / "train").values()]  # in write order
    notes = {path: f"note {row}" for row, (path, _) in enumerate(written)}
    assert [meta["extra"] for meta in metas] == [{"note": notes[meta["path"]]} for meta in metas]
    # Pretraining's class-split reader and zero-shot evaluation's webdataset reader read it as written.
    images, labels, skipped = load_class_split(out / "train")
    assert images.shape == (20, 3, 32, 32) and not skipped
    assert labels.tolist() == [classnames.index(meta["class"]) for meta in metas]
    evaluated = read_wds(out, "train", lambda image: image)
    assert evaluated.task == "classification" and evaluated.classnames == classnames
    assert [target for _, _, target in evaluated.dataset] == labels.tolist()


@needs_foolbox
@pytest.mark.parametrize("kind, cell", [("csv", str), ("jsonl", int)], ids=["csv digits", "jsonl integers"])
def test_class_indices_with_a_classnames_file_are_the_cls(tmp_path, kind, cell):
    table, written = _class_table(tmp_path, kind, cell, extra_rows=[("images/cifar10_00_3.png", cell(10)),
                                                                    ("images/cifar10_01_8.png", cell(-1))])
    names = tmp_path / "names.txt"
    names.write_text("".join(f"{name}\n" for name in CIFAR10))

    summary = write_table_shards(table, tmp_path / "out", "path", None, class_col="label", classnames_file=names)

    assert summary.samples == 20 and summary.skipped == {"unknown_class": 2}
    assert read_classnames(tmp_path / "out") == list(CIFAR10)  # the file's order, every class
    assert _labels_written(tmp_path / "out" / "train") == {path: (label, CIFAR10[label], False)
                                                           for path, label in written}
    labels_of = dict(written)
    in_write_order = [json.loads(sample["json"])["path"] for sample in read_split(tmp_path / "out" / "train").values()]
    assert load_class_split(tmp_path / "out" / "train")[1].tolist() == [labels_of[path] for path in in_write_order]
    # Tables are often sorted by class: rows are written in a seeded shuffled order (see test_folders).
    assert sorted(in_write_order) == sorted(labels_of) and in_write_order != [path for path, _ in written]


@needs_foolbox
def test_whole_numbers_without_a_classnames_file_are_names_and_said_so(tmp_path, capsys):
    table, written = _class_table(tmp_path, cell=str)
    assert main(["data", "from-table", str(table), "--image-col", "path", "--class-col", "label",
                 "--caption-col", "note", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"column 'label' of {table} holds whole numbers, read as class names sorted as text (\"1\", \"10\", \"2\" …); "
        "pass --classnames FILE to read them as indices into FILE's names")
    assert read_classnames(tmp_path / "out") == sorted({str(label) for _, label in written})
    assert all(has_caption for _, _, has_caption in _labels_written(tmp_path / "out" / "train").values())


@needs_foolbox
def test_names_with_a_classnames_file_take_its_order_and_unknown_names_are_counted(tmp_path):
    table, written = _class_table(tmp_path, extra_rows=[("images/cifar10_00_3.png", "kitten")])
    names = tmp_path / "names.txt"
    names.write_text("\n".join(reversed(CIFAR10)) + "\n\n")  # blank lines are not classes
    summary = write_table_shards(table, tmp_path / "out", "path", None, class_col="label", classnames_file=names)
    assert summary.skipped == {"unknown_class": 1}
    assert read_classnames(tmp_path / "out") == list(reversed(CIFAR10))
    assert {path: cls for path, (cls, _, _) in _labels_written(tmp_path / "out" / "train").items()} == {
        path: 9 - label for path, label in written}

    names.write_text("cat\ndog\ncat\n")  # a name twice cannot say which class a row means
    with pytest.raises(UserError, match=r"the class 'cat' is listed twice in the class-names file") as raised:
        write_table_shards(table, tmp_path / "dup", "path", None, class_col="label", classnames_file=names)
    assert "\n" not in str(raised.value)


def test_bad_class_cells_are_skipped_and_counted(tmp_path):
    (tmp_path / "images").mkdir()
    for index in range(6):
        (tmp_path / "images" / f"{index}.png").write_bytes(encode_image(rng_image(40 + index)))
    cells = ["cat", None, ["cat"], "two\nlines", 2.5, 3.0]  # 3.0: an integer column with a null, from pandas
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"path": f"images/{i}.png", "label": cell}) + "\n"
                                              for i, cell in enumerate(cells)))
    summary = write_table_shards(tmp_path / "t.jsonl", tmp_path / "out", "path", None, class_col="label")
    assert summary.samples == 2 and summary.skipped == {"bad_class": 3, "empty_class": 1}
    assert read_classnames(tmp_path / "out") == ["3", "cat"]


@pytest.mark.parametrize("flags, message", [
    (["--class-col", "labl"], "{table} has no column 'labl' (its columns: path, label); pass --class-col with one "
                              "of them"),
    ([], "a table gives captions, classes or both; pass --caption-col COL, --class-col COL, or both"),
    (["--caption-col", "label", "--classnames", "names.txt"], "--classnames {names} names the classes of a class "
                                                              "column; pass --class-col COL too, or leave --classnames "
                                                              "out"),
    (["--class-col", "label", "--classnames", "nowhere.txt"], "--classnames {nowhere} is not found; give a text file "
                                                              "with one class name per line, in label order"),
    (["--class-col", "label", "--classnames", "empty.txt"], "--classnames {empty} holds no class names; give a text "
                                                            "file with one class name per line, in label order"),
], ids=["no such column", "neither captions nor classes", "classnames without a class column", "no classnames file",
        "empty classnames file"])
def test_class_column_mistakes_are_one_error_line(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.png").write_bytes(encode_image(rng_image(1)))
    table = _csv(tmp_path / "t.csv", [("a.png", "cat")])
    table.write_text(table.read_text().replace("filepath,title", "path,label"))
    (tmp_path / "names.txt").write_text("cat\n")
    (tmp_path / "empty.txt").write_text("\n")
    code = main(["data", "from-table", str(table), "--image-col", "path", *flags, "--out", str(tmp_path / "out")])
    assert code == 2
    expected = message.format(table=table, names="names.txt", nowhere="nowhere.txt", empty="empty.txt")
    assert capsys.readouterr().err.splitlines() == [f"lit-softmoe data: error: {expected}"]
    assert not (tmp_path / "out").exists()


def _named_rows_table(folder, names) -> Path:
    """A JSONL table of one image per row (images/N.png) and its class name in the column `label`."""
    (folder / "images").mkdir()
    rows = []
    for index, name in enumerate(names):
        (folder / "images" / f"{index}.png").write_bytes(encode_image(rng_image(index)))
        rows.append({"path": f"images/{index}.png", "label": name})
    table = folder / "table.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return table


def test_one_class_name_in_two_unicode_forms_is_one_class(tmp_path):
    """`café` composed (NFC) in one row and decomposed (NFD) in another, as two systems type it: one class,
    not two classes of one name scored against each other."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    table = _named_rows_table(tmp_path, [composed, decomposed, "dog", decomposed])
    assert main(["data", "from-table", str(table), "--image-col", "path", "--class-col", "label",
                 "--out", str(tmp_path / "out")]) == 0
    assert read_classnames(tmp_path / "out") == [composed, "dog"]
    labels = {meta["path"]: (meta["class"], cls) for meta, cls in
              ((json.loads(s["json"]), int(s["cls"])) for s in read_split(tmp_path / "out" / "train").values())}
    assert labels == {"images/0.png": (composed, 0), "images/1.png": (composed, 0), "images/2.png": ("dog", 1),
                      "images/3.png": (composed, 0)}


def test_a_class_names_file_in_another_unicode_form_names_the_tables_classes(tmp_path):
    """A --classnames file holding `café` decomposed (NFD): the table's cells, read in NFC, were all skipped as
    "not in the class-names file"."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    table = _named_rows_table(tmp_path, [composed, "dog", decomposed])
    (tmp_path / "names.txt").write_text(f"dog\n{decomposed}\n")
    assert main(["data", "from-table", str(table), "--image-col", "path", "--class-col", "label",
                 "--classnames", str(tmp_path / "names.txt"), "--out", str(tmp_path / "out")]) == 0
    assert read_classnames(tmp_path / "out") == ["dog", composed]
    assert sorted(int(s["cls"]) for s in read_split(tmp_path / "out" / "train").values()) == [0, 1, 1]


@pytest.mark.parametrize("other", ["Cat", "\uff43\uff41\uff54"], ids=["case", "full-width"])
def test_class_cells_that_differ_only_in_letter_case_or_width_are_refused(tmp_path, capsys, other):
    """`Cat` and `cat` (or full-width `ｃａｔ`) became two classes, whose prompts CLIP's tokenizer (it lowercases
    and reads width-variants as ASCII) made identical."""
    table = _named_rows_table(tmp_path, ["cat", other, "dog"])
    assert main(["data", "from-table", str(table), "--image-col", "path", "--class-col", "label",
                 "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    first, second = sorted([other, "cat"])
    assert line == (f"lit-softmoe data: error: column 'label' of {table}: the classes {first!r} and {second!r} are one "
                    "name but for letter case or letter width, which would be two classes with the same prompts; "
                    "write the name one way in every row")
    assert not (tmp_path / "out" / "train").exists()
