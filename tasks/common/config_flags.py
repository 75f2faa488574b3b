"""A stage's config filled from a YAML file, then from flags: every dataclass field is a flag and a key.

    cfg = parse_config(SFTConfig, ["--config", "sft.yaml", "--learning_rate", "5e-4"])
    cfg = make_config(SFTConfig, {"learning_rate": "5e-4", "bf16": "true"})    # tests and in-process callers
    split_list("rm_a, rm_b")                                                 # ["rm_a", "rm_b"]

`--learning_rate 5e-4` sets the field of that name (a bool also takes the bare form `--bf16`). Unknown keys and
wrong types raise ConfigError with one line naming the field and the fix; constructing the dataclass validates
the rest, before any work starts. Neither torch nor airflow here: the DAG side may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from tasks.common.config_limits import ConfigError, field_type


def split_list(value: str) -> list[str]:
    """The parts of a comma-separated flag value (several reward models, endpoints or input URIs)."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def _convert(name: str, kind: type, value: Any) -> Any:
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: {value!r} is not a boolean; use true or false")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {kind.__name__}") from None


def parse_config(cls: type, argv: list[str] | None = None, prog: str | None = None):
    """Build `cls` from `--config file.yaml` (optional) and `--field value` flags; validate it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip(), allow_abbrev=False)
    parser.add_argument("--config", help="YAML file of field: value pairs; flags override it")
    for name, f in fields.items():
        kind = field_type(cls, f)
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help: "95%" would crash --help
        names = [f"--{name}"] + [
            f"--{alias}" for alias in f.metadata.get("aliases", ())
        ]  # a peer's flag name for the same thing
        if kind is bool:
            parser.add_argument(
                *names, dest=name, nargs="?", const="true", default=None, metavar="BOOL", help=help_text
            )
        else:
            parser.add_argument(*names, dest=name, default=None, metavar=kind.__name__.upper(), help=help_text)
    # argparse's own errors are already one line; exit code 2 like every usage error.
    args = parser.parse_args(argv)

    values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config: file {args.config} not found; pass an existing YAML file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {args.config} must hold a mapping of field: value")
        unknown = sorted(set(loaded) - set(fields))
        if unknown:
            raise ConfigError(
                f"config: unknown field {unknown[0]!r} in {args.config}; known fields: {', '.join(fields)}"
            )
        values.update(loaded)
    for name in fields:
        flag = getattr(args, name)
        if flag is not None:
            values[name] = flag
    return make_config(cls, values)


def make_config(cls: type, values: dict[str, Any]):
    """Build `cls` from a mapping, each value converted to its field's type (used by tests and in-process callers
    too); constructing it validates it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field for {cls.__name__}; known fields: {', '.join(fields)}")
    converted = {name: _convert(name, field_type(cls, fields[name]), v) for name, v in values.items()}
    return cls(**converted)
