"""An export's README.md: what the towers are, what they were trained on, their zero-shot results
and how to load them, under the YAML front matter the Hugging Face Hub indexes a model by
(https://huggingface.co/docs/hub/model-cards#model-card-metadata), as timm's and open_clip's
`push_to_hf_hub` write it."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from lit_softmoe.evals.reports import markdown_row, percent
from lit_softmoe.model_folders import RUN_CONFIG, read_run_config
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.timm_tower import TIMM_PREFIX, is_timm_tower_config
from lit_softmoe.models.vit import VisionTransformer


def _latest_eval(run_dir: Path | None, checkpoint: Path | None = None) -> tuple[Path, dict] | None:
    """The newest RUN/eval/*.json the eval suite wrote for the exported model, if any: the run's
    final model, or the exported `checkpoint` (a report on another model describes other
    weights)."""
    if run_dir is None or not (run_dir / "eval").is_dir():
        return None
    files = sorted((run_dir / "eval").glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for file in reversed(files):
        try:
            report = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(report, dict) or not isinstance(report.get("results"), list):
            continue
        evaluated = Path(str(report.get("model", "")))
        if (evaluated.parent.name == "checkpoints") != (checkpoint is not None):
            continue
        if checkpoint is not None and evaluated.name != checkpoint.name:  # another step of the run
            continue
        return file, report
    return None


def _zeroshot_section(evaluation: dict, hub: bool = False) -> list[str]:
    """The card's zero-shot table, from its facts ("rows" of an eval report, else the run's
    "scores"); on the Hub without the report's paths (the model evaluated, a skipped benchmark's
    missing folder)."""
    if "rows" in evaluation:
        rows = evaluation["rows"]
        metrics = list(dict.fromkeys(k for row in rows for k in (row.get("metrics") or {})))
        model = "" if hub else f", model `{evaluation.get('model') or '?'}`"
        lines = [f"From `{evaluation['file']}` (suite `{evaluation.get('suite') or '?'}`{model}), "
                 "metrics in %:", "",
                 markdown_row(["benchmark", "task", *metrics, "samples", "status"]),
                 "|" + "---|" * (len(metrics) + 4)]
        for row in rows:
            values = [percent((row.get("metrics") or {}).get(m, "")) for m in metrics]
            status = row.get("status", "")
            if status in ("skipped", "failed") and row.get("reason") and not hub:
                status = f"{status}: {row['reason']}"
            lines.append(markdown_row([str(row.get("benchmark", "")), str(row.get("task", "")),
                                       *values, str(row.get("num_samples", "")), status]))
        return lines
    scores = evaluation.get("scores") or {}
    if not scores:
        return ["No evaluation recorded."]
    return ["From the run's results.json (the LiT recipe's own eval set):", "", "| metric | % |",
            "|---|---|", *[f"| {k} | {percent(v)} |" for k, v in scores.items()]]


def _tower_line(tower_cfg: dict, params: int, name: str | None) -> str:
    if is_timm_tower_config(tower_cfg):
        return (f"timm model `{tower_cfg['timm_model_name']}`{' (' + name + ')' if name else ''}, "
                f"{tower_cfg['image_size']}px, {tower_cfg['in_channels']} channel(s), "
                f"{tower_cfg['width']} features; {params / 1e6:.2f}M parameters")
    kind = {"soft": "Soft MoE",
            "tokens_choice": f"Tokens Choice (top-{tower_cfg.get('num_selected_experts', 1)})",
            "experts_choice": "Experts Choice"}.get(tower_cfg.get("moe_type", "soft"),
                                                    tower_cfg.get("moe_type"))
    soft = tower_cfg.get("moe_type", "soft") == "soft"
    per_expert = f" × {tower_cfg.get('slots_per_expert', 1)} slot(s)" if soft else ""
    moe = (f"{kind}, {tower_cfg['num_experts']} experts{per_expert} in blocks "
           f"{', '.join(map(str, tower_cfg['moe_layers']))}"
           if tower_cfg.get("moe_layers") else "dense")
    return (f"{name + ': ' if name else ''}ViT {tower_cfg['image_size']}px / patch "
            f"{tower_cfg['patch_size']}, {tower_cfg['in_channels']} channel(s), width "
            f"{tower_cfg['width']}, depth {tower_cfg['depth']}, {moe}; "
            f"{params / 1e6:.2f}M parameters")


# The toolkit's licence (pyproject's) as the Hub spells it: weights trained on data under other
# terms may need another; edit README.md's front matter before `lit-softmoe push`.
LICENSE = "apache-2.0"
# Data folders a Hub dataset id is known for (local shard paths mean nothing to the Hub): the
# demo's.
KNOWN_DATASETS = {re.compile(r"fashion[-_]?mnist", re.IGNORECASE): "zalando-datasets/fashion_mnist"}


def _training_data(run_dir: Path | None, tower_dir: str | None) -> list[str]:
    """The data paths the exported model was trained on: the pretraining run's and the LiT run's."""
    runs = [run_dir, Path(tower_dir).parent if tower_dir else None]
    paths = []
    for run in dict.fromkeys(r for r in runs if r is not None and (r / RUN_CONFIG).is_file()):
        data = read_run_config(run).get("data") or {}
        paths += [str(data[key]) for key in ("train", "test") if data.get(key)]
    return paths


def base_model(tower_meta: dict) -> str | None:
    """The Hub id of the timm checkpoint a tower came from (`timm:hf-hub:ORG/NAME`, or timm's own
    `timm:ARCH.TAG`, which timm fetches from timm/ARCH.TAG); None for our towers and local files."""
    source = str(tower_meta.get("source") or "")
    if not source.startswith(TIMM_PREFIX) or "?" in source:
        return None
    name = source[len(TIMM_PREFIX):]
    if name.startswith("hf-hub:"):
        return name[len("hf-hub:"):].split("@")[0]
    return f"timm/{name}" if "." in name else None


def front_matter(config: dict, facts: dict, run_dir: Path | None) -> dict:
    """The Hub's model card metadata: library, task, licence, tags, the base model (a timm
    checkpoint) and (where known) training datasets."""
    pair = config["kind"] == "pair"
    moe = (config["image_tower"].get("moe_type", "soft") if config["image_tower"].get("moe_layers")
           else None)
    moe_tags = [] if moe is None else ["soft-moe"] if moe == "soft" else ["moe"]
    tags = ["lit-softmoe", "vision", *(["lit", "image-text"] if pair else []), *moe_tags,
            "safetensors", *(["open_clip"] if "config" in (config.get("open_clip") or {}) else []),
            *(["onnx"] if "onnx" in config else [])]
    base = base_model(facts.get("tower_meta") or {})
    data = _training_data(run_dir, facts.get("tower_dir"))
    datasets = list(dict.fromkeys(hub_id for path in data
                                  for pattern, hub_id in KNOWN_DATASETS.items()
                                  if pattern.search(path)))
    return {"library_name": "lit-softmoe", "license": LICENSE,
            # An image tower alone has no text side: it gives features, not zero-shot classes.
            "pipeline_tag": ("zero-shot-image-classification" if pair
                             else "image-feature-extraction"),
            "tags": tags, **({"base_model": base} if base else {}),
            **({"datasets": datasets} if datasets else {})}


def front_matter_text(meta: dict) -> str:
    """`---`-fenced YAML; every value written as JSON (a subset of YAML), so no string needs quoting
    rules."""
    lines = []
    for key, value in meta.items():
        lines += ([f"{key}:", *[f"- {json.dumps(item)}" for item in value]]
                  if isinstance(value, list) else [f"{key}: {json.dumps(value)}"])
    return "\n".join(["---", *lines, "---", ""])


def read_front_matter(card: str) -> dict | None:
    """A model card's front matter as a dict; None when it has none (or it holds no mapping),
    ValueError when it is not YAML (a hand edit gone wrong)."""
    import yaml
    match = re.match(r"---\n(.*?\n)---\n", card, re.DOTALL)
    if match is None:
        return None
    try:
        loaded = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        raise ValueError(f"its front matter is not YAML ({' '.join(str(err).split())})") from None
    return loaded if isinstance(loaded, dict) else None


def card_facts(config: dict, model: LiTModel | None, tower: VisionTransformer, facts: dict,
               run_dir: Path | None, results: dict) -> dict:
    """What a card says, as JSON (the export keeps it in config.json's "card"): `push` renders the
    Hub's card from it with no run folder at hand. Local paths are kept here and left out by
    `render_body(hub=True)`."""
    pretrain = facts["tower_meta"].get("pretrain") or {}
    timm_tower = is_timm_tower_config(config["image_tower"])
    card = {"front_matter": front_matter(config, facts, run_dir),
            "tower": {"params": sum(p.numel() for p in tower.parameters()),
                      "name": (facts["tower_meta"].get("source") if timm_tower
                               else pretrain.get("tower"))},
            "pretrain": {k: pretrain[k] for k in ("config", "steps", "train_seconds", "test_top1")
                         if k in pretrain}}
    pre_run = read_run_config(run_dir) if run_dir is not None and model is None else {}
    if pre_run.get("data"):
        card["pretrain_data"] = {"train": pre_run["data"].get("train"),
                                 "test": pre_run["data"].get("test")}
    if model is None:
        return card
    card["text_params"] = sum(p.numel() for p in model.text_tower.parameters())
    if run_dir is not None:
        run = read_run_config(run_dir)
        data, evaluation = run.get("data") or {}, run.get("eval") or {}
        card["lit_data"] = {"train": data.get("train"), "eval": evaluation.get("shards"),
                            "cached": bool(results.get("cached_features"))}
    card["lit"] = {"steps": results.get("steps", facts.get("step")),
                   "train_seconds": results.get("train_seconds")}
    checkpoint = Path(facts["checkpoint"]) if facts.get("checkpoint") else None
    latest = _latest_eval(run_dir, checkpoint)
    if latest is not None:
        file, report = latest
        card["evaluation"] = {"file": file.name, "suite": report.get("suite"),
                              "model": report.get("model"), "rows": report["results"]}
    else:
        card["evaluation"] = {"scores": {k: v for k, v in results.items()
                                         if k.startswith(("zeroshot_", "linear_probe_top1"))}}
    return card


def _shown(path, hub: bool, datasets: list[str]) -> str:
    """A data path as the card shows it: as written locally; on the Hub, the dataset's Hub id where
    it is a known one, else no path (it means nothing there, and tells who trained it where)."""
    if not hub:
        return f"`{path}`"
    if str(path) == "a local dataset" or str(path).startswith("["):
        # shown already (a Hub copy's config.json)
        return str(path)
    known = [hub_id for pattern, hub_id in KNOWN_DATASETS.items() if pattern.search(str(path))]
    return (f"[{known[0]}](https://huggingface.co/datasets/{known[0]})" if known
            else "a local dataset")


def render_body(config: dict, card: dict, location: str, hub: bool = False) -> str:
    """The card's body from `config` and its `card` facts; its snippets load `location` (the export
    folder, or `hf-hub:ORG/NAME`). `hub`: the card for the Hub: no local path (data, configs,
    checkpoints, eval reports), an install line, intended use and limits."""
    pair = config["kind"] == "pair"
    timm_tower = is_timm_tower_config(config["image_tower"])
    datasets = card["front_matter"].get("datasets", [])
    name = card["tower"]["name"]
    if hub and name and "?" in name:  # timm:NAME?file=PATH: a local file
        name = name.split("?")[0] + ", from a local checkpoint"
    title = "LiT image–text pair" if pair else "Soft MoE image tower"
    lines = [f"# {title} exported by lit-softmoe {config['lit_softmoe_version']}", "",
             f"Weights in {config['dtype']} safetensors; `image_tower_sha256` "
             f"{config['image_tower_sha256']}.", "",
             "## Towers", "",
             "- Image (locked): "
             f"{_tower_line(config['image_tower'], card['tower']['params'], name)}"]
    if pair:
        text = config["text"]
        encoder = hub_text_path(text["path"]) if hub and text["kind"] == "hf" else text.get("path")
        shape = (f"open_clip text transformer, width {text['width']}, {text['layers']} layers, "
                 f"{text['heads']} heads"
                 if text["kind"] == "transformer"
                 else f"Hugging Face encoder {encoder} ({text['pooling']} pooling)")
        state = "trained"
        if text.get("locked"):
            unlocked = text.get("unlocked_layers")
            state = f"locked but its last {unlocked} layer(s), trained" if unlocked else "locked"
        own = not hub or text["kind"] == "transformer"  # a hub encoder's tokenizer is its own
        tokenizer_name = config["tokenizer"]["spec"] if own else "its own"
        lines += [f"- Text ({state}): {shape}, context {text['context_length']} tokens, tokenizer "
                  f"`{tokenizer_name}`; "
                  f"{card['text_params'] / 1e6:.2f}M parameters",
                  f"- Embedding width {config['embed_dim']}, {config['loss']} loss, temperature "
                  f"{config['temperature']:.3f}"
                  + (f", bias {config['logit_bias']:.3f}" if config.get("logit_bias") is not None
                     else "")
                  + (", image head" if config["image_head"] else "")]
    lines += ["", "## Training", ""]
    pretrain = card.get("pretrain") or {}
    if pretrain:
        recipe = str(pretrain.get("config", "?"))
        recipe = Path(recipe).name if hub else recipe
        lines.append(f"- Image tower: pretrained by `lit-softmoe pretrain` ({recipe}), "
                     f"{pretrain.get('steps', '?')} steps in {pretrain.get('train_seconds', '?')} s"
                     + (f", test top-1 {percent(pretrain['test_top1'])}%"
                        if "test_top1" in pretrain else ""))
    if card.get("pretrain_data"):
        data = card["pretrain_data"]
        lines.append(f"- Pretraining data: train {_shown(data['train'], hub, datasets)}, "
                     f"test {_shown(data['test'], hub, datasets)}")
    if card.get("lit_data"):
        data = card["lit_data"]
        cached = " (cached image features)" if data["cached"] else ""
        lines.append(f"- LiT data: {_shown(data['train'], hub, datasets)}{cached}, "
                     f"eval {_shown(data['eval'], hub, datasets)}")
    if pair:
        lit = card["lit"]
        lines.append(f"- LiT: {lit['steps'] if lit['steps'] is not None else '?'} steps in "
                     f"{lit['train_seconds'] if lit['train_seconds'] is not None else '?'} s")
        lines += ["", "## Zero-shot", "", *_zeroshot_section(card["evaluation"], hub)]
    if hub:
        lines += ["", "## Install", "",
                  f"`pip install lit-softmoe=={config['lit_softmoe_version']}` (or "
                  "`pip install .` in a checkout of its source): `load_pretrained` below needs it"
                  + ("; open_clip alone loads this pair (below)." if timm_tower and "config" in
                     (config.get("open_clip") or {}) else ".")]
    loader = "load_pretrained" if pair else "load_image_tower"
    lines += ["", "## Use", "", "```python", f"from lit_softmoe import {loader}",
              "", (f"model, preprocess, tokenizer = load_pretrained(\"{location}\")" if pair else
                   f"tower, preprocess = load_image_tower(\"{location}\")"),
              ("image = model.encode_image(preprocess(pil_image)[None])  # (1, D), normalized"
               if pair else
               "features = tower.forward_pooled(preprocess(pil_image)[None])  # (1, width)")]
    if pair:
        lines.append("text = model.encode_text(tokenizer([\"a photo of a cat\"]))  "
                     "# (1, D), normalized")
    lines += ["```", ""]
    if "onnx" in config:
        lines += ["Without torch: onnxruntime + numpy + PIL (+ `tokenizers` for the text) — see "
                  "`scripts/onnx_example.py` in lit-softmoe." if pair else
                  "Without torch: `image_encoder.onnx` (pixels → image_features) with onnxruntime.",
                  ""]
    open_clip = config.get("open_clip") or {}
    where = location if location.startswith("hf-hub:") else f"local-dir:{location}"
    if "config" in open_clip and timm_tower:
        lines += ["With open_clip (`open_clip_config.json` + `open_clip_model.safetensors`; the "
                  "image tower is timm's own model, so no lit-softmoe import is needed):", "",
                  "```python", "import open_clip",
                  f"model, _, preprocess = open_clip.create_model_and_transforms(\"{where}\")",
                  f"tokenizer = open_clip.get_tokenizer(\"{where}\")", "```", ""]
    elif "config" in open_clip:
        lines += ["With open_clip (`open_clip_config.json` + `open_clip_model.safetensors`; timm "
                  "builds the image tower once lit-softmoe registered it: without that import it "
                  "ends in timm's `RuntimeError: Unknown model`):", "", "```python",
                  "import open_clip, lit_softmoe.integrations.timm",
                  f"model, _, preprocess = open_clip.create_model_and_transforms(\"{where}\")",
                  f"tokenizer = open_clip.get_tokenizer(\"{where}\")", "```", ""]
    elif pair and open_clip.get("skipped"):
        lines += [f"Not loadable with open_clip: {open_clip['skipped']}.", ""]
    if hub:
        lines += ["## Intended use and limits", "",
                  ("Zero-shot image classification and image–text retrieval by embedding "
                   "similarity, and image features for probes, in the domain of its training data "
                   "(above): a LiT pair knows the concepts its captions named, and its image "
                   "tower is locked, so it sees what its pretraining taught it. Scores outside "
                   "that domain are untested; check them on your data before relying on them."
                   if pair else
                   "Image features (pooled, before any classifier) for probes, retrieval or a LiT "
                   "text tower, in the domain of its pretraining data (above). Untested "
                   "elsewhere; check it on your data first."), ""]
    return "\n".join(lines)


def hub_text_path(path: str) -> str:
    """A Hugging Face text model as a Hub page names it: a Hub id as it is, a folder of this machine
    by its name."""
    local = Path(path).expanduser()
    return local.name if local.is_absolute() or local.exists() else path


def hub_card_facts(card: dict) -> dict:
    """`card` as config.json holds it on the Hub: no path of the machine the export was made on
    (data folders as the Hub card shows them, the pretraining config by file name, a local
    checkpoint unnamed, no eval report's folders)."""
    hub = copy.deepcopy(card)
    datasets = hub["front_matter"].get("datasets", [])
    for key in ("pretrain_data", "lit_data"):
        for split, path in (hub.get(key) or {}).items():
            if split != "cached" and path is not None:
                hub[key][split] = _shown(path, True, datasets)
    if (hub.get("pretrain") or {}).get("config"):
        hub["pretrain"]["config"] = Path(str(hub["pretrain"]["config"])).name
    name = (hub.get("tower") or {}).get("name")
    if name and "?" in name:
        hub["tower"]["name"] = name.split("?")[0]
    evaluation = hub.get("evaluation") or {}
    evaluation.pop("model", None)
    for row in evaluation.get("rows") or []:
        for key in ("reason", "path"):
            row.pop(key, None)
    return hub


_TASK_TYPES = {"zeroshot_classification": "zero-shot-image-classification", "classification":
               "zero-shot-image-classification", "zeroshot_retrieval": "image-text-retrieval",
               "retrieval": "image-text-retrieval"}


def _eval_results(card: dict, datasets: list[str]) -> list:
    """huggingface_hub EvalResults (the Hub's `model-index`) of the card's zero-shot table, in %."""
    from huggingface_hub import EvalResult

    evaluation = card.get("evaluation") or {}
    results = []
    for row in evaluation.get("rows") or []:
        if row.get("status") != "ok":
            continue
        for metric, value in (row.get("metrics") or {}).items():
            results.append(EvalResult(task_type=_TASK_TYPES.get(row.get("task"),
                                                                 "zero-shot-image-classification"),
                                      dataset_type=str(row["benchmark"]),
                                      dataset_name=str(row["benchmark"]), metric_type=metric,
                                      metric_name=metric, metric_value=round(100 * value, 2)))
    eval_set = datasets[0] if len(datasets) == 1 else "the LiT run's eval set"
    for metric, value in (evaluation.get("scores") or {}).items():
        results.append(EvalResult(task_type="zero-shot-image-classification", dataset_type=eval_set,
                                  dataset_name=eval_set, metric_type=metric, metric_name=metric,
                                  metric_value=round(100 * value, 2)))
    return results


def hub_card(config: dict, repo_id: str) -> str:
    """The card `push` uploads as README.md, rendered from the export's config.json alone: snippets
    on `hf-hub:REPO_ID`, no local path, the zero-shot results as `model-index` (huggingface_hub's
    `ModelCardData` and `EvalResult`), `base_model` for a timm checkpoint's tower, an install line,
    intended use and limits. A pair whose image tower is timm's own is an open_clip model to the Hub
    (`library_name: open_clip`: its "Use this model" snippet works without lit-softmoe); ours are
    lit-softmoe's."""
    from huggingface_hub import ModelCard, ModelCardData

    card = config.get("card")
    if not isinstance(card, dict) or "front_matter" not in card:
        raise ValueError("its config.json has no \"card\" (what the model card says)")
    front = dict(card["front_matter"])
    stock_open_clip = (is_timm_tower_config(config["image_tower"])
                       and "config" in (config.get("open_clip") or {}))
    if stock_open_clip:
        front["library_name"] = "open_clip"
    known = {key: front.pop(key) for key in ("library_name", "license", "pipeline_tag", "tags",
                                             "base_model", "datasets") if key in front}
    results = _eval_results(card, known.get("datasets", []))
    data = ModelCardData(**known, model_name=repo_id, eval_results=results or None, **front)
    body = render_body(config, card, f"hf-hub:{repo_id}", hub=True)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
