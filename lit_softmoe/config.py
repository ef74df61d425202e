"""Typed configs: dataclasses hold every default, YAML files override them, `key=value` overrides win.

OmegaConf does the merging and type checking (a structured config rejects unknown keys and values
of the wrong type); this module only turns its errors into one line that names the fix.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTowerConfig
from lit_softmoe.utils.device import COMPILE_CHOICES, PRECISIONS

T = TypeVar("T")
SHARDINGS = ("none", "fsdp")


# A field's constraint sits beside it, in its metadata; `load_config` checks every field that has one.
def choice(default: str, choices: tuple[str, ...]):
    """A str field whose value must be one of `choices`."""
    return field(default=default, metadata={"choices": choices})


def number(default: float, minimum: float, maximum: float | None = None):
    """A number field whose value must be at least `minimum` (and at most `maximum`): the numbers that a
    value out of range would break (a zero period divides by zero mid-run)."""
    bounds = {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}
    return field(default=default, metadata=bounds)


def pair(default: list, minimum: float, maximum: float, ordered: bool = False, optional: bool = False):
    """A list field of two numbers, each in [`minimum`, `maximum`] (the first at most the second where
    `ordered`); `optional`: [] too (the feature off)."""
    rule = {"pair": (minimum, maximum), "ordered": ordered, "optional": optional}
    return field(default_factory=lambda: list(default), metadata=rule)


@dataclass
class TowerConfig:
    name: str = "soft-tiny-p4-16e"  # a registered name: `lit-softmoe models` lists them
    options: dict[str, Any] = field(default_factory=dict)  # tower options over the registry's, e.g. {num_experts: 32}


@dataclass
class ClassDataConfig:
    train: str = "data/fashion-mnist/train"  # a split folder of class shards (image + .cls)
    test: str = "data/fashion-mnist/test"
    augment: bool = False  # random crop with padding + horizontal flip, per batch (pays only in long runs)
    crop_padding: int = number(2, minimum=0)
    max_train_samples: int = number(0, minimum=0)  # 0: all; > 0 keeps the first N (quick runs)
    max_test_samples: int = number(0, minimum=0)
    # More skipped (corrupt, incomplete) samples than this fraction stops the run.
    max_bad_fraction: float = number(0.01, minimum=0, maximum=1)
    # How embed, LiT on the fly, eval and the exported preprocess decode JPEGs for this tower (recorded in
    # its preprocess): reduced (at a DCT scale keeping the shorter side ≥ 2× the tower's) | full.
    decode: str = choice("reduced", ("full", "reduced"))
    # memory: decode the split once and keep it (small sets of one image size: Fashion-MNIST) | stream: read
    # the shards through loader workers every epoch (any size, flat memory) | auto: memory when the train
    # split's shards total at most 256 MB and its images have the tower's size, else stream.
    loader: str = choice("auto", ("auto", "memory", "stream"))
    workers: int = number(2, minimum=0)  # stream: loader worker processes per training process
    shuffle_buffer: int = number(5000, minimum=0)  # stream: samples (still encoded) in the shuffle buffer
    # With augment: pad (a random crop of the image padded by crop_padding; memory or stream) | random_resized
    # (the Inception crop of the ViT recipes: an area fraction in crop_scale, aspect 3/4-4/3; stream only).
    crop: str = choice("pad", ("pad", "random_resized"))
    # An area fraction: 0 would be a crop of no pixels (torchvision takes its log).
    crop_scale: list[float] = pair([0.08, 1.0], 1e-6, 1.0, ordered=True)
    # stream, with augment: [num_ops, magnitude], e.g. [2, 15]; torchvision's magnitudes run 0-30 (31 bins).
    randaugment: list[int] = pair([], 0, 30, optional=True)
    # Alpha of mixup's Beta(alpha, alpha) mixing ratio, per batch (big_vision: 0.5); 0: off.
    mixup: float = number(0.0, minimum=0)
    # Per-channel input normalization; []: the mean and std of the first 10,000 training images.
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)


@dataclass
class OptimConfig:
    lr: float = number(1e-3, minimum=0)
    weight_decay: float = number(0.05, minimum=0)  # decoupled (AdamW); not on biases, norms, position embeddings, phi
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = number(1.0, minimum=0)  # max global gradient norm; 0 disables
    # cosine | rsqrt (the paper's: rsqrt decay + linear cooldown) | constant
    schedule: str = choice("cosine", ("cosine", "rsqrt", "constant"))
    # Linear warmup: below 1, a fraction of the run (0.05: its first 5%); 1 or more, a number of steps.
    warmup: float = number(200, minimum=0)
    cooldown_steps: int = number(0, minimum=0)  # rsqrt only: linear decay to 0 over the last N steps
    # Layer-wise lr decay (timm's param_groups_layer_decay, from BEiT): a tower's head or projection trains at lr,
    # its block i of L (the last with the final norm) at lr × layer_decay ** (L - i), its embeddings at
    # lr × layer_decay ** (L + 1); LiT's two towers each counted on their own. 1: off; 0 is refused.
    layer_decay: float = number(1.0, minimum=0, maximum=1)


@dataclass
class TrainingRunConfig:
    """The keys both training recipes (`PretrainConfig`, `LiTConfig`) take with the same meaning and
    default; `train.loop` reads them. Each recipe's own keys follow these in its config.yaml."""
    run_dir: str = "runs"  # each recipe names its own default folder
    epochs: float = number(1.0, minimum=0)  # training length; `steps` wins when > 0
    steps: int = number(0, minimum=0)
    # auto (bf16 on GPUs that have it, else fp32) | fp32 | bf16 | fp16 (GPUs without bf16)
    precision: str = choice("auto", PRECISIONS)
    # Memory levers; `lit-softmoe pretrain --plan` / `train --plan` say which a run needs. sharding: none
    # (every process holds the whole trained model, its gradients and AdamW's moments: DDP) | fsdp (each
    # holds 1/N of them).
    sharding: str = choice("none", SHARDINGS)
    grad_checkpointing: bool = False  # keep each block's input only; backward recomputes the block's activations
    # Micro-batches per step: batch_size / processes / accum_steps samples per forward.
    accum_steps: int = number(1, minimum=1)
    seed: int = 0
    # Experiment trackers (accelerate's) that get each record of metrics.jsonl too: tensorboard (in
    # RUN/tensorboard), wandb, mlflow, aim, comet_ml, clearml, dvclive, swanlab, trackio; [] for none.
    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])
    log_project: str = "lit-softmoe"  # the project (wandb, comet_ml, ...) or experiment (mlflow) of the runs
    checkpoint_every: int = number(500, minimum=1)
    keep_checkpoints: int = number(2, minimum=0)
    threads: int = number(0, minimum=0)  # CPU threads for torch; 0: torch's default


@dataclass
class PretrainConfig(TrainingRunConfig):
    run_dir: str = "runs/pretrain"
    tower: TowerConfig = field(default_factory=TowerConfig)
    # A tower folder (from `upcycle`, `convert` or a pretraining run) whose weights a fresh run starts
    # from; its architecture must be `tower`'s. "": start from a random init.
    init_from: str = ""
    data: ClassDataConfig = field(default_factory=ClassDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: str = choice("softmax", ("softmax", "sigmoid"))  # softmax | sigmoid (cross-entropy)
    label_smoothing: float = 0.0  # softmax loss only
    aux_loss_weight: float = 0.005  # × the sparse MoE layers' importance + load losses (V-MoE's 0.005 each)
    batch_size: int = number(128, minimum=1)  # global batch, split over processes
    # torch.compile the tower: auto (on GPUs, where its fused kernels pay) | true | false
    compile: str = choice("auto", COMPILE_CHOICES)
    log_every: int = number(50, minimum=1)
    eval_every: int = number(0, minimum=0)  # steps between test evaluations during training; 0: only at the end
    fewshot_shots: int = number(10, minimum=0)  # k of the k-shot linear probe (closed-form ridge regression)
    eval_batch_size: int = number(512, minimum=1)


def _all_keys(node, prefix="") -> list[str]:
    keys = []
    # Unresolved: an interpolation that does not resolve (an unset ${oc.env:VAR}) is not a key's
    # problem here, and is reported in one line when the config is built.
    items = node.items_ex(resolve=False) if OmegaConf.is_dict(node) else node.items()
    for key, value in items:
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if OmegaConf.is_dict(value):
            keys.extend(_all_keys(value, dotted + "."))
    return keys


def _field_names(schema: type) -> set[str]:
    """Field names of a dataclass and of every dataclass inside it, list items included."""
    import dataclasses
    import typing
    names = set()
    for name, hint in typing.get_type_hints(schema).items():
        names.add(name)
        for inner in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(inner):
                names |= _field_names(inner)
    return names


def _suggest(bad_key: str, schema, schema_type: type | None = None) -> str:
    close = difflib.get_close_matches(bad_key, _all_keys(schema), n=1, cutoff=0.5)
    if not close and schema_type is not None:  # e.g. a key inside a list item (eval suites' benchmarks)
        close = difflib.get_close_matches(bad_key.rsplit(".", 1)[-1], sorted(_field_names(schema_type)), n=1,
                                          cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _constraints(schema: type, prefix: str = ""):
    """(list key, dotted key, metadata) of each field of `schema` that declares a constraint (`choice`,
    `number`), nested config dataclasses included. The list key is None but for the fields of a list's
    items (eval suites' benchmarks): then it names the list and the key is the item's field."""
    import dataclasses
    import typing
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        hint, key = hints[spec.name], f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(hint):
            yield from _constraints(hint, key + ".")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(item := typing.get_args(hint)[0]):
            yield from ((key, item_key, rule) for _, item_key, rule in _constraints(item))
        elif spec.metadata:
            yield None, key, spec.metadata


def _check_pair(key: str, value, rule: dict) -> None:
    """A `pair` field's value, or a UserError naming the key and what it takes."""
    if value is None or (rule["optional"] and len(value) == 0):
        return
    low, high = rule["pair"]
    takes = (f"two numbers in [{low:g}, {high:g}]" + (", the first at most the second" if rule["ordered"] else "")
             + (", or [] for none" if rule["optional"] else ""))
    if len(value) != 2 or not all(low <= v <= high for v in value) or (rule["ordered"] and value[0] > value[1]):
        raise UserError(f"config key {key!r} is {list(value)}; it takes {takes}")


def _select(node, key: str):
    """The value at dotted `key`, or None; an interpolation that does not resolve (an unset
    ${oc.env:VAR}) is None here and reported when the config is built."""
    try:
        return OmegaConf.select(node, key, default=None)
    except OmegaConfBaseException:
        return None


# Shipped configs and suites: package data, so `pip install` users have them too. The top-level
# configs/ and eval/ folders of a source checkout point here.
SHIPPED_CONFIGS = Path(__file__).parent / "configs"


def _shipped_folder(schema: type) -> str:
    return {"PretrainConfig": "pretrain", "LiTConfig": "lit", "EvalSuiteConfig": "suites"}.get(schema.__name__, "")


def shipped_configs(schema: type) -> list[str]:
    """The short names of the shipped configs for `schema` (suites by their bare name, e.g. "fashion-mnist")."""
    folder = _shipped_folder(schema)
    if folder == "suites":
        return sorted(path.stem for path in (SHIPPED_CONFIGS / folder).glob("*.yaml"))
    return sorted(f"{folder}/{path.stem}" for path in (SHIPPED_CONFIGS / folder).glob("*.yaml"))


def config_path(schema: type, name: str | Path) -> Path:
    """The YAML file `name` names: a file that exists, else a shipped one by its short name
    (`pretrain/fmnist-soft-tiny`, `fmnist-soft-tiny` for a pretraining config, `fashion-mnist` for a
    suite) or by its path in a source checkout (`configs/pretrain/fmnist-soft-tiny.yaml`, `eval/fashion-mnist.yaml`)."""
    path = Path(name)
    if path.is_file():
        return path
    parts = list(path.with_suffix("").parts if path.suffix in (".yaml", ".yml") else path.parts)
    if parts[:1] == ["configs"]:  # a source checkout's path, read where the package keeps it
        parts = parts[1:]
    elif parts[:1] == ["eval"]:
        parts = ["suites", *parts[1:]]
    folder = _shipped_folder(schema)
    for candidate in (SHIPPED_CONFIGS.joinpath(*parts), SHIPPED_CONFIGS.joinpath(folder, *parts)):
        if parts and candidate.with_suffix(".yaml").is_file():
            return candidate.with_suffix(".yaml")
    what = "suite" if folder == "suites" else "config file"
    if path.is_dir():
        raise UserError(f"{what} {name} is a folder; give a YAML file in it, or a shipped one: "
                        f"{', '.join(shipped_configs(schema))}")
    raise UserError(f"{what} {name} does not exist; give a YAML file or a shipped one: "
                    f"{', '.join(shipped_configs(schema))}")


ALLOW_PIPE_ENV = "LIT_SOFTMOE_ALLOW_PIPE"


def _is_command(value) -> bool:
    """A shard spec that runs a shell command: `pipe:CMD`, alone or in a `::` list."""
    return isinstance(value, str) and any(part.strip().startswith("pipe:") for part in value.split("::"))


def _refuse_commands_from_file(file_layer, command_line, path: Path) -> None:
    """A config file is data, loaded without running anything of it, except that a `pipe:` shard spec
    in it would be run as a shell command: a config from someone else would be code. Such a value is
    refused unless the user says so (LIT_SOFTMOE_ALLOW_PIPE=1), or gives it on the command line."""
    if os.environ.get(ALLOW_PIPE_ENV) == "1":
        return
    for key in _all_keys(file_layer):
        value = _select(file_layer, key)
        if _is_command(value) and _select(command_line, key) is None:
            raise UserError(f"{path} sets {key} to a shell command ({value[:60]!r}); a config file must not run "
                            f"commands unasked: set {ALLOW_PIPE_ENV}=1 if you trust it, or pass {key}=... on the "
                            "command line")


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] = (),
                commands_from_file: bool = False) -> T:
    """Merge `schema`'s defaults, the YAML file at `path` and dotted `key=value` overrides.

    `path` is a file, or the short name of a shipped one (`config_path`). Every mistake (missing
    file, unknown key, wrong type, a value outside its choices) raises UserError with one line naming
    the key and the fix. A `pipe:` shard spec runs a shell command: one that comes from the file is
    refused unless `commands_from_file` or LIT_SOFTMOE_ALLOW_PIPE=1 (see `_refuse_commands_from_file`).
    """
    base = OmegaConf.structured(schema)
    layers = []  # (layer, where it came from), merged in this order
    if path is not None:
        path = config_path(schema, path)
        try:
            # The top level as YAML reads it: omegaconf reads a bare string as a key and refuses a number.
            with open(path, encoding="utf-8") as stream:  # yaml's marks then name the file
                top = yaml.safe_load(stream)
            if top is not None and not isinstance(top, dict):
                raise UserError(f"{path} holds {'a list' if isinstance(top, list) else 'a single value'}, not a "
                                "mapping of config keys; write `key: value` lines (e.g. `batch_size: 256`)")
            layers.append((OmegaConf.load(path), f" in {path}"))
        except UserError:
            raise
        except Exception as err:  # yaml's errors carry line numbers; keep them on one line
            raise UserError(f"cannot parse {path}: {' '.join(str(err).split())}") from None
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
    # `key=` means the empty string (a shell eats the quotes of `key=''`); OmegaConf would read None.
    command_line = OmegaConf.from_dotlist([item + "''" if item.endswith("=") else item for item in overrides])
    layers.append((command_line, " on the command line"))
    if path is not None and not commands_from_file:
        _refuse_commands_from_file(layers[0][0], command_line, path)
    merged = base
    for layer, where in layers:  # one at a time, so a mistake is told where it was made
        try:
            merged = OmegaConf.merge(merged, layer)
        except ConfigKeyError as err:
            key = getattr(err, "full_key", None) or str(err)
            raise UserError(f"unknown config key {key!r}{where}{_suggest(str(key), base, schema)}") from None
        except (ValidationError, OmegaConfBaseException) as err:
            key = getattr(err, "full_key", "?")
            msg = str(err).splitlines()[0]
            if "is not a ListConfig" in msg:  # omegaconf's words for a single value given to a list key
                msg = f"a list is needed: write it in brackets ({key}='[…]' on a shell's command line)"
            raise UserError(f"bad value for config key {key!r}{where}: {msg}") from None
    if isinstance(_select(merged, "compile"), str):  # YAML's true/false reach a str field as "True"/"False"
        merged.compile = merged.compile.lower()
    rules = list(_constraints(schema))  # the constraints declared beside the fields (`choice`, `number`)
    constraints = [(key, rule) for list_key, key, rule in rules if list_key is None]
    for key, rule in constraints:
        value, choices = _select(merged, key), rule.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise UserError(f"config key {key!r} is {value!r}; choose one of {', '.join(choices)}")
    for key in _all_keys(merged):
        value = _select(merged, key)
        # nan compares false with everything: `epochs=nan` passed every check below, and a
        # `max_bad_fraction=nan` switched the limit off.
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"config key {key!r} is {value}; give a finite number")
    for key, rule in constraints:
        value, minimum = _select(merged, key), rule.get("minimum")
        if minimum is not None and value is not None and value < minimum:
            raise UserError(f"config key {key!r} is {value}; it must be at least {minimum}: set {key}={minimum} "
                            "or more")
    accum_steps, batch_size = _select(merged, "accum_steps"), _select(merged, "batch_size")
    if isinstance(accum_steps, int) and isinstance(batch_size, int) and batch_size % accum_steps:
        raise UserError(f"config key 'accum_steps' is {accum_steps}, which does not divide batch_size {batch_size}; "
                        "choose a divisor of the batch (of each process's share of it, under a launcher)")
    for key, rule in constraints:
        value, maximum = _select(merged, key), rule.get("maximum")
        if maximum is not None and value is not None and value > maximum:
            raise UserError(f"config key {key!r} is {value}; it must be at most {maximum}: set {key}={maximum} "
                            "or less")
    for key, rule in constraints:
        if "pair" in rule:
            _check_pair(key, _select(merged, key), rule)
    for list_key, item_key, rule in rules:
        if list_key is None or "choices" not in rule:
            continue
        choices = rule["choices"]
        for i, item in enumerate(OmegaConf.select(merged, list_key, default=None) or []):
            if OmegaConf.is_dict(item) and item_key in item and item[item_key] not in choices:
                raise UserError(f"config key '{list_key}[{i}].{item_key}' is {item[item_key]!r}; "
                                f"choose one of {', '.join(repr(c) for c in choices)}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # e.g. ${oc.env:VAR} with VAR unset and no default
        raise UserError(f"cannot resolve config{f' {path}' if path else ''}: {str(err).splitlines()[0]}") from None


def micro_batch_size(batch_size: int, processes: int, accum_steps: int = 1) -> int:
    """Samples per forward: the global `batch_size` split over `processes`, each share into `accum_steps`
    micro-batches. A split that does not come out even is one UserError line naming the keys."""
    if batch_size % processes:
        raise UserError(f"batch_size {batch_size} does not split over {processes} processes; give a multiple of "
                        f"{processes}")
    local = batch_size // processes
    if local % accum_steps:
        raise UserError(f"accum_steps {accum_steps} does not divide the {local} samples of each of {processes} "
                        f"processes (batch_size {batch_size}); choose a divisor of {local}")
    return local // accum_steps


def to_yaml(config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ---- LiT: a text tower trained against a locked image tower -------------------------------------

@dataclass
class LiTDataConfig:
    # Image + caption shards, or the feature shards `lit-softmoe embed` wrote from them (detected by
    # the embed.json beside the split): then the locked tower never runs during training.
    train: str = "data/fmnist-features/train"
    workers: int = number(1, minimum=0)  # DataLoader workers per process
    shuffle_buffer: int = number(5000, minimum=0)
    max_bad_fraction: float = number(0.01, minimum=0, maximum=1)
    # Draw shards with replacement (open_clip's --dataset-resampled): every process and worker reads
    # an endless stream, so few shards can feed many processes; an epoch is sizes.json's sample count.
    resampled: bool = False
    # Samples per epoch (all processes together); 0: the sum of sizes.json beside the shards. Shards
    # without one (`pipe:`, `https://`, img2dataset's output) need it.
    samples_per_epoch: int = number(0, minimum=0)


@dataclass
class ZeroShotEvalConfig:
    shards: str = "data/fmnist-features/test"  # class shards (image or features + .cls); "" disables
    classnames: str = ""  # default: classnames.txt beside the split
    templates: str = ""  # default: zeroshot_classification_templates.txt beside the split
    every: int = number(0, minimum=0)  # steps between evaluations during training; 0: only at the end
    probe_train: str = ""  # class shards or features of a train split: report the linear-probe ceiling


@dataclass
class LiTConfig(TrainingRunConfig):
    run_dir: str = "runs/lit"
    image_tower: str = "runs/fmnist-soft-tiny/tower"  # a tower folder from `lit-softmoe pretrain`
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    loss: str = choice("softmax", ("softmax", "sigmoid"))  # softmax (CLIP contrastive) | sigmoid (SigLIP)
    temperature_init: float = 10.0  # LiT's logit scale at init
    image_head: bool = False  # an unlocked linear head on the locked features (LiT finds none best)
    unlocked_blocks: int = 0  # unlock the tower's last N blocks (ablations; needs image shards)
    # torch.compile the text tower (and the image tower's forward when it runs): auto (on GPUs) | true | false
    compile: str = choice("auto", COMPILE_CHOICES)
    data: LiTDataConfig = field(default_factory=LiTDataConfig)
    eval: ZeroShotEvalConfig = field(default_factory=ZeroShotEvalConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=1e-4, warmup=100))
    batch_size: int = number(256, minimum=1)  # global
    log_every: int = number(20, minimum=1)


# ---- zero-shot evaluation suites (eval/*.yaml) --------------------------------------------------

@dataclass
class BenchmarkConfig:
    name: str = ""  # a shipped benchmark (class names + templates), e.g. cifar100, or your own with its files
    root: str = ""  # the data folder; YAML may use ${oc.env:VAR,default}
    split: str = "test"
    format: str = choice("auto", ("auto", "wds", "imagefolder", "cifar", "torchvision", "karpathy"))
    task: str = choice("", ("", "classification", "retrieval"))  # "": the benchmark's (or the data's)
    classnames: str = ""  # a file with one class name per line, over the data's and the shipped ones
    templates: str = ""  # a file with one {c} template per line, or another benchmark's name (e.g. imagenet1k)
    annotations: str = ""  # karpathy: the split JSON (default: dataset_{coco,flickr30k}.json in root)


@dataclass
class EvalSuiteConfig:
    name: str = "suite"
    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    batch_size: int = number(256, minimum=1)  # images per tower forward
    text_batch_size: int = number(1024, minimum=1)  # prompts or captions per text-tower forward
    workers: int = number(2, minimum=0)  # image-decoding worker processes
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10])
    # auto (bf16 autocast on CUDA, fp32 on CPU; fp32 with --peer) | fp32 | bf16 | fp16
    precision: str = choice("auto", PRECISIONS)
    # The image-feature cache (keyed by tower + data); "": $LIT_SOFTMOE_CACHE/eval or ~/.cache/lit_softmoe/eval.
    cache_dir: str = ""
