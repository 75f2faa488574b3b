"""JSON over HTTP for a team's services (a reward server, an LLM judge): POST, retries, one-line errors.

    reply = post_json("http://127.0.0.1:8000/score", {"query": [...]}, who="remote_rm_url", error=RewardError)

Connection failures, timeouts, HTTP 429 and 5xx are retried with exponential backoff; any other HTTP
error, a reply that is not JSON, or the last failed attempt raises ``error`` with one line naming ``who``
(the flag) and the URL. Headers may carry a credential; it is never part of a message.

The URL must be on the operator's allow-list (tasks/common/allowlist.py), checked before anything is sent. A
redirect is followed only to the same scheme, host and port, and an Authorization header is never resent on
a redirect: a credential goes to the host it was configured for and nowhere else.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any

from tasks.common import allowlist


class _Retry(Exception):
    pass


class _CrossHostRedirect(Exception):
    pass


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the origin (scheme, host, port) of the request."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = (
            urllib.parse.urlsplit(req.full_url),
            urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl)),
        )
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            raise _CrossHostRedirect(f"{code} redirect to {new.scheme}://{new.netloc}, another host: not followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameHostRedirects)


def _post_once(url: str, payload: bytes, headers: dict, timeout: float, who: str, error: type[Exception]) -> Any:
    request = urllib.request.Request(
        url, data=payload, method="POST", headers={"Content-Type": "application/json", "Accept": "application/json"}
    )
    for name, value in headers.items():
        # Unredirected: urllib copies ordinary headers onto a redirect's request, these it never does.
        request.add_unredirected_header(name, value)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = response.read()
    except _CrossHostRedirect as e:
        raise error(f"{who}: {url} answered with a {e}") from None
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
    url: str,
    payload: Any,
    who: str,
    error: type[Exception],
    headers: dict | None = None,
    timeout: float = 30,
    retries: int = 3,
    backoff: float = 1.0,
) -> Any:
    """The decoded JSON reply to POSTing ``payload`` as JSON to ``url`` (an allowed host: allowlist.check_url)."""
    allowlist.check_url(url, who, error)
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
