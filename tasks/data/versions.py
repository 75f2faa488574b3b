"""Registered dataset versions: immutable folders under a datasets root, and a listing per name.

    register(root, "chat", "3f2a…", local_dir, manifest)   # upload, manifest.json last; never overwrites
    find(root, "chat", "3f2a…")                              # its manifest, or None
    resolve(root, "chat")                                    # the newest version's manifest ("chat", "3f2a…": that one)
    listing(root, "chat")                                    # {"name", "versions": [{version, uri, created_at, …}, …]}

Layout: ``<root>/<name>/<version>/`` holds data/<split>.jsonl and manifest.json (a manifest like a stage
output's, so tasks.common.nn.data.load_rows reads a version directly), and ``<root>/<name>/versions.json``
lists the versions in the order they were registered: the last is the newest. A version's id is derived
from its content (tasks.data.ingest.version_id), so registering the same data twice finds the first one.
Both writes are compare-and-swaps (storage.write_if): of two concurrent registrations one commits the
version, and no listing update is lost.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.storage import NotFoundError, PreconditionFailed

LISTING = "versions.json"
CAS_ATTEMPTS = 10  # listing updates retried after losing a compare-and-swap


def version_uri(root: str, name: str, version: str) -> str:
    return storage.join(root, name, version)


def listing_uri(root: str, name: str) -> str:
    return storage.join(root, name, LISTING)


def find(root: str, name: str, version: str) -> dict | None:
    """The committed manifest of a version, or None when it was never committed."""
    try:
        return manifests.read_manifest(version_uri(root, name, version))
    except NotFoundError:
        return None


def _read_listing(root: str, name: str) -> tuple[dict, str | None]:
    """(the listing, its etag for write_if); an empty listing before the first version."""
    uri = listing_uri(root, name)
    data, etag = storage.read_versioned(uri)
    if data is None:
        return {"name": name, "versions": []}, None
    try:
        return json.loads(data), etag
    except ValueError:
        raise storage.StorageError(
            f"invalid JSON in {uri}: restore it (each version folder's manifest.json has its entry)", uri
        ) from None


def listing(root: str, name: str) -> dict:
    return _read_listing(root, name)[0]


def register(root: str, name: str, version: str, local_dir: Path, manifest: dict) -> tuple[dict, bool]:
    """Commit `local_dir` as the version (unless it already is) and list it; returns (its manifest, created)."""
    uri = version_uri(root, name, version)
    created = find(root, name, version) is None
    if created:
        files = manifests.upload_files(local_dir, uri)
        committed = {**manifest, "files": dict(sorted(files.items())), "uri": uri}
        body = (json.dumps(committed, indent=2, sort_keys=True) + "\n").encode("utf-8")
        try:
            # Only if absent: a version, once committed, is never rewritten (its files were the same bytes).
            storage.write_if(storage.join(uri, manifests.MANIFEST), body, None)
        except PreconditionFailed:
            created = False  # registered concurrently by another run with the same data
    committed = manifests.read_manifest(uri)
    ensure_listed(root, name, committed)
    return committed, created


def ensure_listed(root: str, name: str, committed: dict) -> None:
    """Append the version to the name's listing, unless it is there (a rerun, or a crash before listing)."""
    uri = listing_uri(root, name)
    info = committed.get("dataset", {})
    entry = {
        "version": info.get("version"),
        "uri": committed["uri"],
        "created_at": committed.get("created_at"),
        "source": info.get("source"),
        "content_sha256": info.get("content_sha256"),
        "rows": info.get("rows", {}),
    }
    for _ in range(CAS_ATTEMPTS):
        current, etag = _read_listing(root, name)
        if any(v["version"] == entry["version"] for v in current["versions"]):
            return
        current["versions"].append(entry)
        current["updated_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            storage.write_if(uri, (json.dumps(current, indent=2, sort_keys=True) + "\n").encode("utf-8"), etag)
            return
        except PreconditionFailed:
            continue
    raise storage.StorageError(f"{uri} kept changing while listing version {entry['version']}: rerun the step", uri)


def resolve(root: str, name: str, version: str = "") -> dict:
    """The manifest of `version` of dataset `name`, or of its newest version when `version` is empty."""
    known = [v["version"] for v in listing(root, name)["versions"]]
    if not version:
        if not known:
            raise ConfigError(
                f"source: no dataset {name!r} registered under {root}; ingest a file first (--source <file URI> --dataset_name {name})"
            )
        version = known[-1]
    found = find(root, name, version)
    if found is None:
        raise ConfigError(
            f"source: no version {version!r} of dataset {name!r} under {root}; registered: {', '.join(known) or 'none'} (dataset:{name} takes the newest)"
        )
    return found
