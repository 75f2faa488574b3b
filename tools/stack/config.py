"""The stack's configuration: ports, scratch paths and the environment of every process it starts.

cfg = Config.from_env()        # defaults, overridden by the RLHF_* variables
env = process_env(cfg)         # os.environ + stack_env() + the venv's bin first on PATH
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Callable

from tasks.common import names

REPO = Path(__file__).resolve().parents[2]
# The interpreter running this file is the environment the stack runs from (make uses .venv/bin/python).
BIN = Path(sys.executable).parent

USERNAME = "admin"
LOOPBACK = "127.0.0.1"
# Ray hands ports in this range to its workers; a port of ours inside it makes `ray start` fail.
RAY_WORKER_PORTS = range(10002, 20000)

AIRFLOW_PROCS = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
COMPONENTS = {"s3": ("s3",), "ray": ("ray",), "airflow": AIRFLOW_PROCS}
ORDER = ("s3", "ray", "airflow")


class StackError(RuntimeError):
    """A one-line, user-facing failure."""


def say(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass
class Config:
    scratch: Path
    airflow_port: int = 8080
    s3_port: int = 9000
    ray_port: int = 6379
    dashboard_port: int = 8265
    ray_client_port: int = 10001
    ray_agent_port: int = 52365
    bucket: str = "rlhf-flow"
    dags_folder: Path = REPO / "dags"
    num_cpus: int = 2

    # env var -> field
    ENV = {
        "RLHF_SCRATCH": "scratch",
        "RLHF_AIRFLOW_PORT": "airflow_port",
        "RLHF_S3_PORT": "s3_port",
        "RLHF_RAY_PORT": "ray_port",
        "RLHF_RAY_DASHBOARD_PORT": "dashboard_port",
        "RLHF_RAY_CLIENT_PORT": "ray_client_port",
        "RLHF_RAY_AGENT_PORT": "ray_agent_port",
        "RLHF_BUCKET": "bucket",
        "RLHF_DAGS_FOLDER": "dags_folder",
        "RLHF_RAY_NUM_CPUS": "num_cpus",
    }

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, base: "Config | None" = None) -> "Config":
        """Defaults (or base's values), overridden by the RLHF_* variables that are set."""
        environ = os.environ if environ is None else environ
        kw: dict[str, Any] = dataclasses.asdict(base) if base is not None else {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for var, field in cls.ENV.items():
            value = environ.get(var)
            if value in (None, ""):
                continue
            if types[field] in ("int", int):
                try:
                    kw[field] = int(value)
                except ValueError:
                    raise StackError(f"{var}={value!r} is not a number") from None
            elif types[field] in ("Path", Path):
                kw[field] = Path(value).expanduser().resolve()
            else:
                kw[field] = value
        kw.setdefault("scratch", REPO / ".scratch")
        return cls(**kw)

    def __post_init__(self) -> None:
        self.scratch = Path(self.scratch).resolve()
        self.dags_folder = Path(self.dags_folder).resolve()

    # Paths -------------------------------------------------------------------------------------
    @property
    def pids(self) -> Path:
        return self.scratch / "pids"

    @property
    def logs(self) -> Path:
        return self.scratch / "logs"

    @property
    def airflow_home(self) -> Path:
        return self.scratch / "airflow"

    @property
    def s3_data(self) -> Path:
        """Where the S3 emulator keeps its objects (tools/s3_server.py writes through to it)."""
        return self.scratch / "s3-data"

    @property
    def snapshot(self) -> Path:
        """Where `down` saved S3 before the emulator wrote through to disk: migrated once by `up`."""
        return self.scratch / "s3-snapshot"

    @property
    def record(self) -> Path:
        return self.scratch / "stack.json"

    @property
    def ray_temp_dir(self) -> Path:
        """Ray's --temp-dir: <scratch>/ray, or a short /tmp path linked from there.

        Ray puts Unix sockets at <temp>/session_<date>_<pid>/sockets/plasma_store, and a socket path is
        limited to 107 bytes: the temp dir itself may use about 40.
        """
        wanted = self.scratch / "ray"
        if len(str(wanted)) <= 40:
            return wanted
        return Path("/tmp") / f"rlhf-ray-{hashlib.sha1(str(self.scratch).encode()).hexdigest()[:10]}"

    # URLs --------------------------------------------------------------------------------------
    @property
    def airflow_url(self) -> str:
        return f"http://{LOOPBACK}:{self.airflow_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.dashboard_port}"

    def ports(self) -> dict[str, int]:
        return {
            "RLHF_AIRFLOW_PORT": self.airflow_port,
            "RLHF_S3_PORT": self.s3_port,
            "RLHF_RAY_PORT": self.ray_port,
            "RLHF_RAY_DASHBOARD_PORT": self.dashboard_port,
            "RLHF_RAY_CLIENT_PORT": self.ray_client_port,
            "RLHF_RAY_AGENT_PORT": self.ray_agent_port,
        }

    def check_ports(self) -> None:
        seen: dict[int, str] = {}
        for var, port in self.ports().items():
            if not 0 < port < 65536:
                raise StackError(f"{var}={port} is not a valid port")
            if port in RAY_WORKER_PORTS:
                raise StackError(
                    f"{var}={port} lies in Ray's worker port range {RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1}: pick another port"
                )
            if port in seen:
                raise StackError(f"{var} and {seen[port]} are both {port}")
            seen[port] = var

    def env(self) -> dict[str, str]:
        return stack_env(
            self.scratch,
            airflow_port=self.airflow_port,
            s3_port=self.s3_port,
            ray_port=self.ray_port,
            dashboard_port=self.dashboard_port,
            bucket=self.bucket,
            dags_folder=self.dags_folder,
        )

    # Recorded configuration of a started stack --------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}

    def save(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.record, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, scratch: Path) -> "Config | None":
        try:
            data = json.loads((Path(scratch) / "stack.json").read_text())
        except (OSError, ValueError):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _all_procs() -> list[str]:
    return [p for c in ORDER for p in COMPONENTS[c]]


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# The environment: one source of truth


def _secret(path: Path, make: Callable[[], str]) -> str:
    """A value generated once into the scratch folder and reused."""
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def airflow_login(scratch: Path) -> tuple[str, str]:
    """(username, password) of the stack's Airflow; the password is generated once into the scratch folder.

    The file is the simple auth manager's own passwords file ([core] simple_auth_manager_passwords_file),
    written before the API server starts, so Airflow never generates another one.
    """
    path = Path(scratch) / "airflow" / "passwords.json"
    try:
        passwords = json.loads(path.read_text())
        if passwords.get(USERNAME):
            return USERNAME, passwords[USERNAME]
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    _atomic_write(path, json.dumps({USERNAME: password}) + "\n", mode=0o600)
    return USERNAME, password


def s3_keys(scratch: Path) -> tuple[str, str]:
    """The embedded S3's access key id and secret, made once per stack. The emulator accepts any pair; a
    secret of its own lets a test prove that it never reaches Ray's API or logs."""
    secrets_dir = Path(scratch) / "secrets"
    return (
        _secret(secrets_dir / "s3_access_key_id", lambda: "RLHF" + secrets.token_hex(8).upper()),
        _secret(secrets_dir / "s3_secret_access_key", lambda: secrets.token_urlsafe(30)),
    )


def ray_token_file(scratch: Path) -> Path:
    """Where a stack keeps the token its Ray head asks for: <scratch>/secrets/ray_auth_token (mode 0600)."""
    return Path(scratch) / "secrets" / "ray_auth_token"


def ray_token(scratch: Path, make: Callable[[], str] | None = None) -> str:
    """The stack's Ray token (RAY_AUTH_MODE=token), made once per stack and reused: 256 random bits, as
    `ray get-auth-token --generate` makes them. `make` gives a new stack's value (the tests give their heads the
    token their own process holds). A file others may read is made private again: the token owns the cluster."""
    path = ray_token_file(scratch)
    token = _secret(path, make or (lambda: secrets.token_hex(32)))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return token


def ray_auth_headers(scratch: Path) -> dict[str, str]:
    """The header the stack's own clients (health checks, scripts) send to its Ray dashboard."""
    return {"Authorization": f"Bearer {ray_token(scratch)}"}


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
        "AIRFLOW__CORE__FERNET_KEY": _secret(
            secrets_dir / "fernet_key", lambda: base64.urlsafe_b64encode(os.urandom(32)).decode()
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(airflow_home / "passwords.json"),
        "AIRFLOW__API__HOST": LOOPBACK,
        "AIRFLOW__API__PORT": str(airflow_port),
        "AIRFLOW__API__BASE_URL": airflow_url,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__SECRET_KEY": _secret(secrets_dir / "api_secret_key", lambda: secrets.token_urlsafe(32)),
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret(secrets_dir / "jwt_secret", lambda: secrets.token_urlsafe(32)),
        # New and changed DAG files show up within seconds.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        # Connections come from the environment, never from the UI or the database.
        names.conn_env(names.S3_CONN): conn_s3(s3, bucket, keys=(key_id, secret)),
        names.conn_env(names.RAY_CONN): conn_ray(dashboard_port, token=ray_auth),
    }
    return env


def process_env(cfg: Config, base: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment of a stack process: base (default os.environ) + stack_env + the venv's bin first."""
    env = dict(os.environ if base is None else base)
    # Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH: another cluster's token in the caller's environment
    # would become this head's token, and refuse the stack's own clients.
    env.pop("RAY_AUTH_TOKEN", None)
    env.update(cfg.env())
    path = env.get("PATH", os.defpath).split(os.pathsep)
    env["PATH"] = os.pathsep.join([str(BIN)] + [p for p in path if p and p != str(BIN)])
    return env
