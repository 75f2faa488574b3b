"""What a stage cost: wall time, the GPUs and CPUs it held, and GPU-hours; summed over a candidate's lineage.

    from tasks.common import cost

    held = cost.held_resources([actor_placement, (2, True)], driver_cpus=1)   # {"gpus": 3, "cpus": 4}
    cost.stage_cost(1800.0, **held)
    # {"wall_time_s": 1800.0, "gpus": 3, "cpus": 4, "gpu_hours": 1.5}
    cost.lineage_cost("s3://b/p/runs/d/r/eval/manifest.json")
    # {"wall_time_s": …, "gpu_hours": …, "stages": 5, "unknown": 0}   summed over the manifest and its inputs

A placement is anything with ``size`` (bundles) and ``use_gpu`` (tasks.common.nn.workers.Placement), or a
``(bundles, use_gpu)`` pair. A bundle is one GPU and one CPU on a GPU cluster, one CPU on a CPU-only one
(workers.Placement.create), so that is what each bundle counts for. Colocated groups share one placement:
pass it once, or it is counted twice. The driver holds what the Ray job reserved for its entrypoint
(RayJobOperator's entrypoint_num_cpus / entrypoint_num_gpus: 1 and 0 by default).
No torch and no airflow here.
"""

from __future__ import annotations

from typing import Any, Iterable

from tasks.common.config import ConfigError

FIELDS = ("wall_time_s", "gpus", "cpus", "gpu_hours")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{name}: must be a number >= 0, got {value!r}; pass seconds or a resource count")
    return value


def held_resources(placements: Iterable[Any], driver_cpus: float = 1, driver_gpus: float = 0) -> dict:
    """{"gpus", "cpus"} held by the stage's placement groups plus its driver."""
    gpus, cpus = _number("driver_gpus", driver_gpus), _number("driver_cpus", driver_cpus)
    for p in placements:
        bundles, use_gpu = (p.size, p.use_gpu) if hasattr(p, "size") else p
        bundles = _number("placement bundles", bundles)
        gpus += bundles if use_gpu else 0
        cpus += bundles  # one CPU per bundle, GPU cluster or not
    return {"gpus": gpus, "cpus": cpus}


def stage_cost(wall_time_s: float, gpus: float, cpus: float) -> dict:
    """The cost fields a stage's manifest records in its metrics."""
    wall = _number("wall_time_s", wall_time_s)
    return {
        "wall_time_s": round(wall, 1),
        "gpus": _number("gpus", gpus),
        "cpus": _number("cpus", cpus),
        "gpu_hours": round(gpus * wall / 3600, 4),
    }


def manifest_dir(value: Any) -> str | None:
    """The stage folder an input value names, when it can be one (s3:// URI or a path; not a hub id)."""
    if not isinstance(value, str) or not value or value.startswith(("http://", "https://")):
        return None
    value = value.rstrip("/")
    return value.removesuffix("/manifest.json") if value.startswith(("s3://", "/", "file://")) else None


def lineage(manifest_uri: str, read=None, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """{stage folder: its manifest} for a stage output and every stage output its inputs name, recursively.

    ``inputs`` values may hold comma-separated URIs (several reward models). Inputs without a committed
    manifest (a hub id, a plain folder, a data file, the registry folder) end the walk there.
    ``read(folder)`` returns the manifest dict or None (default: tasks.common.storage); inputs named in
    ``exclude`` are not followed."""
    read = read or read_manifest_or_none
    seen: dict[str, dict] = {}
    todo = [manifest_dir(manifest_uri)]
    while todo:
        folder = todo.pop()
        if not folder or folder in seen:
            continue
        manifest = read(folder)
        if manifest is None:
            continue
        seen[folder] = manifest
        for name, value in (manifest.get("inputs") or {}).items():
            if name in exclude:
                continue
            todo += [manifest_dir(v.strip()) for v in value.split(",")] if isinstance(value, str) else []
    return seen


def read_manifest_or_none(folder: str) -> dict | None:
    from tasks.common import storage

    try:
        data = storage.read_json(storage.join(folder, "manifest.json"))
    except storage.StorageError:
        return None
    return data if isinstance(data, dict) and data.get("format", "").startswith("rlhf-flow/manifest") else None


# The eval stage also scores the registry's champion: that model's training is not this candidate's cost.
NOT_COST_INPUTS = ("champion",)


def lineage_cost(manifest_uri: str, read=None, exclude: Iterable[str] = NOT_COST_INPUTS) -> dict:
    """Wall time and GPU-hours summed over a stage output's lineage (each stage once, even when reached
    twice); ``unknown`` counts stages that recorded no cost (committed before cost was recorded)."""
    total = {"wall_time_s": 0.0, "gpu_hours": 0.0, "stages": 0, "unknown": 0}
    for manifest in lineage(manifest_uri, read, exclude).values():
        metrics = manifest.get("metrics") or {}
        total["stages"] += 1
        total["wall_time_s"] += float(metrics.get("wall_time_s") or 0)
        if "gpu_hours" in metrics:
            total["gpu_hours"] += float(metrics["gpu_hours"])
        else:
            total["unknown"] += 1
    total["wall_time_s"], total["gpu_hours"] = round(total["wall_time_s"], 1), round(total["gpu_hours"], 4)
    return total
