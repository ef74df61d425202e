"""Typed configs: dataclasses hold every default, YAML files override them,
`key=value` overrides win.

`lit_softmoe.config_loading.load_config` loads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from lit_softmoe.errors import UserError
from lit_softmoe.models.text import TextTowerConfig
from lit_softmoe.utils.device import COMPILE_CHOICES, PRECISIONS

SHARDINGS = ("none", "fsdp")


# A field's constraint sits beside it, in its metadata; `load_config` checks every
# field that has one.
def choice(default: str, choices: tuple[str, ...]):
    """A str field whose value must be one of `choices`."""
    return field(default=default, metadata={"choices": choices})


def number(default: float, minimum: float, maximum: float | None = None):
    """A number field whose value must be at least `minimum` (and at most `maximum`): the numbers
    that a value out of range would break (a zero period divides by zero mid-run)."""
    bounds = {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}
    return field(default=default, metadata=bounds)


def pair(default: list, minimum: float, maximum: float, ordered: bool = False,
         optional: bool = False):
    """A list field of two numbers, each in [`minimum`, `maximum`] (the first at most the second
    where `ordered`); `optional`: [] too (the feature off)."""
    rule = {"pair": (minimum, maximum), "ordered": ordered, "optional": optional}
    return field(default_factory=lambda: list(default), metadata=rule)


@dataclass
class TowerConfig:
    name: str = "soft-tiny-p4-16e"  # a registered name: `lit-softmoe models` lists them
    # tower options over the registry's, e.g. {num_experts: 32}
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClassDataConfig:
    train: str = "data/fashion-mnist/train"  # a split folder of class shards (image + .cls)
    test: str = "data/fashion-mnist/test"
    # random crop with padding + horizontal flip, per batch (pays only in long runs)
    augment: bool = False
    crop_padding: int = number(2, minimum=0)
    max_train_samples: int = number(0, minimum=0)  # 0: all; > 0 keeps the first N (quick runs)
    max_test_samples: int = number(0, minimum=0)
    # More skipped (corrupt, incomplete) samples than this fraction stops the run.
    max_bad_fraction: float = number(0.01, minimum=0, maximum=1)
    # How embed, LiT on the fly, eval and the exported preprocess decode JPEGs for this tower
    # (recorded in its preprocess): reduced (at a DCT scale keeping the shorter side ≥ 2×
    # the tower's) | full.
    decode: str = choice("reduced", ("full", "reduced"))
    # memory: decode the split once and keep it (small sets of one image size: Fashion-MNIST) |
    # stream: read the shards through loader workers every epoch (any size, flat memory) | auto:
    # memory when the train split's shards total at most 256 MB and its images have the tower's
    # size, else stream.
    loader: str = choice("auto", ("auto", "memory", "stream"))
    workers: int = number(2, minimum=0)  # stream: loader worker processes per training process
    # stream: samples (still encoded) in the shuffle buffer
    shuffle_buffer: int = number(5000, minimum=0)
    # With augment: pad (a random crop of the image padded by crop_padding; memory or stream) |
    # random_resized (the Inception crop of the ViT recipes: an area fraction in crop_scale, aspect
    # 3/4-4/3; stream only).
    crop: str = choice("pad", ("pad", "random_resized"))
    # An area fraction: 0 would be a crop of no pixels (torchvision takes its log).
    crop_scale: list[float] = pair([0.08, 1.0], 1e-6, 1.0, ordered=True)
    # stream, with augment: [num_ops, magnitude], e.g. [2, 15]; torchvision's magnitudes
    # run 0-30 (31 bins).
    randaugment: list[int] = pair([], 0, 30, optional=True)
    # Alpha of mixup's Beta(alpha, alpha) mixing ratio, per batch (big_vision: 0.5); 0: off.
    mixup: float = number(0.0, minimum=0)
    # Per-channel input normalization; []: the mean and std of the first 10,000 training images.
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)


@dataclass
class OptimConfig:
    lr: float = number(1e-3, minimum=0)
    # decoupled (AdamW); not on biases, norms, position embeddings, phi
    weight_decay: float = number(0.05, minimum=0)
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = number(1.0, minimum=0)  # max global gradient norm; 0 disables
    # cosine | rsqrt (the paper's: rsqrt decay + linear cooldown) | constant
    schedule: str = choice("cosine", ("cosine", "rsqrt", "constant"))
    # Linear warmup: below 1, a fraction of the run (0.05: its first 5%); 1 or more,
    # a number of steps.
    warmup: float = number(200, minimum=0)
    # rsqrt only: linear decay to 0 over the last N steps
    cooldown_steps: int = number(0, minimum=0)
    # Layer-wise lr decay (timm's param_groups_layer_decay, from BEiT): a tower's head or projection
    # trains at lr, its block i of L (the last with the final norm) at lr × layer_decay ** (L - i),
    # its embeddings at lr × layer_decay ** (L + 1); LiT's two towers each counted on their own.
    # 1: off; 0 is refused.
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
    # Memory levers; `lit-softmoe pretrain --plan` / `train --plan` say which a run needs. sharding:
    # none (every process holds the whole trained model, its gradients and AdamW's moments: DDP) |
    # fsdp (each holds 1/N of them).
    sharding: str = choice("none", SHARDINGS)
    # Expert parallelism: E processes (an expert group) split every Soft MoE layer's experts, n/E
    # each, and exchange the slots with all-to-alls (1: off). Needs sharding=fsdp, which shards the
    # other weights over every process and each expert chunk over the processes that hold it.
    expert_parallel: int = number(1, minimum=1)
    # keep each block's input only; backward recomputes the block's activations
    grad_checkpointing: bool = False
    # Micro-batches per step: batch_size / processes / accum_steps samples per forward.
    accum_steps: int = number(1, minimum=1)
    seed: int = 0
    # Experiment trackers (accelerate's) that get each record of metrics.jsonl too:
    # tensorboard (in RUN/tensorboard), wandb, mlflow, aim, comet_ml, clearml, dvclive, swanlab,
    # trackio; [] for none.
    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])
    # the project (wandb, comet_ml, ...) or experiment (mlflow) of the runs
    log_project: str = "lit-softmoe"
    checkpoint_every: int = number(500, minimum=1)
    keep_checkpoints: int = number(2, minimum=0)
    threads: int = number(0, minimum=0)  # CPU threads for torch; 0: torch's default


@dataclass
class PretrainConfig(TrainingRunConfig):
    run_dir: str = "runs/pretrain"
    tower: TowerConfig = field(default_factory=TowerConfig)
    # A tower folder (from `upcycle`, `convert` or a pretraining run) whose weights a fresh run
    # starts from; its architecture must be `tower`'s. "": start from a random init.
    init_from: str = ""
    data: ClassDataConfig = field(default_factory=ClassDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: str = choice("softmax", ("softmax", "sigmoid"))  # softmax | sigmoid (cross-entropy)
    label_smoothing: float = 0.0  # softmax loss only
    # × the sparse MoE layers' importance + load losses (V-MoE's 0.005 each)
    aux_loss_weight: float = 0.005
    batch_size: int = number(128, minimum=1)  # global batch, split over processes
    # torch.compile the tower: auto (on GPUs, where its fused kernels pay) | true | false
    compile: str = choice("auto", COMPILE_CHOICES)
    log_every: int = number(50, minimum=1)
    # steps between test evaluations during training; 0: only at the end
    eval_every: int = number(0, minimum=0)
    # k of the k-shot linear probe (closed-form ridge regression)
    fewshot_shots: int = number(10, minimum=0)
    eval_batch_size: int = number(512, minimum=1)


def micro_batch_size(batch_size: int, processes: int, accum_steps: int = 1) -> int:
    """Samples per forward: the global `batch_size` split over `processes`, each share into
    `accum_steps` micro-batches. A split that does not come out even is one UserError line
    naming the keys."""
    if batch_size % processes:
        raise UserError(f"batch_size {batch_size} does not split over {processes} processes; "
                        f"give a multiple of {processes}")
    local = batch_size // processes
    if local % accum_steps:
        raise UserError(f"accum_steps {accum_steps} does not divide the {local} "
                        f"samples of each of {processes} processes (batch_size "
                        f"{batch_size}); choose a divisor of {local}")
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
    # Draw shards with replacement (open_clip's --dataset-resampled): every process and
    # worker reads an endless stream, so few shards can feed many processes; an epoch is
    # sizes.json's sample count.
    resampled: bool = False
    # Samples per epoch (all processes together); 0: the sum of sizes.json beside the shards. Shards
    # without one (`pipe:`, `https://`, img2dataset's output) need it.
    samples_per_epoch: int = number(0, minimum=0)


@dataclass
class ZeroShotEvalConfig:
    # class shards (image or features + .cls); "" disables
    shards: str = "data/fmnist-features/test"
    classnames: str = ""  # default: classnames.txt beside the split
    templates: str = ""  # default: zeroshot_classification_templates.txt beside the split
    # steps between evaluations during training; 0: only at the end
    every: int = number(0, minimum=0)
    # class shards or features of a train split: report the linear-probe ceiling
    probe_train: str = ""


@dataclass
class LiTConfig(TrainingRunConfig):
    run_dir: str = "runs/lit"
    image_tower: str = "runs/fmnist-soft-tiny/tower"  # a tower folder from `lit-softmoe pretrain`
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    # softmax (CLIP contrastive) | sigmoid (SigLIP)
    loss: str = choice("softmax", ("softmax", "sigmoid"))
    temperature_init: float = 10.0  # LiT's logit scale at init
    image_head: bool = False  # an unlocked linear head on the locked features (LiT finds none best)
    unlocked_blocks: int = 0  # unlock the tower's last N blocks (ablations; needs image shards)
    # torch.compile the text tower (and the image tower's forward when it runs):
    # auto (on GPUs) | true | false
    compile: str = choice("auto", COMPILE_CHOICES)
    data: LiTDataConfig = field(default_factory=LiTDataConfig)
    eval: ZeroShotEvalConfig = field(default_factory=ZeroShotEvalConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=1e-4, warmup=100))
    batch_size: int = number(256, minimum=1)  # global
    log_every: int = number(20, minimum=1)


# ---- zero-shot evaluation suites (eval/*.yaml) --------------------------------------------------

@dataclass
class BenchmarkConfig:
    # a shipped benchmark (class names + templates), e.g. cifar100, or your own with its files
    name: str = ""
    root: str = ""  # the data folder; YAML may use ${oc.env:VAR,default}
    split: str = "test"
    format: str = choice("auto", ("auto", "wds", "imagefolder", "cifar", "torchvision", "karpathy"))
    # "": the benchmark's (or the data's)
    task: str = choice("", ("", "classification", "retrieval"))
    # a file with one class name per line, over the data's and the shipped ones
    classnames: str = ""
    # a file with one {c} template per line, or another benchmark's name (e.g. imagenet1k)
    templates: str = ""
    # karpathy: the split JSON (default: dataset_{coco,flickr30k}.json in root)
    annotations: str = ""


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
    # The image-feature cache (keyed by tower + data); "": $LIT_SOFTMOE_CACHE/eval or
    # ~/.cache/lit_softmoe/eval.
    cache_dir: str = ""
