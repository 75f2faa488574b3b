"""The storage layer's errors: one line naming the URI or path and the fix, and whether a retry may succeed.
A full, read-only or forbidden disk is told apart from a bad object (DISK_FAULTS), so a stage exits 75 (try
again) for a full disk and 2 (fix the input) for the rest. Standard library only.

    raise StorageError("no object at s3://b/k: check the URI", "s3://b/k")
    disk_error(OSError(errno.ENOSPC, "No space left"), "/data/x")   # "cannot write /data/x: no space left … 1.2 GiB free of …"
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any


class StorageError(Exception):
    """A storage failure with a one-line message naming the URI and the fix; ``uri`` holds the URI.
    ``transient``: the store was unreachable or overloaded, so trying again later may succeed."""

    def __init__(self, message: str, uri: str | None = None, transient: bool = False):
        super().__init__(one_line(message))
        self.uri = uri
        self.transient = transient


class NotFoundError(StorageError):
    """The object, file or prefix does not exist (a StorageError, so callers may catch either)."""


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


class PreconditionFailed(StorageError):
    """A conditional write lost: the object changed (or appeared) since it was read."""


#: A local write's errno that means the disk, not the data: (what to call it, whether a retry may succeed,
#: the fix). A full disk or quota may be freed by retention or by other jobs finishing; a read-only or
#: forbidden folder stays so until someone changes it.
DISK_FAULTS = {
    errno.ENOSPC: (
        "no space left on the device",
        True,
        "free space there or point it at a larger disk; a retry may succeed once space is freed",
    ),
    errno.EDQUOT: (
        "disk quota exceeded",
        True,
        "free space there or raise the quota; a retry may succeed once space is freed",
    ),
    errno.EROFS: ("read-only file system", False, "remount it read-write or point it at a writable folder"),
    errno.EACCES: ("permission denied", False, "fix its permissions or point it at a folder this user may write"),
    errno.EPERM: ("operation not permitted", False, "fix its permissions or point it at a folder this user may write"),
}


def disk_fault(exc: BaseException) -> tuple[str, bool, str] | None:
    """(what went wrong, transient, fix) when `exc` is a full, read-only or forbidden disk; None for any other error."""
    return DISK_FAULTS.get(getattr(exc, "errno", None)) if isinstance(exc, OSError) else None


def _size(n: float) -> str:
    """Bytes for reading: '0 B', '12.0 KiB', '3.5 GiB'."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def free_space(path: str | os.PathLike) -> str:
    """'<free> free of <total>' on the file system holding `path` (its nearest existing parent: the file
    that failed may not exist)."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def fault_path(exc: OSError) -> str | None:
    """The file a disk fault hit: a two-path call's destination (shutil.copyfile and os.replace name the source
    first), else its one file; None when the call named none (a plain file.write)."""
    return exc.filename2 or exc.filename


def disk_action(exc: OSError) -> str:
    """What failed, as far as the errno tells: a full or read-only disk only ever fails a write; a denied
    permission may be a read too."""
    return "write" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else "access"


def disk_error(exc: OSError, path: str | os.PathLike, action: str = "", target: str = "") -> StorageError:
    """One line for a disk fault (see DISK_FAULTS): what was being done (default: disk_action), the path
    that failed, the free space there and the fix; transient (exit 75, retried) for a full disk or quota,
    not for a read-only or forbidden folder (exit 2). `target`: the URI being written when `path` is
    another file (its temp file, say)."""
    action = action or disk_action(exc)
    what, transient, fix = disk_fault(exc) or (one_line(exc.strerror or exc), False, "check the folder")
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    where = (
        f"{target}: {what} ({name}) at {path}" if target and str(target) != str(path) else f"{path}: {what} ({name})"
    )
    return StorageError(
        f"cannot {action} {where}, {free_space(path)} there: {fix}", str(target or path), transient=transient
    )
