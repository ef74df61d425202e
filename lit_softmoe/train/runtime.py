"""What every recipe sets up first: threads, precision and the accelerate object."""
from __future__ import annotations

import math

import torch
from accelerate import Accelerator


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 or None (fp32) for `precision`: auto means bf16 on GPUs that support it, fp32 elsewhere
    (bf16 matmuls on CPUs are slow and change the numbers)."""
    from lit_softmoe.errors import UserError
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else None
    return torch.bfloat16 if precision == "bf16" else None


def parse_device(name: str | None) -> torch.device:
    """A `--device` value as a torch.device (None: cuda when present, else cpu). A name torch does
    not know (`gpu`) or a GPU this machine lacks is a UserError, not a traceback at the first `.to`."""
    from lit_softmoe.errors import UserError
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is not a device; give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {name}: torch finds no CUDA GPU here; leave --device out or give cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: torch finds no Apple GPU here; leave --device out or give cpu")
    return device


def create_accelerator(precision: str = "auto", threads: int = 0) -> Accelerator:
    """`precision`: auto (bf16 on GPUs that support it, else fp32) | fp32 | bf16."""
    if threads > 0:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mixed_precision = "bf16" if autocast_dtype(precision, device) is not None else "no"
    # cpu=True on GPU-less machines: accelerate only forms a multi-process (gloo) group on the CPU
    # when told so, e.g. under `torchrun --nproc_per_node 2`.
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())


def resume_state(checkpoints_dir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 skip_prefixes: tuple[str, ...] = ()) -> tuple[int, float, object]:
    """(step, training seconds so far, the checkpoint) from the newest complete checkpoint; (0, 0, None)."""
    from lit_softmoe.train.checkpoint import latest_checkpoint, load_training_state
    latest = latest_checkpoint(checkpoints_dir)
    if latest is None:
        return 0, 0.0, None
    state = load_training_state(latest, model, optimizer, skip_prefixes=skip_prefixes)
    return state["step"], state.get("train_seconds", 0.0), latest


def open_run_folder(run_dir, config, step: int, is_main: bool):
    """Write the run's config.yaml and open its metrics log, dropping records past `step`
    (what a killed run logged after its last checkpoint)."""
    from lit_softmoe.config import to_yaml
    from lit_softmoe.train.logging import RunLogger
    logger = RunLogger(run_dir, enabled=is_main)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
        logger.truncate_after(step)
    return logger


def global_loss(accelerator: Accelerator, loss: torch.Tensor, step: int) -> float:
    """The loss averaged over all processes (the global batch's); a non-finite one stops the run."""
    from lit_softmoe.errors import UserError
    value = accelerator.reduce(loss.detach(), reduction="mean").item()
    if not math.isfinite(value):
        raise UserError(f"training diverged: loss is {value} at step {step}; "
                        "lower optim.lr or raise optim.warmup_steps")
    return value
