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

Manual moves are the same compare-and-swap, naming the version the caller saw (the CLI: python -m tasks.registry):

    reg.promote_candidate("scheduled__2026-01-02", expected_version=3, promoted_by="alice")
    reg.rollback(to_version=2, expected_version=4, promoted_by="alice", reason="v4 regressed on …")
    reg.listing()   # {"champion", "history", "candidates"}, each candidate with its lineage's cost

A rollback never rewrites history: it is a new version whose entry copies the earlier champion's
(policy, evaluation, metrics) and says ``action: rollback`` and ``rolled_back_to``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

from tasks.common import cost, storage
from tasks.common.config import ConfigError


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
            raise storage.StorageError(
                f"invalid JSON in {self.champion_uri}: restore it from history/", self.champion_uri
            ) from None

    def promote(self, entry: dict[str, Any], expected_version: int, promoted_by: str) -> dict:
        """Make ``entry`` (at least ``policy``: a manifest URI) the champion, if the champion is still
        at ``expected_version`` (0: none yet). Returns the new champion entry; raises StaleChampion."""
        return self._swap({**entry, "action": entry.get("action", "promote")}, expected_version, promoted_by)

    def _check_expected(self, expected_version: int) -> tuple[dict | None, str | None]:
        current, etag = self.champion()
        version = int(current["version"]) if current else 0
        if version != expected_version:
            raise StaleChampion(
                f"{self.champion_uri} is at version {version}, not the version {expected_version} this promotion judged against: "
                "evaluate against the current champion and promote again",
                self.champion_uri,
            )
        return current, etag

    def _swap(self, entry: dict[str, Any], expected_version: int, promoted_by: str) -> dict:
        current, etag = self._check_expected(expected_version)
        version = expected_version
        new = {
            **entry,
            "version": version + 1,
            "promoted_at": _now(),
            "promoted_by": promoted_by,
            "previous": current["policy"] if current else None,
            "previous_version": version,
        }
        try:
            storage.write_if(self.champion_uri, (json.dumps(new, indent=2, sort_keys=True) + "\n").encode(), etag)
        except storage.PreconditionFailed:
            raise StaleChampion(
                f"{self.champion_uri} changed while promoting (another promoter won): evaluate against the new champion and promote again",
                self.champion_uri,
            ) from None
        # Only the CAS winner gets here, so history entries are never contended.
        storage.write_json(self.history_uri(new["version"]), new)
        return new

    def promote_candidate(
        self, run_id: str, expected_version: int, promoted_by: str, override_gate: bool = False, reason: str = ""
    ) -> dict:
        """Manually make a judged candidate (candidates/<run_id>.json) the champion. One that failed its gate
        needs ``override_gate`` (recorded in the history with the reason)."""
        if not promoted_by:
            raise ConfigError("by: missing; pass --by <who> (recorded in the history)")
        try:
            record = storage.read_json(self.candidate_uri(run_id))
        except storage.NotFoundError:
            known = ", ".join(c["run_id"] for c in self.candidates()[-5:]) or "none"
            raise ConfigError(
                f"candidate: no candidate {run_id!r} in {self.root}/candidates; pass a judged run id (newest: {known})"
            ) from None
        if not record.get("passed") and not override_gate:
            raise ConfigError(
                f"candidate: {run_id!r} failed its gate ({record.get('decision')}); pass --override_gate true with --reason to promote it anyway"
            )
        entry = {k: record[k] for k in ("policy", "evaluation", "run_id", "metrics", "gate", "reasons") if k in record}
        return self._swap(
            {**entry, "action": "manual promote", "reason": reason, "override_gate": bool(override_gate)},
            expected_version,
            promoted_by,
        )

    def rollback(self, to_version: int, expected_version: int, promoted_by: str, reason: str = "") -> dict:
        """Make the champion of ``to_version`` (any earlier version) the champion again, as a new version."""
        if not promoted_by:
            raise ConfigError("by: missing; pass --by <who> (recorded in the history)")
        self._check_expected(expected_version)  # a stale view is refused before its other arguments are judged
        if isinstance(to_version, bool) or not isinstance(to_version, int) or not 1 <= to_version < expected_version:
            raise ConfigError(
                f"to_version: {to_version!r} is not an earlier champion of version {expected_version}; "
                f"pass one of 1..{expected_version - 1} (python -m tasks.registry list shows them)"
            )
        try:
            earlier = storage.read_json(self.history_uri(to_version))
        except storage.NotFoundError:
            raise ConfigError(
                f"to_version: no history entry {self.history_uri(to_version)}; pass a version the listing shows"
            ) from None
        entry = {
            k: v
            for k, v in earlier.items()
            if k
            not in ("version", "promoted_at", "promoted_by", "previous", "previous_version", "reason", "override_gate")
        }
        return self._swap(
            {**entry, "action": "rollback", "rolled_back_to": to_version, "reason": reason},
            expected_version,
            promoted_by,
        )

    def history(self) -> list[dict]:
        """Every promotion, oldest first."""
        prefix = storage.join(self.root, "history")
        return [
            storage.read_json(storage.join(prefix, rel))
            for rel, _ in storage.list_files(prefix)
            if rel.endswith(".json")
        ]

    def record_candidate(self, run_id: str, record: dict) -> str:
        uri = self.candidate_uri(run_id)
        storage.write_json(uri, {**record, "run_id": run_id, "judged_at": _now()})
        return uri

    def candidates(self) -> list[dict]:
        """Every judged candidate, oldest judged first."""
        prefix = storage.join(self.root, "candidates")
        found = [
            storage.read_json(storage.join(prefix, rel))
            for rel, _ in storage.list_files(prefix)
            if rel.endswith(".json")
        ]
        return sorted(found, key=lambda c: c.get("judged_at", ""))

    def listing(self, with_cost: bool = True) -> dict:
        """The read-only view: the champion, every promotion or rollback, every candidate with its metrics
        and (with_cost) the cost of producing it, summed over its evaluation's lineage (tasks.common.cost)."""
        champion, _ = self.champion()
        candidates = self.candidates()
        if with_cost:
            for c in candidates:
                c["cost"] = cost.lineage_cost(c.get("evaluation") or c.get("policy") or "")
        return {"registry": self.root, "champion": champion, "history": self.history(), "candidates": candidates}
