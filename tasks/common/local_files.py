"""Local files the storage layer writes and lists: whole or not at all, so a reader never sees half a file.

    from tasks.common import local_files

    local_files.atomic_write(Path("out/meta.json"), b"{}")        # temp file beside it, then rename
    local_files.atomic_copy(Path("a.bin"), Path("out/a.bin"))
    local_files.walk_local("out", exclude=("*.tmp",))             # [("meta.json", 2), ...]
    local_files.local_etag(Path("out/meta.json"))                 # its sha256: a local file's ETag

Standard library only.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from tasks.common.uris import local_path


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy via a temp file + rename so a reader never sees a half-written file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and os.path.samefile(src, dst):
        return  # e.g. commit() of a directory onto itself
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(dst: Path, data: bytes) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def walk_local(local_dir: str | os.PathLike, exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Files under a local directory as sorted ``(relative POSIX path, size)``.

    ``exclude`` holds fnmatch patterns matched against the relative path ("manifest.json" is only the
    top-level one; "*.tmp" matches at any depth because fnmatch's * also matches "/").
    """
    root = local_path(local_dir)
    exclude = tuple(exclude)
    out = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if any(fnmatch.fnmatchcase(rel, pat) for pat in exclude):
            continue
        out.append((rel, path.stat().st_size))
    return sorted(out)


def local_etag(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
