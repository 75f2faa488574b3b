#!/usr/bin/env python3
"""The local stack: an S3 emulator, a Ray head and Airflow 3.3, all on 127.0.0.1.

    python tools/stack.py up [s3|ray|airflow ...]     start (idempotent, health-checked)
    python tools/stack.py down [s3|ray|airflow ...]   stop what `up` started (S3's objects stay on disk)
    python tools/stack.py status                      one line per process: state, pid, URL
    python tools/stack.py env                         `export K=V` lines: eval "$(python tools/stack.py env)"

Configured by environment variables (defaults in brackets): RLHF_SCRATCH [<repo>/.scratch],
RLHF_AIRFLOW_PORT [8080], RLHF_S3_PORT [9000], RLHF_RAY_PORT [6379], RLHF_RAY_DASHBOARD_PORT [8265],
RLHF_RAY_CLIENT_PORT [10001], RLHF_RAY_AGENT_PORT [52365], RLHF_BUCKET [rlhf-flow],
RLHF_DAGS_FOLDER [<repo>/dags], RLHF_RAY_NUM_CPUS [2].

Every process started here gets its own session (process group); its PID file is
$RLHF_SCRATCH/pids/<name>.pid and its output $RLHF_SCRATCH/logs/<name>.log. `down` signals only those
PIDs (and their descendants); it never runs `ray stop`, which would stop every Ray on the machine.

The S3 emulator (tools/s3_server.py) writes every object through to $RLHF_SCRATCH/s3-data before it
answers, so nothing committed is lost when it stops or dies.

Only the standard library, psutil and (for S3 clients) boto3 are imported, so test fixtures and
tools/demo.py can import this module cheaply.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the project's shared names (standard library only)
from tasks.common import names  # noqa: E402

# The interpreter running this file is the environment the stack runs from (make uses .venv/bin/python).
BIN = Path(sys.executable).parent

USERNAME = "admin"
LOOPBACK = "127.0.0.1"
# Ray hands ports in this range to its workers; a port of ours inside it makes `ray start` fail.
RAY_WORKER_PORTS = range(10002, 20000)

AIRFLOW_PROCS = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
COMPONENTS = {"s3": ("s3",), "ray": ("ray",), "airflow": AIRFLOW_PROCS}
ORDER = ("s3", "ray", "airflow")

START_TIMEOUT = {"s3": 30.0, "ray": 120.0, "airflow": 180.0}


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
                    f"{var}={port} lies in Ray's worker port range {RAY_WORKER_PORTS.start}-"
                    f"{RAY_WORKER_PORTS.stop - 1}: pick another port"
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


def current_config(environ: dict[str, str] | None = None) -> Config:
    """The configuration of the stack in $RLHF_SCRATCH.

    While any of it runs: the recorded one (stack.json), so `down`, `status`, `env`, tools/demo.py and a
    second `up` find a stack started on other ports without repeating the variables. Otherwise the
    RLHF_* variables over the defaults.
    """
    asked = Config.from_env(environ)
    recorded = Config.load(asked.scratch)
    if recorded is not None and any(running(recorded, n) for n in _all_procs()):
        return recorded
    return asked


def config_for_up(environ: dict[str, str] | None = None) -> Config:
    """current_config(), with the RLHF_* variables that are set on top (up refuses them if they differ)."""
    return Config.from_env(environ, base=current_config(environ))


def _all_procs() -> list[str]:
    return [p for c in ORDER for p in COMPONENTS[c]]


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
    return (_secret(secrets_dir / "s3_access_key_id", lambda: "RLHF" + secrets.token_hex(8).upper()),
            _secret(secrets_dir / "s3_secret_access_key", lambda: secrets.token_urlsafe(30)))


def conn_s3(endpoint: str, bucket: str = "rlhf-flow", region: str = "us-east-1",
            keys: tuple[str, str] = ("testing", "testing")) -> str:
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


def conn_ray(dashboard_port: int, host: str = LOOPBACK) -> str:
    """AIRFLOW_CONN_RLHF_RAY: the Ray dashboard (job submission API)."""
    return json.dumps({"conn_type": "http", "host": host, "port": dashboard_port, "schema": "http"})


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
        "TORCHINDUCTOR_CACHE_DIR": str(REPO / ".scratch" / "torchinductor"),  # torch.compile's kernels (--torch_compile)
        "TOKENIZERS_PARALLELISM": "false",
        # Ray: the only setting that makes every Ray listener bind 127.0.0.1; no usage reports.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray 2.60 turns token authentication on by itself once any local ray.init() has written
        # ~/.ray/auth_token, and then refuses every client of the stack that does not carry it: say what
        # this loopback-only stack uses, so a machine's history cannot change it.
        "RAY_AUTH_MODE": "disabled",
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
        names.conn_env(names.RAY_CONN): conn_ray(dashboard_port),
    }
    return env


def process_env(cfg: Config, base: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment of a stack process: base (default os.environ) + stack_env + the venv's bin first."""
    env = dict(os.environ if base is None else base)
    env.update(cfg.env())
    path = env.get("PATH", os.defpath).split(os.pathsep)
    env["PATH"] = os.pathsep.join([str(BIN)] + [p for p in path if p and p != str(BIN)])
    return env


# --------------------------------------------------------------------------------------------------
# Processes: PID files, logs, process groups


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pid_file(cfg: Config, name: str) -> Path:
    return cfg.pids / f"{name}.pid"


def log_file(cfg: Config, name: str) -> Path:
    return cfg.logs / f"{name}.log"


def running(cfg: Config, name: str) -> psutil.Process | None:
    """The live process recorded in <name>.pid, or None (missing file, dead, zombie or a recycled PID)."""
    path = pid_file(cfg, name)
    try:
        pid = int(path.read_text().split()[0])
        written = path.stat().st_mtime
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        # A PID reused by a process started after the file was written is not ours.
        if proc.create_time() > written + 2:
            return None
        return proc
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def launch(cfg: Config, name: str, cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """Start cmd in its own session (pgid == pid), output appended to logs/<name>.log, PID in pids/<name>.pid."""
    cfg.pids.mkdir(parents=True, exist_ok=True)
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = open(log_file(cfg, name), "ab")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
    log.flush()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(cwd or REPO),
            start_new_session=True,
        )
    finally:
        log.close()
    _atomic_write(pid_file(cfg, name), f"{proc.pid}\n")
    return proc


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except (OSError, psutil.Error):
            pass
    return out


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def stop_process(pid: int, grace: float = 20.0) -> None:
    """Stop a process we started and everything it started: its descendants and its process group.

    SIGTERM goes to the leader first (`ray start --block` then drains and stops its own children in
    about 3 s; sending it to the whole group makes Ray's drain wait 30 s for a GCS already gone), then to
    the remaining group members, then SIGKILL to whatever is left.
    """
    try:
        leader = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    members = {leader}
    try:
        members.update(leader.children(recursive=True))
    except psutil.Error:
        pass
    if pgid == pid:  # only a group we made (start_new_session) is ours to signal
        members.update(_group(pgid))

    def wait(procs, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = _alive(procs)
            if not left:
                return []
            time.sleep(0.1)
        return _alive(procs)

    with _suppress():
        leader.send_signal(signal.SIGTERM)
    left = wait(members, grace)
    if left:
        for p in left:
            with _suppress():
                p.send_signal(signal.SIGTERM)
        left = wait(left, 5)
    if pgid == pid:
        left = list({*left, *_alive(_group(pgid))})
    for p in left:
        with _suppress():
            p.kill()
    wait(left, 5)
    with _suppress():
        leader.wait(0)  # reap it if it is our child


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        return et is not None and issubclass(et, (psutil.Error, OSError, subprocess.TimeoutExpired))


def tail(path: Path, lines: int = 1) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    rows = [r for r in text.splitlines() if r.strip() and not r.startswith("=== ")]
    return "\n".join(rows[-lines:])


def port_owner(port: int) -> str | None:
    """Who listens on 127.0.0.1:port (or any address), as 'pid N (name)', or None if the port is free."""
    with socket.socket() as s:
        # SO_REUSEADDR as the servers use it: TIME_WAIT leftovers of a stack just stopped do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
            return None
        except OSError:
            pass
    try:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
    except psutil.Error:
        pass
    return "another process"


def live_pids(scratch: Path) -> list[int]:
    """PIDs recorded under <scratch>/pids that are still our processes."""
    cfg = Config(scratch=Path(scratch))
    out = []
    for path in sorted(cfg.pids.glob("*.pid")) if cfg.pids.is_dir() else []:
        proc = running(cfg, path.stem)
        if proc is not None:
            out.append(proc.pid)
    return out


def remove_scratch(scratch: Path) -> None:
    """Delete a scratch folder, and Ray's temp dir when it lives in /tmp (see Config.ray_temp_dir)."""
    scratch = Path(scratch)
    link = scratch / "ray"
    if link.is_symlink():
        shutil.rmtree(link.resolve(), ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Health checks


def http_get(url: str, timeout: float = 3.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def s3_client(cfg: Config):
    import boto3
    from botocore.config import Config as BotoConfig

    key_id, secret = s3_keys(cfg.scratch)
    return boto3.client(
        "s3",
        endpoint_url=cfg.s3_endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=BotoConfig(retries={"max_attempts": 2}, connect_timeout=3, read_timeout=60),
    )


def healthy_s3(cfg: Config) -> tuple[bool, str]:
    try:
        status, _ = http_get(f"{cfg.s3_endpoint}/moto-api/", timeout=2)
        return status == 200, f"HTTP {status}"
    except (OSError, urllib.error.URLError) as e:
        return False, str(e)


def healthy_ray(cfg: Config) -> tuple[bool, str]:
    try:
        status, body = http_get(f"{cfg.dashboard_url}/api/version", timeout=2)
        if status != 200:
            return False, f"/api/version: HTTP {status}"
        status, body = http_get(f"{cfg.dashboard_url}/api/v0/nodes", timeout=5)
        if status != 200:
            return False, f"/api/v0/nodes: HTTP {status}"
        nodes = json.loads(body)["data"]["result"]["result"]
        if not any(n.get("state") == "ALIVE" for n in nodes):
            return False, "no node alive yet"
        return True, "ok"
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as e:
        return False, str(e)


def airflow_health(cfg: Config) -> dict[str, str]:
    """{component: status} from /api/v2/monitor/health; raises OSError if the API does not answer."""
    status, body = http_get(f"{cfg.airflow_url}/api/v2/monitor/health", timeout=3)
    if status != 200:
        raise OSError(f"HTTP {status}")
    data = json.loads(body)
    return {k: (v or {}).get("status") or "unknown" for k, v in data.items()}


def healthy_airflow(cfg: Config) -> tuple[bool, str]:
    try:
        health = airflow_health(cfg)
    except (OSError, urllib.error.URLError, ValueError) as e:
        return False, f"API not answering ({e})"
    wanted = ("metadatabase", "scheduler", "triggerer", "dag_processor")
    bad = [f"{k}={health.get(k, 'missing')}" for k in wanted if health.get(k) != "healthy"]
    return (not bad), ("ok" if not bad else ", ".join(bad))


HEALTH = {"s3": healthy_s3, "ray": healthy_ray, "airflow": healthy_airflow}


def wait_healthy(cfg: Config, component: str, procs: dict[str, subprocess.Popen | psutil.Process], timeout: float):
    deadline = time.monotonic() + timeout
    detail = ""
    while True:
        for name, proc in procs.items():
            code = proc.poll() if isinstance(proc, subprocess.Popen) else (None if _alive([proc]) else "?")
            if code is not None:
                last = tail(log_file(cfg, name))
                raise StackError(
                    f"{name} exited (code {code}) while starting: see {log_file(cfg, name)}"
                    + (f" (last line: {last[-300:]})" if last else "")
                )
        ok, detail = HEALTH[component](cfg)
        if ok:
            return
        if time.monotonic() > deadline:
            logs = ", ".join(str(log_file(cfg, n)) for n in procs)
            raise StackError(f"{component} not healthy after {timeout:.0f}s ({detail}): see {logs}")
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------------
# Airflow REST API client (standard library only): used by tools/demo.py and the live_stack fixture


class APIError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, detail: str):
        super().__init__(f"{method} {path}: HTTP {status}: {detail[:500]}")
        self.status = status
        self.detail = detail


class AirflowAPI:
    """Airflow 3 REST API with the simple auth manager's JWT (POST /auth/token), refreshed on 401."""

    def __init__(self, base_url: str, username: str, password: str, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.username = username
        self.password = password
        self.timeout = timeout
        self._token: str | None = None

    @classmethod
    def for_stack(cls, cfg: Config) -> "AirflowAPI":
        user, password = airflow_login(cfg.scratch)
        return cls(cfg.airflow_url, user, password)

    def token(self, refresh: bool = False) -> str:
        if self._token is None or refresh:
            body = self._send("POST", "/auth/token", {"username": self.username, "password": self.password}, auth=False)
            self._token = body["access_token"]
        return self._token

    def _send(self, method: str, path: str, body: Any = None, params: dict | None = None, auth: bool = True,
              accept: str = "application/json") -> Any:  # fmt: skip
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
                ctype = r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise APIError(e.code, method, path, detail) from None
        if not raw:
            return None
        return json.loads(raw) if "json" in ctype else raw.decode(errors="replace")

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        try:
            return self._send(method, path, body, params)
        except APIError as e:
            if e.status != 401:
                raise
            self.token(refresh=True)
            return self._send(method, path, body, params)

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any = None) -> Any:
        return self.request("PATCH", path, body)


def q(value: str) -> str:
    """A path segment for the REST API (run ids contain ':' and '+')."""
    return urllib.parse.quote(str(value), safe="")


# --------------------------------------------------------------------------------------------------
# Components


def ray_command(cfg: Config) -> list[str]:
    return [
        str(BIN / "ray"), "start", "--head", "--block",
        "--port", str(cfg.ray_port),
        "--dashboard-host", LOOPBACK,
        "--dashboard-port", str(cfg.dashboard_port),
        "--ray-client-server-port", str(cfg.ray_client_port),
        "--dashboard-agent-listen-port", str(cfg.ray_agent_port),
        "--temp-dir", str(cfg.ray_temp_dir),
        "--num-cpus", str(cfg.num_cpus),
        "--include-dashboard", "true",
        "--disable-usage-stats",
    ]  # fmt: skip


def start_ray(cfg: Config, env: dict[str, str], name: str = "ray") -> subprocess.Popen:
    """Start `ray start --head --block` (one parent whose group `down` kills); does not wait."""
    temp = cfg.ray_temp_dir
    temp.mkdir(parents=True, exist_ok=True)
    link = cfg.scratch / "ray"
    if temp != link and not link.exists():
        with _suppress():
            link.symlink_to(temp)
    return launch(cfg, name, ray_command(cfg), env)


def airflow_commands() -> dict[str, list[str]]:
    af = str(BIN / "airflow")
    return {
        "airflow-api-server": [af, "api-server"],  # host and port from AIRFLOW__API__HOST/PORT
        "airflow-scheduler": [af, "scheduler", "--skip-serve-logs"],
        "airflow-dag-processor": [af, "dag-processor"],
        "airflow-triggerer": [af, "triggerer", "--skip-serve-logs"],
    }


def gpu_slots() -> int:
    """Slots of the GPU pool: RLHF_GPU_SLOTS, else the GPUs nvidia-smi lists, at least 1 (a CPU box runs
    one stage at a time)."""
    if os.environ.get("RLHF_GPU_SLOTS"):
        return max(1, int(os.environ["RLHF_GPU_SLOTS"]))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def run_logged(cfg: Config, name: str, cmd: list[str], env: dict[str, str], timeout: float) -> None:
    """Run a one-shot command to completion, output appended to logs/<name>.log."""
    cfg.logs.mkdir(parents=True, exist_ok=True)
    with open(log_file(cfg, name), "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        try:
            code = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            raise StackError(f"`{' '.join(cmd[1:])}` took over {timeout:.0f}s: see {log_file(cfg, name)}") from None
    if code != 0:
        raise StackError(
            f"`{' '.join(cmd[1:])}` failed (code {code}): see {log_file(cfg, name)} (last line: {tail(log_file(cfg, name))[-300:]})"
        )


def reserialize(cfg: Config, env: dict[str, str] | None = None) -> None:
    """`airflow dags reserialize`: parse the DAG folder now instead of at the DAG processor's next pass."""
    run_logged(cfg, "airflow-reserialize", [str(BIN / "airflow"), "dags", "reserialize"],
               env or process_env(cfg), timeout=300)  # fmt: skip


# S3 -----------------------------------------------------------------------------------------------


def migrate_snapshot(cfg: Config) -> tuple[int, int]:
    """Load a snapshot an older `down` saved into the running emulator (which writes it to s3-data),
    then rename it to s3-snapshot.migrated. Returns (objects, bytes); (0, 0) when there is none."""
    manifest_path = cfg.snapshot / "manifest.json"
    if not manifest_path.exists():
        return 0, 0
    manifest = json.loads(manifest_path.read_text())
    s3 = s3_client(cfg)
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    count = size = 0
    for bucket, objects in manifest["buckets"].items():
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        for obj in objects:
            extra = {"Metadata": obj.get("metadata") or {}}
            if obj.get("content_type"):
                extra["ContentType"] = obj["content_type"]
            s3.upload_file(str(cfg.snapshot / obj["file"]), bucket, obj["key"], ExtraArgs=extra)
            count += 1
            size += obj.get("size", 0)
    cfg.snapshot.rename(cfg.scratch / "s3-snapshot.migrated")
    return count, size


def ensure_bucket(cfg: Config) -> None:
    s3 = s3_client(cfg)
    if cfg.bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=cfg.bucket)


# --------------------------------------------------------------------------------------------------
# Commands


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def up(cfg: Config, components: Iterable[str] = ORDER) -> None:
    """Start what is not running; leave alone what runs and answers; wait until everything is healthy."""
    t0 = time.monotonic()
    wanted = [c for c in ORDER if c in set(components)]
    cfg.check_ports()
    recorded = Config.load(cfg.scratch)
    if recorded is not None:
        live = [n for n in _all_procs() if running(recorded, n)]
        diff = {k: (v, recorded.to_json()[k]) for k, v in cfg.to_json().items() if v != recorded.to_json()[k]}
        if live and diff:
            what = ", ".join(f"{k} {old} (asked {new})" for k, (new, old) in diff.items())
            raise StackError(f"the stack in {cfg.scratch} runs with {what}: run `down` first")
    cfg.scratch.mkdir(parents=True, exist_ok=True)
    env = process_env(cfg)
    cfg.save()

    started: dict[str, dict[str, subprocess.Popen | psutil.Process]] = {}
    kept: dict[str, dict[str, psutil.Process]] = {}

    def need(procs: Iterable[str]) -> list[str]:
        return [n for n in procs if running(cfg, n) is None]

    def check_free(var_ports: dict[str, int]) -> None:
        for var, port in var_ports.items():
            owner = port_owner(port)
            if owner:
                raise StackError(f"port {port} ({var}) is already in use by {owner}: set {var} to another port")

    # S3 emulator: quick, started first so the others find it.
    if "s3" in wanted:
        if need(["s3"]):
            check_free({"RLHF_S3_PORT": cfg.s3_port})
            proc = launch(cfg, "s3", [str(BIN / "python"), str(REPO / "tools" / "s3_server.py"), "--host", LOOPBACK,
                                      "--port", str(cfg.s3_port), "--data", str(cfg.s3_data)], env)
            started["s3"] = {"s3": proc}
        else:
            kept["s3"] = {"s3": running(cfg, "s3")}

    if "ray" in wanted:
        if need(["ray"]):
            check_free({k: v for k, v in cfg.ports().items() if "RAY" in k})
            started["ray"] = {"ray": start_ray(cfg, env)}
        else:
            kept["ray"] = {"ray": running(cfg, "ray")}

    if "airflow" in wanted:
        missing = need(AIRFLOW_PROCS)
        if missing:
            if "airflow-api-server" in missing:
                check_free({"RLHF_AIRFLOW_PORT": cfg.airflow_port})
            cfg.airflow_home.mkdir(parents=True, exist_ok=True)
            run_logged(cfg, "airflow-db-migrate", [str(BIN / "airflow"), "db", "migrate"], env, timeout=300)
            # include_deferred: a stage waiting on its Ray job in the triggerer still holds its GPUs.
            run_logged(cfg, "airflow-pool", [str(BIN / "airflow"), "pools", "set", names.GPU_POOL, str(gpu_slots()),
                                             "GPUs the Ray stages hold", "--include-deferred"], env, timeout=300)
            cmds = airflow_commands()
            started["airflow"] = {n: launch(cfg, n, cmds[n], env) for n in missing}
            for n in AIRFLOW_PROCS:
                if n not in missing:
                    started["airflow"][n] = running(cfg, n)
        else:
            kept["airflow"] = {n: running(cfg, n) for n in AIRFLOW_PROCS}

    def since() -> str:
        return f" [{time.monotonic() - t0:.1f}s]" if started else ""

    for comp in wanted:
        procs = started.get(comp) or kept.get(comp)
        fresh = comp in started
        try:
            wait_healthy(cfg, comp, procs, START_TIMEOUT[comp] if fresh else 60)
        except StackError:
            # What this call started and is not healthy goes again; the next `up` starts it afresh.
            for name, proc in started.get(comp, {}).items():
                if isinstance(proc, subprocess.Popen):
                    stop_process(proc.pid, grace=5)
                    pid_file(cfg, name).unlink(missing_ok=True)
            raise
        pids = ", ".join(f"{n} {p.pid}" for n, p in procs.items())
        if comp == "s3":
            ensure_bucket(cfg)
            note = ""
            if fresh:
                n, size = migrate_snapshot(cfg)
                note = f", migrated {n} objects ({_mb(size)}) from {cfg.snapshot}" if n else ""
                note += f", objects in {cfg.s3_data}"
            say(f"s3       {'started' if fresh else 'already running'}: {cfg.s3_endpoint} bucket {cfg.bucket} "
                f"(pid {pids}){note}{since()}")  # fmt: skip
        elif comp == "ray":
            say(f"ray      {'started' if fresh else 'already running'}: dashboard {cfg.dashboard_url}, "
                f"gcs {LOOPBACK}:{cfg.ray_port} (pid {pids}){since()}")  # fmt: skip
        elif comp == "airflow":
            if fresh:
                reserialize(cfg, env)
            user, password = airflow_login(cfg.scratch)
            say(f"airflow  {'started' if fresh else 'already running'}: {cfg.airflow_url} login {user} / {password} "
                f"({pids}){since()}")  # fmt: skip
    say(f"stack up in {time.monotonic() - t0:.1f}s (scratch {cfg.scratch}; logs in {cfg.logs})")


def down(cfg: Config, components: Iterable[str] = ORDER) -> None:
    """Stop only the processes recorded in the PID files: Airflow, then Ray, then S3."""
    wanted = set(components)
    if not any(running(cfg, n) for c in wanted for n in COMPONENTS[c]):
        say(f"nothing running in {cfg.scratch}")
    for comp in reversed(ORDER):
        if comp not in wanted:
            continue
        procs = {}
        for name in COMPONENTS[comp]:
            proc = running(cfg, name)
            if proc is None:
                pid_file(cfg, name).unlink(missing_ok=True)
            else:
                procs[name] = proc
        def stop(name: str, proc: psutil.Process) -> None:
            t = time.monotonic()
            stop_process(proc.pid)
            pid_file(cfg, name).unlink(missing_ok=True)
            say(f"{name:<8} stopped (pid {proc.pid}, {time.monotonic() - t:.1f}s)")

        # The processes of one component stop in parallel (the triggerer alone can take 10 s).
        threads = [threading.Thread(target=stop, args=item) for item in procs.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def status(cfg: Config) -> bool:
    """Print one line per process; True if everything runs and answers."""
    ok_all = True
    health = {c: HEALTH[c](cfg) for c in ORDER if any(running(cfg, n) for n in COMPONENTS[c])}
    urls = {"s3": cfg.s3_endpoint, "ray": cfg.dashboard_url, "airflow-api-server": cfg.airflow_url}
    say(f"stack in {cfg.scratch}")
    for comp in ORDER:
        for name in COMPONENTS[comp]:
            proc = running(cfg, name)
            if proc is None:
                state, pid, ok_all = "stopped", "-", False
            else:
                ok, detail = health.get(comp, (False, ""))
                state = "running" if ok else f"running, not healthy ({detail})"
                pid = str(proc.pid)
                ok_all = ok_all and ok
            say(f"  {name:<22} {state:<10} pid {pid:<8} {urls.get(name, '')}")
    if running(cfg, "airflow-api-server"):
        user, password = airflow_login(cfg.scratch)
        say(f"  airflow login: {user} / {password}")
    say(f"  logs: {cfg.logs}")
    return ok_all


@contextlib.contextmanager
def stack_lock(cfg: Config):
    """One `up` or `down` of a stack at a time: two at once would both start (or stop) the same parts and
    leave it half up. The second waits for the first, then finds what it left."""
    cfg.scratch.mkdir(parents=True, exist_ok=True)
    with open(cfg.scratch / "stack.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another `up` or `down` of {cfg.scratch} to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def print_env(cfg: Config) -> None:
    env = cfg.env()
    env["RAY_ADDRESS"] = cfg.dashboard_url  # for `ray job submit/list` from a shell; not given to the stack
    for k in sorted(env):
        print(f"export {k}={shlex.quote(env[k])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stack.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start the stack (idempotent)")
    p_up.add_argument("components", nargs="*", metavar="{s3,ray,airflow}", help="default: all")
    p_down = sub.add_parser("down", help="stop what up started")
    p_down.add_argument("components", nargs="*", metavar="{s3,ray,airflow}", help="default: all")
    sub.add_parser("status", help="show each process")
    sub.add_parser("env", help="print export lines for the stack's environment")
    p_rs = sub.add_parser("reserialize", help="airflow dags reserialize against the running stack")
    del p_rs
    args = parser.parse_args(argv)
    bad = [c for c in getattr(args, "components", None) or [] if c not in ORDER]
    if bad:
        parser.error(f"unknown component {bad[0]!r} (choose from {', '.join(ORDER)})")
    try:
        if args.cmd == "up":
            cfg = config_for_up()
            with stack_lock(cfg):
                up(cfg, args.components or ORDER)
        elif args.cmd == "down":
            cfg = current_config()
            with stack_lock(cfg):
                down(cfg, args.components or ORDER)
        elif args.cmd == "status":
            status(current_config())
        elif args.cmd == "env":
            print_env(current_config())
        elif args.cmd == "reserialize":
            reserialize(current_config())
    except StackError as e:
        print(f"stack: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stack: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stack.py status | head`
        sys.stdout = None
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
