"""A config field's limits, declared once in its metadata: checked on a value, and written as JSON schema.

    lr: float = field(default=1e-4, metadata={"help": "peak learning rate", "exclusive_min": 0, "max": 1})

    check_declared(f, 0.0)            # ConfigError: lr: must be positive, got 0.0
    param_schema(SFTConfig, "lr")     # {"default": 0.0001, "type": "number", "exclusiveMinimum": 0, "maximum": 1, ...}

The limits a field's metadata may declare: `min`, `max`, `exclusive_min` and `exclusive_max` (bounds the value
must be strictly inside), `choices`, `max_length`, `pattern` (a regex the value must contain a match of, as JSON
schema's), and `fix` (advice added to a refusal). StageConfig.validate enforces them before a stage's own
cross-field checks, and `param_schema` turns them into the JSON schema of the run form's Param
(plugins/form.py), so the form refuses what the stage would. Neither torch nor airflow here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the field and the fix."""


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_declared(f: dataclasses.Field, value: Any) -> None:
    """Refuse `value` for field `f` when it breaks a limit the field's metadata declares (one line)."""
    meta, name = f.metadata, f.name
    fix = f"; {meta['fix']}" if "fix" in meta else ""
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        choices = [str(c) for c in meta["choices"]]
        raise ConfigError(f"{name}: {value!r} is not a choice; use {', '.join(choices[:-1])} or {choices[-1]}{fix}")
    if "min" in meta and value < meta["min"]:
        bound = "must not be negative" if meta["min"] == 0 else f"must be at least {_number(meta['min'])}"
        raise ConfigError(f"{name}: {bound}, got {value}{fix}")
    if "exclusive_min" in meta and not value > meta["exclusive_min"]:
        bound = "must be positive" if meta["exclusive_min"] == 0 else f"must be above {_number(meta['exclusive_min'])}"
        raise ConfigError(f"{name}: {bound}, got {value}{fix}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{name}: must be at most {_number(meta['max'])}, got {value}{fix}")
    if "exclusive_max" in meta and not value < meta["exclusive_max"]:
        raise ConfigError(f"{name}: must be below {_number(meta['exclusive_max'])}, got {value}{fix}")
    if "max_length" in meta and len(value) > meta["max_length"]:
        raise ConfigError(f"{name}: {len(value)} characters, more than {meta['max_length']}{fix}")
    if "pattern" in meta and not re.search(meta["pattern"], value):
        raise ConfigError(f"{name}: {value!r} is not of the form {meta['pattern']}{fix}")


#: JSON schema's keyword for each limit a field's metadata may declare.
SCHEMA_KEYWORDS = {
    "min": "minimum",
    "max": "maximum",
    "exclusive_min": "exclusiveMinimum",
    "exclusive_max": "exclusiveMaximum",
    "choices": "enum",
    "max_length": "maxLength",
    "pattern": "pattern",
}


def param_schema(cls: type, name: str) -> dict[str, Any]:
    """Field `name` of config class `cls` as a JSON schema (what an Airflow Param takes): its default, type,
    declared limits and its help as the description. A string that may be empty also takes null, which the
    UI's form sends for an emptied field (the DAG renders it as '')."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    kind = field_type(cls, f)
    json_type: Any = {bool: "boolean", int: "integer", float: "number", str: "string"}[kind]
    if kind is str and "choices" not in f.metadata and re.search(f.metadata.get("pattern", ""), ""):
        json_type = ["null", "string"]
    schema = {"default": f.default, "type": json_type, "description": f.metadata.get("help", "")}
    for key, keyword in SCHEMA_KEYWORDS.items():
        if key in f.metadata:
            schema[keyword] = list(f.metadata[key]) if key == "choices" else f.metadata[key]
    return schema


def field_type(cls: type, f: dataclasses.Field) -> type:
    """The concrete type of a field: int, float, str or bool (Optional[X] gives X)."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
