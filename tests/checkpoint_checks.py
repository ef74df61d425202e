"""Which checkpoints of a run hold finite weights (a diverged run must not save NaN ones)."""


def finite_checkpoints(run) -> dict[int, bool]:
    from safetensors.torch import load_file
    return {int(path.name.split("_")[1]): all(value.float().isfinite().all() for key, value in
                                              load_file(path / "state.safetensors").items() if key.startswith("model."))
            for path in sorted((run / "checkpoints").glob("step_*"))}
