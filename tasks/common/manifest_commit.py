"""The commit protocol: a stage's files uploaded first, its manifest.json written LAST.

    from tasks.common import manifest_commit

    m = manifest_commit.commit("out/sft", "s3://ckpt/run1/sft", m)    # every file uploaded, then manifest.json
    files = manifest_commit.upload_files("/scratch/shard", uri)        # a Ray worker's own files, for commit(uploaded=)

A reader never consumes a directory without its manifest, so a stage that dies mid-upload leaves nothing a
reader takes for finished; an output committed earlier is first set aside (``set_aside``), never overwritten
under its manifest. Works the same on local paths. What changes here is that protocol; the manifest's
format is tasks.common.manifest_schema.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from tasks.common import storage
from tasks.common.manifest_schema import MANIFEST, check_relpath, file_sha256, stage_dir
from tasks.common.storage import NotFoundError, StorageError

#: Where set_aside moves an output that a stage is about to replace (inside the output's folder).
SUPERSEDED = "superseded"


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
    uri = stage_dir(uri)
    if not root.is_dir():
        raise NotFoundError(f"no local directory {root} to commit to {uri}: write the stage output first", uri)
    set_aside(uri)
    files = upload_files(root, uri)
    for rel, entry in (uploaded or {}).items():
        check_relpath(rel, uri)
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
    uri = stage_dir(uri)
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
