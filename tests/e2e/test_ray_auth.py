"""The Ray cluster asks for a token (issue 53, item 5): a real head started by tools/stack, real HTTP.

Anything on the machine could reach the Jobs API on loopback and run a job as the stack's user, with its S3
keys. The stack's head now runs with RAY_AUTH_MODE=token: a request without the token is refused, and the
hook, the trigger and the stage drivers inside the cluster carry it, each from where it belongs (the rlhf_ray
connection, the head's own token file), never from a Param, a log line or a job's runtime_env.

    pytest tests/e2e/test_ray_auth.py        # starts the session's ray_head (about 10 s)
"""

import asyncio
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.request

import pytest

from plugins.hooks import RayAuthError, RayJobHook, RayUnreachableError
from plugins.triggers import RayJobTrigger
from tasks.common import names
from tools.stack.config import Config, conn_ray, process_env, ray_token, ray_token_file, stack_env

from tests.conftest import REPO

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def post_job(dashboard: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    """(status, body) of a plain POST /api/jobs/, as any process on the machine could send it."""
    req = urllib.request.Request(
        f"{dashboard}/api/jobs/",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_done(hook: RayJobHook, sid: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while (status := str(hook.get_job_info(sid).status.value)) not in TERMINAL:
        assert time.monotonic() < deadline, f"job {sid} still {status} after {timeout:.0f}s"
        time.sleep(0.5)
    return status


def connection_token(dashboard: str) -> str:
    """The token the rlhf_ray connection holds for the head at `dashboard` (set by the ray_head fixture)."""
    conn = json.loads(os.environ[names.conn_env(names.RAY_CONN)])
    assert dashboard.endswith(f":{conn['port']}"), conn
    return conn["password"]


def unique(prefix: str) -> str:
    return f"airflow-auth-{prefix}-{int(time.time() * 1000)}"


# ------------------------------------------------------------------------ the stack's token (no Ray)


def test_the_stack_makes_one_private_token_and_gives_it_to_ray_and_the_connection(tmp_path):
    token = ray_token(tmp_path)
    path = ray_token_file(tmp_path)
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, as `ray get-auth-token --generate`
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ray_token(tmp_path) == token  # made once, then reused
    path.chmod(0o644)
    assert ray_token(tmp_path) == token and stat.S_IMODE(path.stat().st_mode) == 0o600  # made private again
    env = stack_env(tmp_path)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(path)
    assert json.loads(env[names.conn_env(names.RAY_CONN)])["password"] == token
    assert "RAY_AUTH_TOKEN" not in env  # the processes read the file
    # Another cluster's token in the caller's environment would win over the file: it is dropped.
    assert "RAY_AUTH_TOKEN" not in process_env(
        Config(scratch=tmp_path), {"RAY_AUTH_TOKEN": "other-cluster", "PATH": "/usr/bin"}
    )


def test_the_trigger_serializes_the_connection_name_never_the_token(ray_head):
    token = connection_token(ray_head)
    trigger = RayJobTrigger(address=ray_head, submission_id="airflow-x--r--t", ray_conn_id=names.RAY_CONN)
    _, kwargs = trigger.serialize()
    assert kwargs["ray_conn_id"] == names.RAY_CONN
    assert token not in json.dumps(kwargs)


# ---------------------------------------------------------------------------------- the real head


@pytest.mark.e2e
def test_an_unauthenticated_job_submission_is_refused(ray_head):
    sid = unique("anon")
    status, body = post_job(ray_head, {"entrypoint": "echo this must not run", "submission_id": sid})
    assert status == 401, body
    status, body = post_job(
        ray_head,
        {"entrypoint": "echo this must not run", "submission_id": sid},
        {"Authorization": "Bearer not-the-token"},
    )
    assert status == 403, body
    # Nor may an anonymous client read what runs (job list, entrypoints, metadata).
    with pytest.raises(urllib.error.HTTPError) as listing:
        urllib.request.urlopen(f"{ray_head}/api/jobs/", timeout=30)
    assert listing.value.code == 401
    assert RayJobHook().get_job_info(sid) is None  # nothing was submitted


@pytest.mark.e2e
def test_the_hook_submits_with_the_connection_token(ray_head):
    token = connection_token(ray_head)
    hook = RayJobHook()  # address and token from AIRFLOW_CONN_RLHF_RAY
    sid = unique("hook")
    hook.submit(
        entrypoint="echo accepted with the token",
        submission_id=sid,
        runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
        entrypoint_num_cpus=0,
    )
    assert wait_done(hook, sid) == "SUCCEEDED", hook.get_job_logs(sid)
    assert "accepted with the token" in hook.get_job_logs(sid)
    # The trigger's side (aiohttp, the connection read without blocking the loop) carries it too.
    assert asyncio.run(hook.get_status(sid))["status"] == "SUCCEEDED"
    assert "accepted with the token" in asyncio.run(RayJobHook(names.RAY_CONN, address=ray_head).get_logs(sid))
    # The token is in none of what Ray keeps about the job.
    info = hook.get_job_info(sid)
    assert token not in json.dumps(
        {"runtime_env": info.runtime_env, "metadata": info.metadata, "entrypoint": info.entrypoint}, default=str
    )


@pytest.mark.e2e
def test_the_trigger_follows_a_job_with_the_connection_token(ray_head):
    hook = RayJobHook()
    sid = unique("trigger")
    hook.submit(entrypoint="echo followed by the trigger", submission_id=sid, entrypoint_num_cpus=0)
    trigger = RayJobTrigger(address=hook.address, submission_id=sid, ray_conn_id=names.RAY_CONN, poll_interval=0.5)

    async def first_event():
        return await asyncio.wait_for(anext(trigger.run()), timeout=120)

    event = asyncio.run(first_event()).payload
    assert event["status"] == "SUCCEEDED", event
    assert "followed by the trigger" in event["log_tail"]


@pytest.mark.e2e
def test_a_wrong_token_in_the_connection_is_one_line_naming_it(ray_head, monkeypatch):
    """The connection's token is what the hook sends, even where this process holds the right one for Ray's own
    clients (RAY_AUTH_TOKEN_PATH): a wrong one is refused, in one line naming the connection, without the token."""
    port = int(ray_head.rsplit(":", 1)[1])
    monkeypatch.setenv("AIRFLOW_CONN_RAY_WRONG", conn_ray(port, token="0" * 64))
    hook = RayJobHook("ray_wrong")
    with pytest.raises(RayAuthError) as sync_err:
        hook.get_job_info("airflow-anything")
    with pytest.raises(RayAuthError) as async_err:
        asyncio.run(RayJobHook("ray_wrong").get_status("airflow-anything"))
    with pytest.raises(RayAuthError) as nodes_err:
        RayJobHook("ray_wrong").cluster_resources()
    for err in (sync_err.value, async_err.value, nodes_err.value):
        message = str(err)
        assert "\n" not in message and "'ray_wrong'" in message and "HTTP 403" in message and ray_head in message, (
            message
        )
        assert "0" * 64 not in message
        assert isinstance(
            err, RayUnreachableError
        )  # the run's validate task reports it as it reports an unreachable cluster


@pytest.mark.e2e
def test_a_job_whose_runtime_env_has_no_token_still_runs_stage_drivers_and_workers(ray_head):
    """A stage's driver joins the cluster with connect_ray() (tasks/common/nn/workers.py) and places a worker:
    it gets the token from the head's own environment (RAY_AUTH_TOKEN_PATH), not from the job's runtime_env."""
    hook = RayJobHook()
    sid = unique("driver")
    code = (
        "import os, ray; from tasks.common.nn.workers import connect_ray; connect_ray(); "
        "print('driver', ray.get(ray.remote(lambda: 6 * 7).remote()), os.environ['RAY_AUTH_MODE'], 'RAY_AUTH_TOKEN' in os.environ)"
    )
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}}
    hook.submit(
        entrypoint=f'{sys.executable} -c "{code}"', submission_id=sid, runtime_env=runtime_env, entrypoint_num_cpus=0
    )
    assert wait_done(hook, sid) == "SUCCEEDED", hook.get_job_logs(sid)
    assert "driver 42 token False" in hook.get_job_logs(sid)
