"""Airflow 3 REST API client (standard library only), for tools/demo.py and the live_stack fixture.

api = AirflowAPI.for_stack(cfg)
api.get(f"/api/v2/dags/{q(dag_id)}")
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tools.stack.config import Config, airflow_login


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
