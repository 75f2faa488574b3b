"""What a manifest.json holds, and how it is read: the format of a stage output's commit marker.

    from tasks.common import manifest_schema as schema

    m = schema.build_manifest("sft", run_id, config, inputs={"data": data_uri}, metrics={"loss": 1.2}, model="model")
    m = schema.read_manifest("s3://ckpt/run1/sft")       # checked: format, a files table, safe paths
    schema.resolve(m, "model")                           # "s3://ckpt/run1/sft/model"
    schema.manifest_digest("s3://ckpt/run1/sft")         # sha256 of its manifest.json bytes (None: no output)

A manifest lists every file with its size and sha256, the stage, run id, resolved config and its hash,
the inputs, metrics, code version and library versions. What changes here is that format; writing one
(tasks.common.manifest_commit) and fetching what it lists (tasks.common.manifest_fetch) build on it.
No torch, no airflow here.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

from tasks.common import storage
from tasks.common.provenance import code_digest, code_version, package_versions
from tasks.common.storage import NotFoundError, StorageError

FORMAT = "rlhf-flow/manifest/v1"
MANIFEST = "manifest.json"
RESERVED = (
    "format",
    "stage",
    "run_id",
    "created_at",
    "config",
    "config_hash",
    "inputs",
    "input_manifests",
    "metrics",
    "code_version",
    "code_digest",
    "versions",
    "files",
    "uri",
)


def config_hash(config: dict) -> str:
    """sha256 of the canonical JSON of ``config`` (sorted keys, no whitespace)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def build_manifest(
    stage: str,
    run_id: str,
    config: dict,
    inputs: dict,
    metrics: dict,
    input_manifests: dict | None = None,
    **extra: Any,
) -> dict:
    """A manifest for ``commit``; ``extra`` adds stage fields such as ``model="model"``.

    ``input_manifests`` ({input stage folder URI: sha256 of its manifest.json bytes}, see
    ``manifest_digest``) pins what the inputs held when the stage read them, so a rerun
    (tasks.reproduce) can tell a rewritten input from the same one. Left out when not given:
    manifests written before it existed have no such field, and readers must not require it."""
    clash = sorted(set(extra) & set(RESERVED))
    if clash:
        raise ValueError(f"build_manifest: extra keys {clash} are reserved manifest fields: rename them")
    pinned = {} if input_manifests is None else {"input_manifests": dict(sorted(input_manifests.items()))}
    return {
        "format": FORMAT,
        "stage": stage,
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "config_hash": config_hash(config),
        "inputs": dict(inputs),
        **pinned,
        "metrics": dict(metrics),
        "code_version": code_version(),
        "code_digest": code_digest(),
        "versions": package_versions(),
        **extra,
    }


def manifest_digest(uri: str) -> str | None:
    """sha256 of the manifest.json bytes of the stage output ``uri`` names (its folder or its manifest.json);
    None when ``uri`` names no committed stage output (a hub id, a data file, a plain folder, nothing).

    The same digest plugins/stage_cache.py keys on: a manifest lists every file with its sha256, so
    equal digests mean equal contents."""
    if not isinstance(uri, str) or not uri.strip() or uri.startswith(("http://", "https://")):
        return None
    target = storage.join(stage_dir(uri.strip()), MANIFEST)
    # A relative name with no such local file is a hub id (or nothing): do not ask S3 or the hub.
    if not storage.is_s3(target) and not storage.local_path(target).is_file():
        return None
    try:
        return hashlib.sha256(storage.read_bytes(target)).hexdigest()
    except NotFoundError:
        return None


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # releases the GIL: threads hash in parallel


def stage_dir(uri: str | os.PathLike) -> str:
    """The stage directory for a directory URI or its manifest.json URI."""
    uri = str(uri).rstrip("/") or "/"
    if uri == MANIFEST:
        return "."
    if uri.endswith("/" + MANIFEST):
        return uri[: -len(MANIFEST) - 1] or "/"
    return uri


def check_relpath(rel: str, where: str) -> None:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise StorageError(f"manifest at {where} lists an unsafe path {rel!r}: recommit the stage", where)


def read_manifest(uri: str) -> dict:
    """Read the manifest of a stage directory (URI of the directory or of its manifest.json)."""
    directory = stage_dir(uri)
    try:
        m = storage.read_json(storage.join(directory, MANIFEST))
    except NotFoundError:
        raise NotFoundError(
            f"no manifest.json at {directory}: the stage writing it did not finish (rerun it) or the URI is wrong",
            directory,
        ) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise StorageError(
            f"{storage.join(directory, MANIFEST)} is not a {FORMAT} manifest (format={got!r}): recommit the stage with this code",
            directory,
        )
    files = m.get("files")
    if not isinstance(files, dict):
        raise StorageError(f"manifest at {directory} has no 'files' table: recommit the stage", directory)
    for rel, entry in files.items():
        check_relpath(rel, directory)
        if not (
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        ):
            raise StorageError(f"manifest at {directory} has a bad entry for {rel!r}: recommit the stage", directory)
    m["uri"] = directory
    return m


def resolve(manifest: dict, key: str) -> str:
    """The absolute URI of a manifest field holding a path relative to the manifest's directory.

    ``key`` may be dotted to reach nested fields ("datasets.sft"); absolute URIs/paths pass through.
    """
    where = manifest.get("uri", "<manifest>")
    value: Any = manifest
    if key in manifest:
        value = manifest[key]
    else:
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise StorageError(f"manifest at {where} has no field {key!r}: check the stage that wrote it", where)
            value = value[part]
    if not isinstance(value, str):
        raise StorageError(f"manifest field {key!r} at {where} is not a path: {value!r}", where)
    if storage.is_s3(value) or value.startswith("file://") or os.path.isabs(value):
        return value
    if "uri" not in manifest:
        raise StorageError(f"manifest has no 'uri' to resolve {key!r}={value!r} against: load it with read_manifest()")
    return storage.join(manifest["uri"], value)
