"""lit_softmoe.data.tables: CSV, TSV, JSON-lines and Parquet tables of images and captions; rows naming what
is not a regular file, and rows outside `--root`."""
import csv
import json
import os

import pytest

from data_files import ROWS, _encode, _read_split, _rng_image, _run_past_fifos, _write_table
from lit_softmoe.cli import main
from lit_softmoe.data.writers import WriteOptions, write_table_shards
from lit_softmoe.errors import UserError


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "parquet"])
def test_tables_round_trip(tmp_path, kind):
    table = _write_table(tmp_path, kind)
    summary = write_table_shards(table, tmp_path / "out", "filepath", "title")
    assert summary.samples == 3 and summary.skipped == {"empty_caption": 1, "missing_image": 1}
    samples = _read_split(tmp_path / "out/train")
    assert list(samples) == ["images/a", "images/b", "images/d"]
    for key, (name, caption, score) in zip(samples, [ROWS[0], ROWS[1], ROWS[4]]):
        extension = "jpg" if name.endswith(".jpg") else "png"
        assert samples[key][extension] == (tmp_path / name).read_bytes()
        assert samples[key]["txt"].decode() == caption
        meta = json.loads(samples[key]["json"])
        assert meta["path"] == name and meta["extra"] == {"score": score} and meta["width"] == 12


def test_table_bad_rows_are_counted(tmp_path):
    table = _write_table(tmp_path, "csv")
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
    images = [_encode(_rng_image(30 + index)) for index in range(3)]
    column = [{"bytes": images[0], "path": "x/0.png"}, {"bytes": images[1], "path": None},
              {"bytes": None, "path": None}]
    pq.write_table(pa.table({"image": column, "caption": ["zero", "one", "two"]}), tmp_path / "hf.parquet")
    summary = write_table_shards(tmp_path / "hf.parquet", tmp_path / "out", "image", "caption")
    assert summary.samples == 2 and summary.skipped == {"missing_image": 1}
    samples = _read_split(tmp_path / "out/train")
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
    (tmp_path / "images" / "a.png").write_bytes(_encode(_rng_image(0)))
    os.mkfifo(tmp_path / "images" / "pipe.png")
    table = _csv(tmp_path / "t.csv", [("images/a.png", "a picture"), ("/dev/zero", "endless zeros"),
                                      ("images/pipe.png", "a pipe"), ("images", "a folder")])
    summary = _run_past_fifos([tmp_path / "images" / "pipe.png"], write_table_shards, table, tmp_path / "out",
                              "filepath", "title")
    assert summary.samples == 1 and summary.skipped == {"not_a_regular_file": 3}
    samples = _read_split(tmp_path / "out" / "train")
    assert list(samples) == ["images/a"] and samples["images/a"]["png"] == (tmp_path / "images/a.png").read_bytes()


def _table_beside_an_outside_file(tmp_path):
    """tab/t.csv naming tab/images/a.png directly and through a link, and outside/secret.png through
    `..`, an absolute path and a link."""
    root, outside = tmp_path / "tab", tmp_path / "outside"
    (root / "images").mkdir(parents=True)
    outside.mkdir()
    (root / "images" / "a.png").write_bytes(_encode(_rng_image(1)))
    (outside / "secret.png").write_bytes(_encode(_rng_image(2)))
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
    samples = _read_split(tmp_path / "out" / "train")
    assert list(samples) == ["images/a", "images/inner"]
    assert [samples[key]["txt"].decode() for key in samples] == ["inside", "inside, through a link"]
    assert all(sample["png"] == (root / "images" / "a.png").read_bytes() for sample in samples.values())

    # The command line's --root; and without it, all six rows are read.
    assert main(["data", "from-table", str(table), "--image-col", "filepath", "--caption-col", "title",
                 "--root", str(root), "--out", str(tmp_path / "cli")]) == 0
    assert list(_read_split(tmp_path / "cli" / "train")) == ["images/a", "images/inner"]
    everything = write_table_shards(table, tmp_path / "all", "filepath", "title")
    assert everything.samples == 6 and not everything.skipped
    with pytest.raises(UserError, match="--root .* is not a folder"):
        write_table_shards(table, tmp_path / "none", "filepath", "title", root=tmp_path / "nowhere")
