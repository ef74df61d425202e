"""Frozen-embedding cache: run the locked image tower once per image, not once per epoch.

LiT (Zhai et al., CVPR 2022, App. G) locks the image tower and uses no augmentation, so the
tower's output for an image never changes during LiT training: computing it once and storing it
multiplies the training throughput and the largest batch that fits (the paper's App. G). open_clip
has no such cache (its issue #99); this module is ours.

`embed_shards` reads image + caption shards (and `.cls` where present, so class shards such as a
zero-shot test split can be cached too, also without captions), runs `tower.forward_pooled` under
inference mode (bf16 autocast on GPUs that have it) and writes feature shards in the same webdataset
layout, feature shard i for source shard i, as `data.feature_cache` describes the cache (its
folder, samples and embed.json).

Keeping a GPU fed, by default: the tower runs in bf16 weights on GPUs (`prepare_for_inference`, cast
once), one DataLoader worker per available core reads the shards, and JPEGs travel to the GPU
undecoded, where nvJPEG decodes a whole batch and the resize and crop run (`data.gpu_jpeg`); other
images, and every image on the CPU, are decoded, resized and cropped by the workers, which send
uint8 batches (a quarter of float32's bytes through shared memory, pinning and the copy). The
normalization runs on the device, bitwise as the transform computes it
(`transforms.normalize_batch`). One batch stays queued on the GPU while the host turns the previous
one into samples and shards (`ToHost`). The choices are printed once at the start.

Scale: under `torchrun` / `accelerate launch` each process embeds every world_size-th source shard
on its own GPU; the processes share nothing but the output folder (`embed_job`). Each feature shard
is written atomically into a work folder as soon as it is complete, so a killed run, rerun, embeds
only the shards it had not finished. When all are there, rank 0 puts the split folder in place
whole, so its presence means a finished cache: a rerun with the same tower and source files is
skipped, one with anything changed embeds again (`feature_cache.finished_cache`,
`check_feature_cache`).
"""
from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lit_softmoe.data import gpu_jpeg
from lit_softmoe.data.feature_cache import (
    EMBED_FILE,
    cache_fingerprint,
    copy_metadata,
    finished_cache,
    refuse_feature_shards,
    refuse_other_metadata,
    source_stats,
)
from lit_softmoe.data.images import open_image
from lit_softmoe.data.shard_batches import ShardBatches
from lit_softmoe.data.shards import dataset_dir, shard_urls, split_name
from lit_softmoe.data.tar_reading import first_sample_members, listed_sizes
from lit_softmoe.data.transforms import BatchNormalize, decode_min_side, pixel_transform
from lit_softmoe.errors import UserError
from lit_softmoe.models.inference import prepare_for_inference
from lit_softmoe.models.tower_folder import (
    load_tower,
    resolution_change,
    tower_preprocess,
)
from lit_softmoe.nn.expert_parallel import GroupLockstep
from lit_softmoe.train.embed_job import (
    clear_failure,
    finished_shard,
    remove_leftovers,
    report_failure,
    seen_and_bad,
    wait_for_shards,
    work_folder,
    write_feature_split,
)
from lit_softmoe.train.embed_process import bad_fraction_error, embed_this_process_shards
from lit_softmoe.train.sharding import check_expert_groups, expert_group_mesh
from lit_softmoe.utils.device import (
    available_cpus,
    inference_dtype,
    parse_device,
    process_device,
    resolve_compile,
)
from lit_softmoe.utils.distributed import process_rank

# `compile: auto` compiles the tower for runs of at least this many images: below it the compile
# time is not earned back (docs/benchmarks.md, "embed").
COMPILE_MIN_IMAGES = 1_000_000



def embed_shards(
    tower_dir: str | Path,
    shards: str,
    out_dir: str | Path,
    split: str | None = None,
    batch_size: int = 256,
    workers: int | None = None,
    device: str | torch.device | None = None,
    precision: str = "auto",
    compile: str | bool = "auto",
    jpeg_decoder: str = "auto",
    gpu_jpeg_share: float = 1.0,
    max_bad_fraction: float = 0.01,
    progress: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    expert_parallel: int = 1,
) -> dict:
    """Embed every image of `shards` with the tower in `tower_dir`; write feature shards to
    `out_dir/split/`.

    Feature shard `i.tar` holds the embeddings of source shard i, in that shard's order. Under
    `torchrun` or `accelerate launch` each process embeds every world_size-th source shard; the
    processes meet through the file system only (out_dir must be a folder they all see). Each
    feature shard is written atomically into a work folder (`.SPLIT.work-<key>`, keyed by the tower
    and the source files) as soon as it is complete, so a killed run rerun with the same tower and
    sources embeds only the shards that were not finished. Rank 0 then waits for every shard and
    puts the split in place whole, with nshards.txt, sizes.json and embed.json.

    Args:
        tower_dir: a tower folder written by `save_tower` (its config.json holds "preprocess").
        shards: image + caption shards: a split folder, a brace pattern, several joined with `::`.
        out_dir: the feature dataset folder; gets `split/` and the source's classnames.txt & co.
        split: the feature split's name; default: the source split folder's name (e.g. "train").
        batch_size: images per tower forward (a batch never spans two source shards).
        workers: DataLoader workers reading (and decoding) images, each reading whole shards; 0
            decodes in this process; None: one per CPU core this process may use, at most one per
            shard to embed. The output is the same for any number of workers and processes.
        device: where the tower runs; default the process's GPU (LOCAL_RANK) when there is one,
            else the CPU.
        precision: the tower's weight dtype: auto (bf16 on GPUs that support it, else fp32) | fp32 |
            bf16.
        compile: torch.compile the tower: auto (on a GPU, for runs of at least `COMPILE_MIN_IMAGES`
            images, where the compile time is earned back) | true | false.
        jpeg_decoder: auto (on the GPU when the tower runs on one and torchvision has nvJPEG,
            `gpu_jpeg`) | gpu | cpu (the workers decode every image).
        gpu_jpeg_share: with the GPU decoder, the fraction of the JPEGs it decodes; below 1 the
            workers decode the rest, so both decoders work (chosen by sample key: the same shards
            give the same features).
        max_bad_fraction: stop (UserError) when more than this fraction of samples is unreadable;
            fewer are skipped and counted in "bad".
        progress: show a progress bar (images/s, shards done, time left) on rank 0.
        rank, world_size: this process's place among the embedding processes; default from the
            launcher's RANK and WORLD_SIZE (1 process without a launcher).
        expert_parallel: E > 1 splits the tower's experts over each group of E processes of a
            launch (`nn.expert_parallel`): a GPU holds its chunk of them, not the whole tower. The
            processes of a group then run each forward together (`GroupLockstep`), eagerly. The
            features are the same as one process's.

    Returns:
        {"split_dir", "num_samples", "dim", "seconds", "images_per_second", "bad": {reason: count},
        "skipped", "resumed_shards", "rank", "world_size", "startup_seconds",
        "steady_images_per_second", "steady_waits"}; the last three split this process's time at its
        first embedded batch (None where it embedded nothing, or nothing after the first batch), the
        waits saying what bounded the steady rate (`_rates`); "skipped" is True when the split
        already held this tower's embeddings of these shards, unchanged since (nothing was written).
        On ranks other than 0, "num_samples", "bad" and "images_per_second" are this process's share
        and "split_dir" is written by rank 0.
    """
    start = time.perf_counter()
    started = time.time()
    out_dir = Path(out_dir)
    _check_flags(batch_size, workers, jpeg_decoder, gpu_jpeg_share, split)
    rank, world_size = process_rank(rank, world_size)
    check_expert_groups(expert_parallel, world_size)
    urls = shard_urls(shards)  # a UserError for missing local shards, before any work
    members = first_sample_members(urls[0])  # one sample read: what kind of shards these are
    refuse_feature_shards(shards, urls, members, "--shards")
    split = split or split_name(shards, urls)
    split_dir = out_dir / split
    # The split is replaced whole at the end: only an earlier feature cache may be. `--out DATA`
    # for `--shards DATA/train` (the dataset folder, not a new one) replaced the images themselves.
    if split_dir.is_dir() and any(split_dir.iterdir()) and not (split_dir / EMBED_FILE).is_file():
        raise UserError(f"{split_dir} holds other data (not a feature cache of "
                        "`lit-softmoe embed`), which embedding would replace; give a new --out "
                        f"folder (e.g. {out_dir}-features) or another --split")
    device = parse_device(str(device), "--device") if device is not None else process_device()
    weights = inference_dtype(precision, device)
    decoder, decoder_why = gpu_jpeg.choose_decoder(jpeg_decoder, device, "--jpeg-decoder")
    fingerprint = cache_fingerprint(tower_dir)
    # What the features depend on besides the tower: a cache of another weight dtype or JPEG decoder
    # differs within rounding (cosine >= 0.999), and is made again rather than mixed with this one.
    wanted = {**fingerprint, "source": str(shards), "source_stats": source_stats(urls),
              "precision": "bf16 weights" if weights == torch.bfloat16 else "fp32",
              "jpeg_decoder": decoder,
              **({"gpu_jpeg_share": gpu_jpeg_share} if decoder == "gpu" else {})}

    source_dir = dataset_dir(shards, urls)
    refuse_other_metadata(source_dir, out_dir, split, "--out")
    out_dir.mkdir(parents=True, exist_ok=True)
    # else embedded again: the new split replaces the old one atomically
    done = finished_cache(split_dir, wanted)
    if done is not None:
        return _summary(split_dir, done["num_samples"], done["dim"],
                        round(time.perf_counter() - start, 3), None, done.get("bad", {}), rank,
                        world_size, skipped=True)
    # The work folder of this tower and these sources: a killed run's finished shards are
    # kept there.
    work_dir = work_folder(out_dir, split, wanted)
    if rank == 0:
        remove_leftovers(out_dir, split, keep=work_dir)
        copy_metadata(source_dir, out_dir)
    work_dir.mkdir(exist_ok=True)
    clear_failure(work_dir, rank)
    job = _EmbedJob(tower_dir=tower_dir, shards=shards, urls=urls, members=members, split=split,
                    split_dir=split_dir, work_dir=work_dir, wanted=wanted, device=device,
                    weights=weights, decoder=decoder, decoder_why=decoder_why,
                    batch_size=batch_size, workers=workers, compile=compile,
                    gpu_jpeg_share=gpu_jpeg_share, max_bad_fraction=max_bad_fraction,
                    progress=progress, rank=rank, world_size=world_size, start=start,
                    started=started, expert_parallel=expert_parallel)
    return _embed_job(job)


@dataclass
class _EmbedJob:
    """`embed_shards`' arguments once checked and resolved (see its docstring), and what it
    found: the source's `urls` and first sample's `members`, the `wanted` cache key and the
    `work_dir` keyed by it. `start`: perf_counter at the call; `started`: its wall-clock time."""
    tower_dir: str | Path
    shards: str
    urls: list[str]
    members: set
    split: str
    split_dir: Path
    work_dir: Path
    wanted: dict
    device: torch.device
    weights: torch.dtype
    decoder: str
    decoder_why: str
    batch_size: int
    workers: int | None
    compile: str | bool
    gpu_jpeg_share: float
    max_bad_fraction: float
    progress: bool
    rank: int
    world_size: int
    start: float
    started: float
    expert_parallel: int = 1


def _embed_job(job: _EmbedJob) -> dict:
    """Embed this process's shards not finished yet; on rank 0, then wait for every shard and put
    the split in place. → `embed_shards`' result."""
    if job.expert_parallel > 1:  # only this process's chunk of the experts is read
        expert_mesh = expert_group_mesh(job.device, job.expert_parallel)
        tower, meta = load_tower(job.tower_dir, device=job.device, dtype=job.weights,
                                 expert_mesh=expert_mesh)
        group = expert_mesh.get_group()
    else:
        tower, meta = load_tower(job.tower_dir, device=job.device)
    listed = listed_sizes(job.urls) or {}
    mine = [(index, url) for index, url in enumerate(job.urls)
            if index % job.world_size == job.rank]
    # a killed run's finished shards
    kept = {index: finished_shard(job.work_dir, index) for index, _ in mine}
    finished = [record for record in kept.values() if record is not None]
    todo = [(index, url) for index, url in mine if kept[index] is None]
    known = all(url in listed for _, url in todo)
    images_to_embed = sum(listed[url] for _, url in todo) if known else None
    compiled, compile_why = _choose_compile(job.compile, job.device, images_to_embed)
    if job.expert_parallel > 1:
        compiled, compile_why = False, f"expert_parallel={job.expert_parallel}"
    # eval(), no grad, weights cast once: no drop-path or dropout, the cache is the locked tower's
    # deterministic output.
    tower = prepare_for_inference(tower, dtype=job.weights, compile=compiled)
    preprocess = tower_preprocess(job.tower_dir, tower, meta)
    runner = tower if job.expert_parallel == 1 else GroupLockstep(
        tower, group, (tower.cfg.in_channels, preprocess.image_size, preprocess.image_size),
        job.device)
    pixels = pixel_transform(preprocess)  # uint8 from the workers (its decode too, as eval and LiT)
    normalize = BatchNormalize(preprocess)  # on `device`
    workers = (min(available_cpus(), len(todo)) if job.workers is None
               else min(job.workers, len(todo)))
    gpu_decoder, min_side = None, decode_min_side(pixels)
    if job.decoder == "gpu":
        gpu_decoder = gpu_jpeg.JpegBatchDecoder(
            job.device, preprocess.image_size, tower.cfg.in_channels,
            host_decode=lambda data: pixels(open_image(data, min_side)),  # as the workers decode
            min_side=min_side)  # the tower's reduced decode, mimicked there
    # Class shards without captions (`data from-folder --layout classes`: a labelled eval set) are
    # cached with their class alone, for zero-shot evaluation; everything else needs its caption.
    class_only = "cls" in job.members and "txt" not in job.members
    # what runs, once, where a user sees it (the result line goes to stdout)
    if job.rank == 0 and todo:
        print(f"embed: tower {job.tower_dir} on {job.device}, "
              f"{'bf16' if job.weights == torch.bfloat16 else 'fp32'} weights, "
              f"{'compiled' if compiled else 'eager'} ({compile_why}), {workers} worker(s) reading "
              f"shards, JPEGs decoded {gpu_jpeg.decoder_words(job.decoder, job.gpu_jpeg_share)} "
              f"({job.decoder_why})"
              + (f", {resized}" if (resized := resolution_change(tower, meta["preprocess"]))
                 else ""),
              file=sys.stderr, flush=True)
    progress_bar = tqdm(total=images_to_embed, desc="embed", unit="img",
                        disable=not job.progress or job.rank != 0, dynamic_ncols=True)
    progress_bar.set_postfix(shards=f"{len(finished)}/{len(mine)}")
    resumed = len(finished)
    timing = {"later_images": 0, "waiting_for_pixels": 0.0, "waiting_for_features": 0.0,
              "preparing": 0.0}
    try:
        if todo:
            dataset = ShardBatches(todo, "image-class" if class_only else "image-caption", pixels,
                                   job.batch_size, listed, with_cls="cls" in job.members,
                                   defer=(gpu_jpeg.DeferToGpu(job.gpu_jpeg_share)
                                          if gpu_decoder else None))
            embed_this_process_shards(todo, job.work_dir, dataset, runner, normalize, job.device,
                                      job.batch_size if compiled else None, gpu_decoder, workers,
                                      job.max_bad_fraction, str(job.shards), finished, progress_bar,
                                      timing)
        if job.expert_parallel > 1:  # the group's others may still have batches: join them
            runner.drain()
        mine_seconds = time.perf_counter() - job.start
        rates = _rates(job.start, timing)
        if job.rank != 0:  # rank 0 puts the split in place
            fresh = sum(record["num_samples"] for record in finished[resumed:])
            return _summary(job.split_dir, sum(r["num_samples"] for r in finished), tower.cfg.width,
                            round(mine_seconds, 3), per_second(fresh, mine_seconds),
                            seen_and_bad(finished)[2], job.rank, job.world_size,
                            resumed_shards=resumed, rates=rates)
        records = (wait_for_shards(job.work_dir, len(job.urls), job.started,
                                   lambda found: progress_bar.set_postfix(
                                       shards=f"{found}/{len(job.urls)} (all processes)"))
                   if job.world_size > 1 else
                   [finished_shard(job.work_dir, index) for index in range(len(job.urls))])
    except UserError as err:
        # tells rank 0, which waits for this process's shards, why they will not come
        if job.world_size > 1:
            report_failure(job.work_dir, job.rank, str(err))
        raise
    finally:
        progress_bar.close()

    # ---- rank 0: the whole split, checked, then put in place in one step
    num_samples, bad = _check_split(records, str(job.shards), class_only, job.max_bad_fraction)
    seconds = round(time.perf_counter() - job.start, 3)
    info = {**job.wanted, "split": job.split, "num_samples": num_samples, "dim": tower.cfg.width,
            "dtype": "float16", "with_cls": "cls" in job.members, "with_txt": not class_only,
            "bad": bad, "seconds": seconds, "processes": job.world_size}
    write_feature_split(job.work_dir, job.split_dir, records, info)
    rate = per_second(sum(r["num_samples"] for r in finished[resumed:]), mine_seconds)
    return _summary(job.split_dir, num_samples, tower.cfg.width, seconds, rate, bad, job.rank,
                    job.world_size, resumed_shards=resumed, rates=rates)


def rerun_command(tower_dir, source: str | None, split_dir: Path) -> str:
    """The embed command that makes the cache in `split_dir` again (the `remake` hint of
    `feature_cache.check_feature_cache`), each value quoted as a shell needs it: a `timm:...?file=`
    tower (a glob) or brace-expanded shards would otherwise be rewritten by the shell a user pastes
    it into."""
    words = ["lit-softmoe", "embed", "--tower", str(tower_dir), "--shards", source or "SHARDS",
             "--out", str(split_dir.parent), "--split", split_dir.name]
    return f"rerun `{shlex.join(words)}`"


def _check_flags(batch_size: int, workers: int | None, jpeg_decoder: str, gpu_jpeg_share: float,
                 split: str | None) -> None:
    """The command's own flags, named as the command takes them: the loader's checks would name
    data.* options that embed does not take."""
    for value, flag, least in ((batch_size, "--batch-size", 1), (workers, "--workers", 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if jpeg_decoder not in gpu_jpeg.DECODERS:
        raise UserError(f"--jpeg-decoder must be one of {', '.join(gpu_jpeg.DECODERS)}, "
                        f"got {jpeg_decoder!r}")
    if not 0.0 <= gpu_jpeg_share <= 1.0:
        raise UserError(f"--gpu-jpeg-share must be in [0, 1] (the fraction of the JPEGs the GPU "
                        f"decodes), got {gpu_jpeg_share}")
    if split is not None and (split in ("", ".", "..") or "/" in split or "\\" in split):
        raise UserError(f"--split {split!r} must be a folder name (e.g. train), not a path; "
                        "give the parent folder as --out")


def _check_split(records: list[dict], source: str, class_only: bool,
                 max_bad_fraction: float) -> tuple[int, dict]:
    """(samples, bad-sample counts by reason) of the whole split's shard records; a UserError when
    no sample could be embedded or too many were bad."""
    num_samples = sum(record["num_samples"] for record in records)
    _, _, bad = seen_and_bad(records)
    if num_samples == 0:
        needed = "an image and a .cls" if class_only else "an image and a .txt (or a .cls)"
        raise UserError(f"no sample of {source} could be embedded (skipped: {bad or 'nothing'}); "
                        f"check that its shards hold {needed} per sample")
    error = bad_fraction_error(source, records, max_bad_fraction)
    if error:
        raise UserError(error)
    return num_samples, bad


def _summary(split_dir: Path, num_samples: int, dim: int, seconds: float,
             images_per_second: float | None, bad: dict, rank: int, world_size: int,
             skipped: bool = False, resumed_shards: int = 0, rates: dict | None = None) -> dict:
    """`embed_shards`' result (its docstring says each key); `rates`: `_rates`' keys, None where
    nothing was embedded."""
    rates = rates or {"startup_seconds": None, "steady_images_per_second": None,
                      "steady_waits": None}
    return {"split_dir": str(split_dir), "num_samples": num_samples, "dim": dim, "seconds": seconds,
            "images_per_second": images_per_second, "bad": bad, "skipped": skipped,
            "resumed_shards": resumed_shards, "rank": rank, "world_size": world_size, **rates}


def _choose_compile(setting: str | bool, device: torch.device,
                    images: int | None) -> tuple[bool, str]:
    """(compile the tower?, why) for `--compile`: auto compiles on a GPU for long runs
    (`COMPILE_MIN_IMAGES`)."""
    if str(setting).strip().lower() != "auto":
        return resolve_compile(setting, device), f"--compile {str(setting).lower()}"
    if not resolve_compile("auto", device):
        return False, f"auto: the tower runs on {device.type}"
    if images is not None and images < COMPILE_MIN_IMAGES:
        return False, (f"auto: {images:,} images, fewer than the {COMPILE_MIN_IMAGES:,} that earn "
                       "the compile back")
    return True, "auto: a long run on a GPU"


def per_second(count: float, seconds: float) -> float:
    """`count` / `seconds` to one decimal, or to three significant digits below 1: a large tower on
    a CPU embeds under one image a second, which one decimal rounded to 0."""
    rate = count / max(seconds, 1e-9)
    return round(rate, 1) if rate >= 1 else float(f"{rate:.3g}")


def _rates(start: float, timing: dict) -> dict:
    """The seconds before the first batch was embedded (hashing and loading the tower, starting the
    workers, their first shards) and the images/s after it: on a large tower and a short run they
    differ most. "steady_waits": the shares of the steady time the loop waited for pixels and for
    features, and the share the device thread spent preparing batches (see
    `embed_this_process_shards`)."""
    if "first_batch" not in timing:
        return {"startup_seconds": None, "steady_images_per_second": None, "steady_waits": None}
    later = time.perf_counter() - timing["first_batch"]
    steady = (per_second(timing["later_images"], later) if timing["later_images"] and later > 0
              else None)
    waits = {key: round(timing[key] / later, 3)
             for key in ("waiting_for_pixels", "waiting_for_features", "preparing")}
    return {"startup_seconds": round(timing["first_batch"] - start, 3),
            "steady_images_per_second": steady,
            "steady_waits": waits if later > 0 else None}
