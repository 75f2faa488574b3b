"""JSON over HTTP for a team's services (a reward server, an LLM judge): POST, retries, one-line errors.

    reply = post_json("http://127.0.0.1:8000/score", {"query": [...]}, who="remote_rm_url", error=RewardError)

Connection failures, timeouts, HTTP 429 and 5xx are retried with exponential backoff; any other HTTP
error, a reply that is not JSON, or the last failed attempt raises ``error`` with one line naming ``who``
(the flag) and the URL. Headers may carry a credential; it is never part of a message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Any


class _Retry(Exception):
    pass


def _post_once(url: str, payload: bytes, headers: dict, timeout: float, who: str, error: type[Exception]) -> Any:
    request = urllib.request.Request(url, data=payload, method="POST", headers={"Content-Type": "application/json", "Accept": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read(200).decode("utf-8", "replace").split())
        message = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
        if e.code >= 500 or e.code == 429:
            raise _Retry(message) from None
        raise error(f"{who}: {url} answered {message}") from None
    except (urllib.error.URLError, OSError, HTTPException) as e:  # refused, reset, timed out, …
        reason = getattr(e, "reason", None) or e
        raise _Retry(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__) from None
    try:
        return json.loads(body)
    except ValueError:
        snippet = " ".join(body[:120].decode("utf-8", "replace").split())
        raise error(f"{who}: {url} answered with no JSON: {snippet!r}") from None


def post_json(
    url: str, payload: Any, who: str, error: type[Exception], headers: dict | None = None, timeout: float = 30, retries: int = 3, backoff: float = 1.0
) -> Any:
    """The decoded JSON reply to POSTing ``payload`` as JSON to ``url``."""
    body = json.dumps(payload).encode()
    attempts = retries + 1
    for attempt in range(attempts):
        try:
            return _post_once(url, body, headers or {}, timeout, who, error)
        except _Retry as e:
            last = str(e)
            if attempt + 1 < attempts:
                time.sleep(backoff * 2**attempt)
    raise error(f"{who}: {url} failed after {attempts} attempts: {last}")
