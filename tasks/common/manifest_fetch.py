"""Fetching a committed stage output: every file its manifest lists, downloaded and verified, cached per URI.

    from tasks.common import manifest_fetch

    uri = "s3://ckpt/run1/sft"
    path, m = manifest_fetch.fetch(uri, manifest_fetch.local_cache_dir(uri), subdir="model")

A second fetch into the same folder only stats the files it verified before; a byte that differs from the
manifest is an error naming the object and what the user does about it (``repair_hint``). What changes
here is how a reader gets and trusts the files; the manifest's format is tasks.common.manifest_schema.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from tasks.common import storage
from tasks.common.folder_lock import folder_lock
from tasks.common.manifest_schema import MANIFEST, file_sha256, read_manifest, stage_dir
from tasks.common.storage import NotFoundError, StorageError


def repair_hint(directory: str) -> str:
    """What a user does about a stage output whose files no longer match its manifest."""
    found = re.search(r"/runs/([^/]+)/([^/]+)/([^/]+)/?$", directory)
    if not found:
        return "commit that output again (rerun the stage that wrote it)"
    dag_id, run, task_id = found.groups()
    return (
        f"clear task {task_id} of run {run} of DAG {dag_id} (Airflow UI: Clear, or `airflow tasks clear "
        f"{dag_id} -t '^{task_id}$'`): a cleared stage is computed again; a new run recomputes it by itself"
    )


def local_cache_dir(uri: str) -> Path:
    """A stable folder for fetches of ``uri`` under $RLHF_CACHE_DIR (default: the system temp dir), keyed by the
    S3 endpoint too: two stacks on one host (two emulators, a test's and the developer's) may hold different
    objects under the same bucket and key."""
    uri = stage_dir(uri)
    root = os.environ.get("RLHF_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"rlhf-flow-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", uri).strip("_")[-80:]  # readable, bounded length
    where = f"{storage.endpoint()} {uri}" if storage.is_s3(uri) else uri
    path = Path(root) / f"{slug}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _local_size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _stat(path: Path) -> dict | None:
    """The size and modification time of a local file: what a verified copy's digest is reused on."""
    try:
        st = path.stat()
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns} if path.is_file() else None


def _verified(cached: dict | None, remote: dict, stat: dict | None) -> bool:
    """Whether a local copy checked earlier (``cached``: the entry it was verified against, with its stat then)
    still stands for ``remote`` without rehashing: same sha256 and size, and its file's stat unchanged."""
    if not cached or stat is None or cached.get("sha256") != remote["sha256"] or cached.get("size") != remote["size"]:
        return False
    return cached.get("mtime_ns") == stat["mtime_ns"] and stat["size"] == remote["size"]


def fetch(uri: str, local_dir: str | os.PathLike, subdir: str | None = None) -> tuple[Path, dict]:
    """Download and verify the files a committed directory's manifest lists (only ``subdir`` if given).

    ``local_dir`` keeps a manifest.json listing exactly the files it holds verified, each with the size and
    mtime its copy had when its sha256 was checked, so a second fetch into it (see ``local_cache_dir``) only
    stats the files whose sha256 the remote manifest still agrees with; a copy whose stat changed since (a
    same-size overwrite, a corrupted block rewritten) is hashed again, and fetched again unless it still
    matches. Returns (``local_dir`` or ``local_dir/subdir``, the remote manifest).
    """
    m = read_manifest(uri)
    directory = m["uri"]
    files: dict[str, dict] = m["files"]
    selected = files
    if subdir:
        prefix = subdir.strip("/") + "/"
        selected = {rel: e for rel, e in files.items() if rel.startswith(prefix)}
        if not selected:
            raise NotFoundError(
                f"manifest at {directory} lists no files under {subdir!r}: check the subdir or the stage that wrote it",
                directory,
            )
    local = storage.local_path(local_dir)
    local.mkdir(parents=True, exist_ok=True)
    cache_manifest = local / MANIFEST

    with folder_lock(local):
        try:
            cached = json.loads(cache_manifest.read_text()).get("files", {})
        except (OSError, ValueError, AttributeError):
            cached = {}
        # Files verified earlier that the remote manifest still agrees with, and still present.
        kept = {rel: cached[rel] for rel, e in files.items() if _verified(cached.get(rel), e, _stat(local / rel))}
        todo = [rel for rel in selected if rel not in kept]
        verified: dict[str, dict] = {}  # rel -> the remote entry plus the stat of the copy just checked

        def get(rel: str) -> None:
            expected, target, src = files[rel], local / rel, storage.join(directory, rel)
            # A same-size local copy (an interrupted fetch's, or one whose stat changed) is reused if its hash agrees.
            if _local_size(target) == expected["size"] and file_sha256(target) == expected["sha256"]:
                verified[rel] = {**expected, **_stat(target)}
                return
            try:
                storage.download_file(src, target)
            except NotFoundError:
                raise NotFoundError(
                    f"missing {src}: listed in {directory}/{MANIFEST} but not in storage; {repair_hint(directory)}", src
                ) from None
            size = _local_size(target)
            if size != expected["size"]:
                target.unlink(missing_ok=True)
                raise StorageError(
                    f"size mismatch for {src}: got {size} bytes, manifest says "
                    f"{expected['size']}; the object is truncated or overwritten: {repair_hint(directory)}",
                    src,
                )
            sha = file_sha256(target)
            if sha != expected["sha256"]:
                target.unlink(missing_ok=True)
                raise StorageError(
                    f"sha256 mismatch for {src}: got {sha[:16]}..., manifest says "
                    f"{expected['sha256'][:16]}...; the object is corrupted or overwritten: "
                    f"{repair_hint(directory)}",
                    src,
                )
            verified[rel] = {**expected, **_stat(target)}

        if todo:
            # Until the new set is verified the local marker must not vouch for anything.
            cache_manifest.unlink(missing_ok=True)
            storage.parallel_map(get, todo)
            storage.write_json(str(cache_manifest), {**m, "files": {**kept, **verified}})
    return (local / subdir.strip("/") if subdir else local), m
