"""Where the stack runs, and the environment of every process it starts: one source of truth.

    env = stack_env(scratch, airflow_port=8080, s3_port=9000)   # every variable, secrets made on first use
    conn_s3("http://127.0.0.1:9000", "rlhf-flow")             # AIRFLOW_CONN_RLHF_S3's value

The stack runs from this checkout (REPO) on the interpreter running this file (BIN: make uses
.venv/bin/python), every service on loopback. What changes here is what the Ray head, its job drivers and
workers, and the Airflow components are configured with; the ports and folders themselves are
tools/stack/config.py (Config.env() calls stack_env with them).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from tasks.common import names
from tools.stack.credentials import USERNAME, airflow_login, ray_token, ray_token_file, s3_keys
from tools.stack.files import write_once

REPO = Path(__file__).resolve().parents[2]
# The interpreter running this file is the environment the stack runs from (make uses .venv/bin/python).
BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"


def conn_s3(
    endpoint: str, bucket: str = "rlhf-flow", region: str = "us-east-1", keys: tuple[str, str] = ("testing", "testing")
) -> str:
    """AIRFLOW_CONN_RLHF_S3: an aws connection to the S3 emulator; its extra `bucket` is the pipeline's
    default bucket (the DAG's `bucket` Param left empty)."""
    return json.dumps(
        {
            "conn_type": "aws",
            "login": keys[0],
            "password": keys[1],
            "extra": {"endpoint_url": endpoint, "region_name": region, "bucket": bucket},
        }
    )


def conn_ray(dashboard_port: int, host: str = LOOPBACK, token: str | None = None) -> str:
    """AIRFLOW_CONN_RLHF_RAY: the Ray dashboard (job submission API); its password is the cluster's token, which
    plugins/hooks.py sends as `Authorization: Bearer …` and nowhere else."""
    conn: dict[str, Any] = {"conn_type": "http", "host": host, "port": dashboard_port, "schema": "http"}
    if token:
        conn["password"] = token
    return json.dumps(conn)


def stack_env(
    scratch: Path | str,
    airflow_port: int = 8080,
    s3_port: int = 9000,
    ray_port: int = 6379,
    dashboard_port: int = 8265,
    bucket: str = "rlhf-flow",
    dags_folder: Path | str | None = None,
) -> dict[str, str]:
    """Every variable the stack's processes need (Ray head and job drivers, Airflow components and workers).

    PATH is not included: launch() puts the venv's bin first. Secrets are created in the scratch folder on
    first use.
    """
    scratch = Path(scratch).resolve()
    airflow_home = scratch / "airflow"
    secrets_dir = scratch / "secrets"
    s3 = f"http://{LOOPBACK}:{s3_port}"
    airflow_url = f"http://{LOOPBACK}:{airflow_port}"
    _, _ = airflow_login(scratch)  # make sure the passwords file exists before any Airflow process reads it
    key_id, secret = s3_keys(scratch)
    ray_auth = ray_token(scratch)
    env = {
        # The stack's own settings, for DAGs, stages and scripts that want them.
        "RLHF_SCRATCH": str(scratch),
        "RLHF_AIRFLOW_PORT": str(airflow_port),
        "RLHF_S3_PORT": str(s3_port),
        "RLHF_RAY_PORT": str(ray_port),
        "RLHF_RAY_DASHBOARD_PORT": str(dashboard_port),
        "RLHF_BUCKET": bucket,
        # S3: Ray nodes and Airflow get it from their own environment, never from a job's runtime_env.
        "AWS_ACCESS_KEY_ID": key_id,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": s3,
        # Offline ML stack.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(scratch / "hf"),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(scratch / "wandb"),
        "WANDB_CACHE_DIR": str(scratch / "wandb-cache"),
        # One JIT cache for DeepSpeed's ops, shared by every stack and the tests: each op builds once.
        "TORCH_EXTENSIONS_DIR": str(REPO / ".scratch" / "torch_extensions"),
        "TORCHINDUCTOR_CACHE_DIR": str(
            REPO / ".scratch" / "torchinductor"
        ),  # torch.compile's kernels (--torch_compile)
        "TOKENIZERS_PARALLELISM": "false",
        # Ray: the only setting that makes every Ray listener bind 127.0.0.1; no usage reports.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray asks every client for the stack's token: loopback alone would let any process on the machine run
        # jobs (as this user, with the S3 keys above). The head, its job drivers and workers read it from the
        # file (so a job's runtime_env never needs it); Airflow sends it from the rlhf_ray connection below.
        # A shell's RAY_AUTH_TOKEN would win over the file: process_env() drops it.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(ray_token_file(scratch)),
        # Airflow 3.3: SQLite + LocalExecutor, everything on loopback.
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__DAGS_FOLDER": str(Path(dags_folder).resolve() if dags_folder else REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{airflow_url}/execution/",
        "AIRFLOW__CORE__FERNET_KEY": write_once(
            secrets_dir / "fernet_key", lambda: base64.urlsafe_b64encode(os.urandom(32)).decode()
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(airflow_home / "passwords.json"),
        "AIRFLOW__API__HOST": LOOPBACK,
        "AIRFLOW__API__PORT": str(airflow_port),
        "AIRFLOW__API__BASE_URL": airflow_url,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__SECRET_KEY": write_once(secrets_dir / "api_secret_key", lambda: secrets.token_urlsafe(32)),
        "AIRFLOW__API_AUTH__JWT_SECRET": write_once(secrets_dir / "jwt_secret", lambda: secrets.token_urlsafe(32)),
        # New and changed DAG files show up within seconds.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        # Connections come from the environment, never from the UI or the database.
        names.conn_env(names.S3_CONN): conn_s3(s3, bucket, keys=(key_id, secret)),
        names.conn_env(names.RAY_CONN): conn_ray(dashboard_port, token=ray_auth),
    }
    return env
