"""URIs as the storage layer reads them: ``s3://bucket/key...`` or a local path (plain or ``file://``).

    from tasks.common import uris

    uris.is_s3("s3://ckpt/run1")                 # True
    uris.split_s3("s3://ckpt/run1/sft")          # ("ckpt", "run1/sft")
    uris.join("s3://ckpt/run1", "sft", "x.json")  # "s3://ckpt/run1/sft/x.json"
    uris.local_path("file:///data/run1")         # Path("/data/run1")
    uris.inside("/tmp/dl", "model/../../etc/x")  # StorageError: leads outside /tmp/dl

Pure string and path work, no I/O: what changes here is the URI grammar, never how objects move.
tasks.common.storage re-exports every name, so ``storage.join`` and ``uris.join`` are one function.
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.common.errors import StorageError


def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; the key may be empty (bucket root)."""
    if not is_s3(uri):
        raise StorageError(f"not an S3 URI: {uri}: use s3://bucket/key", uri)
    bucket, _, key = str(uri)[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"no bucket in {uri}: use s3://bucket/key", uri)
    return bucket, key


def join(uri: str | os.PathLike, *parts: str) -> str:
    """Append path parts to an S3 URI or local path (keeps ``s3://`` / ``file://`` as given)."""
    uri = str(uri)
    parts = tuple(p.strip("/") for p in map(str, parts) if p and p.strip("/"))
    if is_s3(uri) or uri.startswith("file://"):
        return "/".join((uri.rstrip("/"), *parts)) if parts else uri
    return os.path.join(uri, *parts)


def inside(root: str | os.PathLike, rel: str, source: str = "") -> Path:
    """``root / rel``, refused unless it stays under ``root``: every local path named by remote data (an object
    key, a manifest entry) goes through here, so a key such as ``model/../../etc/x`` or ``/tmp/x`` cannot
    write outside the folder it is downloaded into."""
    base, text = Path(root).resolve(), str(rel)
    if text and not text.startswith(("/", "\\")) and "\0" not in text:
        target = (base / text).resolve()
        if target.is_relative_to(base) and target != base:
            return target
    raise StorageError(
        f"{source or 'download'}: the key {text!r} leads outside {base}; refusing to write it (remove or rename that object in storage)",
        source or None,
    )


def local_path(uri: str | os.PathLike) -> Path:
    """The filesystem path of a local URI (plain or ``file://``)."""
    uri = str(uri)
    if is_s3(uri):
        raise StorageError(f"{uri} is an S3 URI, not a local path: download it first", uri)
    return Path(uri[len("file://") :] if uri.startswith("file://") else uri)
