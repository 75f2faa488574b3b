"""RayJobHook: the Airflow side's handle on a Ray cluster's Jobs API.

Sync methods (used by the operator, on a worker) go through Ray's own ``JobSubmissionClient``, which
also zips and uploads a local ``working_dir``. Async methods (used by the trigger, in the triggerer's
event loop) talk to the same Jobs REST API with aiohttp, so no blocking HTTP ever runs in the loop.

The dashboard address comes from an Airflow connection (default ``rlhf_ray``) of conn_type ``http``:
host, port and schema (``http`` or ``https``); ``host`` may also be a full URL. Any failure to reach
Ray is raised as :class:`RayUnreachableError`, whose message is one line naming the address.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from airflow.sdk import BaseHook

from tasks.common import names

LIVE_STATUSES = frozenset({"PENDING", "RUNNING"})
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})

DEFAULT_HTTP_TIMEOUT = 30.0
# How long submit() waits for a starting cluster's job agent ("No available agent to submit job").
DEFAULT_AGENT_WAIT_S = 60.0


class RayUnreachableError(ConnectionError):
    """The Ray dashboard / Jobs API could not be reached (message: one line naming the address)."""


class RayJobHook(BaseHook):
    """Submit, inspect, stop and read the logs of Ray jobs.

    :param ray_conn_id: Airflow connection holding the Ray dashboard address.
    :param address: use this dashboard address ("http://host:port") instead of a connection
        (the trigger uses this: it runs where the address is already resolved).
    :param http_timeout: seconds before an HTTP request to Ray is abandoned.
    :param agent_wait_s: how long a submission waits for a starting cluster's job agent.
    """

    conn_name_attr = "ray_conn_id"
    default_conn_name = names.RAY_CONN
    conn_type = "http"
    hook_name = "Ray Jobs API"

    def __init__(
        self,
        ray_conn_id: str = default_conn_name,
        *,
        address: str | None = None,
        http_timeout: float = DEFAULT_HTTP_TIMEOUT,
        agent_wait_s: float = DEFAULT_AGENT_WAIT_S,
    ) -> None:
        super().__init__()
        self.ray_conn_id = ray_conn_id
        self._address = address.rstrip("/") if address else None
        self.http_timeout = http_timeout
        self.agent_wait_s = agent_wait_s
        self._client = None

    # ------------------------------------------------------------------ address

    @staticmethod
    def address_from_connection(conn: Any) -> str:
        """``http://host:port`` from a connection's host/port/schema (``host`` may be a whole URL)."""
        host = (conn.host or "").strip().rstrip("/")
        if not host:
            raise ValueError(f"Connection {conn.conn_id!r} has no host: set the Ray dashboard's address")
        if "://" in host:
            scheme, _, rest = host.partition("://")
        else:
            scheme, rest = (conn.schema or "http").strip() or "http", host
        if conn.port and ":" not in rest.split("/")[0]:
            rest = f"{rest}:{conn.port}"
        return f"{scheme}://{rest}"

    @property
    def address(self) -> str:
        """The Ray dashboard's base URL, e.g. ``http://127.0.0.1:8265``."""
        if self._address is None:
            self._address = self.address_from_connection(self.get_connection(self.ray_conn_id))
        return self._address

    def dashboard_url(self, submission_id: str) -> str:
        """Where a person looks at this job in the Ray dashboard."""
        return f"{self.address}/#/jobs/{submission_id}"

    def _unreachable(self, exc: BaseException) -> RayUnreachableError:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if len(cause) > 200:
            cause = cause[:197] + "..."
        return RayUnreachableError(f"Ray Jobs API at {self.address} is unreachable: {cause}")

    # ------------------------------------------------------------------ sync (operator side)

    def get_conn(self):
        """A connected ``ray.job_submission.JobSubmissionClient`` (created once per hook)."""
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            try:
                self._client = JobSubmissionClient(self.address)
            except (ConnectionError, OSError) as exc:
                raise self._unreachable(exc) from exc
            except RuntimeError as exc:
                raise self._unreachable(exc) from exc
        return self._client

    def _call(self, fn, *args, **kwargs):
        import requests

        try:
            return fn(*args, **kwargs)
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError) as exc:
            raise self._unreachable(exc) from exc

    def submit(
        self,
        entrypoint: str,
        submission_id: str,
        runtime_env: dict[str, Any] | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Submit a job under ``submission_id``; return that id. Raises if the id is already taken."""
        client = self.get_conn()
        deadline = time.monotonic() + self.agent_wait_s
        while True:
            try:
                return self._call(
                    client.submit_job,
                    entrypoint=entrypoint,
                    submission_id=submission_id,
                    runtime_env=runtime_env,
                    entrypoint_num_cpus=entrypoint_num_cpus,
                    entrypoint_num_gpus=entrypoint_num_gpus,
                    metadata=metadata,
                )
            except RuntimeError as exc:
                # A freshly started head answers 500 until its job agent has registered: wait for it.
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
                self.log.info("Ray has no job agent yet (cluster starting?); retrying the submission")
                time.sleep(1.0)

    def cluster_resources(self) -> dict[str, float]:
        """The total resources of the cluster's live nodes ({"CPU": 2.0, "GPU": 8.0, …}), from the dashboard's state API."""
        import requests

        try:
            response = requests.get(f"{self.address}/api/v0/nodes", params={"detail": "1"}, timeout=self.http_timeout)
            response.raise_for_status()
            nodes = response.json()["data"]["result"]["result"]
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            raise self._unreachable(e) from None
        total: dict[str, float] = {}
        for node in nodes:
            if node.get("state") == "ALIVE":
                for name, amount in (node.get("resources_total") or {}).items():
                    total[name] = total.get(name, 0.0) + float(amount)
        return total

    def get_job_info(self, submission_id: str):
        """Ray's ``JobDetails`` for the job, or None when Ray does not know the id."""
        client = self.get_conn()
        try:
            return self._call(client.get_job_info, submission_id)
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                return None
            raise

    def list_jobs(self) -> list:
        """Every job Ray knows (``JobDetails``), submission jobs and plain drivers alike."""
        client = self.get_conn()
        return self._call(client.list_jobs)

    def stop_job(self, submission_id: str) -> bool:
        """Ask Ray to stop the job (SIGTERM, then kill); True if it was running. Never deletes it."""
        client = self.get_conn()
        return self._call(client.stop_job, submission_id)

    def get_job_logs(self, submission_id: str) -> str:
        """The driver's whole log so far."""
        client = self.get_conn()
        return self._call(client.get_job_logs, submission_id)

    # ------------------------------------------------------------------ async (trigger side)

    async def _aget_json(self, path: str, *, method: str = "GET") -> Any:
        """One request to the Jobs REST API; None on 404; one-line errors otherwise."""
        url = f"{self.address}{path}"
        timeout = aiohttp.ClientTimeout(total=self.http_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.request(method, url) as resp:
                    if resp.status == 404:
                        return None
                    text = await resp.text()
                    if resp.status != 200:
                        first = " ".join(text.split())[:200]
                        raise RuntimeError(f"Ray Jobs API at {self.address}: {method} {path} -> HTTP {resp.status}: {first}")
                    try:
                        return await resp.json(content_type=None)
                    except ValueError as exc:
                        raise RuntimeError(f"Ray Jobs API at {self.address}: {method} {path} returned no JSON") from exc
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            raise self._unreachable(exc) from exc

    async def get_status(self, submission_id: str) -> dict[str, Any] | None:
        """``GET /api/jobs/{id}``: the job's details (``status``, ``message``, ...), or None if unknown."""
        return await self._aget_json(f"/api/jobs/{submission_id}")

    async def get_logs(self, submission_id: str) -> str | None:
        """``GET /api/jobs/{id}/logs``: the driver's whole log so far, or None if the job is unknown."""
        payload = await self._aget_json(f"/api/jobs/{submission_id}/logs")
        if payload is None:
            return None
        return payload.get("logs") or ""

    async def astop_job(self, submission_id: str) -> bool:
        """``POST /api/jobs/{id}/stop``: True if Ray stopped a live job."""
        payload = await self._aget_json(f"/api/jobs/{submission_id}/stop", method="POST")
        return bool(payload and payload.get("stopped"))
