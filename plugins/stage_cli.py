"""The contract with a stage process, ``python -m tasks.<stage> --output <uri> --run_id <id> --flag value ...``.

What the Airflow side and a stage agree on: the Ray submission id of a task's job, the folder its stage
writes, how a value becomes a flag and the flags an entrypoint, which run-conf keys may become flags, and
the line and exit status a stage stops with when its input is at fault (the stage side: tasks/common/stage.py).

    from plugins.stage_cli import build_entrypoint, failure_message, output_uri_for, submission_id_for

    sid = submission_id_for(dag_id, run_id, "sft")
    build_entrypoint("tasks.sft", output_uri_for(root, dag_id, run_id, "sft"), run_id, {"max_steps": 30})
    failure_message(event)  # a failed job's error: the stage's own cause first, then the driver log's tail
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

# What a stage prints as its last line when it stops on something only its input can fix (bad config, missing
# or corrupt data), and the exit status it then has: the contract in tasks/common/stages.py. Such a failure
# would fail again the same way, so it is not retried.
from tasks.common.stages import ERROR_PREFIX

_FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_MAX_SUBMISSION_ID = 120


def key_safe(value: str) -> str:
    """An object-key-safe form: characters outside [A-Za-z0-9._-] become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", value)


def ray_safe(value: str) -> str:
    """A submission-id-safe form: characters outside [A-Za-z0-9_-] become '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", value)


def submission_id_for(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The deterministic Ray submission id of a task instance (before any attempt suffix).

    ``airflow-<dag_id>--<run_id>--<task_id>[--m<map_index>]``, sanitized for Ray and URLs. Too long
    an id keeps its head and gains a short hash of the full one, so it stays unique and deterministic.
    """
    parts = [dag_id, run_id, task_id] + ([f"m{map_index}"] if map_index is not None and map_index >= 0 else [])
    raw = "airflow-" + "--".join(parts)
    sid = ray_safe(raw)
    if len(sid) > _MAX_SUBMISSION_ID:
        digest = hashlib.sha1(raw.encode()).hexdigest()[:10]
        sid = f"{sid[: _MAX_SUBMISSION_ID - 11]}-{digest}"
    return sid


def output_uri_for(output_root: str, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """``{output_root}/runs/{dag_id}/{run_id}/{task_id}`` with the run id made key-safe."""
    uri = f"{output_root.rstrip('/')}/runs/{dag_id}/{key_safe(run_id)}/{task_id}"
    if map_index is not None and map_index >= 0:
        uri += f"/{map_index}"
    return uri


def render_flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def render_flags(args: Mapping[str, Any] | None) -> list[str]:
    """``{key: value}`` -> ``["--key", "value", ...]``: None dropped, bools as true/false, lists/dicts as JSON."""
    out: list[str] = []
    for key, value in (args or {}).items():
        if not isinstance(key, str) or not _FLAG_NAME.match(key):
            raise ValueError(f"Bad flag name {key!r}: use letters, digits, '_' and '-'")
        if value is None:
            continue
        out += [f"--{key}", render_flag_value(value)]
    return out


def build_entrypoint(
    module: str, output: str, run_id: str, args: Mapping[str, Any] | None, python: str = "python"
) -> str:
    """``python -m <module> --output <output> --run_id <run_id> --flag value ...``, shell-quoted."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module or ""):
        raise ValueError(f"Bad module name {module!r}")
    argv = [python, "-m", module, "--output", output, "--run_id", run_id, *render_flags(args)]
    return shlex.join(argv)


def stage_cause(log: str) -> str | None:
    """The one-line cause a stage printed before exiting (``error: …``, tasks/common/stage.py), if any."""
    for line in reversed(log.splitlines()):
        if line.startswith(ERROR_PREFIX):
            return line[len(ERROR_PREFIX) :].strip()
    return None


def failure_message(event: Mapping[str, Any], submission_id: str | None = None) -> str:
    """One line of cause, then the last lines of the driver log. The line is the stage's own cause when it
    printed one (with the job's id and status after it), else the job's status and Ray's message."""
    sid = event.get("submission_id") or submission_id
    tail = event.get("log_tail") or ""
    cause = stage_cause(tail)
    if cause:
        exit_code = event.get("exit_code")
        headline = f"{cause} (Ray job {sid} {event.get('status')}" + (
            f", exit code {exit_code})" if exit_code is not None else ")"
        )
    else:
        message = " ".join(str(event.get("message") or "").split())
        if len(message) > 300:
            message = message[:297] + "..."
        headline = f"Ray job {sid} {event.get('status')}" + (f": {message}" if message else "")
    return f"{headline}\n--- last lines of the driver log ---\n{tail or '(empty driver log)'}"


def unknown_conf(conf: Mapping[str, Any], known: Iterable[str]) -> str | None:
    """A one-line refusal naming the run conf's keys that are not Params of the DAG (a typo would otherwise
    run the default silently), each with the closest Param name; None when every key is known."""
    known = sorted(known)
    bad = sorted(k for k in conf if k not in known)
    if not bad:
        return None
    named = []
    for key in bad:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"conf key{'s' if len(bad) > 1 else ''} {', '.join(named)} {'are' if len(bad) > 1 else 'is'} not "
        "Params of this DAG: fix the name and trigger again (the trigger form lists every Param)"
    )
