"""LiT's shard loaders (`train.lit`): the loader of a split (the training stream, or an eval or
probe split read whole), the training data checked and opened, and its batches for a (resumed) run
with the loader's counts a checkpoint keeps."""
from __future__ import annotations

from lit_softmoe.config import LiTConfig, micro_batch_size
from lit_softmoe.data.feature_cache import check_feature_caches, is_feature_cache
from lit_softmoe.data.pipelines import ShardDataConfig, create_shard_loader
from lit_softmoe.data.tar_reading import require_class_labels
from lit_softmoe.data.transforms import pixel_transform
from lit_softmoe.errors import UserError
from lit_softmoe.models.preprocess import Preprocess
from lit_softmoe.train.embed import rerun_command
from lit_softmoe.train.loop import TrainingRun


def shard_loader(cfg: LiTConfig, urls: str, kind: str, batch_size: int, transform=None,
                 tokenizer=None, exact: bool = False, pin_memory: bool = False):
    # pin_memory: batches land in page-locked memory, so the copies to the GPU run asynchronously
    # (non_blocking) while the workers prefetch the next batches.
    # exact (the eval and probe sets): read by the main process alone, so every shard, not this
    # process's share of them (under torchrun the loader would split them by rank).
    node = {"rank": 0, "world_size": 1} if exact else {}
    data_cfg = ShardDataConfig(urls=urls, batch_size=batch_size, workers=cfg.data.workers,
                               seed=cfg.seed, shuffle=not exact,
                               shuffle_buffer=cfg.data.shuffle_buffer, exact_epoch=exact,
                               resampled=cfg.data.resampled and not exact,
                               samples_per_epoch=0 if exact else cfg.data.samples_per_epoch,
                               max_bad_fraction=cfg.data.max_bad_fraction, pin_memory=pin_memory,
                               **node)
    return create_shard_loader(data_cfg, kind, transform=transform, tokenizer=tokenizer)


def data_counts(loader) -> dict:
    """The loader's counts of the run so far, as a checkpoint stores them."""
    return {"samples_read": loader.samples_read, "bad": dict(loader.bad.counts)}


def restore_data_counts(loader, counts: dict) -> None:
    """Put a checkpoint's counts back into a fresh loader."""
    loader.samples_read = counts["samples_read"]
    loader.bad.counts.update(counts["bad"])


def setup_train_data(cfg: LiTConfig, run: TrainingRun, preprocess: Preprocess, tokenizer) -> tuple:
    """(whether data.train holds cached features, the training loader), the splits checked first."""
    accelerator = run.accelerator
    cached = is_feature_cache(cfg.data.train)
    if cached:
        if cfg.unlocked_blocks:
            raise UserError("unlocked_blocks needs image shards (data.train), not cached features")
        check_feature_caches(cfg.data.train, cfg.image_tower, rerun_command)
    # without an eval set the probe is skipped
    probe_train = cfg.eval.probe_train if cfg.eval.shards else ""
    for split, key in ((cfg.eval.shards, "eval.shards"), (probe_train, "eval.probe_train")):
        if cfg.unlocked_blocks and split and is_feature_cache(split):
            raise UserError(f"{key} holds cached features of the initial tower, but "
                            f"unlocked_blocks={cfg.unlocked_blocks} trains part of it; point {key} "
                            "to image shards")
        if split:  # read after training: a split without class labels is refused now
            require_class_labels(str(split), key)
    # The batch splits evenly over processes and micro-batches, or one line says why not.
    micro_batch_size(cfg.batch_size, accelerator.num_processes, cfg.accum_steps)
    local_batch = cfg.batch_size // accelerator.num_processes
    loader = shard_loader(cfg, cfg.data.train, "embedding-caption" if cached else "image-caption",
                          local_batch, transform=None if cached else pixel_transform(preprocess),
                          tokenizer=tokenizer, pin_memory=accelerator.device.type == "cuda")
    if loader.smallest_pass is not None and loader.smallest_pass < local_batch:
        # A stream shorter than a batch wraps around inside it: a repeated pair is its own negative.
        streams = (f"{accelerator.num_processes} process(es) × {max(1, cfg.data.workers)} data "
                   "worker(s)")
        raise UserError(f"data.train is read as {streams}, and one of them holds only "
                        f"{loader.smallest_pass} samples, fewer than its batch of {local_batch}, "
                        "so batches would repeat samples; lower batch_size or data.workers, or add "
                        "data")
    return cached, loader


def train_batches(loader, run: TrainingRun, epoch_start: dict):
    """The training batches of steps `run.step` to `run.total_steps` - 1. The shard order of an
    epoch is a function of (seed, epoch): a resumed run replays the interrupted epoch and skips the
    batches it had trained on. As the loop it replaces did, a batch past the last step may be read
    (and counted) before the end is seen. `epoch_start["counts"]`: the loader's counts as the
    current epoch started, what a resume into that epoch restores."""
    while run.step < run.total_steps:
        epoch, done_in_epoch = divmod(run.step, run.steps_per_epoch)
        loader.set_epoch(epoch)
        epoch_start["counts"] = data_counts(loader)
        for index, batch in enumerate(loader):
            if index < done_in_epoch:
                continue  # already trained on before the interruption
            if run.step >= run.total_steps or index >= run.steps_per_epoch:
                break
            yield batch  # `train` takes its step before asking for the next one
