"""The local stack (tools/stack, what `make up` / `make down` run): healthy, idempotent, loopback-only,
and S3 kept across down/up. The unit tests at the top start nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from plugins.hooks import RayJobHook, RayUnreachableError
from tools.stack.config import Config, StackError, airflow_login, conn_ray, process_env, ray_token, stack_env
from tools.stack.health import airflow_health, wait_healthy
from tools.stack.processes import alive, remove_scratch, running, start_ray, stop_process
from tools.stack.s3 import s3_client

from tests.conftest import REPO, STACK_CMD, _stack_port, head_config, stack_subprocess_env

LOOPBACK_IPS = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


# ----------------------------------------------------------------------------------------- unit


def test_stack_env_is_loopback_complete_and_stable(tmp_path):
    env = stack_env(tmp_path, airflow_port=38080, s3_port=39000, ray_port=36379, dashboard_port=38265)
    for key in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE", "HF_HOME", "WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "TORCH_EXTENSIONS_DIR",
        "TOKENIZERS_PARALLELISM", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "AIRFLOW_HOME",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY",
    ):  # fmt: skip
        assert env[key], key
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:39000"
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:38080/execution/"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["TORCH_EXTENSIONS_DIR"] == str(REPO / ".scratch" / "torch_extensions")
    s3 = json.loads(env["AIRFLOW_CONN_RLHF_S3"])
    assert s3["conn_type"] == "aws" and s3["extra"]["endpoint_url"] == "http://127.0.0.1:39000"
    # Its password is the head's token (tests/e2e/test_ray_auth.py).
    assert json.loads(env["AIRFLOW_CONN_RLHF_RAY"]) == {
        "conn_type": "http", "host": "127.0.0.1", "port": 38265, "schema": "http", "password": ray_token(tmp_path),
    }  # fmt: skip
    # Secrets and the login are generated once and reused.
    again = stack_env(tmp_path, airflow_port=38080, s3_port=39000, ray_port=36379, dashboard_port=38265)
    assert again == env
    user, password = airflow_login(tmp_path)
    assert user == "admin" and len(password) >= 12
    assert json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text()) == {user: password}


def test_ports_inside_rays_worker_range_are_refused(tmp_path):
    with pytest.raises(StackError, match="worker port range"):
        Config(scratch=tmp_path, dashboard_port=18265).check_ports()
    with pytest.raises(StackError, match="both"):
        Config(scratch=tmp_path, s3_port=8080).check_ports()


def test_status_and_down_of_a_stack_never_started(tmp_path):
    env = stack_subprocess_env(tmp_path / "never")
    for cmd in (["status"], ["down"]):
        out = subprocess.run([*STACK_CMD, *cmd], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    assert (
        "stopped"
        in subprocess.run([*STACK_CMD, "status"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    )


# ----------------------------------------------------------------------------------------- e2e


@pytest.mark.e2e
def test_up_is_healthy(live_stack):
    health = airflow_health(live_stack.cfg)
    for component in ("metadatabase", "scheduler", "triggerer", "dag_processor"):
        assert health[component] == "healthy", health
    with urllib.request.urlopen(
        urllib.request.Request(f"{live_stack.ray_dashboard}/api/version", headers=live_stack.ray_headers()), timeout=10
    ) as r:
        assert json.load(r)["ray_version"]
    live_stack.s3().head_bucket(Bucket=live_stack.bucket)
    # The login works and the REST API answers with it.
    assert live_stack.token().count(".") == 2
    assert "dags" in live_stack.rest("GET", "/api/v2/dags", limit=1)
    status = live_stack.stack("status")
    assert status.returncode == 0
    assert status.stdout.count(" running ") == 6, status.stdout


@pytest.mark.e2e
def test_second_up_is_a_no_op(live_stack):
    before = live_stack.pids()
    assert len(before) == 6
    t0 = time.monotonic()
    again = live_stack.stack("up", timeout=120)
    elapsed = time.monotonic() - t0
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already running") == 3, again.stdout
    assert live_stack.pids() == before
    assert elapsed < 30, f"a no-op up took {elapsed:.1f}s"


def _listening(pid: int) -> list[tuple[str, int, str]]:
    """(ip, port, process name) of every listening inet socket of pid and its descendants."""
    out = []
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((c.laddr.ip, c.laddr.port, proc.name()))
        except psutil.Error:
            pass
    return out


@pytest.mark.e2e
def test_nothing_listens_beyond_loopback(live_stack):
    sockets = [s for pid in live_stack.pids().values() for s in _listening(pid)]
    ports = {port for _, port, _ in sockets}
    cfg = live_stack.cfg
    assert {cfg.airflow_port, cfg.s3_port, cfg.ray_port, cfg.dashboard_port} <= ports, sockets
    exposed = [s for s in sockets if s[0] not in LOOPBACK_IPS]
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"


@pytest.mark.e2e
def test_s3_objects_survive_the_emulator_being_killed():
    """Every object S3 acknowledged is on disk: after `kill -9` of the emulator, `up` serves it again, with
    its ETag (a manifest's record) and content type; `down` and `up` keep it too, and `up` replaces an emulator
    of this stack whose PID file was lost (S3 alone, own scratch)."""
    parent = REPO / ".scratch" / "test-stack"
    scratch = parent / f"{os.getpid()}-s3"
    remove_scratch(scratch)
    env = stack_subprocess_env(scratch, s3_port=_stack_port())

    transcript = []  # every command's output: a failure shows what `down` said before the `up` that failed

    def run(*args):
        out = subprocess.run([*STACK_CMD, *args], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        transcript.append(f"$ stack {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
        assert out.returncode == 0, "\n".join(transcript)
        return out.stdout

    try:
        run("up", "s3")
        cfg = Config.load(scratch)
        assert running(cfg, "s3") is not None
        # The PID file records the process's start time: a recycled PID (another start time) is not ours.
        pid, started = (cfg.pids / "s3.pid").read_text().split()
        (cfg.pids / "s3.pid").write_text(f"{pid} {float(started) - 5}\n")
        assert running(cfg, "s3") is None
        (cfg.pids / "s3.pid").write_text(f"{pid} {started}\n")
        s3 = s3_client(cfg)
        key = "runs/rlhf_pipeline/manual__x/sft/manifest.json"
        s3.put_object(Bucket=cfg.bucket, Key=key, Body=b'{"stage": "sft"}', ContentType="application/json")
        s3.put_object(Bucket=cfg.bucket, Key="runs/gone", Body=b"deleted before the crash")
        s3.delete_object(Bucket=cfg.bucket, Key="runs/gone")
        s3.create_bucket(Bucket="another")
        s3.put_object(Bucket="another", Key="dir/", Body=b"")
        big = os.urandom(9 * 1024 * 1024)  # uploaded in parts: its ETag is not an MD5 of the bytes
        (scratch / "big").write_bytes(big)
        s3.upload_file(str(scratch / "big"), "another", "model/weights.bin")
        before = {
            b: {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=b)["Contents"]} for b in (cfg.bucket, "another")
        }
        assert before["another"]["model/weights.bin"].endswith('-2"')

        proc = running(cfg, "s3")
        proc.kill()  # SIGKILL: no handler, no shutdown path runs
        proc.wait(30)
        run("up", "s3")
        s3 = s3_client(cfg)
        after = {
            b: {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=b)["Contents"]} for b in (cfg.bucket, "another")
        }
        assert after == before
        obj = s3.get_object(Bucket=cfg.bucket, Key=key)
        assert obj["Body"].read() == b'{"stage": "sft"}' and obj["ContentType"] == "application/json"
        assert s3.get_object(Bucket="another", Key="model/weights.bin")["Body"].read() == big

        run("down", "s3")
        run("up", "s3")
        assert s3_client(cfg).get_object(Bucket="another", Key="dir/")["Body"].read() == b""

        # An emulator of this stack that no PID file names (its file lost) holds the port: `up` stops it and
        # starts its own on the same folder, instead of refusing the port.
        orphan = running(cfg, "s3")
        (cfg.pids / "s3.pid").unlink()
        assert f"stopping pid {orphan.pid}" in run("up", "s3")
        assert not alive([orphan]) and running(cfg, "s3").pid != orphan.pid
        assert s3_client(cfg).get_object(Bucket=cfg.bucket, Key=key)["Body"].read() == b'{"stage": "sft"}'
    finally:
        subprocess.run([*STACK_CMD, "down"], env=env, cwd=REPO, capture_output=True, timeout=120)
        remove_scratch(scratch)


@pytest.mark.e2e
def test_ray_head_jobs_reach_s3_with_the_nodes_environment(ray_head, s3_server):
    """A job driver started by the ray_head fixture finds the venv's python and S3 with no runtime_env."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_head)
    code = f"import boto3, sys; boto3.client('s3').put_object(Bucket='{s3_server.bucket}', Key='ray-head/probe', Body=sys.executable.encode())"
    job = client.submit_job(entrypoint=f'python -c "{code}"')
    deadline = time.monotonic() + 120
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, "job did not finish in 120 s"
        time.sleep(0.5)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job)
    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key="ray-head/probe")["Body"].read().decode()
    assert Path(body).parent == Path(sys.executable).parent


@pytest.mark.e2e
@pytest.mark.slow  # 67 s, most of it the readiness wait running out: make test stays inside its 25 minutes
def test_a_head_whose_job_agent_lost_its_port_is_not_ready(tmp_path, s3_server, monkeypatch):
    """Ray's dashboard agent keeps running without its HTTP server when its port is taken, and the head then
    answers every job submission "No available agent": readiness must say so, naming the agent and its log."""
    cfg = head_config(tmp_path / "stack", s3_server)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", cfg.ray_agent_port))
        squatter.listen()
        proc = start_ray(cfg, process_env(cfg))
        try:
            with pytest.raises(StackError, match=f"job agent on port {cfg.ray_agent_port}.*dashboard_agent.log"):
                wait_healthy(cfg, "ray", {"ray": proc}, timeout=40)
            # A submission to such a head, after its wait, is one line that says where to look.
            monkeypatch.setenv("AIRFLOW_CONN_RLHF_RAY", conn_ray(cfg.dashboard_port, token=ray_token(cfg.scratch)))
            with pytest.raises(RayUnreachableError, match="has no job agent after 5s: see dashboard_agent.log"):
                RayJobHook(agent_wait_s=5).submit(entrypoint="true", submission_id="never-runs")
        finally:
            stop_process(proc.pid)


@pytest.mark.e2e
def test_two_ups_at_once_leave_one_whole_stack():
    """`up` takes the stack's lock: a second `up` started at the same moment waits, then finds S3 running."""
    scratch = REPO / ".scratch" / "test-stack" / f"{os.getpid()}-lock"
    remove_scratch(scratch)
    env = stack_subprocess_env(scratch, s3_port=_stack_port())
    try:
        procs = [
            subprocess.Popen(
                [*STACK_CMD, "up", "s3"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert sum("s3       started" in o for o in outs) == 1 and sum("already running" in o for o in outs) == 1, outs
        cfg = Config.load(scratch)
        s3_procs = [
            p for p in psutil.process_iter(["cmdline"]) if str(cfg.s3_data) in " ".join(p.info["cmdline"] or [])
        ]
        assert len(s3_procs) == 1 and running(cfg, "s3").pid == s3_procs[0].pid
    finally:
        subprocess.run([*STACK_CMD, "down"], env=env, cwd=REPO, capture_output=True, timeout=120)
        remove_scratch(scratch)
