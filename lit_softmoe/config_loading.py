"""Loading a typed config: `load_config` merges a config dataclass's defaults, a YAML file
(also a shipped one, by its short name) and `key=value` overrides, and checks every field's
declared constraint.

OmegaConf does the merging and type checking (a structured config rejects unknown keys and values
of the wrong type); this module only turns its errors into one line that names the fix.
"""
from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lit_softmoe.errors import UserError

T = TypeVar("T")


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
    # e.g. a key inside a list item (eval suites' benchmarks)
    if not close and schema_type is not None:
        close = difflib.get_close_matches(bad_key.rsplit(".", 1)[-1],
                                          sorted(_field_names(schema_type)), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _constraints(schema: type, prefix: str = ""):
    """(list key, dotted key, metadata) of each field of `schema` that declares a constraint
    (`choice`, `number`), nested config dataclasses included. The list key is None but for the
    fields of a list's items (eval suites' benchmarks): then it names the list and the key
    is the item's field."""
    import dataclasses
    import typing
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        hint, key = hints[spec.name], f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(hint):
            yield from _constraints(hint, key + ".")
        elif typing.get_origin(hint) is list \
                and dataclasses.is_dataclass(item := typing.get_args(hint)[0]):
            yield from ((key, item_key, rule) for _, item_key, rule in _constraints(item))
        elif spec.metadata:
            yield None, key, spec.metadata


def _check_pair(key: str, value, rule: dict) -> None:
    """A `pair` field's value, or a UserError naming the key and what it takes."""
    if value is None or (rule["optional"] and len(value) == 0):
        return
    low, high = rule["pair"]
    takes = (f"two numbers in [{low:g}, {high:g}]"
             + (", the first at most the second" if rule["ordered"] else "")
             + (", or [] for none" if rule["optional"] else ""))
    if len(value) != 2 or not all(low <= v <= high for v in value) \
            or (rule["ordered"] and value[0] > value[1]):
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
    return {"PretrainConfig": "pretrain", "LiTConfig": "lit",
            "EvalSuiteConfig": "suites"}.get(schema.__name__, "")


def shipped_configs(schema: type) -> list[str]:
    """The short names of the shipped configs for `schema` (suites by their bare name, e.g.
    "fashion-mnist")."""
    folder = _shipped_folder(schema)
    if folder == "suites":
        return sorted(path.stem for path in (SHIPPED_CONFIGS / folder).glob("*.yaml"))
    return sorted(f"{folder}/{path.stem}" for path in (SHIPPED_CONFIGS / folder).glob("*.yaml"))


def config_path(schema: type, name: str | Path) -> Path:
    """The YAML file `name` names: a file that exists, else a shipped one by its short name
    (`pretrain/fmnist-soft-tiny`, `fmnist-soft-tiny` for a pretraining config, `fashion-mnist`
    for a suite) or by its path in a source checkout (`configs/pretrain/fmnist-soft-tiny.yaml`,
    `eval/fashion-mnist.yaml`)."""
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
    return isinstance(value, str) and any(part.strip().startswith("pipe:")
                                          for part in value.split("::"))


def _refuse_commands_from_file(file_layer, command_line, path: Path) -> None:
    """A config file is data, loaded without running anything of it, except that a `pipe:`
    shard spec in it would be run as a shell command: a config from someone else would be code.
    Such a value is refused unless the user says so (LIT_SOFTMOE_ALLOW_PIPE=1), or gives it
    on the command line."""
    if os.environ.get(ALLOW_PIPE_ENV) == "1":
        return
    for key in _all_keys(file_layer):
        value = _select(file_layer, key)
        if _is_command(value) and _select(command_line, key) is None:
            raise UserError(f"{path} sets {key} to a shell command ({value[:60]!r}); a config file "
                            f"must not run commands unasked: set {ALLOW_PIPE_ENV}=1 if you trust "
                            f"it, or pass {key}=... on the command line")


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] = (),
                commands_from_file: bool = False) -> T:
    """Merge `schema`'s defaults, the YAML file at `path` and dotted `key=value` overrides.

    `path` is a file, or the short name of a shipped one (`config_path`). Every mistake (missing
    file, unknown key, wrong type, a value outside its choices) raises UserError with one line
    naming the key and the fix. A `pipe:` shard spec runs a shell command: one that comes from the
    file is refused unless `commands_from_file` or LIT_SOFTMOE_ALLOW_PIPE=1 (see
    `_refuse_commands_from_file`).
    """
    base = OmegaConf.structured(schema)
    layers = []  # (layer, where it came from), merged in this order
    if path is not None:
        path = config_path(schema, path)
        try:
            # The top level as YAML reads it: omegaconf reads a bare string as a key and refuses
            # a number.
            with open(path, encoding="utf-8") as stream:  # yaml's marks then name the file
                top = yaml.safe_load(stream)
            if top is not None and not isinstance(top, dict):
                raise UserError(f"{path} holds "
                                f"{'a list' if isinstance(top, list) else 'a single value'}, "
                                "not a mapping of config keys; write `key: value` lines "
                                "(e.g. `batch_size: 256`)")
            layers.append((OmegaConf.load(path), f" in {path}"))
        except UserError:
            raise
        except Exception as err:  # yaml's errors carry line numbers; keep them on one line
            raise UserError(f"cannot parse {path}: {' '.join(str(err).split())}") from None
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
    # `key=` means the empty string (a shell eats the quotes of `key=''`); OmegaConf
    # would read None.
    command_line = OmegaConf.from_dotlist([item + "''" if item.endswith("=") else item
                                           for item in overrides])
    layers.append((command_line, " on the command line"))
    if path is not None and not commands_from_file:
        _refuse_commands_from_file(layers[0][0], command_line, path)
    merged = base
    for layer, where in layers:  # one at a time, so a mistake is told where it was made
        try:
            merged = OmegaConf.merge(merged, layer)
        except ConfigKeyError as err:
            key = getattr(err, "full_key", None) or str(err)
            raise UserError(f"unknown config key {key!r}{where}"
                            f"{_suggest(str(key), base, schema)}") from None
        except (ValidationError, OmegaConfBaseException) as err:
            key = getattr(err, "full_key", "?")
            msg = str(err).splitlines()[0]
            # omegaconf's words for a single value given to a list key
            if "is not a ListConfig" in msg:
                msg = ("a list is needed: write it in brackets "
                       f"({key}='[…]' on a shell's command line)")
            raise UserError(f"bad value for config key {key!r}{where}: {msg}") from None
    # YAML's true/false reach a str field as "True"/"False"
    if isinstance(_select(merged, "compile"), str):
        merged.compile = merged.compile.lower()
    # the constraints declared beside the fields (`choice`, `number`)
    rules = list(_constraints(schema))
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
            raise UserError(f"config key {key!r} is {value}; "
                            f"it must be at least {minimum}: set {key}={minimum} or more")
    accum_steps, batch_size = _select(merged, "accum_steps"), _select(merged, "batch_size")
    if isinstance(accum_steps, int) and isinstance(batch_size, int) and batch_size % accum_steps:
        raise UserError(f"config key 'accum_steps' is {accum_steps}, which does not divide "
                        f"batch_size {batch_size}; choose a divisor of the batch (of each "
                        "process's share of it, under a launcher)")
    for key, rule in constraints:
        value, maximum = _select(merged, key), rule.get("maximum")
        if maximum is not None and value is not None and value > maximum:
            raise UserError(f"config key {key!r} is {value}; "
                            f"it must be at most {maximum}: set {key}={maximum} or less")
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
        raise UserError(f"cannot resolve config{f' {path}' if path else ''}: "
                        f"{str(err).splitlines()[0]}") from None
