"""One process at a time in a local folder, across processes: a lock file beside the folder.

    from tasks.common.folder_lock import folder_lock

    with folder_lock(Path("/cache/run1-sft")):   # 8 Ray workers of a node: one fetches, the others wait and reuse
        ...

Standard library only; on a system without fcntl (not POSIX) there is no cross-process lock.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def folder_lock(local: Path):
    """Serialize work into one local folder across processes (e.g. 8 Ray workers of a node fetching or
    merging the same model): one does it, the others wait and reuse the result."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    with open(local.parent / f".{local.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
