"""The model registry: which policy is a model's champion, how it got there, and every candidate judged.

    reg = Registry("s3://bucket/prefix/models/demo-policy")
    champ, etag = reg.champion()            # None when nothing was promoted yet
    reg.record_candidate(run_id, {...})    # every judged candidate, promoted or not
    reg.promote({"policy": uri, ...}, expected_version=champ["version"] if champ else 0)

Layout under the root: ``champion.json`` (the pointer, with a ``version`` that counts promotions),
``history/<version>.json`` (one entry per promotion, never rewritten) and ``candidates/<run_id>.json``.
A promotion is a compare-and-swap on champion.json (storage.write_if: S3's conditional PutObject, a lock
on a local folder): it acts only on the version its caller judged against, so of two promoters that
read the same champion exactly one wins, and a promoter holding a stale view is refused.
"""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

from tasks.common import storage


class StaleChampion(storage.StorageError):
    """The champion is no longer the one the caller judged against."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Registry:
    def __init__(self, root: str):
        self.root = root.rstrip("/")

    @property
    def champion_uri(self) -> str:
        return storage.join(self.root, "champion.json")

    def history_uri(self, version: int) -> str:
        return storage.join(self.root, "history", f"{version:06d}.json")

    def candidate_uri(self, run_id: str) -> str:
        return storage.join(self.root, "candidates", re.sub(r"[^A-Za-z0-9._-]", "_", run_id) + ".json")

    def champion(self) -> tuple[dict | None, str | None]:
        """(champion entry, its etag), or (None, None) before the first promotion."""
        data, etag = storage.read_versioned(self.champion_uri)
        if data is None:
            return None, None
        try:
            return json.loads(data), etag
        except ValueError:
            raise storage.StorageError(f"invalid JSON in {self.champion_uri}: restore it from history/", self.champion_uri) from None

    def promote(self, entry: dict[str, Any], expected_version: int, promoted_by: str) -> dict:
        """Make ``entry`` (at least ``policy``: a manifest URI) the champion, if the champion is still
        at ``expected_version`` (0: none yet). Returns the new champion entry; raises StaleChampion."""
        current, etag = self.champion()
        version = int(current["version"]) if current else 0
        if version != expected_version:
            raise StaleChampion(
                f"{self.champion_uri} is at version {version}, not the version {expected_version} this promotion judged against: "
                "evaluate against the current champion and promote again", self.champion_uri)
        new = {**entry, "version": version + 1, "promoted_at": _now(), "promoted_by": promoted_by,
               "previous": current["policy"] if current else None}
        try:
            storage.write_if(self.champion_uri, (json.dumps(new, indent=2, sort_keys=True) + "\n").encode(), etag)
        except storage.PreconditionFailed:
            raise StaleChampion(f"{self.champion_uri} changed while promoting (another promoter won): "
                                "evaluate against the new champion and promote again", self.champion_uri) from None
        # Only the CAS winner gets here, so history entries are never contended.
        storage.write_json(self.history_uri(new["version"]), new)
        return new

    def history(self) -> list[dict]:
        """Every promotion, oldest first."""
        prefix = storage.join(self.root, "history")
        return [storage.read_json(storage.join(prefix, rel)) for rel, _ in storage.list_files(prefix) if rel.endswith(".json")]

    def record_candidate(self, run_id: str, record: dict) -> str:
        uri = self.candidate_uri(run_id)
        storage.write_json(uri, {**record, "run_id": run_id, "judged_at": _now()})
        return uri
