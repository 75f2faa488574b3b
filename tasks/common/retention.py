"""Retention: expire what nobody will read again under s3://<bucket>/<prefix>, never what a champion needs.

    from tasks.common import retention

    plan = retention.plan("s3://rlhf-flow/rlhf-flow", max_age_days=30, multipart_age_hours=24)
    print(retention.describe(plan))          # what would go (dry run: stop here)
    retention.apply(plan)                    # delete it

(CLI: ``python -m tasks.registry retention --root s3://… --max_age_days 30 [--dry_run true]``.)

What goes, once its newest object is older than ``max_age_days``:

- a **failed run** of a pipeline DAG (``dags``): a run folder ``runs/<dag>/<run>/`` without a committed
  ``promote`` stage (it stopped before the gate, or its gate stage failed);
- a **rejected candidate**: a run whose promote manifest says the gate failed (``passed`` 0).

Inside such a run every stage folder goes except those in the **protected lineage**: the stage outputs
named by any registry's champion and its history (``models/*/champion.json``, ``history/*.json``: policy
and evaluation) and by every run that stays, followed through manifest ``inputs`` recursively (policy ->
sft -> prepare_data, reward model, ...), since a cache hit makes a later run read an earlier run's folder.
Registry records (``models/``) are never touched. Cache index entries (``cache/<key>.json``,
plugins/stage_cache.py) that point at a deleted or missing manifest go too, so no stage is skipped onto
a hole. Multipart uploads under the prefix started more than ``multipart_age_hours`` ago and never
completed (a job killed mid-upload) are aborted: S3 keeps and bills their parts otherwise.

In-stage checkpoints are pruned by the stages themselves: ``--max_ckpt_num`` keeps the newest N
(tasks.common.checkpoint.CheckpointStore). Deletion removes each folder's manifest.json first, so a
reader sees an uncommitted folder, never a half-deleted committed one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Iterable

from tasks.common import cost, names, s3_client, storage
from tasks.common.config import ConfigError

PIPELINE_DAGS = names.PIPELINE_DAGS
MANIFEST = "manifest.json"


def _check(root: str, max_age_days: float, multipart_age_hours: float) -> tuple[str, str]:
    if not storage.is_s3(root):
        raise ConfigError(f"root: {root!r} is not an s3:// URI; pass the pipeline's s3://<bucket>/<prefix>")
    for name, value in (("max_age_days", max_age_days), ("multipart_age_hours", multipart_age_hours)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{name}: must be a number >= 0, got {value!r}")
    bucket, key = storage.split_s3(root)
    return bucket, key.strip("/")


def _objects(bucket: str, prefix: str) -> list[dict]:
    """Every object under ``prefix/`` as {"Key", "Size", "LastModified" (epoch s)}."""
    out = []
    try:
        for page in storage.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            out += [
                {"Key": o["Key"], "Size": o["Size"], "LastModified": o["LastModified"].timestamp()}
                for o in page.get("Contents", [])
            ]
    except s3_client.S3_ERRORS as e:
        raise s3_client.storage_error(e, f"s3://{bucket}/{prefix}", "list") from None
    return out


def _reader():
    """A memoised manifest reader: the lineage walks reach the same folders again and again."""
    cache: dict[str, dict | None] = {}

    def read(folder: str) -> dict | None:
        if folder not in cache:
            cache[folder] = cost.read_manifest_or_none(folder)
        return cache[folder]

    return read


def _registry_roots(bucket: str, key: str, objects: list[dict]) -> set[str]:
    """The stage folders every registry's champion and history entries name."""
    roots = set()
    for o in objects:
        rel = o["Key"][len(key) + 1 :] if key else o["Key"]
        parts = rel.split("/")
        if len(parts) >= 3 and (parts[2] == "champion.json" or (parts[2] == "history" and rel.endswith(".json"))):
            entry = storage.read_json(f"s3://{bucket}/{o['Key']}")
            roots |= {entry.get("policy") or "", entry.get("evaluation") or ""}
    return {r for r in roots if r}


def plan(
    root: str,
    max_age_days: float,
    multipart_age_hours: float = 24,
    dags: Iterable[str] = PIPELINE_DAGS,
    now: float | None = None,
) -> dict:
    """What retention would delete and why; nothing is deleted here."""
    bucket, key = _check(root, max_age_days, multipart_age_hours)
    now = time.time() if now is None else now
    base = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    top = (key + "/") if key else ""
    read = _reader()

    # runs/<dag>/<run>/<stage>/… grouped by run and stage folder
    runs: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for o in _objects(bucket, top + "runs"):
        parts = o["Key"][len(top + "runs/") :].split("/", 3)
        if len(parts) >= 4:
            runs[(parts[0], parts[1])][parts[2]].append(o)

    protected_roots = _registry_roots(bucket, key, _objects(bucket, top + "models"))
    verdicts = []
    for (dag, run), stages in sorted(runs.items()):
        newest = max(o["LastModified"] for objs in stages.values() for o in objs)
        promote = read(f"{base}/runs/{dag}/{run}/promote") if "promote" in stages else None
        if dag not in dags:
            status = "other dag"
        elif promote is None:
            status = "failed"
        else:
            m = promote.get("metrics") or {}
            status = "promoted" if m.get("promoted") else ("passed" if m.get("passed") else "rejected")
        expire = status in ("failed", "rejected") and now - newest > max_age_days * 86400
        verdicts.append(
            {
                "run": f"{dag}/{run}",
                "status": status,
                "age_days": round((now - newest) / 86400, 2),
                "expire": expire,
                "stages": stages,
            }
        )
        if not expire:  # a run that stays keeps its inputs, wherever they live
            protected_roots |= {f"{base}/runs/{dag}/{run}/{s}" for s in stages if read(f"{base}/runs/{dag}/{run}/{s}")}

    protected: set[str] = set()
    for r in protected_roots:
        protected |= set(cost.lineage(r, read))

    delete, kept, removed_manifests = [], [], set()
    for v in verdicts:
        v["delete"], v["keep"] = [], []
        if not v["expire"]:
            continue
        for s, objs in sorted(v.pop("stages").items()):
            folder = f"{base}/runs/{v['run']}/{s}"
            if folder in protected:
                v["keep"].append(folder)
                kept.append(folder)
                continue
            v["delete"].append(folder)
            removed_manifests.add(folder)
            # manifest.json first: a concurrent reader then sees an uncommitted folder, never a torn one
            delete += sorted(objs, key=lambda o: not o["Key"].endswith("/" + MANIFEST))
    for v in verdicts:
        v.pop("stages", None)

    cache_entries = []
    for o in _objects(bucket, top + "cache"):
        if not o["Key"].endswith(".json"):
            continue
        uri = f"s3://{bucket}/{o['Key']}"
        try:
            target = cost.manifest_dir(storage.read_json(uri).get("manifest", ""))
        except (storage.StorageError, AttributeError):
            target = None
        if target is None or target in removed_manifests or read(target) is None:
            cache_entries.append(o)

    multipart = []
    try:
        for page in storage.client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=top):
            for u in page.get("Uploads", []):
                if now - u["Initiated"].timestamp() > multipart_age_hours * 3600:
                    multipart.append(
                        {"Key": u["Key"], "UploadId": u["UploadId"], "Initiated": u["Initiated"].isoformat()}
                    )
    except s3_client.S3_ERRORS as e:
        raise s3_client.storage_error(e, root, "list multipart uploads under") from None

    return {
        "root": base,
        "bucket": bucket,
        "max_age_days": max_age_days,
        "multipart_age_hours": multipart_age_hours,
        "runs": verdicts,
        "protected_kept": sorted(kept),
        "objects": delete,
        "cache_entries": cache_entries,
        "multipart": multipart,
        "bytes": sum(o["Size"] for o in delete),
    }


def apply(p: dict) -> dict:
    """Delete what ``plan`` listed: stage folders (manifests first), stale cache entries, unfinished uploads."""
    bucket, s3 = p["bucket"], storage.client()
    keys = [o["Key"] for o in p["objects"]]
    manifests = [k for k in keys if k.endswith("/" + MANIFEST)]
    rest = [k for k in keys if not k.endswith("/" + MANIFEST)] + [o["Key"] for o in p["cache_entries"]]
    try:
        for batch in (manifests, rest):
            for i in range(0, len(batch), 1000):  # DeleteObjects takes at most 1000 keys
                resp = s3.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch[i : i + 1000]], "Quiet": True}
                )
                if resp.get("Errors"):
                    e = resp["Errors"][0]
                    raise storage.StorageError(
                        f"cannot delete s3://{bucket}/{e['Key']}: {e.get('Code')}: {e.get('Message')}; "
                        "check the credentials' s3:DeleteObject permission and rerun",
                        p["root"],
                    )
        for u in p["multipart"]:
            s3.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    except s3_client.S3_ERRORS as e:
        raise s3_client.storage_error(e, p["root"], "delete under") from None
    return {
        "objects": len(keys),
        "bytes": p["bytes"],
        "cache_entries": len(p["cache_entries"]),
        "multipart": len(p["multipart"]),
    }


def describe(p: dict, dry_run: bool = True) -> str:
    """The plan as lines a person reads (the CLI's output)."""
    verb = "would delete" if dry_run else "deleted"
    lines = []
    for v in p["runs"]:
        if v["expire"]:
            lines.append(
                f"{v['run']}: {v['status']}, {v['age_days']} days old: {verb} {len(v['delete'])} stage folder(s)"
                + (f", kept {len(v['keep'])} a champion or a kept run needs" if v["keep"] else "")
            )
            lines += [f"  - {f}" for f in v["delete"]] + [f"  = {f} (lineage)" for f in v["keep"]]
    lines += [f"cache entry {verb}: s3://{p['bucket']}/{o['Key']}" for o in p["cache_entries"]]
    lines += [
        f"unfinished upload {'would be aborted' if dry_run else 'aborted'}: s3://{p['bucket']}/{u['Key']} (started {u['Initiated']})"
        for u in p["multipart"]
    ]
    lines.append(
        f"total {verb}: {len(p['objects'])} object(s), {p['bytes']} bytes, {len(p['cache_entries'])} cache entr(ies); unfinished uploads: {len(p['multipart'])}"
    )
    return "\n".join(lines)
