"""LiT edge cases on tiny data (300 + 300 Fashion-MNIST images, a random soft-test-4e tower): unlocked
tower blocks train to the end and are evaluated with the trained tower, a resumed run reports the
bad samples of the whole run, a bad template is refused before training, and a torn last line in
metrics.jsonl does not block a resume."""
import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.shards import read_lines, write_split
from lit_softmoe.data.transforms import eval_transform
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, zeroshot_metrics
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.text import TextTowerConfig, create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.models.tower_folder import load_tower, save_tower
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import RunLogger, read_metrics

from lit_data import PREPROCESS, _lit


def test_unlocked_blocks_train_to_the_end_and_evaluate_the_trained_tower(data, tmp_path):
    images = data / "fmnist"
    run = tmp_path / "run"
    results = train_lit(_lit(data, run, "unlocked_blocks=1", "steps=4", "optim.lr=1e-2", "optim.warmup_steps=1",
                             f"data.train={images / 'train'}", f"eval.shards={images / 'test'}", "eval.every=2"))
    assert (run / "model" / "model.safetensors").is_file() and json.loads((run / "results.json").read_text())

    # The saved pair holds the whole tower, its last block trained, the others as they were.
    state = load_file(run / "model" / "model.safetensors")
    initial, _ = load_tower(data / "tower")
    last = len(initial.blocks) - 1
    for name, value in initial.state_dict().items():
        trained = state[f"image_tower.{name}"]
        if name.startswith(f"blocks.{last}.") and value.is_floating_point():
            assert not torch.equal(trained, value), name
        elif not name.startswith(("blocks.", "norm.")):
            assert torch.equal(trained, value), name

    # The final zero-shot score is the trained pair's: the eval images went through the trained tower,
    # not the initial one.
    tower, _ = load_tower(data / "tower")
    model = LiTModel(tower, create_text_tower(TextTowerConfig(width=64, layers=1, heads=2), embed_dim=tower.embed_dim),
                     unlocked_blocks=1)
    model.load_state_dict(state)
    model.eval()
    loader = create_shard_loader(ShardDataConfig(urls=str(images / "test"), batch_size=300, workers=0, shuffle=False,
                                                 exact_epoch=True), "image-class",
                                 transform=eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"]))
    batch = next(iter(loader))
    tokenizer = create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
    with torch.no_grad():
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer, read_lines(images / "classnames.txt"),
                                               read_lines(images / "zeroshot_classification_templates.txt"))
        metrics = zeroshot_metrics(model.encode_image(batch["image"]), batch["label"], classifier)
    assert metrics["top1"] == pytest.approx(results["zeroshot_top1"], abs=1e-6)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "zeroshot_top1" in r] == [2, 4]


def test_unlocked_blocks_refuse_cached_eval_features_before_training(data, tmp_path):
    # The cached eval features come from the initial tower: they cannot score a tower that trains.
    with pytest.raises(UserError, match="eval.shards holds cached features"):
        train_lit(_lit(data, tmp_path / "run", "unlocked_blocks=1", "steps=2",
                       f"data.train={data / 'fmnist' / 'train'}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_shards_as_a_pattern_or_list_find_the_class_names_beside_the_split(data, tmp_path):
    """eval.shards as a brace pattern or a '::' list of the split's shards: the class names and templates
    are read from the dataset folder (as for the folder itself), and the score is the folder's."""
    test = data / "fmnist" / "test"  # six shards of 50 images
    scores = []
    for spec in (str(test), str(test / "{0..5}.tar"), f"{test / '0.tar'}::{test / '{1..5}.tar'}"):
        scores.append(train_lit(_lit(data, tmp_path / f"run{len(scores)}", "steps=2", f"eval.shards={spec}"))
                      ["zeroshot_top1"])
    assert scores[0] == scores[1] == scores[2]
    with pytest.raises(UserError, match="set eval.classnames"):
        train_lit(_lit(data, tmp_path / "remote", "steps=2", "eval.shards=https://example.com/test/{0..5}.tar"))


def test_a_batch_larger_than_a_data_stream_is_refused_before_training(data, tmp_path):
    """A stream shorter than its batch wraps around inside it, and a repeated pair is its own negative."""
    images = data / "fmnist" / "train"  # 300 samples in 6 shards of 50
    with pytest.raises(UserError, match=r"read as 1 process\(es\) × 1 data worker\(s\), and one of them holds only "
                                        r"300 samples, fewer than its batch of 400"):
        train_lit(_lit(data, tmp_path / "run", "steps=2", "batch_size=400", "eval.shards=''"))
    with pytest.raises(UserError, match=r"× 2 data worker\(s\), and one of them holds only 150 samples, fewer "
                                        r"than its batch of 200"):
        train_lit(_lit(data, tmp_path / "run", "steps=2", "batch_size=200", "data.workers=2", "eval.shards=''",
                       f"data.train={images}"))
    assert not (tmp_path / "run").exists()
    # Each of two workers holds three shards (150 samples): a batch of 150 never repeats one.
    batches = create_shard_loader(ShardDataConfig(urls=str(images), batch_size=150, workers=2), "image-class",
                                  transform=eval_transform(28, 1, PREPROCESS["mean"], PREPROCESS["std"]))
    assert batches.smallest_pass == 150
    for batch in batches:
        assert len(set(batch["key"])) == 150


def test_a_resume_against_a_tower_rewritten_since_its_checkpoint_is_refused(data, tmp_path):
    tower = tmp_path / "tower"
    shutil.copytree(data / "tower", tower)
    run = tmp_path / "run"
    # Image shards: a feature cache would be refused as another tower's before the checkpoint is read.
    common = [f"image_tower={tower}", f"data.train={data / 'fmnist' / 'train'}", "checkpoint_every=2", "eval.shards=''"]
    train_lit(_lit(data, run, "steps=2", *common))
    assert json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())["image_tower_sha256"]
    meta = json.loads((tower / "config.json").read_text())
    torch.manual_seed(1)  # same name, config and preprocessing; other weights
    save_tower(tower, create_image_tower("soft-test-4e", num_classes=10).eval(),
               extra={k: v for k, v in meta.items() if k != "tower"})
    with pytest.raises(UserError, match=r"the image tower at .*tower was rewritten after .*step_00000002 was saved"):
        train_lit(_lit(data, run, "steps=4", *common))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def test_resampled_shards_feed_more_workers_than_there_are_shards(data, tmp_path):
    # The feature cache is one shard: two workers each need one of their own, unless shards are drawn
    # with replacement, which the error suggests (data.resampled, a LiT config key).
    with pytest.raises(UserError, match=r"1 shards cannot feed 1 processes × 2 workers .* set data.resampled=true"):
        train_lit(_lit(data, tmp_path / "run", "steps=4", "data.workers=2", "eval.shards=''"))
    results = train_lit(_lit(data, tmp_path / "run", "steps=4", "data.workers=2", "data.resampled=true",
                             "eval.shards=''"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert results["steps"] == 4 and len(losses) == 4 and all(np.isfinite(losses))


def test_resumed_run_reports_the_bad_samples_of_the_whole_run(data, tmp_path):
    """200 samples, one in 20 with an empty caption: 4 steps an epoch, 12 steps. A run killed after its
    step-6 (mid-epoch) or step-8 (epoch end) checkpoint, then resumed, reports what the straight run does."""
    rng = np.random.default_rng(0)
    write_split(({"png": PIL.Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)),
                  "txt": b"" if i % 20 == 0 else f"caption {i % 10}".encode()} for i in range(200)),
                tmp_path / "data", "train", samples_per_shard=50)
    common = [f"data.train={tmp_path / 'data' / 'train'}", "eval.shards=''", "data.max_bad_fraction=0.2",
              "steps=12", "checkpoint_every=2", "keep_checkpoints=10"]
    straight = train_lit(_lit(data, tmp_path / "straight", *common))
    assert straight["bad_samples"]["bad_txt"] >= 30  # 10 in each pass over the shards, 3 epochs

    def data_records(run):
        return [{k: v for k, v in r.items() if k.startswith("data/")} for r in read_metrics(run / "metrics.jsonl")]

    for killed_after in (6, 8):
        run = tmp_path / f"killed_{killed_after}"
        shutil.copytree(tmp_path / "straight", run)  # what a run killed after that checkpoint leaves
        shutil.rmtree(run / "model")
        (run / "results.json").unlink()
        for checkpoint in (run / "checkpoints").glob("step_*"):
            if int(checkpoint.name.split("_")[1]) > killed_after:
                shutil.rmtree(checkpoint)
        resumed = train_lit(_lit(data, run, *common))
        assert resumed["bad_samples"] == straight["bad_samples"], killed_after
        assert data_records(run) == data_records(tmp_path / "straight"), killed_after


@pytest.mark.parametrize("template", ["a photo of a {}.", "a photo of a {classname}.", "a photo.", "a {c"])
def test_a_bad_template_is_refused_before_training(data, tmp_path, template):
    templates = tmp_path / "templates.txt"
    templates.write_text(f"a photo of a {{c}}.\n{template}\n")
    with pytest.raises(UserError) as err:
        train_lit(_lit(data, tmp_path / "run", "steps=2", f"eval.templates={templates}"))
    message = str(err.value)
    assert str(templates) in message and repr(template) in message and "{c}" in message
    assert "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any training


# ---- metrics.jsonl ---------------------------------------------------------------------------------

def _write_records(path: Path, steps) -> list[dict]:
    records = [{"step": step, "loss": 1.0 / step} for step in steps]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_a_torn_last_metrics_line_is_dropped(tmp_path):
    records = _write_records(tmp_path / "metrics.jsonl", [1, 2, 3])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.2')  # a run killed mid-append
    assert read_metrics(tmp_path / "metrics.jsonl") == records
    logger = RunLogger(tmp_path, tensorboard=False)
    logger.truncate_after(2)
    logger.log({"step": 3, "loss": 0.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [*records[:2], {"step": 3, "loss": 0.5}]


def test_a_bad_metrics_line_before_the_last_is_reported(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        RunLogger(tmp_path, tensorboard=False).truncate_after(1)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'


def test_truncating_the_metrics_is_atomic(tmp_path, monkeypatch):
    """A kill halfway through the rewrite leaves the old file whole."""
    records = _write_records(tmp_path / "metrics.jsonl", range(1, 50))
    write_text = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        write_text(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        RunLogger(tmp_path, tensorboard=False).truncate_after(10)
    monkeypatch.undo()
    assert read_metrics(tmp_path / "metrics.jsonl") == records


def test_a_run_killed_while_logging_resumes(data, tmp_path):
    run = tmp_path / "run"
    train_lit(_lit(data, run, "steps=4", "checkpoint_every=2", "keep_checkpoints=5", "eval.shards=''"))
    shutil.rmtree(run / "model")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.2')
    results = train_lit(_lit(data, run, "steps=4", "checkpoint_every=2", "keep_checkpoints=5", "eval.shards=''"))
    assert results["steps"] == 4 and (run / "model").is_dir()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
