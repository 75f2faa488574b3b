"""A team's own Python file (a reward function, an evaluation metric), from a local path or S3.

    fn = load_function("s3://bucket/metrics.py", "metrics", who="metric_func", error=MetricError)

The file is downloaded once per URI into the stage's cache, imported under a private module name and
registered in sys.modules (dataclasses and pickling inside the file look themselves up there). Every
failure is one line naming the flag: `who`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tasks.common import storage


def cache_dir() -> Path:
    root = os.environ.get("RLHF_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"rlhf-flow-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    return Path(root) / "user_code"


def fetch(path: str, who: str, error: type[Exception]) -> Path:
    """A local copy of the file at ``path`` (local, file:// or s3://)."""
    digest = hashlib.sha256(path.encode()).hexdigest()[:12]
    try:
        if storage.is_s3(path):
            return storage.download_file(path, cache_dir() / digest / Path(storage.split_s3(path)[1]).name)
        local = storage.local_path(path)
        if not local.is_file():
            raise storage.NotFoundError(path)
        return local
    except storage.NotFoundError:
        raise error(f"{who}: {path} not found") from None
    except storage.StorageError as e:
        raise error(f"{who}: {path} cannot be fetched: {e}") from None


def load_module(path: str, who: str, error: type[Exception], purpose: str = "user"):
    """The module defined by the Python file at ``path`` (imported afresh: the file may have changed)."""
    module_name = f"_rlhf_{purpose}_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    local = fetch(path, who, error)
    spec = importlib.util.spec_from_file_location(module_name, local)
    if spec is None or spec.loader is None or local.suffix != ".py":
        raise error(f"{who}: {path} cannot be imported; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise error(f"{who}: {path} failed to import: {type(e).__name__}: {e}") from e
    return module


def load_function(path: str, name: str, who: str, error: type[Exception], signature: str = "") -> Callable:
    """The function ``name`` defined by the Python file at ``path``; ``signature`` (its arguments, for the
    error that says it is missing)."""
    func = getattr(load_module(path, who, error, purpose=f"user_{name}"), name, None)
    if not callable(func):
        raise error(f"{who}: {path} defines no {name}({signature})")
    return func
