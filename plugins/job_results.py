"""What a stage task's success leaves on the Airflow side: its cache entry, its asset events, its links, its log.

    index_result(cache, key, manifest_uri, (dag_id, run_id, task_id, -1), "tasks.sft", submission_id)
    outlet_event.extra = asset_extra(manifest_uri, manifest, cache_hit=False)   # {"manifest", "metrics", "stage", ...}
    wandb_url(s3, manifest_uri, manifest)              # the run's wandb page when the stage wrote wandb.json
    store_driver_log(s3, hook, submission_id, output_uri, log)   # <output>/logs/<submission id>.log

What changes here is what a success publishes; when it does is the operator's (plugins/operators.py).
"""

from __future__ import annotations

from typing import Any

from plugins.hooks import RayJobHook
from plugins.s3 import S3Store
from plugins.stage_cache import StageCache


def index_result(
    cache: StageCache, key: str, manifest: str, ids: tuple[str, str, str, int], module: str, submission_id: str | None
) -> None:
    """Record a committed result under its cache key, whether or not the run may reuse: a later run that allows
    reuse finds it."""
    dag_id, run_id, task_id, _ = ids
    cache.record(
        key,
        {
            "manifest": manifest,
            "dag_id": dag_id,
            "run_id": run_id,
            "task_id": task_id,
            "module": module,
            "submission_id": submission_id,
        },
    )


def asset_extra(manifest: str, record: dict, cache_hit: bool) -> dict[str, Any]:
    """The extra of an outlet Asset's event: the manifest URI, the stage's numeric metrics, whether it was a
    cache hit, and the stage."""
    metrics = {
        k: v
        for k, v in (record.get("metrics") or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return {"manifest": manifest, "metrics": metrics, "cache_hit": cache_hit, "stage": record.get("stage")}


def wandb_url(s3: S3Store, manifest: str, record: dict) -> str | None:
    """The wandb run's URL from the wandb.json beside the manifest, None when the stage wrote none."""
    if "wandb.json" in (record.get("files") or {}):
        return s3.read_json(manifest.removesuffix("manifest.json") + "wandb.json").get("url")
    return None


def store_driver_log(s3: S3Store, hook: RayJobHook, submission_id: str, output: str, log: Any) -> None:
    """Keep the job's driver log beside the stage's manifest (logs/<submission id>.log), best effort."""
    uri = f"{output}/logs/{submission_id}.log"
    try:
        s3.write_text(uri, hook.get_job_logs(submission_id))
        log.info("Driver log stored at %s", uri)
    except Exception as exc:
        log.warning("Could not store the driver log of %s: %s", submission_id, exc)
