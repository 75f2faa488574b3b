"""The stack's configuration: its ports and scratch folders, from defaults and the RLHF_* variables.

cfg = Config.from_env()        # defaults, overridden by the RLHF_* variables
env = process_env(cfg)         # os.environ + stack_env() + the venv's bin first on PATH

The parts it is built on have their own modules, and their names are importable from here too: the
environment of the stack's processes (tools/stack/environment.py: stack_env, conn_s3, conn_ray, REPO, BIN,
LOOPBACK), its credentials (tools/stack/credentials.py: airflow_login, s3_keys, ray_token, ...), and its
small files (tools/stack/files.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tools.stack.credentials import USERNAME, airflow_login, ray_auth_headers, ray_token, ray_token_file, s3_keys
from tools.stack.environment import BIN, LOOPBACK, REPO, conn_ray, conn_s3, stack_env
from tools.stack.files import atomic_write

# The stack's names, its parts' included: callers write `from tools.stack.config import conn_s3`.
__all__ = [
    "AIRFLOW_PROCS",
    "BIN",
    "COMPONENTS",
    "LOOPBACK",
    "ORDER",
    "RAY_WORKER_PORTS",
    "REPO",
    "USERNAME",
    "Config",
    "StackError",
    "airflow_login",
    "conn_ray",
    "conn_s3",
    "process_env",
    "ray_auth_headers",
    "ray_token",
    "ray_token_file",
    "s3_keys",
    "say",
    "stack_env",
]

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
        atomic_write(self.record, json.dumps(self.to_json(), indent=2) + "\n")

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
