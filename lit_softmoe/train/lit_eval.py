"""LiT's evaluation (`train.lit`): the zero-shot eval set read and checked before training, scored
during training and at the end, with the linear probe.

The main process scores; the image features it needs come from the locked tower. Under expert
parallel (`expert_parallel` > 1) that tower is split over the processes, so every process reads the
eval images (each the whole split, in the same order: the same batches) and runs them through it
together (`sharding.expert_features`); the main process keeps the features."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from lit_softmoe.config import LiTConfig
from lit_softmoe.data.feature_cache import check_feature_caches, is_feature_cache
from lit_softmoe.data.samples import read_labels
from lit_softmoe.data.shards import (
    CLASSNAMES_FILE,
    TEMPLATES_FILE,
    dataset_dir,
    is_local_url,
    read_classnames_file,
    read_lines,
    shard_urls,
)
from lit_softmoe.data.transforms import BatchNormalize, pixel_transform
from lit_softmoe.errors import UserError
from lit_softmoe.evals import build_zeroshot_classifier, zeroshot_metrics
from lit_softmoe.evals.probes import linear_probe
from lit_softmoe.metadata import check_templates
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.preprocess import Preprocess
from lit_softmoe.train.embed import rerun_command
from lit_softmoe.train.lit_loaders import shard_loader
from lit_softmoe.train.loop import TrainingRun
from lit_softmoe.train.sharding import expert_features, gather_into


# no_grad, not inference_mode: under expert parallel the sharded model's forward fills FSDP's
# buffers, which training then writes to (an inference tensor may not be written outside it).
@torch.no_grad()
def class_features(cfg: LiTConfig, split: str, model: LiTModel, preprocess: Preprocess,
                   accelerator, image_features=None):
    """(features (N, D) of the locked tower, labels (N,)) for a class split, images or
    cached features. `image_features`: what maps the normalized pixels to the tower's pooled
    features (default: `model.image_tower.forward_pooled`)."""
    if is_feature_cache(split):
        check_feature_caches(split, cfg.image_tower, rerun_command)
        loader = shard_loader(cfg, split, "embedding-class", 1024, exact=True)
        loader.set_epoch(0)
        batches = [(b["embedding"], b["label"]) for b in loader]
    else:
        loader = shard_loader(cfg, split, "image-class", 256, transform=pixel_transform(preprocess),
                              exact=True)
        loader.set_epoch(0)
        normalize, batches = BatchNormalize(preprocess), []
        image_features = image_features or model.image_tower.forward_pooled
        for b in loader:
            with accelerator.autocast():
                pixels = normalize(b["image"].to(accelerator.device))
                batches.append((image_features(pixels).float().cpu(), b["label"]))
    return (torch.cat([features for features, _ in batches]).float(),
            torch.cat([labels for _, labels in batches]))


def _zeroshot_eval(cfg: LiTConfig, model: LiTModel, eval_set: dict, tokenizer, preprocess,
                   accelerator, fresh: tuple | None = None) -> dict:
    """`fresh`: the eval split's (features, labels) through the current image tower, computed by
    every process together (expert parallel with unlocked blocks); else computed here as needed."""
    if fresh is not None:
        eval_set["features"], eval_set["labels"] = fresh
    elif not model.image_tower_locked:
        # The tower's last blocks train: features computed earlier would score the current text
        # tower against an older image tower, so the eval images go through the current one.
        eval_set["features"], eval_set["labels"] = class_features(cfg, eval_set["split"], model,
                                                                  preprocess, accelerator)
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        classifier = build_zeroshot_classifier(model.encode_text, tokenizer, eval_set["classnames"],
                                               eval_set["templates"], device=accelerator.device)
        images = model.encode_image_features(eval_set["features"].to(accelerator.device)).float()
    model.train()
    return {f"zeroshot_{k}": v
            for k, v in zeroshot_metrics(images, eval_set["labels"], classifier).items()}


def check_remote_eval_split(cfg: LiTConfig) -> None:
    """A remote eval split (`https://`, `pipe:`) has no folder holding classnames.txt and the
    templates: without eval.classnames and eval.templates it is refused from the settings alone,
    before training, which opens the split's first shard for its labels (a download; offline, a
    minute's wait for the same one line)."""
    split = str(cfg.eval.shards)
    if split and not is_local_url(split.split("::")[0]):
        eval_label_files(cfg)


def eval_label_files(cfg: LiTConfig) -> tuple[Path, Path]:
    """Where the class names and templates of the eval set (`eval.shards`, set) are read from;
    whether the files are there is `setup_eval`'s check (after the split's labels)."""
    split = str(cfg.eval.shards)
    # The folder beside the split (also for a pattern or a '::' list); remote shards have none.
    folder = dataset_dir(split)
    for value, name, key in ((cfg.eval.classnames, CLASSNAMES_FILE, "eval.classnames"),
                             (cfg.eval.templates, TEMPLATES_FILE, "eval.templates")):
        if not value and folder is None:
            raise UserError(f"eval.shards {split} is not a local split, so there is no {name} "
                            f"beside it; set {key} to a file with one entry per line")
    classnames = Path(cfg.eval.classnames) if cfg.eval.classnames else folder / CLASSNAMES_FILE
    templates = Path(cfg.eval.templates) if cfg.eval.templates else folder / TEMPLATES_FILE
    return classnames, templates


def setup_eval(cfg: LiTConfig, model, preprocess, accelerator,
               image_features=None) -> dict | None:
    """The eval set's class names, templates and, for a locked tower, its image features (once),
    each checked; None without eval.shards. `image_features`: as `class_features` takes it."""
    if not cfg.eval.shards:
        return None
    split = str(cfg.eval.shards)
    classnames, templates = eval_label_files(cfg)
    for path, key in ((classnames, "eval.classnames"), (templates, "eval.templates")):
        if not path.is_file():
            raise UserError(f"{path} not found; set {key} to a file with one entry per line")
    eval_set = {"split": split, "classnames": read_classnames_file(classnames),
                "templates": read_lines(templates), "features": None, "labels": None}
    if not eval_set["classnames"]:
        raise UserError(f"{classnames} holds no class names; set eval.classnames to a file with "
                        "one per line")
    check_templates(eval_set["templates"], str(templates))  # now, not after training
    if model.image_tower_locked:  # computed once; with unlocked blocks, at each evaluation
        eval_set["features"], eval_set["labels"] = class_features(cfg, split, model, preprocess,
                                                                  accelerator, image_features)
        largest = int(eval_set["labels"].max())
    else:  # the labels alone, from the `.cls` members: no tower pass over the eval images
        # just for them
        # Quiet: a side pass over shards whose bad samples each evaluation counts.
        largest = max(read_labels(shard_urls(split), log=False), default=-1)
    # its images would all count as misses: a wrong score
    if largest >= len(eval_set["classnames"]):
        raise UserError(f"eval.shards {split} holds class {largest}, but {classnames} names "
                        f"{len(eval_set['classnames'])} classes; set eval.classnames to a file "
                        "naming every class of the split, one per line in class order")
    return eval_set


def expert_parallel_features(cfg: LiTConfig, model: LiTModel, preprocess: Preprocess,
                             accelerator, splits: list[str]) -> list[tuple | None]:
    """Collective under expert parallel (None each otherwise): each split's (features, labels)
    through the sharded `model`'s image tower, run by every process together."""
    if cfg.expert_parallel == 1:
        return [None] * len(splits)
    features = partial(expert_features, model)
    return [class_features(cfg, split, model, preprocess, accelerator, features)
            for split in splits]


def zeroshot_eval_during_training(cfg: LiTConfig, run: TrainingRun, model_module: LiTModel, plain,
                                  eval_set, tokenizer, preprocess) -> dict | None:
    """Called on every process: a sharded model is gathered into the main process's plain copy first
    (a collective); the main process alone scores it."""
    eval_model = gather_into(plain, model_module) if run.sharded else model_module
    recompute = [] if model_module.image_tower_locked else [str(cfg.eval.shards)]
    fresh = expert_parallel_features(cfg, model_module, preprocess, run.accelerator, recompute)
    if not run.is_main:
        return None
    return _zeroshot_eval(cfg, eval_model, eval_set, tokenizer, preprocess, run.accelerator,
                          fresh[0] if fresh else None)


def final_features(cfg: LiTConfig, model: LiTModel, preprocess: Preprocess,
                   accelerator) -> dict | None:
    """Collective under expert parallel (None otherwise), before `final_evaluation`: the image
    features it needs, run by every process together: the eval split's when the tower has unlocked
    blocks ("eval"), the probe's training split ("probe")."""
    if cfg.expert_parallel == 1 or not cfg.eval.shards:
        return None
    splits = {"eval": None if model.image_tower_locked else str(cfg.eval.shards),
              "probe": cfg.eval.probe_train or None}
    splits = {key: split for key, split in splits.items() if split}
    return dict(zip(splits, expert_parallel_features(cfg, model, preprocess, accelerator,
                                                     list(splits.values()))))


def final_evaluation(cfg: LiTConfig, run: TrainingRun, model: LiTModel, eval_set: dict | None,
                     tokenizer, preprocess, results: dict,
                     computed: dict | None = None) -> str | None:
    """Main process: the zero-shot scores and the linear probe into `results` and metrics.jsonl;
    → why the probe was skipped, if it was for want of samples. `computed`: `final_features`'."""
    if eval_set is None:
        return None
    computed = computed or {}
    probe_skipped = None
    results.update(_zeroshot_eval(cfg, model, eval_set, tokenizer, preprocess, run.accelerator,
                                  computed.get("eval")))
    if cfg.eval.probe_train:
        train_features, train_labels = computed.get("probe") or class_features(
            cfg, cfg.eval.probe_train, model, preprocess, run.accelerator)
        if len(train_labels) < 2:  # the probe standardizes the features: one sample has no spread
            probe_skipped = ("the linear probe is skipped: eval.probe_train "
                             f"{cfg.eval.probe_train} holds {len(train_labels)} sample(s), and it "
                             "needs at least 2")
        else:
            results.update(linear_probe(train_features, train_labels, eval_set["features"],
                                        eval_set["labels"]))
    scores = {k: v for k, v in results.items() if k.startswith(("zeroshot", "linear"))}
    run.logger.log({"step": run.total_steps, **scores})
    return probe_skipped
