"""What a form value may reach beyond the store: the operator's allow-lists, set in the environment, never the form.

Hosts a stage may call:

    check_url("http://127.0.0.1:8000/v1", who="judge_url", error=ConfigError)    # passes: loopback
    check_url("http://10.0.0.1/v1", who="judge_url", error=ConfigError)
    # ConfigError: judge_url: host 10.0.0.1 is not in the operator's allow-list ($RLHF_ALLOWED_HOSTS: …)

$RLHF_ALLOWED_HOSTS is a comma-separated list of host names (``judge.internal``), IP addresses or networks
(``10.1.2.3``, ``10.1.0.0/16``), each optionally with ``:port``. Unset, only loopback is allowed
(127.0.0.0/8, ::1, localhost); set, it replaces that default. The Airflow side (plugins/pipeline.py's
`validate`) and every stage check each URL a form value names (the LLM judge, remote reward endpoints) before
anything is sent; plugins/operators.py hands the Airflow side's value to the stage jobs, so one setting rules
both. A host name matches by name only: what it resolves to is the operator's DNS.

Folders a team's Python file (an environment, a reward function, a metric) may come from:

    check_code_path("s3://bucket/env.py", "env_path", ConfigError)       # the store: always
    check_code_path("tasks/data/demo_reward.py", "remote_rm_url", …)     # the shipped code (the working dir): always
    check_code_path("/home/me/env.py", "env_path", ConfigError)          # only under $RLHF_USER_CODE_DIRS

$RLHF_USER_CODE_DIRS is a comma-separated list of absolute folders on the Ray nodes; unset, no file from a
node's own disk outside the working directory is accepted (a form could otherwise run any .py file a node holds).
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from pathlib import PurePosixPath

ENV = "RLHF_ALLOWED_HOSTS"
CODE_DIRS_ENV = "RLHF_USER_CODE_DIRS"
LOOPBACK = "127.0.0.0/8,::1,localhost"


def _split_entry(entry: str) -> tuple[str, int | None]:
    """(host or network, port or None) of one allow-list entry: `h`, `h:443`, `[::1]:8000`, `10.0.0.0/8`."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, int(port)
    return entry, None


def allowed_entries(value: str | None = None) -> list[tuple[str, int | None]]:
    """The parsed allow-list (``value``, else $RLHF_ALLOWED_HOSTS, else loopback); a malformed entry is a
    one-line ValueError naming it."""
    raw = os.environ.get(ENV, "") if value is None else value
    entries = []
    for entry in (raw or LOOPBACK).split(","):
        if not entry.strip():
            continue
        try:
            host, port = _split_entry(entry)
            if "/" in host:
                ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise ValueError(
                f"{ENV}: {entry.strip()!r} is not host, host:port, an IP address or a network like 10.0.0.0/8"
            ) from None
        entries.append((host, port))
    return entries


def _host_matches(host: str, pattern: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == pattern  # a name matches by name only
    try:
        return address in ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return False  # a name pattern never matches an IP literal


def host_allowed(host: str, port: int | None, value: str | None = None) -> bool:
    host = (host or "").lower().strip("[]")
    return any(_host_matches(host, h) and (p is None or p == port) for h, p in allowed_entries(value))


def check_url(url: str, who: str, error: type[Exception], value: str | None = None) -> str:
    """``url`` when it is http(s) to an allowed host; otherwise ``error`` with one line naming ``who``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise error(f"{who}: {url} is not an http(s):// URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ok = host_allowed(parts.hostname, port, value)
    except ValueError as e:
        raise error(f"{who}: {e}") from None
    if not ok:
        listed = os.environ.get(ENV) if value is None else value
        raise error(
            f"{who}: host {parts.hostname} (port {port}) is not in the operator's allow-list (${ENV}: {listed or 'unset, loopback only'}); "
            f"the operator adds it to ${ENV} where Airflow and Ray run, not in the form"
        )
    return url


def check_code_path(path: str, who: str, error: type[Exception], dirs: str | None = None) -> str:
    """``path`` when a Python file may be imported from there (see the module); otherwise ``error``, one line.

    A ``#sha256=…`` pin (tasks/common/user_code.py) is not part of the path."""
    where = path.split("#", 1)[0]
    if where.startswith("s3://"):
        return path
    local = where[len("file://") :] if where.startswith("file://") else where
    parts = PurePosixPath(local).parts
    if not local.startswith("/") and ".." not in parts:
        return path  # relative: inside the stage's own working directory, the code shipped with the job
    raw = os.environ.get(CODE_DIRS_ENV, "") if dirs is None else dirs
    # The working directory is the code shipped with the job (or the checkout a developer runs a stage in).
    roots = [os.getcwd()] + [os.path.realpath(d.strip()) for d in raw.split(",") if d.strip()]
    resolved = os.path.realpath(local)  # symlinks followed: a link out of an allowed folder is outside it
    if any(resolved.startswith(root.rstrip("/") + "/") for root in roots if os.path.isabs(root)):
        return path
    raise error(
        f"{who}: {where} is on a node's own disk, outside the folders the operator allows (${CODE_DIRS_ENV}: {raw or 'unset, none'}); "
        "upload it to s3:// or ask the operator to add its folder"
    )


def check_reach(value: str, who: str, error: type[Exception]) -> None:
    """Each part of a comma-separated form value that reaches out, checked: an http(s):// URL (check_url), a
    Python file (check_code_path); other parts (a built-in name) are the stage's to judge."""
    for part in (p.strip() for p in str(value or "").split(",")):
        if part.startswith(("http://", "https://")):
            check_url(part, who, error)
        elif part.split("#", 1)[0].endswith(".py"):
            check_code_path(part, who, error)
