"""Readiness checks of the stack's parts, over HTTP on 127.0.0.1: HEALTH[component](cfg) -> (ok, detail)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import psutil

from tools.stack.config import LOOPBACK, Config, StackError, ray_auth_headers, ray_token_file
from tools.stack.processes import alive, log_file, tail


def http_get(url: str, timeout: float = 3.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET; `headers` for an authenticated one, e.g. http_get(url, headers=ray_auth_headers(scratch))."""
    req = urllib.request.Request(url, headers={"Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def healthy_s3(cfg: Config) -> tuple[bool, str]:
    try:
        status, _ = http_get(f"{cfg.s3_endpoint}/moto-api/", timeout=2)
        return status == 200, f"HTTP {status}"
    except (OSError, urllib.error.URLError) as e:
        return False, str(e)


def healthy_ray(cfg: Config) -> tuple[bool, str]:
    """The dashboard answers the stack's token and a node is alive (the head asks every client for the token)."""
    try:
        auth = ray_auth_headers(cfg.scratch)
        status, body = http_get(f"{cfg.dashboard_url}/api/version", timeout=2, headers=auth)
        if status in (401, 403):
            return (
                False,
                f"/api/version: HTTP {status}, the head refused the token in {ray_token_file(cfg.scratch)} (a head of another stack on this port?)",
            )
        if status != 200:
            return False, f"/api/version: HTTP {status}"
        status, body = http_get(f"{cfg.dashboard_url}/api/v0/nodes", timeout=5, headers=auth)
        if status != 200:
            return False, f"/api/v0/nodes: HTTP {status}"
        nodes = json.loads(body)["data"]["result"]["result"]
        if not any(n.get("state") == "ALIVE" for n in nodes):
            return False, "no node alive yet"
        # Jobs are submitted through the head's dashboard agent; until its HTTP server is up (and it never is if
        # its port was taken) every submission answers "No available agent".
        agent = f"the job agent on port {cfg.ray_agent_port}"
        try:
            status, _ = http_get(f"http://{LOOPBACK}:{cfg.ray_agent_port}/api/healthz", timeout=5, headers=auth)
        except (OSError, urllib.error.URLError) as e:
            return False, f"{agent} does not answer ({e}; its log: dashboard_agent.log under {cfg.ray_temp_dir})"
        if status != 200:
            return False, f"{agent}: HTTP {status} (its log: dashboard_agent.log under {cfg.ray_temp_dir})"
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
            code = proc.poll() if isinstance(proc, subprocess.Popen) else (None if alive([proc]) else "?")
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
