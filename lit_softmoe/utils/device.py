"""Devices, precision and the fast-path defaults as users name them (`--device cuda:1`,
`precision=auto`, `compile=auto`), resolved in one place so every command chooses alike."""
from __future__ import annotations

import os

import torch

from lit_softmoe.errors import UserError
from lit_softmoe.utils.distributed import local_rank

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `precision`, None for fp32: auto means bf16 on GPUs that support it,
    fp32 elsewhere (bf16 matmuls on CPUs are slow and change the numbers). fp16 is asked for by
    name: for GPUs without bf16 (compute capability below 8.0), where training needs a loss scaler
    (`create_accelerator` sets one up)."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def precision_name(dtype: torch.dtype | None) -> str:
    """An autocast dtype (None: none) as the precision names it: fp32, bf16 or fp16."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def inference_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The weight dtype of a tower that only runs forward (locked): bf16 or fp16 where `precision`
    runs in it (auto: bf16 on GPUs that support it), else fp32. Cast once, it halves the bytes read
    per batch and spares autocast a cast of every weight at every call."""
    return autocast_dtype(precision, device) or torch.float32


COMPILE_CHOICES = ("auto", "true", "false")


def resolve_compile(setting: str | bool, device: torch.device) -> bool:
    """Whether to `torch.compile`: `true` / `false`, or `auto` = on CUDA
    (where its fused kernels pay for the compile time) and off on the CPU (no faster there, and a
    C++ toolchain must be present)."""
    value = str(setting).strip().lower()  # YAML's true/false reach a str field as "True"/"False"
    if value not in COMPILE_CHOICES:
        raise UserError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {setting!r}")
    if value == "auto":
        return device.type == "cuda"
    return value == "true"


def available_cpus() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or taskset's limit),
    not the machine's count that `os.cpu_count` gives."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def parse_device(name: str | None, setting: str = "device") -> torch.device:
    """A device name as a torch.device (None: cuda when present, else cpu). A name torch
    does not know (`gpu`) or a GPU this machine lacks is a UserError, not a traceback at
    the first `.to`; its message calls the value `setting`, the name the caller knows it by
    (the CLI passes "--device")."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{setting} {name!r} is not a device; give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{setting} {name}: torch finds no CUDA GPU here; "
                            f"leave {setting} out or give cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"{setting} {name}: this machine has {count} CUDA GPU(s), "
                            f"cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{setting} {name}: torch finds no Apple GPU here; "
                        f"leave {setting} out or give cpu")
    return device


def process_device() -> torch.device:
    """Where this process runs a model when no `--device` is given: its own GPU
    (the launcher's LOCAL_RANK picks it, one GPU per process) when there is one, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank() % torch.cuda.device_count())


def autocast_context(device: torch.device, precision: str) -> torch.autocast:
    """`torch.autocast` for `precision` on `device`: in the dtype `autocast_dtype` gives, or off."""
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
