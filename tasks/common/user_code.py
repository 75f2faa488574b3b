"""A team's own Python file (an environment, a reward function, a metric), from S3 or an allowed folder, by content.

    local, digest = fetch("s3://bucket/metrics.py", "metric_func", MetricError)   # a cached copy, and its sha256
    fn = load_function(f"s3://bucket/metrics.py#sha256={digest}", "metrics", who="metric_func", error=MetricError)

A file is fetched, hashed, and kept in the stage's cache under its sha256; the module is imported from those
bytes under a name made of the digest, so a changed file is never taken for the old one. A ``#sha256=<hex>``
suffix pins the content: a file that no longer has that digest fails with one line naming both. A stage pins
each file it runs as it starts (StageRun.code_input) and records the pin in its manifest, so a later stage
(eval, a rerun) runs the same bytes or refuses. Paths on a node's own disk must be under the operator's
folders (tasks/common/allowlist.py: $RLHF_USER_CODE_DIRS); every failure is one line naming the flag `who`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tasks.common import allowlist, storage

_PIN = re.compile(r"#sha256=([0-9a-f]{64})$")


def cache_dir() -> Path:
    root = os.environ.get("RLHF_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"rlhf-flow-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    )
    return Path(root) / "user_code"


def split_pin(spec: str) -> tuple[str, str | None]:
    """(the file's URI, its pinned sha256 or None) of ``uri`` or ``uri#sha256=<hex>``."""
    found = _PIN.search(spec)
    return (spec[: found.start()], found.group(1)) if found else (spec, None)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(
    spec: str, who: str, error: type[Exception], source: str = "pinned", cached: bool = False
) -> tuple[Path, str]:
    """(a local copy of the file ``spec`` names, its sha256), checked against the pin when ``spec`` has one
    (``source``: where the pin came from, for the error). ``cached``: a pinned file already in the cache is
    used without asking its source again (a worker importing what its stage pinned); otherwise the source is
    read, so a file changed there is noticed.

    The copy sits in the cache under its digest and is written once: nothing rewrites a digest's file."""
    uri, pinned = split_pin(spec)
    allowlist.check_code_path(uri, who, error)
    kept = cache_dir() / (pinned or "-") / (Path(uri).name or "file.py")
    if cached and pinned and kept.is_file() and sha256_bytes(kept.read_bytes()) == pinned:
        return kept, pinned  # a small file: rehashed rather than trusted
    try:
        if not storage.is_s3(uri) and not storage.local_path(uri).is_file():
            raise storage.NotFoundError(uri)
        data = storage.read_bytes(uri)
    except storage.NotFoundError:
        raise error(f"{who}: {uri} not found") from None
    except storage.StorageError as e:
        raise error(f"{who}: {uri} cannot be fetched: {e}") from None
    digest = sha256_bytes(data)
    if pinned and digest != pinned:
        raise error(
            f"{who}: {uri} has sha256 {digest} but {pinned} was {source}: the file changed since; restore it, or pass the new file under a new name"
        )
    target = cache_dir() / digest / (Path(uri).name or "file.py")  # the name keeps tracebacks readable
    if not target.is_file():
        storage.write_bytes(str(target), data)  # temp file + rename: a reader never sees half of it
    return target, digest


def load_module(spec: str, who: str, error: type[Exception], purpose: str = "user"):
    """The module the Python file ``spec`` defines, imported from the bytes fetched (see fetch)."""
    uri, _ = split_pin(spec)
    if not uri.endswith(".py"):
        raise error(f"{who}: {uri} cannot be imported; name a .py file")
    local, digest = fetch(spec, who, error, cached=True)
    module_name = f"_rlhf_{purpose}_{digest[:16]}"  # imported afresh each time: no state shared between loads
    module_spec = importlib.util.spec_from_file_location(module_name, local)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{who}: {uri} cannot be imported; name a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file look themselves up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise error(f"{who}: {uri} failed to import: {type(e).__name__}: {e}") from e
    return module


def load_function(spec: str, name: str, who: str, error: type[Exception], signature: str = "") -> Callable:
    """The function ``name`` defined by the Python file ``spec``; ``signature`` (its arguments, for the
    error that says it is missing)."""
    func = getattr(load_module(spec, who, error, purpose=f"user_{name}"), name, None)
    if not callable(func):
        raise error(f"{who}: {split_pin(spec)[0]} defines no {name}({signature})")
    return func
