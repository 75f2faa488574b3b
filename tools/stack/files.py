"""The stack's own small files, written whole (``atomic_write``) or once (``write_once``).

    atomic_write(scratch / "stack.json", text)                             # temp file, then rename
    token = write_once(scratch / "secrets" / "jwt_secret", lambda: secrets.token_urlsafe(32))   # made once, reused

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_once(path: Path, make: Callable[[], str]) -> str:
    """A value generated once into the scratch folder and reused."""
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
