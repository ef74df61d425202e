"""lit_softmoe.data.tables: CSV, TSV, JSON-lines and Parquet tables of images and captions."""
import json

import pytest

from data_files import ROWS, _encode, _read_split, _rng_image, _write_table
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
