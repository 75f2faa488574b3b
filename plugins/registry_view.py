"""The registry view, read-only: a FastAPI app the API server mounts (register ``app``, e.g. at /rlhf-registry).

    GET /rlhf-registry/?bucket=rlhf-flow&prefix=rlhf-flow&model_name=demo-policy          an HTML page
    GET /rlhf-registry/api?bucket=…&prefix=…&model_name=…                                 the same as JSON

Shows the champion, every promotion and rollback (who, when, which run, gate metrics) and every judged
candidate with its metrics and cost (GPU-hours and wall time summed over the manifests of its policy's
lineage and its evaluation: the stages' ``gpu_hours`` / ``wall_time_s`` metrics where they recorded them).
Nothing here writes: promote and roll back with the rlhf_registry DAG or ``python -m tasks.registry``.
S3 through the connection ``rlhf_s3``; callers need read access to the rlhf_registry DAG's runs (Airflow's own auth).
The lineage walk is tasks.common.cost's (standard library only), reading manifests through that connection.
"""

from __future__ import annotations

import html
import json
import re

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from plugins.reports import (
    bad,
    can_read_runs_of,
    check_location,
    check_prefix,
    check_served,
    list_pages,
    read_object,
    served_buckets,
)
from plugins.s3 import split_uri
from tasks.common import cost, names

MODEL = re.compile(names.NAME_PATTERN)  # the model_name Param's pattern
MAX_CANDIDATES = 100  # newest shown; each costs a few manifest reads

app = FastAPI(title="rlhf-flow registry", docs_url=None, redoc_url=None, openapi_url=None)
# The registry is what the rlhf_registry DAG manages (promotions, rollbacks): reading it is reading that DAG's runs.
can_read_runs = can_read_runs_of(names.REGISTRY_DAG)


def registry_root(bucket: str, prefix: str, model_name: str) -> str:
    """The registry's folder, after validating each part (formats only; see served_root)."""
    root = check_location(bucket, prefix)
    if not MODEL.match(model_name):
        raise bad("model_name", model_name, "is not a model name: use letters, digits, '.', '_' and '-'")
    return f"{root}/models/{model_name}"


def served_root(bucket: str | None, prefix: str, model_name: str) -> str:
    """registry_root in a served bucket (the default when None), under a prefix some run wrote under."""
    bucket = bucket or served_buckets()[0]
    root = registry_root(bucket, prefix, model_name)
    check_served(bucket)
    check_prefix(prefix, None)
    return root


def _json(uri: str) -> dict | None:
    raw = read_object(uri)
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None


def _list(uri: str) -> list[str]:
    bucket, key = split_uri(uri)
    return sorted(f"s3://{bucket}/{k}" for k in list_pages(bucket, key.rstrip("/") + "/") if k.endswith(".json"))


def _manifest(folder: str) -> dict | None:
    """A stage folder's manifest through the rlhf_s3 connection (None off S3 or where there is none)."""
    return _json(f"{folder}/manifest.json") if folder.startswith("s3://") else None


def listing(root: str) -> dict:
    candidates = [c for c in (_json(u) for u in _list(f"{root}/candidates")) if c]
    candidates = sorted(candidates, key=lambda c: c.get("judged_at", ""))[-MAX_CANDIDATES:]
    for c in candidates:
        # The evaluation's inputs name the policy: its lineage holds the policy's (tasks.common.registry does the same).
        c["cost"] = cost.lineage_cost(c.get("evaluation") or c.get("policy") or "", read=_manifest)
    return {
        "registry": root,
        "champion": _json(f"{root}/champion.json"),
        "history": [h for h in (_json(u) for u in _list(f"{root}/history")) if h],
        "candidates": candidates,
    }


@app.get("/api", dependencies=[can_read_runs])
def registry_json(
    bucket: str | None = Query(None), prefix: str = Query("rlhf-flow"), model_name: str = Query("demo-policy")
) -> dict:
    return listing(served_root(bucket, prefix, model_name))


def _metrics(m: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted((m or {}).items()) if isinstance(v, (int, float)))


@app.get("/", response_class=HTMLResponse, dependencies=[can_read_runs])
def registry_page(
    bucket: str | None = Query(None), prefix: str = Query("rlhf-flow"), model_name: str = Query("demo-policy")
):
    data = listing(served_root(bucket, prefix, model_name))
    e = html.escape
    champ = data["champion"]
    rows = "".join(
        f"<tr><td>v{h['version']}</td><td>{e(str(h.get('promoted_at')))}</td><td>{e(str(h.get('action', 'promote')))}"
        f"{' to v' + str(h['rolled_back_to']) if 'rolled_back_to' in h else ''}</td><td>{e(str(h.get('promoted_by')))}</td>"
        f"<td>{e(str(h.get('run_id', '')))}</td><td>{e(_metrics(h.get('metrics')))}</td><td>{e(str(h.get('reason', '')))}</td></tr>"
        for h in reversed(data["history"])
    )
    cands = "".join(
        f"<tr><td>{e(str(c.get('run_id')))}</td><td>{'promoted' if c.get('promoted') else 'passed' if c.get('passed') else 'rejected'}"
        f"</td><td>{e(_metrics(c.get('metrics')))}</td><td>{c['cost']['gpu_hours']:.3f}</td><td>{c['cost']['wall_time_s']:.0f}</td>"
        f"<td>{e(str(c.get('decision', '')))}</td></tr>"
        for c in reversed(data["candidates"])
    )
    head = f"v{champ['version']}: {e(champ['policy'])}" if champ else "none yet"
    return HTMLResponse(
        f"<!doctype html><meta charset=utf-8><title>Registry {e(model_name)}</title>"
        "<style>body{font-family:sans-serif;margin:1em}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}</style>"
        f"<h1>{e(data['registry'])}</h1><p>Champion: {head}</p>"
        "<h2>History</h2><table><tr><th>version</th><th>when</th><th>action</th><th>by</th><th>run</th><th>metrics</th><th>reason</th></tr>"
        f"{rows}</table><h2>Candidates</h2><table><tr><th>run</th><th>verdict</th><th>metrics</th><th>GPU-h</th><th>wall s</th>"
        f"<th>decision</th></tr>{cands}</table>",
        headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'"},
    )
