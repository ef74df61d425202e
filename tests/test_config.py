"""lit_softmoe.config: every shipped YAML (configs and eval suites) loads and validates; mistakes become one
clear UserError that says where they were made."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cli_errors import one_line_error
from evalkit import needs_foolbox, tiny_pair
from launch import python_command
from lit_softmoe.config import (
    EvalSuiteConfig,
    LiTConfig,
    PretrainConfig,
    micro_batch_size,
)
from lit_softmoe.config_loading import load_config
from lit_softmoe.errors import UserError
from lit_softmoe.evals.suite import run_suite
from lit_softmoe.metadata import benchmark_info
from lit_softmoe.models.registry import image_tower_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SUITES = Path(__file__).parent.parent / "eval"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("pretrain/*.yaml")), ids=lambda p: p.name)
def test_every_pretrain_config_loads_and_names_a_real_tower(path):
    cfg = load_config(PretrainConfig, path)
    assert isinstance(cfg, PretrainConfig)
    image_tower_config(cfg.tower.name, **cfg.tower.options)  # raises on an unknown tower or option
    assert path.read_text().startswith("#"), "each config opens with a header showing its command"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("lit/*.yaml")), ids=lambda p: p.name)
def test_every_lit_config_loads(path):
    cfg = load_config(LiTConfig, path)
    cfg.text.validate()  # raises on an unknown text tower kind or pooling
    assert path.read_text().startswith("#")


def test_yaml_and_overrides_merge_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 64\noptim:\n  lr: 0.01\n")
    cfg = load_config(PretrainConfig, path, ["optim.lr=3e-4", "tower.options.num_experts=8"])
    assert cfg.batch_size == 64
    assert cfg.optim.lr == pytest.approx(3e-4)  # the override wins over the file
    assert cfg.optim.warmup == PretrainConfig().optim.warmup  # untouched default
    assert cfg.tower.options == {"num_experts": 8}


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(UserError, match=r"optim\.lrr.*did you mean 'optim\.lr'"):
        load_config(PretrainConfig, None, ["optim.lrr=1"])


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("bach_size: 3\n")
    with pytest.raises(UserError, match=r"bach_size.*did you mean 'batch_size'"):
        load_config(PretrainConfig, path)


def test_wrong_type_and_bad_choice_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="batch_size"):
        load_config(PretrainConfig, None, ["batch_size=many"])
    with pytest.raises(UserError, match="loss.*softmax, sigmoid"):
        load_config(PretrainConfig, None, ["loss=hinge"])
    with pytest.raises(UserError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="key=value"):
        load_config(PretrainConfig, None, ["optim.lr"])


def test_an_empty_override_is_the_empty_string():
    # `eval.shards=` (or `eval.shards=''`, whose quotes the shell removes) disables the eval set.
    assert load_config(LiTConfig, None, ["eval.shards="]).eval.shards == ""
    assert load_config(LiTConfig, None, ["eval.shards=''"]).eval.shards == ""
    with pytest.raises(UserError, match="batch_size"):
        load_config(LiTConfig, None, ["batch_size="])  # an int cannot be empty


@pytest.mark.parametrize("schema, override", [
    (PretrainConfig, "log_every=0"), (PretrainConfig, "checkpoint_every=0"), (PretrainConfig, "batch_size=0"),
    (PretrainConfig, "eval_batch_size=0"), (PretrainConfig, "data.max_train_samples=-1"),
    (LiTConfig, "log_every=0"), (LiTConfig, "checkpoint_every=0"), (LiTConfig, "eval.every=-5"),
    (LiTConfig, "data.workers=-1"), (LiTConfig, "optim.lr=-1"), (LiTConfig, "optim.weight_decay=-0.5"),
    (PretrainConfig, "optim.lr=-0.001"), (LiTConfig, "text.unlocked_layers=-1"),
    (PretrainConfig, "optim.layer_decay=-0.5")])
def test_values_that_would_break_the_run_are_refused_up_front(schema, override):
    """A zero logging or checkpoint period, or a zero batch, divided by zero mid-run (a traceback); a
    negative learning rate or weight decay ended in the optimizer's own traceback."""
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"config key '{key}' is -?[\d.]+; it must be at least \d: set {key}="):
        load_config(schema, None, [override])


@pytest.mark.parametrize("schema, override, bound", [
    (PretrainConfig, "optim.grad_clip=-1", "at least 0: set optim.grad_clip=0 or more"),
    (LiTConfig, "optim.grad_clip=-0.5", "at least 0: set optim.grad_clip=0 or more"),
    (PretrainConfig, "data.max_bad_fraction=5", "at most 1: set data.max_bad_fraction=1 or less"),
    (LiTConfig, "data.max_bad_fraction=1.5", "at most 1: set data.max_bad_fraction=1 or less"),
    (PretrainConfig, "optim.layer_decay=1.5", "at most 1: set optim.layer_decay=1 or less"),
    (LiTConfig, "optim.layer_decay=2", "at most 1: set optim.layer_decay=1 or less")])
def test_a_negative_grad_clip_and_a_fraction_over_one_are_refused(schema, override, bound):
    """grad_clip=-1 switched clipping off (only 0 means off), and a bad-sample fraction of 5 was taken."""
    key, value = override.split("=")
    with pytest.raises(UserError, match=rf"^config key '{key}' is {re.escape(str(float(value)))}; it must be {bound}$"):
        load_config(schema, None, [override])


def test_grad_clip_zero_and_a_fraction_of_one_are_allowed():
    cfg = load_config(PretrainConfig, None, ["optim.grad_clip=0", "data.max_bad_fraction=1"])
    assert (cfg.optim.grad_clip, cfg.data.max_bad_fraction) == (0, 1)


def test_an_unset_environment_variable_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: ${oc.env:LIT_SOFTMOE_TEST_UNSET_VAR}\n")
    with pytest.raises(UserError, match="cannot resolve config"):
        load_config(PretrainConfig, path)


def test_errors_say_where_a_config_file_or_an_unknown_key_came_from(tmp_path):
    from lit_softmoe.config import EvalSuiteConfig
    with pytest.raises(UserError, match="a shipped one: clip-27, fashion-mnist, lit-paper$"):
        load_config(EvalSuiteConfig, tmp_path / "nope.yaml")
    with pytest.raises(UserError, match=r"a shipped one: pretrain/fmnist-dense-tiny, pretrain/fmnist-soft-tiny, "
                                        r"pretrain/soft-b16-128e-imagenet1k, pretrain/soft-b16-128e-imagenet21k, "
                                        r"pretrain/soft-s16-128e-imagenet1k, pretrain/soft-s16-128e-imagenet21k, "
                                        r"pretrain/upcycle-fmnist-tiny$"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")
    config = tmp_path / "run.yaml"
    config.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(UserError, match=f"unknown config key 'optim.lrr' in {config}"):
        load_config(PretrainConfig, config)
    config.write_text("steps: 3\n")
    with pytest.raises(UserError, match="unknown config key 'optim.lrr' on the command line"):
        load_config(PretrainConfig, config, ["optim.lrr=1"])
    # An unknown section: OmegaConf names its first part, which no override spells whole.
    with pytest.raises(UserError, match="unknown config key 'foo' on the command line"):
        load_config(PretrainConfig, config, ["foo.bar=1"])
    with pytest.raises(UserError, match="unknown config key 'fewshot' on the command line"):
        load_config(LiTConfig, None, ["fewshot.x=1"])
    with pytest.raises(UserError, match=f"bad value for config key 'steps' in {config}"):
        config.write_text("steps: many\n")
        load_config(PretrainConfig, config, ["optim.lr=1e-3"])


@pytest.mark.parametrize("command, override", [
    ("pretrain", "log_every=0"), ("pretrain", "checkpoint_every=0"), ("pretrain", "batch_size=0"),
    ("train", "log_every=0"), ("train", "checkpoint_every=0")])
def test_zero_periods_and_batches_in_the_config(tmp_path, capsys, command, override):
    (tmp_path / "c.yaml").write_text("{}\n")
    line = one_line_error(capsys, [command, "--config", str(tmp_path / "c.yaml"), override])
    key = override.split("=")[0]
    assert f"config key '{key}' is 0; it must be at least 1: set {key}=1 or more" in line


@needs_foolbox
def test_every_shipped_suite_loads():
    from pathlib import Path
    suites = sorted(Path(__file__).parent.parent.glob("eval/*.yaml"))
    assert {s.stem for s in suites} >= {"fashion-mnist", "lit-paper", "clip-27"}
    for path in suites:
        cfg = load_config(EvalSuiteConfig, path)
        assert cfg.benchmarks and all(b.root for b in cfg.benchmarks), path
        for b in cfg.benchmarks:
            benchmark_info(b.name)  # every benchmark has shipped metadata
    assert len(load_config(EvalSuiteConfig, "eval/clip-27.yaml").benchmarks) >= 27


@needs_foolbox
def test_cli_mistakes_end_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbenchmarks:\n  - name: cifar10\n    root: /x\n    fromat: wds\n")
    run = subprocess.run([*python_command(), "-m", "lit_softmoe.cli", "eval", "--model", "m", "--suite", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "unknown config key" in run.stderr and "fromat" in run.stderr and "format" in run.stderr
    bad.write_text("name: x\nbenchmarks:\n  - name: cifar10\n    root: /x\n    format: zip\n")
    # The same `main` in this process: a second subprocess would only add a torch import.
    assert "'benchmarks[0].format' is 'zip'" in one_line_error(capsys, ["eval", "--model", "m", "--suite", str(bad)])


@needs_foolbox
def test_shipped_suites_read_the_shards_lit_softmoe_data_writes(fmnist, tmp_path, monkeypatch):
    """LIT_SOFTMOE_DATA names the raw *-ubyte.gz downloads (README Quickstart); the suites read the
    converted shards: data/NAME, or $LIT_SOFTMOE_BENCHMARKS/NAME."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "t10k-images-idx3-ubyte.gz").write_bytes(b"")
    monkeypatch.setenv("LIT_SOFTMOE_DATA", str(raw))
    monkeypatch.delenv("LIT_SOFTMOE_BENCHMARKS", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fashion-mnist").symlink_to(fmnist)  # where `lit-softmoe data fashion-mnist` writes
    cfg = load_config(EvalSuiteConfig, SUITES / "fashion-mnist.yaml", ["workers=0", f"cache_dir={tmp_path / 'c'}"])
    assert cfg.benchmarks[0].root == "data/fashion-mnist"
    report = run_suite("m", cfg, out=tmp_path / "r.json", model_bundle=tiny_pair())
    assert report["evaluated"] == 1 and report["results"][0]["num_samples"] == 300
    monkeypatch.setenv("LIT_SOFTMOE_BENCHMARKS", "/bench")
    for suite in SUITES.glob("*.yaml"):
        for b in load_config(EvalSuiteConfig, suite).benchmarks:
            assert b.root == f"/bench/{b.name}", (suite, b.root)


def test_shipped_configs_and_suites_load_by_short_name_from_anywhere(tmp_path, monkeypatch):
    """The configs and suites are package data: a pip-installed package finds them by short name, or by
    their path in a source checkout, from a working directory without configs/ or eval/ folders."""
    by_path = load_config(PretrainConfig, CONFIGS / "pretrain" / "fmnist-soft-tiny.yaml")
    suite_by_path = load_config(EvalSuiteConfig, SUITES / "lit-paper.yaml")
    monkeypatch.chdir(tmp_path)
    for name in ("pretrain/fmnist-soft-tiny", "fmnist-soft-tiny", "configs/pretrain/fmnist-soft-tiny.yaml"):
        assert load_config(PretrainConfig, name) == by_path
    for name in ("lit-paper", "eval/lit-paper.yaml", "suites/lit-paper"):
        assert load_config(EvalSuiteConfig, name) == suite_by_path
    assert load_config(LiTConfig, "lit/fmnist-tiny").text.width == 128
    (tmp_path / "fashion-mnist").write_text("name: mine\n")  # a file of the user's own comes first
    assert load_config(EvalSuiteConfig, "fashion-mnist").name == "mine"
    with pytest.raises(UserError, match=r"config file fmnist-nope does not exist; give a YAML file or a shipped "
                                        r"one: pretrain/fmnist-dense-tiny, pretrain/fmnist-soft-tiny, "
                                        r"pretrain/soft-b16-128e-imagenet1k, pretrain/soft-b16-128e-imagenet21k, "
                                        r"pretrain/soft-s16-128e-imagenet1k, pretrain/soft-s16-128e-imagenet21k, "
                                        r"pretrain/upcycle-fmnist-tiny$"):
        load_config(PretrainConfig, "fmnist-nope")


def test_warmup_steps_is_an_unknown_key_that_names_warmup(tmp_path):
    """optim.warmup is the one warmup key: warmup_steps, on the command line or in a file, is refused in one
    line that names it."""
    with pytest.raises(UserError, match=r"unknown config key 'optim.warmup_steps' on the command line \(did you "
                                        r"mean 'optim.warmup'\?\)"):
        load_config(PretrainConfig, None, ["optim.warmup_steps=25"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.002\n  warmup_steps: 300\n")
    with pytest.raises(UserError, match=rf"unknown config key 'optim.warmup_steps' in {path} \(did you mean"):
        load_config(PretrainConfig, path)


@pytest.mark.parametrize("override", ["epochs=nan", "epochs=inf", "data.max_bad_fraction=nan", "optim.lr=-inf"])
def test_a_value_that_is_not_a_finite_number_is_refused(override):
    """nan compares false with everything: epochs=nan passed every check (a traceback later) and
    max_bad_fraction=nan silently switched the bad-sample limit off."""
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"config key '{key}' is -?(nan|inf); give a finite number"):
        load_config(PretrainConfig, None, [override])


def test_a_shell_command_in_a_config_file_needs_the_users_consent(tmp_path, monkeypatch):
    """A `pipe:` shard spec runs a shell command: from a config file (someone else's, maybe) it is
    refused unless LIT_SOFTMOE_ALLOW_PIPE=1; on the command line it is the user's own."""
    monkeypatch.delenv("LIT_SOFTMOE_ALLOW_PIPE", raising=False)
    config = tmp_path / "lit.yaml"
    config.write_text("data:\n  train: 'data/a/train::pipe:curl -s https://x/0.tar'\n")
    with pytest.raises(UserError, match=r"sets data\.train to a shell command .*set LIT_SOFTMOE_ALLOW_PIPE=1"):
        load_config(LiTConfig, config)
    assert load_config(LiTConfig, config, ["data.train=pipe:cat a.tar"]).data.train == "pipe:cat a.tar"
    monkeypatch.setenv("LIT_SOFTMOE_ALLOW_PIPE", "1")
    assert load_config(LiTConfig, config).data.train.endswith("0.tar")


def test_a_shell_command_in_a_config_file_given_to_train_is_one_line(tmp_path, capsys, monkeypatch):
    """Through the command line: refused before anything runs (no run folder), naming the key."""
    monkeypatch.delenv("LIT_SOFTMOE_ALLOW_PIPE", raising=False)
    marker = tmp_path / "ran"
    (tmp_path / "c.yaml").write_text(f"run_dir: {tmp_path / 'run'}\ndata:\n  train: 'pipe:touch {marker}'\n")
    line = one_line_error(capsys, ["train", "--config", str(tmp_path / "c.yaml")])
    assert "sets data.train to a shell command" in line and "LIT_SOFTMOE_ALLOW_PIPE=1" in line
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_shell_command_reached_through_an_interpolation_in_a_config_file_is_refused(tmp_path, monkeypatch):
    """The check reads each value as the run will: `${oc.env:SPEC}` holding `pipe:...` is a command from
    the file too; and an unset variable elsewhere stays the one-line "cannot resolve" error."""
    monkeypatch.delenv("LIT_SOFTMOE_ALLOW_PIPE", raising=False)
    monkeypatch.setenv("LIT_SOFTMOE_TEST_SPEC", "pipe:curl -s https://x/0.tar")
    config = tmp_path / "lit.yaml"
    config.write_text("data:\n  train: ${oc.env:LIT_SOFTMOE_TEST_SPEC}\n")
    with pytest.raises(UserError, match=r"sets data\.train to a shell command \('pipe:curl"):
        load_config(LiTConfig, config)
    config.write_text("batch_size: ${oc.env:LIT_SOFTMOE_TEST_UNSET_VAR}\ndata:\n  train: data/a/train\n")
    with pytest.raises(UserError, match="cannot resolve config"):
        load_config(LiTConfig, config)


@pytest.mark.parametrize("schema", [PretrainConfig, LiTConfig])
def test_compile_defaults_to_auto_and_takes_yaml_booleans(tmp_path, schema):
    assert load_config(schema).compile == "auto"  # on GPUs, off on the CPU (utils.device.resolve_compile)
    path = tmp_path / "c.yaml"
    path.write_text("compile: true\n")  # a YAML boolean, as the shipped ImageNet configs write it
    assert load_config(schema, path).compile == "true"
    assert load_config(schema, path, ["compile=False"]).compile == "false"
    assert load_config(schema, overrides=["compile=yes"]).compile == "true"  # YAML 1.1's yes is a boolean
    with pytest.raises(UserError, match=r"config key 'compile' is 'maybe'; choose one of auto, true, false"):
        load_config(schema, overrides=["compile=maybe"])


@pytest.mark.parametrize("override, message", [
    ("sharding=zero3", "config key 'sharding' is 'zero3'; choose one of none, fsdp"),
    ("accum_steps=0", "config key 'accum_steps' is 0; it must be at least 1"),
    ("accum_steps=3", "config key 'accum_steps' is 3, which does not divide batch_size 128"),
])
def test_lever_values_are_checked_at_load(override, message):
    with pytest.raises(UserError, match=message):
        load_config(PretrainConfig, "pretrain/fmnist-soft-tiny", [override])


def test_micro_batch_size_names_what_does_not_divide():
    assert micro_batch_size(4096, 8, 4) == 128
    with pytest.raises(UserError, match="batch_size 100 does not split over 8 processes"):
        micro_batch_size(100, 8)
    with pytest.raises(UserError, match="accum_steps 3 does not divide the 512 samples of each of 8 processes"):
        micro_batch_size(4096, 8, 3)



@pytest.mark.parametrize("override,takes", [
    ("data.crop_scale=[-1,0.5]", "two numbers in [1e-06, 1], the first at most the second"),  # log of -1: a traceback
    ("data.crop_scale=[2,1]", "two numbers in [1e-06, 1], the first at most the second"),
    ("data.crop_scale=[0.5,0.4]", "two numbers in [1e-06, 1], the first at most the second"),
    ("data.crop_scale=[0.5]", "two numbers in [1e-06, 1], the first at most the second"),
    ("data.randaugment=[2,100]", "two numbers in [0, 30], or [] for none"),  # torchvision's 31 magnitude bins
    ("data.randaugment=[2,-15]", "two numbers in [0, 30], or [] for none"),
    ("data.randaugment=[2]", "two numbers in [0, 30], or [] for none"),
])
def test_augmentation_ranges_are_checked_where_the_config_is_read(override, takes, capsys):
    """An area fraction outside (0, 1] or a RandAugment magnitude outside torchvision's bins was accepted and
    failed (or ran) later; now one line names the key and what it takes, before anything runs."""
    key, value = override.split("=")
    with pytest.raises(UserError) as caught:
        load_config(PretrainConfig, "pretrain/fmnist-soft-tiny", [override, "data.crop=random_resized"])
    assert str(caught.value).startswith(f"config key {key!r} is ") and str(caught.value).endswith(f"it takes {takes}")
    line = one_line_error(capsys, ["pretrain", "--config", "pretrain/fmnist-soft-tiny", override])
    assert f"config key {key!r}" in line
    # In range they load as given, and [] switches RandAugment off.
    good = load_config(PretrainConfig, "pretrain/fmnist-soft-tiny",
                       ["data.crop_scale=[0.4,1.0]", "data.randaugment=[]"])
    assert good.data.crop_scale == [0.4, 1.0] and good.data.randaugment == []


@pytest.mark.parametrize("text,holds", [("- batch_size: 8\n- steps: 2\n", "a list"),
                                        ("just a string\n", "a single value"), ("42\n", "a single value")])
def test_a_config_file_that_is_not_a_mapping_is_one_line(tmp_path, capsys, text, holds):
    """A YAML list ended in omegaconf's ConfigAttributeError traceback, a bare string in "unknown config key
    'just a string'" (omegaconf reads it as a key)."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    line = one_line_error(capsys, ["pretrain", "--config", str(path)])
    assert line.endswith(f"{path} holds {holds}, not a mapping of config keys; write `key: value` lines "
                         "(e.g. `batch_size: 256`)")
    path.write_text("")  # an empty file is no mistake: the defaults
    assert load_config(PretrainConfig, path).batch_size == PretrainConfig().batch_size


def test_a_config_path_that_is_a_folder_or_a_list_key_given_one_value_says_so(tmp_path, capsys):
    """A folder given as --config was said not to exist; one value for a list key (`data.crop_scale=0.5`) got
    omegaconf's "AnyNode is not a ListConfig, TupleConfig, list, or tuple"."""
    line = one_line_error(capsys, ["pretrain", "--config", str(tmp_path)])
    assert line.startswith(f"lit-softmoe pretrain: error: config file {tmp_path} is a folder; give a YAML file in "
                           "it, or a shipped one: pretrain/"), line
    with pytest.raises(UserError) as refused:
        load_config(PretrainConfig, None, ["data.crop_scale=0.5"])
    assert str(refused.value) == ("bad value for config key 'data.crop_scale' on the command line: a list is needed: "
                                  "write it in brackets (data.crop_scale='[…]' on a shell's command line)")


def test_overrides_may_follow_a_flag_and_keep_their_order(tmp_path, capsys):
    """`run_dir=r --plan data.crop=x`: argparse had filled the overrides before the flag, and called the ones after
    it "unrecognized arguments"."""
    (tmp_path / "c.yaml").write_text("{}\n")
    line = one_line_error(capsys, ["pretrain", "--config", str(tmp_path / "c.yaml"), "data.crop=pad", "--plan",
                                   "data.crop=nowhere"])
    assert line == ("lit-softmoe pretrain: error: config key 'data.crop' is 'nowhere'; choose one of pad, "
                    "random_resized")  # the later one, as on one run of overrides
