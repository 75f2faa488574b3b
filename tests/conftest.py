"""Shared fixtures: real services on 127.0.0.1, nothing mocked.

The environment is fixed here, at import time, because Airflow reads AIRFLOW_HOME on its first
import and transformers reads HF_HUB_OFFLINE on its first import.
"""

import getpass
import json
import os
import random
import socket
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Under pytest-xdist (`make test TEST_WORKERS=n`) each worker has its own scratch: its own in-process
# Airflow DB, caches and Ray head folders, as two sessions would.
SCRATCH = Path(os.environ.get("RLHF_TEST_SCRATCH", REPO / ".scratch" / "test")) / os.environ.get(
    "PYTEST_XDIST_WORKER", ""
)
SCRATCH.mkdir(parents=True, exist_ok=True)

os.environ.setdefault("AIRFLOW_HOME", str(SCRATCH / "airflow-inproc"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(SCRATCH / "hf")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_DIR"] = str(SCRATCH / "wandb")
os.environ["WANDB_CACHE_DIR"] = str(SCRATCH / "wandb-cache")
# One JIT cache for DeepSpeed's ops across tests and the local stack: each op builds once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".scratch" / "torch_extensions"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".scratch" / "torchinductor"))  # torch.compile's kernels
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' own Python files (environments, rewards, metrics) sit under pytest's tmp_path: the operator's folder
# (tasks/common/allowlist.py) for them; tests of the refusal pass their own.
os.environ["RLHF_USER_CODE_DIRS"] = str(Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.stack.config import ray_auth_headers, ray_token, ray_token_file  # noqa: E402

# Every Ray head the tests start asks for a token, as the stack's does (tools/stack). One token per session folder:
# head_config() gives it to each head, and this process's own Ray clients (in-process drivers, JobSubmissionClient,
# stages run as plain processes, local ray.init() clusters) read it from the file as Ray's clients do. Set before
# the first `import ray`, which reads both once. A shell's RAY_AUTH_TOKEN would win over the file.
TEST_RAY_TOKEN = ray_token(SCRATCH)
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN_PATH"] = str(ray_token_file(SCRATCH))
os.environ.pop("RAY_AUTH_TOKEN", None)


def ray_headers() -> dict[str, str]:
    """The Authorization header for a raw HTTP request to a test head (ray_head, two_nodes):
    urllib.request.Request(f"{ray_head}/api/jobs/", headers=ray_headers())."""
    return ray_auth_headers(SCRATCH)


#: Fixtures of the one local stack a session shares (see live_stack): their tests run in one xdist worker.
STACK_FIXTURES = {"live_stack", "demo_run"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(items):
    """Mark the tests that place stages on Ray (a head, or test_multinode's two nodes) `ray`: `make test-fast`
    leaves them out, with e2e.

    The tests on the shared stack form one xdist group (`--dist loadgroup` gives it to one worker, which
    starts the stack once) and run first: the longest unit of work starts at once while the other worker
    takes everything else.
    """
    stack = []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if {"ray_head", "ray_address", "ray_driver", "two_nodes"} & names:
            item.add_marker(pytest.mark.ray)
        if STACK_FIXTURES & names:
            item.add_marker(pytest.mark.xdist_group("stack"))
            stack.append(item)
    others = [item for item in items if item not in stack]
    items[:] = stack + others


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under `--dist loadgroup`, refuse to run when xdist did not group the stack's tests (it marks their node ids
    `@stack`): each worker would start a stack and a demo run of its own."""
    if getattr(session.config.option, "loadgroup", False) and os.environ.get("PYTEST_XDIST_WORKER"):
        loose = [
            item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
        ]
        if loose:
            raise pytest.UsageError(
                f"pytest-xdist did not group {loose[0]} with the other stack tests (a pytest/xdist version "
                "pair that breaks --dist loadgroup); install from locks/dev.txt, or run with TEST_WORKERS=0"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, endpoint: str, bucket: str):
        self.endpoint = endpoint
        self.bucket = bucket

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server over real HTTP on 127.0.0.1, with the environment boto3 reads pointing at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_S3=endpoint,
    )
    s3 = S3Server(endpoint, "rlhf-test")
    s3.client().create_bucket(Bucket=s3.bucket)
    yield s3
    server.stop()


# ---------------------------------------------------------------------------------------------------
# The local stack, started by the same code as `make up` (tools/stack): a bare Ray head for tests that
# run Airflow in-process, and the whole stack for end-to-end tests.

import subprocess  # noqa: E402
import time  # noqa: E402

from tools.stack.api import AirflowAPI  # noqa: E402
from tools.stack.config import (  # noqa: E402
    RAY_WORKER_PORTS,
    Config,
    StackError,
    _all_procs,
    airflow_login,
    conn_ray,
    conn_s3,
    process_env,
)
from tools.stack.health import wait_healthy  # noqa: E402
from tools.stack.processes import live_pids, pid_file, remove_scratch, running, start_ray, stop_process  # noqa: E402
from tools.stack.s3 import s3_client  # noqa: E402

# `make up`'s command line; run it with cwd=REPO (tools.stack is found from the repo root).
STACK_CMD = [sys.executable, "-m", "tools.stack"]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_TAKEN: set[int] = set()


def _stack_port() -> int:
    """A free port for a stack's listener, below the kernel's ephemeral range and above Ray's worker range.

    A port from the ephemeral range can be taken, between this pick and the bind, by any outgoing connection or
    port-0 listener on the machine (another stack's Ray starts dozens): Ray's dashboard agent then runs without
    its HTTP server and every job submission answers "No available agent"."""
    low, high = RAY_WORKER_PORTS.stop, _ephemeral_low()
    rng = random.Random()  # not the tests' seeded one: concurrent sessions must not pick the same ports
    while True:
        port = rng.randrange(low, high)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port


def head_config(scratch: Path, s3_server) -> Config:
    """A stack Config for a Ray head of the tests' own: free ports, the session's S3 emulator and bucket, and the
    session's Ray token (TEST_RAY_TOKEN, which this process's drivers hold)."""
    ray_token(scratch, make=lambda: TEST_RAY_TOKEN)
    return Config(
        scratch=scratch,
        airflow_port=_stack_port(),
        s3_port=int(s3_server.endpoint.rsplit(":", 1)[1]),
        ray_port=_stack_port(),
        dashboard_port=_stack_port(),
        ray_client_port=_stack_port(),
        ray_agent_port=_stack_port(),
        bucket=s3_server.bucket,
    )


def _clear_stale(parent: Path, keep: Path) -> None:
    """Remove per-session folders under parent left by earlier sessions whose processes are gone."""
    if not parent.is_dir():
        return
    for d in parent.iterdir():
        if d.is_dir() and d != keep and not live_pids(d):
            remove_scratch(d)


RAY_GCS_ADDRESS = ""


@pytest.fixture
def ray_driver(ray_address, monkeypatch) -> str:
    """This process as a Ray driver on ray_head, as a stage's own driver is (placed_group, connect_ray): for
    stages run in process. Disconnects after the test."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    yield ray_address
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_head) -> str:
    """ray_head's GCS address, what a stage run as a plain process needs in RAY_ADDRESS to place its workers."""
    return RAY_GCS_ADDRESS


@pytest.fixture(scope="session")
def airflow_db():
    """The in-process Airflow metadata DB (SQLite under AIRFLOW_HOME), migrated."""
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, env=os.environ.copy()
    )


@pytest.fixture(scope="session")
def ray_head(s3_server):
    """A real `ray start --head --block` on free loopback ports, with s3_server's endpoint and credentials in
    its environment (job drivers inherit it). Yields the dashboard address ``http://127.0.0.1:<port>``.

    Also sets AIRFLOW_CONN_RLHF_RAY (with the head's token as its password) and AIRFLOW_CONN_RLHF_S3 in os.environ
    for in-process Airflow. The head asks every client for the token (RAY_AUTH_MODE=token): raw HTTP requests to it
    send ray_headers().
    """
    parent = SCRATCH / "ray-head"
    scratch = parent / str(os.getpid())  # one per session: concurrent sessions never share a head
    _clear_stale(parent, scratch)
    cfg = head_config(scratch, s3_server)
    env = process_env(cfg)
    # Same caches as the in-process tests (set at the top of this file).
    for key in ("HF_HOME", "WANDB_DIR", "WANDB_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        env[key] = os.environ[key]
    proc = start_ray(cfg, env)
    try:
        wait_healthy(cfg, "ray", {"ray": proc}, timeout=120)
    except StackError as e:
        stop_process(proc.pid)
        pytest.fail(f"ray_head: {e}", pytrace=False)
    global RAY_GCS_ADDRESS
    RAY_GCS_ADDRESS = f"127.0.0.1:{cfg.ray_port}"
    saved = {k: os.environ.get(k) for k in ("AIRFLOW_CONN_RLHF_RAY", "AIRFLOW_CONN_RLHF_S3")}
    os.environ["AIRFLOW_CONN_RLHF_RAY"] = conn_ray(cfg.dashboard_port, token=ray_token(cfg.scratch))
    os.environ["AIRFLOW_CONN_RLHF_S3"] = conn_s3(s3_server.endpoint, s3_server.bucket)
    yield cfg.dashboard_url
    stop_process(proc.pid)
    pid_file(cfg, "ray").unlink(missing_ok=True)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class LiveStack:
    """A running stack started by `python -m tools.stack up` (what `make up` runs), on its own scratch and ports."""

    def __init__(self, cfg: Config, env: dict):
        self.cfg = cfg
        self.env = env  # the environment tools.stack runs with (RLHF_* chosen here)
        self.scratch = cfg.scratch
        self.airflow_url = cfg.airflow_url
        self.username, self.password = airflow_login(cfg.scratch)
        self.s3_endpoint = cfg.s3_endpoint
        self.bucket = cfg.bucket
        self.ray_dashboard = cfg.dashboard_url
        self.api = AirflowAPI(cfg.airflow_url, self.username, self.password)

    def token(self) -> str:
        """A JWT for ``Authorization: Bearer …`` (POST /auth/token)."""
        return self.api.token()

    def ray_headers(self) -> dict:
        """The Authorization header of a raw HTTP request to the stack's Ray dashboard (its head asks for the
        stack's token): urllib.request.Request(f"{live.ray_dashboard}/api/jobs/", headers=live.ray_headers())."""
        return ray_auth_headers(self.cfg.scratch)

    def rest(self, method: str, path: str, body=None, **params):
        """An authenticated REST call, e.g. ``rest("GET", "/api/v2/dags")``; returns the decoded JSON."""
        return self.api.request(method, path, body, params or None)

    def s3(self):
        """A boto3 S3 client for the stack's emulator."""
        return s3_client(self.cfg)

    def stack(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run ``python -m tools.stack <args>`` against this stack."""
        return subprocess.run(
            [*STACK_CMD, *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    def pids(self) -> dict:
        """{process name: pid} of the stack's running processes."""
        return {n: p.pid for n in _all_procs() if (p := running(self.cfg, n)) is not None}

    def stage_env(self) -> dict:
        """The environment of a stage run as a plain process against this stack: its S3 emulator and its Ray
        head (RAY_ADDRESS), nothing of the in-process fixtures' S3 or Ray."""
        env = process_env(
            self.cfg, {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_", "RLHF_"))}
        )
        env["RAY_ADDRESS"] = f"127.0.0.1:{self.cfg.ray_port}"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return env


def stack_subprocess_env(scratch: Path, **ports: int) -> dict:
    """os.environ without anything that configures Airflow, AWS, Ray or the stack, plus RLHF_* for scratch/ports.

    Other fixtures set AIRFLOW_CONN_*, AWS_ENDPOINT_URL_S3, … in os.environ for in-process tests; a stack
    started from the tests must not inherit them.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "AWS_", "RAY_", "RLHF_"))}
    env["RLHF_SCRATCH"] = str(scratch)
    names = {
        "airflow_port": "RLHF_AIRFLOW_PORT", "s3_port": "RLHF_S3_PORT", "ray_port": "RLHF_RAY_PORT",
        "dashboard_port": "RLHF_RAY_DASHBOARD_PORT", "ray_client_port": "RLHF_RAY_CLIENT_PORT",
        "ray_agent_port": "RLHF_RAY_AGENT_PORT",
    }  # fmt: skip
    for key, value in ports.items():
        env[names[key]] = str(value)
    return env


@pytest.fixture(scope="session")
def live_stack():
    """The whole stack, started exactly as `make up` does (`python -m tools.stack up` in a subprocess), but in
    <repo>/.scratch/test-stack/<pid> on free ports, so it never meets a developer's stack or another test
    session's. Yields a LiveStack (airflow_url, username, password, s3_endpoint, bucket, ray_dashboard,
    token(), rest(), s3(), stack(), pids()); teardown runs `down`.
    """
    parent = REPO / ".scratch" / "test-stack"
    scratch = parent / str(os.getpid())
    _clear_stale(parent, scratch)
    ports = {
        k: _stack_port()
        for k in ("airflow_port", "s3_port", "ray_port", "dashboard_port", "ray_client_port", "ray_agent_port")
    }
    env = stack_subprocess_env(scratch, **ports)
    t0 = time.monotonic()
    up = subprocess.run([*STACK_CMD, "up"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    cfg = Config.load(scratch) or Config.from_env(env)
    if up.returncode != 0:
        subprocess.run([*STACK_CMD, "down"], env=env, cwd=REPO,
                       capture_output=True, timeout=300)  # fmt: skip
        pytest.fail(f"live_stack: `python -m tools.stack up` failed:\n{up.stdout}\n{up.stderr}", pytrace=False)
    live = LiveStack(cfg, env)
    live.up_seconds = time.monotonic() - t0
    live.up_output = up.stdout
    yield live
    down = subprocess.run(
        [*STACK_CMD, "down"], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if down.returncode != 0:
        print(
            f"live_stack teardown: `python -m tools.stack down` failed:\n{down.stdout}\n{down.stderr}", file=sys.stderr
        )


class DemoRun:
    """The demo as `make demo` runs it (tools/demo.py on the live stack: the rlhf_pipeline DAG at its Param
    defaults, triggered through the REST API), once per session: tests/e2e/test_e2e.py checks it, the learning
    checks start from its SFT and reward model, the nightly and browser tests reuse its cached stages."""

    def __init__(self, live: LiveStack, run: dict, stdout: str):
        self.live, self.run, self.stdout = live, run, stdout
        self.run_id = run["dag_run_id"]

    def xcom(self, task_id: str):
        entry = self.live.rest(
            "GET", f"/api/v2/dags/rlhf_pipeline/dagRuns/{self.run_id}/taskInstances/{task_id}/xcomEntries/return_value"
        )
        value = entry["value"]
        return json.loads(value) if isinstance(value, str) and value.startswith('"') else value

    def read_json(self, uri: str) -> dict:
        bucket, key = uri.removeprefix("s3://").split("/", 1)
        return json.loads(self.live.s3().get_object(Bucket=bucket, Key=key)["Body"].read())

    def report(self) -> dict:
        return self.read_json(self.xcom("eval").replace("manifest.json", "report.json"))


@pytest.fixture(scope="session")
def demo_run(live_stack) -> DemoRun:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "demo.py"), "--timeout", "2400"],
        env=live_stack.env,
        capture_output=True,
        text=True,
        timeout=2700,
    )
    print(done.stdout[-6000:])
    assert done.returncode == 0, f"demo failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    runs = live_stack.rest("GET", "/api/v2/dags/rlhf_pipeline/dagRuns", order_by="-run_after", limit=1)["dag_runs"]
    return DemoRun(live_stack, runs[0], done.stdout)
