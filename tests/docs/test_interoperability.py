"""docs/interoperability.md: every example on the page, run as the page shows it.

An example is a fenced block right after an `<!-- example: NAME -->` line. Its placeholder folders
(`runs/demo/export`, `data/fashion-mnist`, ...) are replaced by folders the fixtures build, and what it
computes is checked against our own API's answer on the same folder; the trackers' command runs in a
tmp folder laid out as the shipped config expects. No example needs the network."""
from __future__ import annotations

import importlib.util
import re
import shlex
import textwrap
from pathlib import Path

import pytest
import torch

from evalkit import needs_clip_benchmark
from lit_softmoe.hub import load_pretrained

DOC = Path(__file__).resolve().parents[2] / "docs" / "interoperability.md"
EXAMPLE = re.compile(r"^(?P<indent> *)<!-- example: (?P<name>[\w-]+) -->\n(?P=indent)```(?P<lang>\w+)\n"
                     r"(?P<body>.*?)^(?P=indent)```$", re.MULTILINE | re.DOTALL)
# The examples the tests below run, by the name that marks them on the page.
RUN_HERE = {"open-clip-zero-shot", "open-clip-export", "clip-benchmark", "timm", "timm-features", "timm-export",
            "hf-hub", "onnx", "trackers"}


def _examples() -> dict[str, str]:
    examples = {}
    for match in EXAMPLE.finditer(DOC.read_text()):
        assert match["name"] not in examples, f"two examples named {match['name']}"
        examples[match["name"]] = textwrap.dedent(match["body"])
    return examples


def _example(name: str, **folders) -> str:
    """The example `name`, each placeholder folder (`folders`: placeholder -> tmp folder) replaced."""
    code = _examples()[name]
    assert len(code.splitlines()) <= 6, f"{name}: {len(code.splitlines())} lines, a short example has 6 at most"
    for placeholder, folder in folders.items():
        assert placeholder in code, f"{name} no longer names {placeholder}"
        code = code.replace(placeholder, str(folder))
    return code


def _run(code: str) -> dict:
    scope: dict = {"__name__": "__example__"}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 (the docs' own example)
    return scope


def test_every_block_of_the_page_is_an_example_that_runs():
    text = DOC.read_text()
    fences = re.findall(r"^ *```\w+$", text, re.MULTILINE)
    examples = _examples()
    assert len(fences) == len(examples), "a fenced block of the page has no `<!-- example: NAME -->` line before it"
    assert set(examples) == RUN_HERE, "an example of the page is not run here, or one run here left the page"


# ---- open_clip ----------------------------------------------------------------------------------

def test_open_clip_zero_shot_example_gives_our_classifier(hub_export):
    pytest.importorskip("open_clip")
    from lit_softmoe.evals.classifier import build_zeroshot_classifier
    code = _example("open-clip-zero-shot", **{"runs/demo/export": hub_export})
    assert code.count(str(hub_export)) == 2  # the model and the tokenizer
    classifier = _run(code)["classifier"]
    model, _, tokenizer = load_pretrained(hub_export)
    ours = build_zeroshot_classifier(model.encode_text, tokenizer, ["sneaker", "bag"],
                                     ["a photo of a {c}.", "a drawing of a {c}."])
    assert classifier.shape == (model.text_tower.embed_dim, 2)
    torch.testing.assert_close(classifier, ours, rtol=0, atol=1e-6)


def test_open_clip_export_example_embeds_as_ours(hub_export):
    pytest.importorskip("open_clip")
    code = _example("open-clip-export", **{"runs/demo/export": hub_export})
    scope = _run(code)
    assert type(scope["model"]).__name__ == "CustomTextCLIP"  # open_clip's own class, built from the export
    # The one copy of the weights, read by both loaders (the page's "One copy of the weights").
    assert sorted(p.name for p in hub_export.glob("*.safetensors")) == ["image_tower_extra.safetensors",
                                                                        "open_clip_model.safetensors"]
    assert scope["text"].shape == scope["ours"].shape == (1, scope["model"].text.output_dim)
    torch.testing.assert_close(scope["text"], scope["ours"], rtol=0, atol=1e-5)
    model, _, _ = load_pretrained(hub_export)
    pixels = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(scope["model"].encode_image(pixels.expand(-1, 3, -1, -1), normalize=True),
                                   model.encode_image(pixels), rtol=0, atol=1e-5)


# ---- CLIP_benchmark ----------------------------------------------------------------------------

@needs_clip_benchmark
def test_clip_benchmark_example_agrees_with_our_suite(hub_export, fmnist, tmp_path, capsys):
    from lit_softmoe.config import BenchmarkConfig, EvalSuiteConfig
    from lit_softmoe.evals.suite import run_suite
    from lit_softmoe.integrations.clip_benchmark import in_our_names
    code = _example("clip-benchmark", **{"runs/demo/export": hub_export, "data/fashion-mnist": fmnist})
    result = _run(code)["result"]
    assert capsys.readouterr().out.strip().endswith(str(result["metrics"]))
    assert set(result["metrics"]) >= {"acc1", "acc5", "mean_per_class_recall"}  # the names the comment gives
    suite = EvalSuiteConfig(name="s", workers=0, batch_size=64, cache_dir=str(tmp_path / "cache"),
                            benchmarks=[BenchmarkConfig(name="fashion-mnist", root=str(fmnist), split="test")])
    ours = run_suite(hub_export, suite, out=tmp_path / "ours.json")["results"][0]
    assert ours["status"] == "ok" and ours["num_samples"] == 300
    theirs = in_our_names(result["metrics"])
    assert set(theirs) == set(ours["metrics"])
    for key, value in ours["metrics"].items():
        assert abs(value - theirs[key]) * 100 <= 0.1 + 1e-6, (key, value, theirs[key])  # float32 slack


# ---- timm -----------------------------------------------------------------------------------------

def test_timm_example_builds_a_registered_tower_and_a_tower_folder(run):
    from lit_softmoe.hub import load_image_tower
    from lit_softmoe.models.registry import image_tower_config
    from lit_softmoe.models.vit import VisionTransformer
    from towers import images
    tower_dir = run.parent / "pre" / "tower"  # soft-test-4e: 28x28 gray in patches of 7, as the demo's
    code = _example("timm", **{"runs/demo/pretrain/tower": tower_dir})
    scope = _run(code)
    fresh, tower, tokens = scope["fresh"], scope["tower"], scope["tokens"]
    assert isinstance(fresh, VisionTransformer)
    assert fresh.cfg == image_tower_config("soft-tiny-p7-16e", num_classes=10)
    ours, _ = load_image_tower(tower_dir)
    assert tower.cfg == ours.cfg and not tower.training
    assert tokens.shape == (2, 16, ours.cfg.width) and "# (2, 16, D)" in code
    x = images(ours.cfg, b=2)
    with torch.no_grad():
        assert torch.equal(tower.forward_features(x), ours.forward_features(x))  # the folder's weights


def test_timm_features_example_gives_the_block_maps():
    code = _example("timm-features")
    scope = _run(code)
    tower, tokens, maps, backbone, last_two = (scope[k] for k in ("tower", "tokens", "maps", "backbone", "last_two"))
    d = tower.cfg.width
    assert tower.cfg.depth == 6 and tokens.shape == (2, 16, d) and "6 maps (2, D, 4, 4)" in code
    assert len(maps) == 6 and all(m.shape == (2, d, 4, 4) for m in maps)
    assert backbone.feature_info.module_name() == ["blocks.4", "blocks.5"] and len(backbone.model.blocks) == 6
    assert len(last_two) == 2 and all(m.shape == (2, d, 4, 4) for m in last_two)
    # The same tower's blocks give the same maps through both doors.
    kept = backbone.model.state_dict()
    backbone.model.load_state_dict({k: v for k, v in tower.state_dict().items() if k in kept})
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        for got, want in zip(backbone(x), tower.forward_intermediates(x, intermediates_only=True)[-2:]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_timm_export_example_builds_the_image_only_export_as_our_loader(run, tmp_path):
    from lit_softmoe.export import export_pair
    from towers import images
    export = export_pair(run.parent / "pre", tmp_path / "tower-export", onnx=False)  # soft-test-4e, as the demo's
    code = _example("timm-export", **{"exports/my-tower": export})
    scope = _run(code)
    tower, ours, pooled = scope["tower"], scope["ours"], scope["pooled"]
    assert type(tower).__name__ == "VisionTransformer" and tower.cfg == ours.cfg and not tower.training
    assert pooled.shape == (2, ours.cfg.width) and "# (2, D)" in code
    x = images(ours.cfg, b=2)
    with torch.no_grad():  # the export's weights, in timm's tower as in ours
        torch.testing.assert_close(tower.forward_features(x), ours.forward_features(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(tower.forward_head(tower.forward_features(x), pre_logits=True),
                                   ours.forward_pooled(x), rtol=0, atol=1e-5)


# ---- Hugging Face -------------------------------------------------------------------------------

def test_hf_hub_example_loads_the_cached_export_offline(hub_export, tmp_path, monkeypatch):
    from hf_hub_cache import cache_repo, offline_hf_cache
    cache_repo(offline_hf_cache(monkeypatch, tmp_path / "hf"), "org/name", hub_export)
    code = _example("hf-hub")
    assert 'load_pretrained("hf-hub:org/name")' in code
    text = _run(code)["text"]
    reference, _, tokenizer = load_pretrained(hub_export)
    with torch.no_grad():
        assert torch.equal(text, reference.encode_text(tokenizer(["a photo of a sneaker"])))


# ---- ONNX -----------------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="pip install 'lit-softmoe[onnx]'")
def test_onnx_example_gives_encode_text(onnx_export):
    code = _example("onnx", **{"runs/demo/export": onnx_export})
    assert "torch" not in code
    text = _run(code)["text"]
    model, _, tokenizer = load_pretrained(onnx_export)
    with torch.no_grad():
        expected = model.encode_text(tokenizer(["a photo of a sneaker"]))
    assert text.shape == tuple(expected.shape) == (1, model.text_tower.embed_dim)
    torch.testing.assert_close(torch.from_numpy(text), expected, rtol=0, atol=1e-4)  # export's own check: 1e-4


# ---- experiment trackers ---------------------------------------------------------------------------

def _hparams(folder: Path) -> dict:
    """The hyperparameters TensorBoard shows for the run in `folder` (its hparams plugin's session start)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2
    for file in folder.rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(file)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = data.session_start_info.hparams  # name -> protobuf Value
                    return {name: getattr(v, v.WhichOneof("kind")) for name, v in hparams.items()}
    raise AssertionError(f"no hparams under {folder}")


def test_trackers_example_trains_with_its_metrics_in_tensorboard(data, tmp_path, monkeypatch):
    """The command as the page gives it, in a folder laid out as the shipped config names its inputs (the
    tower and feature cache of `data`); TensorBoard then holds what metrics.jsonl holds, and the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_softmoe import cli
    from lit_softmoe.config import LiTConfig
    from lit_softmoe.config_loading import config_path, load_config
    from lit_softmoe.train.logging import read_metrics
    lines = [line for line in _example("trackers").splitlines() if not line.startswith("#")]
    assert [line.split()[0] for line in lines] == ["lit-softmoe", "tensorboard"]
    argv, logdir = shlex.split(lines[0])[1:], Path(shlex.split(lines[1])[-1])
    shipped = load_config(LiTConfig, config_path(LiTConfig, argv[argv.index("--config") + 1]))
    features = Path(shipped.data.train).parent  # as `lit-softmoe embed --out FEATURES` writes both splits
    assert Path(shipped.eval.shards) == features / "test" and Path(shipped.data.train) == features / "train"
    for placeholder, built in ((Path(shipped.image_tower), data / "tower"), (features, data / "features")):
        (tmp_path / placeholder).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / placeholder).symlink_to(built)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 0
    run = Path(shipped.run_dir)
    assert logdir == run / "tensorboard"
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    records = read_metrics(run / "metrics.jsonl")
    for tag in ("loss", "zeroshot_top1"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        shown = [(event.step, event.value) for event in accumulator.Scalars(tag)]
        assert logged and [s for s, _ in shown] == [s for s, _ in logged], tag
        assert [v for _, v in shown] == pytest.approx([v for _, v in logged], rel=1e-6), tag
    hparams = _hparams(logdir)
    assert hparams["log_project"] == "fmnist" and hparams["log_with"] == "['tensorboard']"
    assert hparams["image_tower"] == shipped.image_tower
