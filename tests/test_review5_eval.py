"""Review 5 of the zero-shot evaluation, the demo and export: blank caption lines counted as CLIP_benchmark
reads them, FER2013's Kaggle folders lined up with the shipped class names, the demo's results table when
a probe or an eval was skipped or failed, and two exports racing for one new --out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
from lit_softmoe.evals.suite import run_suite

from evalkit import foolbox_images, tiny_pair, write_wds_benchmark
from lit_runs import _make_run

# Per image: CLIP_benchmark's str.splitlines gives ['', 'a dog', '', 'another dog', ''] (3 empty), ['a cat'],
# [' ', ' '] (2 blank, no caption left), ['a bird'] (a final newline is no line): 5 empty captions.
CAPTIONS = ["\na dog\n\nanother dog\n\n", "a cat", " \n ", "a bird\n"]
TIMINGS = {"shards": 1.2, "pretrain": 30.4}


def _retrieval_suite(tmp_path: Path, *benchmarks: BenchmarkConfig) -> EvalSuiteConfig:
    return EvalSuiteConfig(name="r", workers=0, cache_dir=str(tmp_path / "cache"), benchmarks=list(benchmarks))


def test_blank_caption_lines_are_counted_as_clip_benchmark_reads_them(tmp_path, caplog):
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", c) for (p, _), c in zip(images, CAPTIONS)],
                               retrieval=True)
    cfg = _retrieval_suite(tmp_path, BenchmarkConfig(name="r", root=str(root)))
    bundle = tiny_pair(3, 32)
    with caplog.at_level("WARNING"):
        cold = run_suite("m", cfg, out=tmp_path / "a.json", model_bundle=bundle)["results"][0]
    warm = run_suite("m", cfg, out=tmp_path / "b.json", model_bundle=bundle)["results"][0]
    assert (cold["image_cache"], warm["image_cache"]) == ("miss", "hit")
    for entry in (cold, warm):  # the cache holds the raw text: a hit counts the same lines
        assert entry["empty_captions"] == 5
        assert (entry["num_samples"], entry["num_captions"], entry["images_without_captions"]) == (3, 4, 1)
    assert "5 blank caption line(s) left out" in caplog.text and "CLIP_benchmark" in caplog.text


def test_empty_captions_is_what_clip_benchmarks_own_reader_leaves_empty(tmp_path):
    builder = pytest.importorskip("clip_benchmark.datasets.builder")
    images = foolbox_images("imagenet")[:4]
    root = write_wds_benchmark(tmp_path / "r", [(p.read_bytes(), "jpg", c) for (p, _), c in zip(images, CAPTIONS)],
                               retrieval=True)
    theirs = [texts for _, texts in builder.build_wds_dataset("r", transform=lambda im: 0, split="test",
                                                              data_dir=str(root))]
    assert len(theirs) == 4
    empty = sum(not text.strip() for texts in theirs for text in texts)
    entry = run_suite("m", _retrieval_suite(tmp_path, BenchmarkConfig(name="r", root=str(root))),
                      out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["empty_captions"] == empty == 5
    assert entry["num_captions"] + entry["empty_captions"] == sum(map(len, theirs))


def test_karpathy_empty_sentences_are_counted_even_as_an_images_only_one(tmp_path):
    images = foolbox_images("imagenet")[:3]
    sentences = [["a dog", ""], [""], ["a cat"]]
    (tmp_path / "k" / "images").mkdir(parents=True)
    entries = []
    for (path, _), raws in zip(images, sentences):
        (tmp_path / "k" / "images" / path.name).write_bytes(path.read_bytes())
        entries.append({"filename": path.name, "split": "test", "sentences": [{"raw": r} for r in raws]})
    (tmp_path / "k" / "dataset_flickr30k.json").write_text(json.dumps({"images": entries}))
    entry = run_suite("m", _retrieval_suite(tmp_path, BenchmarkConfig(name="flickr30k", root=str(tmp_path / "k"))),
                      out=tmp_path / "o.json", model_bundle=tiny_pair(3, 32))["results"][0]
    assert entry["format"] == "karpathy"
    assert (entry["empty_captions"], entry["num_captions"], entry["images_without_captions"]) == (2, 2, 1)


def test_peer_result_explains_a_gap_from_blank_caption_lines(monkeypatch):
    from lit_softmoe.integrations import clip_benchmark as peer
    monkeypatch.setattr(peer, "clip_benchmark_available", lambda: True)
    monkeypatch.setattr(peer, "run_clip_benchmark", lambda *a, **k: {"metrics": {"text_retrieval_recall@1": 0.5}})
    spec = BenchmarkConfig(name="r", root="x")
    entry = {"task": "retrieval", "metrics": {"image_to_text_R@1": 0.75}, "empty_captions": 3}
    result = peer.compare_with_clip_benchmark("m", spec, entry)
    assert result["max_abs_diff_points"] == pytest.approx(25.0) and "3 blank caption line(s)" in result["note"]
    assert "note" not in peer.compare_with_clip_benchmark("m", spec, {**entry, "empty_captions": 0})


def _image_folders(root: Path, folders: list[str], per_folder: int = 2) -> None:
    import PIL.Image
    for f, folder in enumerate(folders):
        (root / folder).mkdir(parents=True)
        for i in range(per_folder):
            PIL.Image.new("L", (8, 8), color=10 * f + i).save(root / folder / f"{i}.png")


@pytest.mark.parametrize("name, folders", [
    ("fer2013", ["angry", "disgust", "fear", "happy", "neutral", "sad", "surprise"]),  # Kaggle msambare/fer2013
    ("eurosat", ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
                 "PermanentCrop", "Residential", "River", "SeaLake"]),  # the EuroSAT RGB zip's 2750/
])
def test_a_common_copys_class_folders_get_the_shipped_class_names(tmp_path, name, folders):
    from lit_softmoe.metadata import benchmark_info
    from lit_softmoe.evals.benchmark import read_split as _read
    from lit_softmoe.evals.prompts import resolve_prompts
    _image_folders(tmp_path / name / "test", folders)
    spec = BenchmarkConfig(name=name, root=str(tmp_path / name))
    data = _read(spec, lambda image: torch.tensor(image.getpixel((0, 0))))
    shipped = list(benchmark_info(name).classnames)
    assert data.format == "imagefolder"
    classnames, _, _ = resolve_prompts(spec, data)
    assert classnames == shipped  # the prompts say "disgusted", "lake or sea" …, in the shipped order
    # Each folder's images carry its class's index: the pixel value 10 * folder + i tells the folder.
    targets = {int(image) // 10: target for _, image, target in (data.dataset[i] for i in range(len(data.dataset)))}
    assert targets == dict(enumerate(range(len(folders))))
    if name == "fer2013":
        assert (shipped[targets[1]], shipped[targets[6]]) == ("disgusted", "surprised")


# ---- the demo's results table ------------------------------------------------------------------

def _table(shots=10, tower=None, lit=None, entry=None) -> dict:
    from lit_softmoe.demo import results_rows
    tower = {"params": 1_234_567, "test_top1": 0.81234, "fewshot10_top1": 0.65432} if tower is None else tower
    lit = {"linear_probe_top1": 0.85, "zeroshot_top1": 0.7} if lit is None else lit
    entry = {"status": "ok", "metrics": {"top1": 0.7512, "top5": 0.98765}} if entry is None else entry
    rows = results_rows("soft-tiny-p4", shots, tower, lit, entry, TIMINGS)
    assert len(rows) == len(dict(rows))  # one row per line of the table
    return dict(rows)


def test_demo_table_with_every_number():
    table = _table()
    assert table["image tower"] == "soft-tiny-p4 (1.23M params)"
    assert (table["tower test top-1 (classifier head)"], table["tower 10-shot linear probe"]) == ("0.8123", "0.6543")
    assert table["tower linear probe, all train images"] == "0.8500"
    assert (table["LiT zero-shot top-1 (unseen prompts)"], table["LiT zero-shot top-5"]) == ("0.7512", "0.9877")
    assert (table["time: pretrain"], table["time: total"]) == ("30 s", "32 s")


def test_demo_table_says_which_probe_was_skipped_and_why():
    tower = {"params": 1_000_000, "test_top1": 0.5,
             "fewshot_skipped": "the 10-shot linear probe is skipped: class 3 (dress) has 4 training images; "
                                "lower fewshot_shots (0 turns the probe off)"}
    lit = {"probe_skipped": "the linear probe is skipped: eval.probe_train p holds 1 sample(s), and it needs at least 2"}
    table = _table(tower=tower, lit=lit)
    assert table["tower 10-shot linear probe"] == \
        "skipped: class 3 (dress) has 4 training images; lower fewshot_shots (0 turns the probe off)"
    assert table["tower linear probe, all train images"] == \
        "skipped: eval.probe_train p holds 1 sample(s), and it needs at least 2"
    assert table["LiT zero-shot top-1 (unseen prompts)"] == "0.7512"
    off = _table(shots=0, tower={"params": 1_000_000, "test_top1": 0.5}, lit={})
    assert off["tower 0-shot linear probe"] == "off (fewshot_shots is 0)"
    assert off["tower linear probe, all train images"] == "not run (eval.probe_train is not set)"


@pytest.mark.parametrize("status, reason", [
    ("failed", "fashion-mnist: labels run from 0 to 11 but there are 10 class names; check classnames for d"),
    ("skipped", "fashion-mnist data folder not found at d; write it with `lit-softmoe data fashion-mnist --out d`"),
])
def test_demo_table_says_an_eval_that_did_not_run(status, reason):
    entry = {"benchmark": "fashion-mnist", "task": "classification", "status": status, "reason": reason, "path": "d"}
    table = _table(entry=entry)
    assert table["LiT zero-shot top-1 (unseen prompts)"] == table["LiT zero-shot top-5"] == f"{status}: {reason}"
    assert table["tower 10-shot linear probe"] == "0.6543"  # the numbers that exist are still shown
    two = _table(entry={"status": "ok", "metrics": {"top1": 0.5}})  # under 5 classes there is no top-5
    assert two["LiT zero-shot top-5"].startswith("not measured") and two["LiT zero-shot top-1 (unseen prompts)"] == "0.5000"


# ---- two exports to one new --out --------------------------------------------------------------

def _another_export_finishes_meanwhile(monkeypatch, out: Path) -> None:
    """While this export writes its files (the model card is its last), another one fills `out`."""
    from lit_softmoe.export import pair as export
    card = export.model_card

    def racing_card(*args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"written by": "the other export"}')
        return card(*args, **kwargs)

    monkeypatch.setattr(export, "model_card", racing_card)


@pytest.fixture(scope="module")
def lit_run(tmp_path_factory) -> Path:
    return _make_run(tmp_path_factory.mktemp("review5-export"))


def test_an_out_filled_by_another_export_meanwhile_is_kept(lit_run, tmp_path, monkeypatch, capsys):
    from lit_softmoe import cli
    out = tmp_path / "new-export"
    _another_export_finishes_meanwhile(monkeypatch, out)
    code = cli.main(["export", str(lit_run), "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert str(out) in lines[0] and "another run" in lines[0] and "--overwrite" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # the other export's, untouched
    assert json.loads((out / "config.json").read_text()) == {"written by": "the other export"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new-export"]  # no temporary folder left


def test_overwrite_still_replaces_and_an_empty_out_is_still_taken(lit_run, tmp_path, monkeypatch):
    from lit_softmoe.export import export_pair
    from lit_softmoe.hub import load_pretrained
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_pair(lit_run, empty) == empty and json.loads((empty / "config.json").read_text())["kind"] == "pair"
    out = tmp_path / "raced"
    _another_export_finishes_meanwhile(monkeypatch, out)
    export_pair(lit_run, out, overwrite=True)  # asked for: the other export is replaced
    assert json.loads((out / "config.json").read_text())["kind"] == "pair"
    load_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "raced"]
