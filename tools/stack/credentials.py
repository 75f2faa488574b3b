"""The stack's credentials, each made once into its scratch folder and reused: the Airflow login, the S3 keys,
the Ray token.

    user, password = airflow_login(scratch)       # ("admin", "…"): the simple auth manager's passwords file
    key_id, secret = s3_keys(scratch)             # the embedded S3's keys
    headers = ray_auth_headers(scratch)           # {"Authorization": "Bearer …"} for the Ray dashboard

Every file under <scratch>/secrets is private (mode 0600). What changes here is how a credential is made and
kept; which process gets which is tools/stack/environment.py.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Callable

from tools.stack.files import atomic_write, write_once

USERNAME = "admin"


def airflow_login(scratch: Path) -> tuple[str, str]:
    """(username, password) of the stack's Airflow; the password is generated once into the scratch folder.

    The file is the simple auth manager's own passwords file ([core] simple_auth_manager_passwords_file),
    written before the API server starts, so Airflow never generates another one.
    """
    path = Path(scratch) / "airflow" / "passwords.json"
    try:
        passwords = json.loads(path.read_text())
        if passwords.get(USERNAME):
            return USERNAME, passwords[USERNAME]
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    atomic_write(path, json.dumps({USERNAME: password}) + "\n", mode=0o600)
    return USERNAME, password


def s3_keys(scratch: Path) -> tuple[str, str]:
    """The embedded S3's access key id and secret, made once per stack. The emulator accepts any pair; a
    secret of its own lets a test prove that it never reaches Ray's API or logs."""
    secrets_dir = Path(scratch) / "secrets"
    return (
        write_once(secrets_dir / "s3_access_key_id", lambda: "RLHF" + secrets.token_hex(8).upper()),
        write_once(secrets_dir / "s3_secret_access_key", lambda: secrets.token_urlsafe(30)),
    )


def ray_token_file(scratch: Path) -> Path:
    """Where a stack keeps the token its Ray head asks for: <scratch>/secrets/ray_auth_token (mode 0600)."""
    return Path(scratch) / "secrets" / "ray_auth_token"


def ray_token(scratch: Path, make: Callable[[], str] | None = None) -> str:
    """The stack's Ray token (RAY_AUTH_MODE=token), made once per stack and reused: 256 random bits, as
    `ray get-auth-token --generate` makes them. `make` gives a new stack's value (the tests give their heads the
    token their own process holds). A file others may read is made private again: the token owns the cluster."""
    path = ray_token_file(scratch)
    token = write_once(path, make or (lambda: secrets.token_hex(32)))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return token


def ray_auth_headers(scratch: Path) -> dict[str, str]:
    """The header the stack's own clients (health checks, scripts) send to its Ray dashboard."""
    return {"Authorization": f"Bearer {ray_token(scratch)}"}
