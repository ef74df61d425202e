"""LiT training (Zhai et al., "LiT: Zero-Shot Transfer with Locked-image text Tuning", CVPR 2022):
a text tower learns to match a locked image tower. The recipe behind `lit-softmoe train`.

Read top to bottom: accelerate → locked image tower + text tower → data (image shards, or the
feature shards `lit-softmoe embed` cached, so the tower runs once per image instead of once per
epoch) → zero-shot eval set (its image embeddings computed once when the tower is locked, so only
the class prompts are re-encoded at each evaluation; with `unlocked_blocks` the tower trains, and
the eval images go through it again at every evaluation) → train with checkpoints and exact resume →
final evaluation and the trained pair saved. The run's start, resume, step loop and checkpoint
cadence are the skeleton both recipes share (`train.loop`); this recipe's part of a step is
`_step_functions`.

Resume: a rerun into a run folder continues its run only with the same config, up to the keys
`runtime.RESUMABLE_KEYS` lists (training length, frequencies, speed). The shard order of an epoch is
a function of (seed, epoch), so a resumed run replays the interrupted epoch's batches and skips the
ones it had already trained on. The bad-sample counts of the data are saved as of the start of that
epoch and restored, and the replay counts the epoch's samples again, so a resumed run reports the
totals an uninterrupted one does.
"""
from __future__ import annotations

import json
import logging
import math
from functools import partial
from pathlib import Path

import torch

from lit_softmoe.config import LiTConfig
from lit_softmoe.data.transforms import BatchNormalize
from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import STATE_META, require_keys
from lit_softmoe.models.lit import LiTModel, distinct_rows
from lit_softmoe.models.text import create_text_tower
from lit_softmoe.models.tokenizers import create_tokenizer
from lit_softmoe.models.tower_folder import (
    load_tower,
    resolution_change,
    tower_fingerprint,
    tower_folder,
    tower_preprocess,
)
from lit_softmoe.nn.expert_parallel import experts_held
from lit_softmoe.train.accumulation import contrastive_accumulation, split_batch
from lit_softmoe.train.lit_eval import (
    check_remote_eval_split,
    final_evaluation,
    final_features,
    setup_eval,
    zeroshot_eval_during_training,
)
from lit_softmoe.train.lit_loaders import (
    data_counts,
    restore_data_counts,
    setup_train_data,
    train_batches,
)
from lit_softmoe.train.loop import (
    LogWindow,
    StepFunctions,
    TrainingRun,
    announce_resume,
    finish_run,
    open_run,
    resume,
    start_run,
    train,
)
from lit_softmoe.train.loss import contrastive_loss, sigmoid_loss
from lit_softmoe.train.optim import check_optim_settings, create_optimizer
from lit_softmoe.train.runtime import check_run_dir, create_accelerator, run_folder_lock
from lit_softmoe.train.sharding import (
    expert_features,
    expert_group_mesh,
    gather_into,
    local_weights_sha256,
    shard_lit_model,
)
from lit_softmoe.utils.atomic import write_folder_atomically
from lit_softmoe.utils.device import inference_dtype, precision_name, resolve_compile
from lit_softmoe.utils.distributed import is_main_process
from lit_softmoe.utils.folder_identity import FOLDER_ID, new_folder_id

_log = logging.getLogger(__name__)


def _setup_model(cfg: LiTConfig, device: torch.device | str = "cpu",
                 locked_dtype: torch.dtype | None = None,
                 expert_mesh=None) -> tuple[LiTModel, dict]:
    """The pair, its image tower read from its folder onto `device`, not into host memory first
    (every process holds the locked tower whole: eight processes of an L/16 run held 8 × 52 GB of
    host memory on the way). A fully locked tower is cast to `locked_dtype` as it is read, so that
    only the cast tower is ever held whole: L/16 in fp32 (52 GB) would not fit a 40 GB GPU on the
    way to its 26 GB in bf16. A partly unlocked one is read in fp32, whatever its folder holds: its
    last blocks train (`hold_locked_image_in` casts the rest). `expert_mesh`: the experts come split
    over it (`load_tower`)."""
    tower, meta = load_tower(cfg.image_tower, device=device,
                             dtype=torch.float32 if cfg.unlocked_blocks else locked_dtype,
                             expert_mesh=expert_mesh)
    text_tower = create_text_tower(cfg.text, embed_dim=tower.embed_dim)
    model = LiTModel(tower, text_tower, loss=cfg.loss, temperature_init=cfg.temperature_init,
                     image_head=cfg.image_head, unlocked_blocks=cfg.unlocked_blocks,
                     text_locked=cfg.text.locked, text_unlocked_layers=cfg.text.unlocked_layers)
    return model, meta


def _setup_optimizer(cfg: LiTConfig, model: LiTModel) -> torch.optim.AdamW:
    # Pretraining's rule (`optim.param_groups`): unlocked tower blocks decay Soft MoE's `scale` as
    # it does; optim.layer_decay scales each tower's layers on its own.
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    # the logit scale always trains, so a LiTModel never gets here; a subclass might
    if not trained:
        raise UserError("nothing in this model trains; unlock a part (text.locked=false, "
                        "unlocked_blocks, text.unlocked_layers or image_head)")
    if set(trained) <= {"logit_scale", "logit_bias"} and is_main_process():
        _log.warning("warning: both towers are locked, so only the logit scale (and bias) train; "
                     "unlock a part (text.locked=false, text.unlocked_layers, unlocked_blocks or "
                     "image_head) to learn more")
    return create_optimizer(model, cfg.optim)


def _frozen_prefixes(model: LiTModel) -> tuple[str, ...]:
    """What training checkpoints leave out: the image tower's locked part
    (`LiTModel.locked_image_keys`) and the locked parameters of a Hugging Face text tower (text.path
    holds them, checked by `locked_text_sha256`). A from-scratch text tower's locked parameters stay
    in: its random init has no other copy."""
    image = tuple(model.locked_image_keys())
    if not (model.text_locked and model.text_tower.cfg.kind == "hf"):
        return image
    return image + tuple(f"text_tower.{n}" for n, p in model.text_tower.named_parameters()
                         if not p.requires_grad)


def model_description(cfg: LiTConfig, meta: dict, model: LiTModel, tower_sha: str) -> dict:
    """What rebuilds the pair beside its weights, in model/config.json and in every checkpoint's
    state.json ("model"): loading either needs no training config. `tower_sha`: the tower's weights
    identity (`tower_fingerprint`'s tower_sha256); exports and load_pretrained refuse a tower folder
    rewritten since (even with the same architecture), which would pair this text tower with other
    image features."""
    locked_text = {"text_locked_sha256": model.locked_text_sha256()} if model.text_locked else {}
    return {"image_tower": str(tower_folder(cfg.image_tower).resolve()),
            "image_tower_config": meta["tower"], "image_tower_sha256": tower_sha,
            "preprocess": meta.get("preprocess"), "text": cfg.text.to_dict(),
            "embed_dim": model.image_tower.embed_dim, "loss": cfg.loss,
            "unlocked_blocks": cfg.unlocked_blocks, **locked_text}


def save_model(run_dir: Path, model: LiTModel, description: dict, results: dict) -> Path:
    """The trained pair: text side (locked parts too), the image tower's trained blocks if any, and
    the temperature as safetensors, and what rebuilds the rest (the tower's locked part: its
    folder)."""
    from safetensors.torch import save_file
    locked = set(model.locked_image_keys())
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
             if k not in locked}
    info = {**description, "results": results, FOLDER_ID: new_folder_id()}

    def write(tmp: Path):
        save_file(state, tmp / "model.safetensors", metadata={FOLDER_ID: info[FOLDER_ID]})
        (tmp / "config.json").write_text(json.dumps(info, indent=2) + "\n")

    return write_folder_atomically(run_dir / "model", write)


def train_lit(cfg: LiTConfig) -> dict:
    """Train the text tower of `cfg` against its locked image tower; returns the final metrics."""
    # a file, a dataset there, a read-only parent: one line, now
    check_run_dir(cfg.run_dir, "model")
    with run_folder_lock(cfg.run_dir):  # one run in a run folder at a time
        return _train_lit(cfg)


def _train_lit(cfg: LiTConfig) -> dict:
    run = start_run(cfg, "train", lambda cfg: check_optim_settings(cfg.optim), create_accelerator)
    accelerator, is_main, sharded = run.accelerator, run.is_main, run.sharded
    check_remote_eval_split(cfg)  # before any shard is opened
    # The probe is scored on the eval set. Without one (`eval.shards=`, which the README's own-data
    # command sets over a config naming a probe set) it is skipped, as pretrain skips its few-shot
    # probe: said now and at the end, and recorded in results.json.
    probe_skipped = None
    if cfg.eval.probe_train and not cfg.eval.shards:
        probe_skipped = ("the linear probe on eval.probe_train is skipped: there is no eval set "
                         "to score it on (eval.shards is empty); set eval.shards to a labelled "
                         "split to run it")
        if is_main:
            _log.warning(probe_skipped)

    # ---- model: locked image tower + text tower; tokenizer; optimizer
    torch.manual_seed(cfg.seed)
    # The tower's locked part only runs forward: held in the dtype it runs in (bf16 under bf16
    # autocast), cast once instead of by autocast at every step. Unlocked blocks train in fp32 with
    # the rest of the model.
    tower_dtype = inference_dtype(cfg.precision, accelerator.device)
    expert_parallel = cfg.expert_parallel > 1
    # Under expert parallel only this process's chunk of the tower's experts is read: no process
    # holds the whole tower.
    expert_mesh = (expert_group_mesh(accelerator.device, cfg.expert_parallel) if expert_parallel
                   else None)
    model, meta = _setup_model(cfg, accelerator.device, tower_dtype, expert_mesh)
    # a partly unlocked tower's locked part (a locked one is cast already)
    model.hold_locked_image_in(tower_dtype)
    # the text tower's blocks (and unlocked image blocks)
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    tokenizer = create_tokenizer(model.text_tower.tokenizer_spec, model.text_tower.context_length)
    preprocess = tower_preprocess(cfg.image_tower, model.image_tower, meta)
    # Sharded: the main process evaluates and saves a plain copy (sharing the locked tower), filled
    # with the trained weights by `gather_into`; the shards are made before the optimizer, which
    # holds them.
    frozen = _frozen_prefixes(model)  # parts no step changes: left out of training checkpoints
    # The tower's locked part must end exactly as it started (checked after training); unlocked
    # blocks train.
    # (under expert parallel, each process's own chunk: taken once the model is sharded, below)
    tower_hash = None if expert_parallel else model.locked_image_sha256()
    # The tower's weights identity, recorded in checkpoints and model/config.json: a resume or an
    # export refuses a tower folder rewritten since (a retrained tower would pair with this text
    # tower).
    tower_sha = tower_fingerprint(cfg.image_tower)["tower_sha256"]
    description = model_description(cfg, meta, model, tower_sha)
    # a locked text tower's locked parameters: checked the same
    text_hash = description.get("text_locked_sha256")
    plain = None
    if sharded:
        plain = shard_lit_model(model, accelerator.device, cfg.expert_parallel,
                                keep_plain=is_main)
    if expert_parallel:  # each process holds its own chunk of the locked experts, and checks it
        tower_hash = local_weights_sha256(model.locked_image_parameters())
    optimizer = _setup_optimizer(cfg, model)

    # ---- data: cached features (the tower never runs) or images (the tower runs every step)
    cached, loader = setup_train_data(cfg, run, preprocess, tokenizer)
    run.steps_per_epoch = len(loader)
    run.total_steps = cfg.steps if cfg.steps > 0 else math.ceil(cfg.epochs * run.steps_per_epoch)
    if not sharded:  # a sharded model is on the device already
        model.to(accelerator.device)
    # Expert parallel runs eager: its all-to-alls and DTensor chunks have not been through
    # torch.compile on a GPU here (embed does the same).
    compiled = resolve_compile(cfg.compile, accelerator.device) and cfg.expert_parallel == 1
    if compiled:  # in place, so parameter names, checkpoints and the optimizer are unchanged
        if not cached:  # with cached features the tower never runs in a training step
            model.image_tower.forward_features = torch.compile(model.image_tower.forward_features)
        model.text_tower.compile()
    if expert_parallel:  # every process runs the eval images through the split tower, together
        eval_set = setup_eval(cfg, model, preprocess, accelerator,
                              partial(expert_features, model))
        eval_set = eval_set if is_main else None
    else:
        eval_set = (setup_eval(cfg, plain if sharded else model, preprocess, accelerator)
                    if is_main else None)

    # ---- resume
    checkpoint_meta, latest = resume(run, model, optimizer, skip_prefixes=frozen)
    if latest is not None:
        _check_checkpoint(cfg, checkpoint_meta, latest, tower_sha, text_hash, frozen)
    announce_resume(run, latest)
    if latest is not None and is_main:  # the counts saved are the main process's, the ones reported
        restore_data_counts(loader, checkpoint_meta["data_counts"])
    model_module = model
    if not sharded:  # a sharded model is FSDP's already: DDP would wrap it again
        model, optimizer = accelerator.prepare(model, optimizer)
    open_run(run)
    inputs = "cached features" if cached else "images"
    resized = None if cached else resolution_change(model_module.image_tower, meta["preprocess"])
    inputs += f", {resized}" if resized else ""
    held = f"in {precision_name(tower_dtype)} weights"
    if cfg.unlocked_blocks and tower_dtype != torch.float32:
        held += f" but its last {cfg.unlocked_blocks} block(s) (fp32: they train)"
    if expert_parallel:  # the chunk this process holds of each MoE layer's experts
        here, experts = experts_held(model_module.image_tower)
        held += f", {here} of the {experts} experts of each MoE layer here"
    run.say(
        f"LiT: text tower {cfg.text.kind} against {cfg.image_tower} ({inputs}), "
        f"{run.total_steps} steps of {cfg.batch_size}; on {accelerator.device}, "
        f"{accelerator.mixed_precision if accelerator.mixed_precision != 'no' else 'fp32'}, "
        f"image tower {held}, "
        f"{'compiled' if compiled else 'eager'} (compile={cfg.compile}"
        f"{f', expert_parallel={cfg.expert_parallel}' if cfg.expert_parallel > 1 else ''})")

    # ---- train
    epoch_start: dict = {}  # the loader's counts as the current epoch started (`train_batches`)

    def evaluate() -> dict | None:
        return zeroshot_eval_during_training(cfg, run, model_module, plain, eval_set, tokenizer,
                                             preprocess)

    normalize = None if cached else BatchNormalize(preprocess)  # uint8 pixels from the workers
    steps = _step_functions(cfg, run, model, model_module, loader, normalize, epoch_start,
                            {"image_tower_sha256": tower_sha, "model": description}, evaluate)
    train(run, model, model_module, optimizer, train_batches(loader, run, epoch_start), steps,
          desc="lit", eval_every=cfg.eval.every if cfg.eval.shards else 0, skip_prefixes=frozen)
    loader.check_bad_fraction()

    # ---- final evaluation; a locked tower must be exactly what it was
    results = {"steps": run.total_steps, "train_seconds": round(run.train_seconds, 1),
               "cached_features": cached, "bad_samples": dict(loader.bad.counts)}
    computed = final_features(cfg, model_module, preprocess, accelerator)  # all processes
    locked_now = (local_weights_sha256(model_module.locked_image_parameters()) if expert_parallel
                  else None)
    if sharded:  # the main process evaluates and saves the plain copy, with the trained weights
        # (and the locked text layers' current ones, for the check below)
        model_module = gather_into(plain, model_module, frozen=text_hash is not None)
    if not expert_parallel and tower_hash is not None and is_main:
        locked_now = model_module.locked_image_sha256()
    if tower_hash is not None and locked_now is not None and locked_now != tower_hash:
        raise RuntimeError("the locked image tower changed during training; this is a bug, please "
                           "report it")
    if text_hash is not None and is_main and model_module.locked_text_sha256() != text_hash:
        raise RuntimeError("the locked text layers changed during training; this is a bug, please "
                           "report it")
    if is_main:
        probe_skipped = final_evaluation(cfg, run, model_module, eval_set, tokenizer, preprocess,
                                         results, computed) or probe_skipped
        if probe_skipped:
            _log.warning(probe_skipped)
            results["probe_skipped"] = probe_skipped
        save_model(run.run_dir, model_module, description, results)
    return finish_run(run, results, curve_keys=("loss", "temperature", "zeroshot_top1"),
                      title=f"LiT {cfg.text.kind} text tower")


def _check_checkpoint(cfg: LiTConfig, checkpoint_meta: dict, latest: Path, tower_sha: str,
                      text_hash: str | None, frozen: tuple[str, ...]) -> None:
    """A checkpoint resumes only against the towers it was trained with: their locked weights are
    left out of it, so the folders they come from must hold what they held then."""
    require_keys(checkpoint_meta, ("train_seconds", "data_counts", "image_tower_sha256"),
                 latest / STATE_META,
                 "the run cannot be resumed from it; start this one with another run_dir=...")
    if checkpoint_meta["image_tower_sha256"] != tower_sha:
        raise UserError(f"{latest} was trained against other image tower weights than "
                        f"{cfg.image_tower} holds (the tower was rewritten since, or the "
                        "checkpoint is another run's), so the run cannot go on against it; put "
                        "that tower back, or give a new run_dir")
    text_sha = (checkpoint_meta.get("model") or {}).get("text_locked_sha256")
    if any(p.startswith("text_tower.") for p in frozen) and text_sha != text_hash:  # from text.path
        raise UserError(f"the text model at {cfg.text.path} changed after {latest} was saved (its "
                        "locked weights differ), so the run cannot go on with it; put that model "
                        "back, or give a new run_dir")


def _step_functions(cfg: LiTConfig, run: TrainingRun, model, model_module: LiTModel, loader,
                    normalize: BatchNormalize | None, epoch_start: dict, checkpoint_identity: dict,
                    evaluate) -> StepFunctions:
    """LiT's part of each step (`loop.StepFunctions`): `model` runs the step (possibly
    DDP-wrapped), `model_module` is the plain LiTModel under it. `normalize`: the image batches'
    normalization on the device, None for cached features. `checkpoint_identity`: what every
    checkpoint records of the towers (checked by `_check_checkpoint` on resume)."""
    accelerator, cached = run.accelerator, normalize is None
    last_outputs: list = []  # the step's last forward outputs: (zimg, ztxt, logit_scale, ...)

    # (images or cached features, text, text_rows) → (zimg, ztxt, logit_scale[, logit_bias])
    def embed(micro_batch):
        micro_images, micro_text, text_rows = micro_batch
        with accelerator.autocast():
            if cached:
                return model(image_features=micro_images, text=micro_text, text_rows=text_rows)
            return model(micro_images, micro_text, text_rows=text_rows)

    def text_on_device(ids: torch.Tensor, dedupe: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Distinct rows found on the host, where the ids still are, so a GPU does not wait for
        # their count.
        ids, rows = distinct_rows(ids) if dedupe else (ids, None)
        return (ids.to(accelerator.device, non_blocking=True),
                None if rows is None else rows.to(accelerator.device, non_blocking=True))

    def loss_fn(*outputs):
        with accelerator.autocast():
            return (sigmoid_loss if cfg.loss == "sigmoid" else contrastive_loss)(*outputs)

    def forward_backward(batch) -> torch.Tensor:
        images = batch["embedding" if cached else "image"].to(accelerator.device, non_blocking=True)
        images = images if cached else normalize(images)
        # accum_steps micro-batches give the whole batch's loss and gradient (open_clip's
        # recompute scheme).
        # A deterministic text tower embeds each distinct caption once (its mode read once a step:
        # evaluations switch it and back between steps).
        dedupe = not model_module.text_tower.is_stochastic()
        micro_batches = [(micro_images, *text_on_device(micro_text, dedupe))
                         for micro_images, micro_text
                         in split_batch((images, batch["text"]), cfg.accum_steps)]
        loss, outputs = contrastive_accumulation(embed, loss_fn, micro_batches,
                                                 backward=accelerator.backward,
                                                 no_sync=run.no_sync(model))
        last_outputs[:] = outputs
        return loss

    def log_record(window: LogWindow) -> dict:
        return {"step": window.step, "epoch": window.epoch, "loss": window.loss, "lr": window.lr,
                "temperature": float(last_outputs[2].detach()),
                "train_seconds": round(run.train_seconds, 2),
                "samples_per_s": round(window.rate, 1), **loader.metrics()}

    def checkpoint_meta() -> dict:
        # A resume replays this epoch from its start (counting its samples again), or at an
        # epoch's end starts the next: the counts as of then (this epoch's stream read nothing
        # past its last batch). The main process's counts are the ones recorded.
        at_epoch_end = run.step % run.steps_per_epoch == 0
        return {"data_counts": data_counts(loader) if at_epoch_end else epoch_start["counts"],
                **checkpoint_identity}

    # after_update: CLIP's cap on the logit scale parameter itself (see LiTModel).
    return StepFunctions(forward_backward, log_record, checkpoint_meta, evaluate=evaluate,
                         after_update=model_module.clamp_logit_scale_)
