"""RayJobHook: the Airflow side's handle on a Ray cluster's Jobs API.

Sync methods (used by the operator, on a worker) go through Ray's own ``JobSubmissionClient``, which
also zips and uploads a local ``working_dir``. Async methods (used by the trigger, in the triggerer's
event loop) talk to the same Jobs REST API with aiohttp, so no blocking HTTP ever runs in the loop.

The dashboard address comes from an Airflow connection (default ``rlhf_ray``) of conn_type ``http``:
host, port and schema (``http`` or ``https``); ``host`` may also be a full URL. Any failure to reach
Ray is raised as :class:`RayUnreachableError`, whose message is one line naming the address.

A cluster started with ``RAY_AUTH_MODE=token`` refuses every request without its token. The token is the
connection's password (or ``token`` in its extra) and travels only as the ``Authorization: Bearer`` header
of requests to that connection's address: never in a Param, a log line or a job's runtime_env (the job's
processes get it from the cluster's own nodes). A hook given an address that is not its connection's uses
Ray's own client settings instead (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, as ``ray job submit``
does). A refused token is raised as :class:`RayAuthError`, one line naming the connection to fix.

    hook = RayJobHook()                                   # connection rlhf_ray: address and token
    hook.submit("python -m tasks.sft ...", submission_id="airflow-...")
    await RayJobHook("rlhf_ray", address=url).get_status("airflow-...")   # the trigger's side
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from tasks.common import names

LIVE_STATUSES = frozenset({"PENDING", "RUNNING"})
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})

DEFAULT_HTTP_TIMEOUT = 30.0
# How long submit() waits for a starting cluster's job agent ("No available agent to submit job").
DEFAULT_AGENT_WAIT_S = 60.0


class RayUnreachableError(ConnectionError):
    """The Ray dashboard / Jobs API could not be reached (message: one line naming the address)."""


class RayAuthError(RayUnreachableError):
    """Ray refused the request's token (HTTP 401 or 403): one line naming the connection to fix. A kind of
    unreachable, so that whoever reports an unreachable cluster (the run's validate task) reports this too."""


AUTH_REFUSED = {401, 403}


def token_from_connection(conn: Any) -> str | None:
    """The cluster's token held by a connection: its password, else ``token`` in its extra; None when it holds none."""
    token = (conn.password or "").strip()
    if not token:
        extra = conn.extra_dejson or {}
        token = str(extra.get("token") or "").strip()
    return token or None


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def ray_client_headers() -> dict[str, str]:
    """The header Ray's own clients would send from this process (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), {} when this process has no token mode. Imports ray: only
    reached when no connection gives the token."""
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    except ImportError:  # a Ray without token authentication
        return {}
    return dict(get_auth_headers_if_auth_enabled({}))


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
        self._headers: dict[str, str] | None = None

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

    # ------------------------------------------------------------------ token

    def _connection_or_none(self, conn: Any = None) -> Any:
        """The hook's connection; None when an explicit address was given and no such connection exists."""
        if conn is not None:
            return conn
        try:
            return self.get_connection(self.ray_conn_id) if self.ray_conn_id else None
        except AirflowNotFoundException:
            if self._address is None:
                raise
            return None

    def _headers_from(self, conn: Any) -> dict[str, str]:
        """The connection's token when this hook talks to the connection's own address, else Ray's client settings:
        a token never goes to an address its connection does not name."""
        if conn is not None and (conn.host or "").strip():
            if self._address is None or self.address_from_connection(conn) == self._address:
                token = token_from_connection(conn)
                if token:
                    return bearer(token)
        return ray_client_headers()

    def auth_headers(self) -> dict[str, str]:
        """The Authorization header of every request to the Jobs API ({} for a cluster that asks no token)."""
        if self._headers is None:
            self._headers = self._headers_from(self._connection_or_none())
        return self._headers

    async def aauth_headers(self) -> dict[str, str]:
        """auth_headers() for the triggerer's event loop: the connection is read without blocking it."""
        if self._headers is None:
            conn = None
            if self.ray_conn_id:
                try:
                    conn = await self.aget_connection(self.ray_conn_id)
                except AirflowNotFoundException:
                    if self._address is None:
                        raise
            self._headers = self._headers_from(conn)
        return self._headers

    def _auth_refused(self, status: int) -> RayAuthError:
        where = f"the password of Airflow connection {self.ray_conn_id!r}" if self.ray_conn_id else "RAY_AUTH_TOKEN"
        if status == 401:
            return RayAuthError(
                f"Ray Jobs API at {self.address} asks for a token (HTTP 401): set {where} to the cluster's token (its nodes' RAY_AUTH_TOKEN)"
            )
        return RayAuthError(
            f"Ray Jobs API at {self.address} refused the token (HTTP 403): {where} must be the cluster's token (its nodes' RAY_AUTH_TOKEN)"
        )

    def _ray_auth_error(self, exc: BaseException) -> RayAuthError | None:
        """Ray's own AuthenticationError (raised by JobSubmissionClient on 401/403) as a one-line RayAuthError."""
        if type(exc).__name__ != "AuthenticationError":
            return None
        return self._auth_refused(401 if str(exc).startswith("Authentication required") else 403)

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
                # An explicit Authorization header: Ray's client then adds no token of its own.
                self._client = JobSubmissionClient(self.address, headers=self.auth_headers())
            except (ConnectionError, OSError, RuntimeError) as exc:
                raise self._unreachable(exc) from exc
            except Exception as exc:  # its version check refused the token
                refused = self._ray_auth_error(exc)
                if refused is None:
                    raise
                raise refused from None
        return self._client

    def _call(self, fn, *args, **kwargs):
        import requests

        try:
            return fn(*args, **kwargs)
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError) as exc:
            raise self._unreachable(exc) from exc
        except Exception as exc:
            refused = self._ray_auth_error(exc)
            if refused is None:
                raise
            raise refused from None

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
                if "No available agent" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise RayUnreachableError(
                        f"Ray at {self.address} has no job agent after {self.agent_wait_s:.0f}s: see dashboard_agent.log "
                        "in the head's session logs (a taken --dashboard-agent-listen-port leaves it without one)"
                    ) from None
                self.log.info("Ray has no job agent yet (cluster starting?); retrying the submission")
                time.sleep(1.0)

    def cluster_resources(self) -> dict[str, float]:
        """The total resources of the cluster's live nodes ({"CPU": 2.0, "GPU": 8.0, …}), from the dashboard's state API."""
        import requests

        try:
            response = requests.get(
                f"{self.address}/api/v0/nodes",
                params={"detail": "1"},
                headers=self.auth_headers(),
                timeout=self.http_timeout,
            )
            if response.status_code in AUTH_REFUSED:
                raise self._auth_refused(response.status_code)
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
        headers = await self.aauth_headers()
        timeout = aiohttp.ClientTimeout(total=self.http_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.request(method, url, headers=headers) as resp:
                    if resp.status == 404:
                        return None
                    if resp.status in AUTH_REFUSED:
                        raise self._auth_refused(resp.status)
                    text = await resp.text()
                    if resp.status != 200:
                        first = " ".join(text.split())[:200]
                        raise RuntimeError(
                            f"Ray Jobs API at {self.address}: {method} {path} -> HTTP {resp.status}: {first}"
                        )
                    try:
                        return await resp.json(content_type=None)
                    except ValueError as exc:
                        raise RuntimeError(f"Ray Jobs API at {self.address}: {method} {path} returned no JSON") from exc
        except RayAuthError:
            raise
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
