"""lit_softmoe.train.trackers: `log_with` (accelerate's experiment trackers). TensorBoard, the one that
works offline here, holds exactly the numbers of metrics.jsonl after a run and after a resume; unknown
or uninstalled trackers are one line before any work."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from accelerate.utils import LoggerType

from cli_errors import one_line_error
from lit_data import lit_config
from lit_softmoe.config import PretrainConfig
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.train import trackers
from lit_softmoe.train.lit import train_lit
from lit_softmoe.train.logging import read_metrics
from lit_softmoe.train.pretrain import pretrain
from lit_softmoe.train.runtime import check_same_run


def _pretrain_cfg(data, run, *extra):
    return load_config(PretrainConfig, None, [
        f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}", f"run_dir={run}",
        "tower.name=soft-test-4e", "batch_size=50", "fewshot_shots=3", "precision=fp32", "log_every=1", *extra])


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: the scalars of the event files in `folder`, earlier files' steps purged
    where a later file restarted (SummaryWriter's purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def _metrics_scalars(path) -> dict[str, list[tuple[int, float]]]:
    scalars = {}
    for record in read_metrics(path):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.setdefault(key, []).append((record["step"], value))
    return scalars


def _assert_tensorboard_holds_the_metrics(run):
    shown, logged = _tensorboard_scalars(run / "tensorboard"), _metrics_scalars(run / "metrics.jsonl")
    assert sorted(shown) == sorted(logged)
    for tag, points in logged.items():
        assert [step for step, _ in shown[tag]] == [step for step, _ in points], tag
        assert [value for _, value in shown[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag


def test_pretrain_tensorboard_holds_the_metrics_also_after_a_resume(data, tmp_path, monkeypatch):
    from tensorboard.summary.writer import event_file_writer
    # This process's next event files are its 10th, 11th and 12th, as in a worker that had run other tests: in name
    # order "10" sorts before "9", which hid a resumed run's steps when its files opened within one second.
    monkeypatch.setattr(event_file_writer._global_uid, "_value", 9)
    run = tmp_path / "run"
    pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2", "checkpoint_every=2"))
    _assert_tensorboard_holds_the_metrics(run)
    assert {"loss", "lr", "test_top1", "fewshot3_top1"} <= set(_tensorboard_scalars(run / "tensorboard"))
    # A run killed after logging past its checkpoint: its event files hold steps 3, 4 and the final
    # evaluation, which the resume from step 2 logs again; TensorBoard shows the new ones only.
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    pretrain(_pretrain_cfg(data, run, "steps=4", "eval_every=2", "checkpoint_every=2"))
    _assert_tensorboard_holds_the_metrics(run)
    # A longer rerun resumes at the last step: its records there are sent again after the purge.
    pretrain(_pretrain_cfg(data, run, "steps=6", "eval_every=2", "checkpoint_every=2"))
    _assert_tensorboard_holds_the_metrics(run)
    assert [step for step, _ in _tensorboard_scalars(run / "tensorboard")["loss"]] == [1, 2, 3, 4, 5, 6]
    # The trackers may change between a run and its resume: metrics.jsonl and the model do not depend on them.
    check_same_run(run, _pretrain_cfg(data, run, "steps=6", "eval_every=2", "checkpoint_every=2", "log_with=[]"))


def test_a_restart_within_a_second_waits_for_the_next_so_its_event_file_sorts_last(tmp_path):
    # TensorBoard reads a folder's event files in name order: the second a file was opened, host, pid, then a
    # per-process count that is not zero-padded. Within one second a writer's 10th file sorted before its 9th, and
    # the resumed run's purge_step then hid the steps it had just logged (the test above, in a shuffled order).
    folder = tmp_path / "tensorboard"
    folder.mkdir()
    now = int(time.time())
    (folder / f"events.out.tfevents.{now}.host.1.9").write_bytes(b"")
    trackers._after_the_newest_event_file(folder)
    assert time.time() >= now + 1
    tic = time.perf_counter()
    trackers._after_the_newest_event_file(folder)  # that second is over: no wait
    trackers._after_the_newest_event_file(tmp_path / "empty")  # a first start: no files, no wait
    assert time.perf_counter() - tic < 0.2


def test_lit_tensorboard_holds_the_metrics_and_no_tracker_writes_none(data, tmp_path):
    train_lit(lit_config(data, tmp_path / "lit", "steps=3"))
    _assert_tensorboard_holds_the_metrics(tmp_path / "lit")
    assert {"loss", "temperature", "zeroshot_top1"} <= set(_tensorboard_scalars(tmp_path / "lit" / "tensorboard"))
    train_lit(lit_config(data, tmp_path / "plain", "steps=2", "log_with=[]"))
    assert not (tmp_path / "plain" / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl") if "loss" in r] == [1, 2]


def test_log_with_is_a_list_in_the_config():
    assert load_config(PretrainConfig).log_with == ["tensorboard"]
    assert load_config(PretrainConfig, None, ["log_with=[tensorboard,wandb]"]).log_with == ["tensorboard", "wandb"]
    assert load_config(PretrainConfig, None, ["log_with=[]"]).log_with == []


def test_an_unknown_tracker_is_one_line_naming_the_choices():
    with pytest.raises(UserError, match=r"'tensorbord', a tracker accelerate does not know \(did you mean "
                                        r"'tensorboard'\?\); choose from .*wandb"):
        trackers.check_trackers(["tensorbord"])
    with pytest.raises(UserError, match="'all', a tracker accelerate does not know"):
        trackers.check_trackers(["all"])


@pytest.mark.parametrize("name, fix", [("wandb", "pip install 'lit-softmoe[wandb]'"),
                                       ("mlflow", "pip install 'lit-softmoe[mlflow]'"),
                                       ("tensorboard", "pip install tensorboard")])
def test_a_tracker_without_its_package_names_what_to_install(monkeypatch, name, fix):
    monkeypatch.setattr(trackers, "get_available_trackers", lambda: [])  # a machine without any
    with pytest.raises(UserError) as err:
        trackers.check_trackers([name])
    assert str(err.value) == f"log_with names {name!r}, but its package is not installed: {fix}, or drop {name} " \
                             "from log_with"


@pytest.mark.parametrize("command", ["pretrain", "train"])
def test_a_tracker_mistake_stops_the_command_before_any_work(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(trackers, "get_available_trackers", lambda: [])
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    run = tmp_path / "run"
    # The data paths do not exist: the tracker check comes first.
    line = one_line_error(capsys, [command, "--config", str(empty), f"run_dir={run}", "data.train=nowhere",
                                    "log_with=[wandb]"])
    assert "pip install 'lit-softmoe[wandb]'" in line
    assert not run.exists()


def test_every_tracker_but_tensorboard_has_its_extra_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(trackers.TRACKER_EXTRAS) == set(LoggerType.list()) - {"all", "tensorboard"}
    assert set(trackers.TRACKER_EXTRAS.values()) <= set(extras)
