"""A pipeline run's Params as its tasks read them: where the run writes, and a Param left empty at its default.

    OUTPUT_ROOT                                        # "s3://{{ params.bucket or … }}/{{ params.prefix }}" (templated)
    fill_empty({"seed": None, "prefix": "x"}, {"seed": 0})   # {"seed": 0, "prefix": "x"}
    as_bool("False")                                   # False: a rendered template is a string

No airflow import: plugins/operators.py and plugins/pipeline.py both read these.
"""

from __future__ import annotations

from typing import Any

#: The bucket of a run: the `bucket` Param when set, else the `bucket` in the extra of the S3 connection
#: rlhf_s3, else "rlhf-flow". Moving to another store changes the connection, not the DAG.
BUCKET = "{{ params.bucket or conn.rlhf_s3.extra_dejson.get('bucket') or 'rlhf-flow' }}"
#: Where a run's stages write: s3://<bucket>/<prefix>.
OUTPUT_ROOT = "s3://" + BUCKET + "/{{ params.prefix }}"


def as_bool(value: Any) -> bool:
    """A templated flag's truth: rendered templates are strings ("True", "false", "1")."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes", "on")


def fill_empty(params, defaults: dict[str, Any]) -> dict[str, Any]:
    """A run's Params with each one left empty (null, as Airflow's form sends an emptied optional field) at its
    default: what every task of a pipeline reads."""
    return {name: defaults.get(name) if value is None else value for name, value in dict(params).items()}
