"""manifest.json: the commit marker of a stage's output directory.

A stage writes its files into a local folder, then ``commit`` uploads them and writes
``<uri>/manifest.json`` LAST, listing every file with its size and sha256. A reader never consumes a
directory without it: ``read_manifest`` refuses one, and ``fetch`` verifies every byte it downloads.

    from tasks.common import manifest as mf

    m = mf.build_manifest("sft", run_id, config, inputs={"data": data_uri}, metrics={"loss": 1.2},
                          model="model")
    m = mf.commit("out/sft", "s3://ckpt/run1/sft", m)        # manifest.json written last

    # downstream (e.g. on every Ray worker of the RL stage):
    uri = "s3://ckpt/run1/sft"
    path, m = mf.fetch(uri, mf.local_cache_dir(uri), subdir="model")   # verified, cached per URI
    mf.resolve(m, "model")                                     # "s3://ckpt/run1/sft/model"

Works the same on local paths (``commit("out/sft", "/data/run1/sft", m)``). No torch, no airflow here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from tasks.common import storage
from tasks.common.provenance import code_digest, code_version, package_versions
from tasks.common.storage import NotFoundError, StorageError

FORMAT = "rlhf-flow/manifest/v1"
MANIFEST = "manifest.json"
#: Where set_aside moves an output that a stage is about to replace (inside the output's folder).
SUPERSEDED = "superseded"
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


# ---------------------------------------------------------------- building


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
    target = storage.join(_dir_uri(uri.strip()), MANIFEST)
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


# ---------------------------------------------------------------- writing


def _dir_uri(uri: str | os.PathLike) -> str:
    """The stage directory for a directory URI or its manifest.json URI."""
    uri = str(uri).rstrip("/") or "/"
    if uri == MANIFEST:
        return "."
    if uri.endswith("/" + MANIFEST):
        return uri[: -len(MANIFEST) - 1] or "/"
    return uri


def upload_files(local_dir: str | os.PathLike, uri: str) -> dict[str, dict]:
    """Upload every file under ``local_dir`` to ``uri``; returns {relpath: {"size", "sha256"}} for a manifest.

    What a Ray worker calls for the files it wrote on its own node (checkpoint shards, a final model):
    another node's process cannot read them, so the writer uploads them and hands the listing to the
    process that commits the manifest (``commit(..., uploaded=...)``).
    """
    root = storage.local_path(local_dir)
    listed = storage.walk_local(root, exclude=(MANIFEST,))
    hashes = storage.parallel_map(lambda f: file_sha256(root / f[0]), listed)
    uploaded = storage.upload_dir(root, uri, exclude=(MANIFEST,))
    if uploaded != listed:
        raise StorageError(f"files under {root} changed while uploading to {uri}: finish writing them first", uri)
    return {rel: {"size": size, "sha256": sha} for (rel, size), sha in zip(listed, hashes)}


def commit(local_dir: str | os.PathLike, uri: str, manifest: dict, uploaded: dict[str, dict] | None = None) -> dict:
    """Upload ``local_dir`` to ``uri``, then write ``<uri>/manifest.json`` last.

    ``uploaded`` lists files other processes already put under ``uri`` (``upload_files``' result, paths
    relative to ``uri``); the manifest vouches for them too. Returns the manifest with ``files``
    ({relpath: {"size", "sha256"}}) and ``uri`` (the output root).
    """
    root = storage.local_path(local_dir)
    uri = _dir_uri(uri)
    if not root.is_dir():
        raise NotFoundError(f"no local directory {root} to commit to {uri}: write the stage output first", uri)
    set_aside(uri)
    files = upload_files(root, uri)
    for rel, entry in (uploaded or {}).items():
        _check_relpath(rel, uri)
        if files.setdefault(rel, entry) != entry:
            raise StorageError(
                f"{storage.join(uri, rel)} was written twice with different contents: give each writer its own file names",
                uri,
            )
    # The store's own checksum of each file (S3's ETag), so a reuse can check the files without reading
    # them. A local folder's "ETag" is the sha256 itself (storage.list_files).
    etags = {rel: etag for rel, _, etag in storage.list_files(uri, etags=True)} if storage.is_s3(uri) else {}
    files = {rel: {**entry, "etag": etags.get(rel, entry["sha256"])} for rel, entry in sorted(files.items())}
    out = {**manifest, "files": files, "uri": uri}
    storage.write_json(storage.join(uri, MANIFEST), out)
    return out


def set_aside(uri: str) -> str | None:
    """Before a stage writes into ``uri`` again: move the output committed there (its manifest and the
    files it lists) to ``<uri>/superseded/<UTC time>/``, so that nothing committed is lost and no reader
    sees a manifest vouch for files being replaced. Returns where it went (None: nothing was committed)."""
    uri = _dir_uri(uri)
    marker = storage.join(uri, MANIFEST)
    if not storage.exists(marker):
        return None
    old = storage.read_json(marker)
    aside = storage.join(uri, SUPERSEDED, datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ"))
    files = old.get("files") if isinstance(old, dict) and isinstance(old.get("files"), dict) else {}
    present = {rel for rel, _ in storage.list_files(uri)}
    storage.parallel_map(
        lambda rel: storage.copy(storage.join(uri, rel), storage.join(aside, rel)),
        [rel for rel in files if rel in present and not rel.startswith(SUPERSEDED + "/")],
    )
    storage.copy(marker, storage.join(aside, MANIFEST))  # last: it vouches for the copies above
    storage.delete(marker)  # readers now see "unfinished" while new files land
    print(f"set aside the output committed at {uri} to {aside}", flush=True)
    return aside


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


# ---------------------------------------------------------------- reading


def _check_relpath(rel: str, where: str) -> None:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise StorageError(f"manifest at {where} lists an unsafe path {rel!r}: recommit the stage", where)


def read_manifest(uri: str) -> dict:
    """Read the manifest of a stage directory (URI of the directory or of its manifest.json)."""
    directory = _dir_uri(uri)
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
        _check_relpath(rel, directory)
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


def local_cache_dir(uri: str) -> Path:
    """A stable folder for fetches of ``uri`` under $RLHF_CACHE_DIR (default: the system temp dir), keyed by the
    S3 endpoint too: two stacks on one host (two emulators, a test's and the developer's) may hold different
    objects under the same bucket and key."""
    uri = _dir_uri(uri)
    root = os.environ.get("RLHF_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"rlhf-flow-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", uri).strip("_")[-80:]  # readable, bounded length
    where = f"{storage.endpoint()} {uri}" if storage.is_s3(uri) else uri
    path = Path(root) / f"{slug}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
