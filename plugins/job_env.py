"""What a stage's Ray job takes along: the project's code as its working_dir, and an environment with no secret.

    refuse_secret_env({"HF_HOME": "/cache"})            # a name such as AWS_SECRET_ACCESS_KEY: ValueError
    job_runtime_env({"HF_HOME": "/cache"}, code_dir)    # {"env_vars": {...}, "working_dir": code_dir, "excludes": [...]}
    default_working_dir()                               # the project root of a source checkout, else None

A runtime_env is readable by anyone who reaches Ray's dashboard and is written to Ray's logs: never
credentials in it, Ray nodes get S3 access from their own environment.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tasks.common import allowlist

#: The folder holding plugins/ and tasks/ (a source checkout; see :func:`default_working_dir`).
PROJECT_ROOT = Path(__file__).resolve().parents[1]

#: What never travels to Ray with the working_dir (gitignore syntax, relative to the working_dir).
WORKING_DIR_EXCLUDES = [".venv", ".scratch", ".git", "__pycache__", "tests", "bench", "docker", "*.whl"]

#: Settings every job gets. Never credentials: Ray nodes get S3 access from their own environment.
DEFAULT_ENV_VARS = {"PYTHONUNBUFFERED": "1"}
#: The operator's settings from the Airflow side's environment that every job gets too (what a stage may reach).
OPERATOR_ENV_VARS = (allowlist.ENV, allowlist.CODE_DIRS_ENV)
_SECRET_ENV = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|SESSION_KEY|API_KEY", re.I)


def default_working_dir() -> str | None:
    """The project root when this is a source checkout (it holds plugins/, tasks/ and pyproject.toml).

    Installed as a package (site-packages), there is nothing sensible to ship: the Ray workers are then
    expected to have ``rlhf-flow[train]`` installed, and the job runs with no working_dir.
    """
    root = PROJECT_ROOT
    if (root / "tasks").is_dir() and (root / "plugins").is_dir() and (root / "pyproject.toml").is_file():
        return str(root)
    return None


def refuse_secret_env(env_vars: dict[str, str]) -> None:
    """Refuse extra job environment whose names look like credentials."""
    bad = sorted(k for k in env_vars if _SECRET_ENV.search(k))
    if bad:
        raise ValueError(
            f"env_vars {bad} look like credentials: never ship secrets in a Ray runtime_env; give the Ray nodes their own access instead"
        )


def job_runtime_env(env_vars: dict[str, Any], working_dir: str | None) -> dict[str, Any]:
    """The job's runtime_env: DEFAULT_ENV_VARS, the operator's settings, ``env_vars``; ``working_dir`` shipped."""
    # The operator's allow-lists (tasks/common/allowlist.py) as this side has them: one setting rules both sides.
    allowed = {k: os.environ[k] for k in OPERATOR_ENV_VARS if k in os.environ}
    env: dict[str, Any] = {"env_vars": {**DEFAULT_ENV_VARS, **allowed, **{k: str(v) for k, v in env_vars.items()}}}
    if working_dir:
        env["working_dir"] = str(working_dir)
        env["excludes"] = list(WORKING_DIR_EXCLUDES)
    return env
