"""Checkpoints on disk: safetensors for every tensor, JSON for everything else, nothing pickled.

Two kinds:
- a *tower* folder (`model.safetensors` + `config.json`): what later stages (LiT, export) load;
- a *training state* folder (`state.safetensors` + `state.json`): model, optimizer moments and RNG
  state at a step, enough to resume exactly.
Both are written into a temporary sibling folder and renamed into place, so a run killed mid-write
never leaves a half-written checkpoint under the final name.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lit_softmoe.errors import UserError, check_writable
from lit_softmoe.models.vit import ViTConfig, VisionTransformer

TOWER_WEIGHTS, TOWER_CONFIG = "model.safetensors", "config.json"
STATE_TENSORS, STATE_META = "state.safetensors", "state.json"


_in_flight: set[Path] = set()  # temporary folders this process is writing right now (any thread)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux's renameat2 with RENAME_EXCHANGE); False
    where the system, its C library or the filesystem cannot, and the caller renames twice instead."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without the wrapper (glibc < 2.28, older musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. a filesystem without the flag
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _stale_leftovers(final_dir: Path) -> list[re.Match]:
    """Name matches (kind "tmp" | "old", pid, suffix) of the temporary siblings that killed
    `write_folder_atomically` calls left beside `final_dir`. A leftover is stale when the process named in it is gone, or
    carries this process's pid but is not being written by it: a job rerun in a fresh container
    often gets the same small pid. (Folders on a disk that several machines share are only judged
    by this machine's processes.)"""
    pattern = re.compile(rf"^\.{re.escape(final_dir.name)}\.(tmp|old)-(\d+)(-.*)?$")
    stale = []
    for path in final_dir.parent.iterdir() if final_dir.parent.is_dir() else []:
        match = pattern.match(path.name)
        if match and path not in _in_flight:
            pid = int(match.group(2))
            if pid == os.getpid() or pid <= 0 or not _is_alive(pid):
                stale.append(match)
    return stale


def recover_folder(final_dir: str | Path) -> None:
    """Remove what killed `write_folder_atomically` calls left beside `final_dir`; if one was
    killed between its two renames (systems without an atomic exchange), `final_dir` is missing
    and its previous version is put back first."""
    final_dir = Path(final_dir)
    for match in _stale_leftovers(final_dir):
        kind, path = match.group(1), final_dir.parent / match.string
        # An "old" holder keeps the previous version at holder/NAME; the pid-only name that
        # earlier versions used is the previous version itself.
        previous = path / final_dir.name if match.group(3) else path
        if kind == "old" and not final_dir.exists() and previous.is_dir():
            os.replace(previous, final_dir)
        shutil.rmtree(path, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read from /proc where it is there (os.umask can only read it by setting it,
    which for a moment changes the mode of files other threads create)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow_umask(folder: Path) -> None:
    """mkdtemp makes the folder private (0700) and safetensors its files (0600); a tower, a model, a
    checkpoint or an export is read by other users and programs too, so each gets the mode the umask
    gives new files and folders (0755 / 0644 under the usual 022)."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


class FolderTakenError(FileExistsError):
    """`write_folder_atomically(..., replace=False)` found its folder filled by another writer."""


def write_folder_atomically(final_dir: str | Path, write, replace: bool = True) -> Path:
    """Call `write(tmp_dir)`, then move tmp_dir to `final_dir` (replacing an older one).

    On Linux an older folder is swapped out in one atomic step, so a reader finds the old or the
    new folder, never none. Elsewhere it is renamed away first: a run killed between the two
    renames leaves `final_dir` missing, and the next call (or `load_tower`) puts the old one back.
    `replace=False`: `final_dir` may only be absent or empty; one that another writer filled while
    `write` ran is kept and FolderTakenError raised. The last step is then one rename, which refuses
    a folder holding files, so no check made earlier can be raced.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(final_dir)
    # The pid in the names tells a later call whether their writer is still alive.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-{os.getpid()}-", dir=final_dir.parent))
    _in_flight.add(tmp_dir)
    try:
        write(tmp_dir)
        _follow_umask(tmp_dir)
        if not replace:
            _rename_onto_empty(tmp_dir, final_dir)
        elif not final_dir.exists():
            os.replace(tmp_dir, final_dir)
        elif _exchange(tmp_dir, final_dir):
            pass  # tmp_dir now holds the old folder: removed below
        else:
            # A fresh, empty holder: the old folder's name there cannot collide with a leftover.
            holder = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old-{os.getpid()}-", dir=final_dir.parent))
            _in_flight.add(holder)
            try:
                os.replace(final_dir, holder / final_dir.name)
                os.replace(tmp_dir, final_dir)
            except BaseException:
                if not final_dir.exists():
                    os.replace(holder / final_dir.name, final_dir)
                raise
            finally:
                shutil.rmtree(holder, ignore_errors=True)
                _in_flight.discard(holder)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        _in_flight.discard(tmp_dir)
    return final_dir


def _rename_onto_empty(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)  # POSIX: takes an empty folder's place, refuses a filled one
    except OSError:
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()  # Windows refuses any existing folder: an empty one is removed first
            os.rename(src, dst)
        elif dst.exists():
            raise FolderTakenError(f"{dst} was filled by another writer") from None
        else:
            raise


def check_tower_out(out_dir: str | Path, record_key: str, record: dict, overwrite: bool,
                    source: str | Path) -> None:
    """Refuse, before any work, an `out_dir` that saving a tower there would destroy.

    Saving replaces the whole folder, so a non-empty one (a run, a dataset, another tower) needs
    `overwrite`, as export's --out does. A tower this same command wrote (config.json's
    `record_key` entry holds `record`) is replaced without it: a rerun gives the same tower.
    Never, even with `overwrite`: the folder the tower is read from, or one holding it.
    """
    out_dir = Path(out_dir)
    check_writable(out_dir, "--out", folder=True)
    target, source = out_dir.resolve(), Path(source).resolve()
    if target == source or target in source.parents:
        raise UserError(f"--out {out_dir} holds the input {source}; pick another folder")
    if (source / TOWER_CONFIG).is_file() and source in target.parents:
        # Saving the source tower again (a pretraining rerun) replaces its folder whole, with this one.
        raise UserError(f"--out {out_dir} is inside the input tower folder {source}; pick a folder outside it")
    if overwrite or not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    try:
        written = json.loads((out_dir / TOWER_CONFIG).read_text()).get(record_key) or {}
    except (OSError, ValueError, AttributeError):
        written = {}
    own_files = {p.name for p in out_dir.iterdir()} <= {TOWER_CONFIG, TOWER_WEIGHTS}
    if not (own_files and isinstance(written, dict) and all(written.get(k) == v for k, v in record.items())):
        raise UserError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it, "
                        "or pick another folder")


def _contiguous_state(module: torch.nn.Module, skip_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    # safetensors refuses shared or non-contiguous storage; detach + clone makes each tensor its own.
    return {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()
            if not k.startswith(skip_prefixes)}


# ---- towers -------------------------------------------------------------------------------------

def save_tower(out_dir: str | Path, tower: VisionTransformer, extra: dict | None = None) -> Path:
    """Save a tower as safetensors + config.json (tower config under "tower", plus `extra`)."""
    meta = {"tower": tower.cfg.to_dict(), **(extra or {})}

    def write(tmp: Path):
        save_file(_contiguous_state(tower), tmp / TOWER_WEIGHTS)
        (tmp / TOWER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")

    return write_folder_atomically(out_dir, write)


def update_tower_meta(tower_dir: str | Path, updates: dict) -> None:
    """Merge `updates` into a saved tower's config.json (rewritten atomically; weights untouched)."""
    path = Path(tower_dir) / TOWER_CONFIG
    meta = {**json.loads(path.read_text()), **updates}
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temporary, path)


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                     skip_prefixes: tuple[str, ...] = ()) -> None:
    """Raise UserError naming every missing, unexpected or mis-shaped key (a loud, pure loader)."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(skip_prefixes)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
    if mismatched:
        problems.append(f"{len(mismatched)} shapes differ, checkpoint vs tower (e.g. {'; '.join(mismatched[:2])})")
    if problems:
        raise UserError(f"{source} does not fit the tower: {'; '.join(problems)}; "
                        "use the tower name and options the checkpoint was trained with")


def load_weights(path: str | Path, device="cpu") -> dict[str, torch.Tensor]:
    """A safetensors file, or one UserError line naming it when it is missing or damaged (a folder
    copied only in part, a truncated download)."""
    try:
        return load_file(path, device=str(device))
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}: {err}); the folder is incomplete or damaged: "
                        "copy it again or write it anew") from None


def load_tower(path: str | Path, device="cpu") -> tuple[VisionTransformer, dict]:
    """Load a tower folder written by `save_tower`; returns (tower, its config.json contents)."""
    path = Path(path)
    if not path.exists():
        try:
            recover_folder(path)  # a save killed mid-replace, on a system without an atomic exchange
        except OSError:  # e.g. a read-only folder: say below that there is no tower
            pass
    config_file, weights_file = path / TOWER_CONFIG, path / TOWER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise UserError(f"{path} is not a tower checkpoint (needs {TOWER_CONFIG} and {TOWER_WEIGHTS}); "
                        "point to the `tower` folder of a finished pretraining run")
    try:
        meta = json.loads(config_file.read_text())
    except ValueError as err:
        raise UserError(f"{config_file} is not valid JSON ({err}); the tower folder is damaged: save or copy it again") \
            from None
    try:
        cfg = ViTConfig.from_dict(meta["tower"])
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{config_file} has no valid tower config: {err}") from None
    tower = VisionTransformer(cfg, device="meta")
    state = load_weights(weights_file, device)
    check_state_dict(tower, state, str(weights_file))
    tower.load_state_dict(state, assign=True)
    return tower, meta


# ---- training state -----------------------------------------------------------------------------

def save_training_state(ckpt_dir: str | Path, step: int, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, meta: dict | None = None,
                        skip_prefixes: tuple[str, ...] = ()) -> Path:
    """Model weights, optimizer moments and RNG at `step`, written atomically.

    `skip_prefixes` leaves out frozen parts (a locked image tower) that the run never changes.
    """
    tensors = {f"model.{k}": v for k, v in _contiguous_state(model, skip_prefixes).items()}
    opt_state = optimizer.state_dict()
    for param_id, param_state in opt_state["state"].items():
        for name, value in param_state.items():
            tensors[f"optim.{param_id}.{name}"] = torch.as_tensor(value).detach().contiguous().clone()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = rng
    # The names behind the optimizer's numbered parameters: a resume maps the moments by name, so a
    # parameter frozen since (or a model whose parameter order changed) still finds its own.
    info = {"step": step, "param_groups": opt_state["param_groups"],
            "param_names": _optimizer_param_names(model, optimizer), **(meta or {})}

    def write(tmp: Path):
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp / STATE_TENSORS)
        (tmp / STATE_META).write_text(json.dumps(info, indent=2) + "\n")

    return write_folder_atomically(ckpt_dir, write)


def load_training_state(ckpt_dir: str | Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, skip_prefixes: tuple[str, ...] = ()) -> dict:
    """Restore what `save_training_state` wrote; returns its JSON metadata (with "step")."""
    ckpt_dir = Path(ckpt_dir)
    info = json.loads((ckpt_dir / STATE_META).read_text())
    tensors = load_file(ckpt_dir / STATE_TENSORS)
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    check_state_dict(model, model_state, str(ckpt_dir), skip_prefixes)
    model.load_state_dict(model_state, strict=not skip_prefixes)
    opt_state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, param_id, name = key.split(".", 2)
            opt_state.setdefault(int(param_id), {})[name] = value
    optimizer.load_state_dict(_optimizer_state_by_name(ckpt_dir, info, opt_state, model, optimizer))
    torch.set_rng_state(tensors["rng.cpu"])
    cuda_states = [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in tensors]
    if cuda_states and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    return info


def _optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def _legacy_groupings(model: torch.nn.Module, now: list[list[str]]):
    """Candidate (decay, no-decay) name groups of a checkpoint written before names were saved, each
    in the model's parameter order as the optimizers were built: the groups as now; with the HF text
    towers' pooler, frozen since, still trained (its weight decayed, its bias not); and either of
    those with every scalar and vector undecayed, as LiT's groups were before Soft MoE's `scale` of
    unlocked blocks was decayed."""
    params = dict(model.named_parameters())
    order = {name: index for index, name in enumerate(params)}
    pooler = [name for name, param in params.items() if ".pooler." in name and not param.requires_grad]
    for extra in ([], pooler):
        for vectors_apart in (False, True):
            decayed = set(now[0]) | {name for name in extra if params[name].ndim >= 2}
            if vectors_apart:
                decayed = {name for name in decayed if params[name].ndim >= 2}
            names = sorted(now[0] + now[1] + extra, key=order.get)
            yield [[name for name in names if name in decayed], [name for name in names if name not in decayed]]


def _fits(saved_groups: list[dict], names: list[list[str]], opt_state: dict[int, dict],
          params: dict[str, torch.Tensor]) -> bool:
    """Whether `names` can be the checkpoint's groups: the same sizes, and each moment of its parameter's shape."""
    if [len(group["params"]) for group in saved_groups] != [len(group) for group in names]:
        return False
    return all(tuple(moment.shape) == tuple(params[name].shape)
               for group, group_names in zip(saved_groups, names)
               for param_id, name in zip(group["params"], group_names)
               for key, moment in opt_state.get(param_id, {}).items() if key.startswith("exp_avg"))


def _optimizer_state_by_name(ckpt_dir: Path, info: dict, opt_state: dict[int, dict], model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's optimizer state renumbered for `optimizer`, matching parameters by name.

    Moments of parameters the model no longer trains are dropped (e.g. the HF text towers' pooler,
    frozen since: it never gets a gradient). A checkpoint from before names were saved is read with
    the first of `_legacy_groupings` that fits it. A trained parameter the checkpoint lacks means
    another model: refused."""
    now = _optimizer_param_names(model, optimizer)
    saved_groups = info["param_groups"]
    saved = info.get("param_names")
    if saved is None and len(saved_groups) == len(now) == 2:  # written before names were saved
        params = dict(model.named_parameters())
        saved = next((names for names in _legacy_groupings(model, now)
                      if _fits(saved_groups, names, opt_state, params)), None)
    if saved is None or len(saved_groups) != len(now) or \
            [len(g["params"]) for g in saved_groups] != [len(names) for names in saved]:
        raise UserError(f"{ckpt_dir} holds the optimizer of another model "
                        f"({sum(len(g['params']) for g in saved_groups)} trained "
                        f"tensors, this one trains {sum(map(len, now))}); resume with the run's own settings, "
                        "or start a new run_dir")
    saved_ids = {name: param_id for group, names in zip(saved_groups, saved)
                 for param_id, name in zip(group["params"], names)}
    missing = [name for names in now for name in names if name not in saved_ids]
    if missing:
        raise UserError(f"{ckpt_dir} has no optimizer state for {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which this model trains; "
                        "resume with the run's own settings, or start a new run_dir")
    state, groups, next_id = {}, [], 0
    for saved_group, names in zip(saved_groups, now):
        ids = list(range(next_id, next_id + len(names)))
        next_id += len(names)
        for param_id, name in zip(ids, names):
            if saved_ids[name] in opt_state:
                state[param_id] = opt_state[saved_ids[name]]
        groups.append({**saved_group, "params": ids})
    return {"state": state, "param_groups": groups}


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete `step_*` folder (temporary folders start with '.' and are ignored)."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return None
    done = sorted(p for p in checkpoints_dir.glob("step_*") if (p / STATE_META).is_file())
    return done[-1] if done else None


def prune_checkpoints(checkpoints_dir: str | Path, keep: int) -> None:
    done = sorted(Path(checkpoints_dir).glob("step_*"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
