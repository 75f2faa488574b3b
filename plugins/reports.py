"""The report view: a FastAPI app the API server mounts at /rlhf-flow (AirflowPlugin.fastapi_apps).

    GET /rlhf-flow/?bucket=rlhf-flow&prefix=rlhf-flow&dag_id=rlhf_pipeline   runs with an eval report
    GET /rlhf-flow/dags/<dag_id>/runs/<run_id>/report.html                    a run's report (also
        report.json, report.md, chart_<name>.svg), read from the eval stage's output in S3

S3 through the Airflow connection ``rlhf_s3`` (the amazon provider's S3Hook). A run's report is found
through the manifest URI its eval task returned (XCom), else through the operator's layout
(``plugins.operators.output_uri_for``) under bucket/prefix. Callers need read access to the DAG's runs, checked
by Airflow's own auth (the UI's session cookie, or a Bearer token). Every name that reaches a key is
validated first: a run id becomes its key-safe form, file names come from a fixed set.
"""
from __future__ import annotations

import html
import json
import re
from urllib.parse import quote

from airflow.api_fastapi.core_api.security import DagAccessEntity, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

from plugins.operators import key_safe, output_uri_for

AWS_CONN_ID = "rlhf_s3"
DEFAULTS = {"bucket": "rlhf-flow", "prefix": "rlhf-flow", "dag_id": "rlhf_pipeline"}
# The DAG's Params' patterns for bucket and prefix; dag and run ids as Airflow allows them.
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
PREFIX = re.compile(r"^[A-Za-z0-9._\-/]{0,200}$")
DAG_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")
RUN_ID = re.compile(r"^[A-Za-z0-9_.:+\-]{1,250}$")
FILES = {"report.html": "text/html; charset=utf-8", "report.json": "application/json", "report.md": "text/markdown; charset=utf-8"}
CHART = re.compile(r"^chart_[a-z]{1,20}\.svg$")
# report.html is data from S3: no scripts, nothing loaded from elsewhere, framed only by Airflow's UI.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'"


def bad(field: str, value: str, fix: str) -> HTTPException:
    return HTTPException(400, f"{field}: {value[:80]!r} {fix}")


def check_location(bucket: str, prefix: str, dag_id: str) -> str:
    """The runs' root URI ``s3://<bucket>/<prefix>``, after validating each part."""
    if not BUCKET.match(bucket):
        raise bad("bucket", bucket, "is not an S3 bucket name: use 3-63 lowercase letters, digits, '.' and '-'")
    if not PREFIX.match(prefix) or ".." in prefix.split("/"):
        raise bad("prefix", prefix, "is not a key prefix: use letters, digits, '.', '_', '-' and '/', no '..' segment")
    if not DAG_ID.match(dag_id) or set(dag_id) == {"."}:
        raise bad("dag_id", dag_id, "is not a DAG id: use letters, digits, '_', '.' and '-'")
    return f"s3://{bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{bucket}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id) or set(run_id) == {"."}:
        raise bad("run_id", run_id, "is not a DAG run id: use letters, digits and _ . : + -")
    return run_id


def _s3():
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook  # lazily: every Airflow process loads the plugin

    return S3Hook(aws_conn_id=AWS_CONN_ID).get_conn()


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def read_object(uri: str) -> bytes | None:
    """The object's bytes, None when it (or its bucket) does not exist; 502 with one line otherwise."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _split(uri)
    try:
        return _s3().get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchBucket", "404"):
            return None
        raise HTTPException(502, f"S3 (connection {AWS_CONN_ID}): reading {uri} failed: {e}") from None
    except BotoCoreError as e:
        raise HTTPException(502, f"S3 (connection {AWS_CONN_ID}) is unreachable: {e}") from None


def eval_output(dag_id: str, run_id: str) -> str | None:
    """The folder of the manifest the run's eval task returned (its XCom), None when Airflow has none.

    Preferred over the layout: a cache hit returns another run's eval output, and the run's own Params
    (bucket, prefix) are in it already."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        value = session.scalar(XComModel.get_many(key="return_value", run_id=run_id, dag_ids=dag_id, task_ids="eval",
                                                  map_indexes=-1).with_only_columns(XComModel.value))
    if isinstance(value, str) and value.startswith("s3://") and value.endswith("/manifest.json"):
        return value.removesuffix("/manifest.json")
    return None


def list_runs(root: str, dag_id: str) -> list[dict]:
    """Every run under <root>/runs/<dag_id>/ whose eval stage committed its manifest, newest first."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _split(f"{root}/runs/{dag_id}/")
    runs = []
    try:
        pages = _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key, Delimiter="/")
        folders = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
            raise HTTPException(404, f"bucket: {bucket!r} does not exist: pass ?bucket=<the run's bucket Param>") from None
        raise HTTPException(502, f"S3 (connection {AWS_CONN_ID}): listing s3://{bucket}/{key} failed: {e}") from None
    except BotoCoreError as e:
        raise HTTPException(502, f"S3 (connection {AWS_CONN_ID}) is unreachable: {e}") from None
    for folder in folders:
        raw = read_object(f"s3://{bucket}/{folder}eval/manifest.json")  # the manifest commits the report
        if raw is None:
            continue
        try:
            manifest = json.loads(raw)
        except ValueError:
            continue
        runs.append({"run": folder[len(key):].rstrip("/"), "created_at": manifest.get("created_at", ""),
                     "run_id": manifest.get("run_id", ""), "metrics": manifest.get("metrics", {})})
    return sorted(runs, key=lambda r: r["created_at"], reverse=True)


app = FastAPI(title="rlhf-flow reports", docs_url=None, redoc_url=None, openapi_url=None)
# Reading a report is reading a DAG run's results.
can_read_runs = Depends(requires_access_dag("GET", DagAccessEntity.RUN))


@app.get("/", response_class=HTMLResponse, dependencies=[can_read_runs])
def index(request: Request, bucket: str = Query(DEFAULTS["bucket"]), prefix: str = Query(DEFAULTS["prefix"]),
          dag_id: str = Query(DEFAULTS["dag_id"])) -> HTMLResponse:
    root = check_location(bucket, prefix, dag_id)
    runs = list_runs(root, dag_id)
    e = html.escape
    rows = []
    for r in runs:
        # The run id itself (not its key-safe folder name), so the report is found through the run's XCom.
        run_id = r["run_id"] if RUN_ID.match(r["run_id"] or "") else r["run"]
        base = f"{e(request.scope.get('root_path', ''))}/dags/{e(dag_id)}/runs/{quote(run_id, safe='')}"
        query = f"?bucket={e(bucket)}&amp;prefix={e(prefix)}"
        m = r["metrics"]
        cells = "".join(f'<td class="num">{m[k]:.3f}</td>' if isinstance(m.get(k), (int, float)) else "<td></td>"
                        for k in ("policy_accuracy", "policy_preferred_style_rate", "policy_kl_to_ref"))
        rows.append(f'<tr><td><a class="report" href="{base}/report.html{query}">{e(r["run_id"] or r["run"])}</a></td>'
                    f"<td>{e(r['created_at'])}</td>{cells}"
                    f'<td><a href="{base}/report.json{query}">json</a> <a href="{base}/report.md{query}">md</a></td></tr>')
    body = ("<table><tr><th>run</th><th>evaluated at</th><th>policy accuracy</th><th>policy style rate</th>"
            "<th>policy KL</th><th>files</th></tr>" + "".join(rows) + "</table>") if rows else \
        f"<p>No evaluated runs under <code>{e(root)}/runs/{e(dag_id)}/</code> yet.</p>"
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>rlhf-flow reports</title><style>'
            "body{font-family:sans-serif;margin:24px}td,th{border:1px solid #ccc;padding:4px 10px}table{border-collapse:collapse}"
            f".num{{text-align:right}}</style></head><body><h1>Evaluation reports</h1><p><code>{e(root)}/runs/{e(dag_id)}/</code> "
            f"({len(runs)} evaluated runs)</p>{body}</body></html>")
    return HTMLResponse(page, headers={"Content-Security-Policy": CSP})


@app.get("/dags/{dag_id}/runs/{run_id}/{name}", dependencies=[can_read_runs])
def report_file(dag_id: str, run_id: str, name: str, bucket: str = Query(DEFAULTS["bucket"]),
                prefix: str = Query(DEFAULTS["prefix"])) -> Response:
    root = check_location(bucket, prefix, dag_id)
    check_run_id(run_id)
    media = FILES.get(name) or ("image/svg+xml" if CHART.match(name) else None)
    if media is None:
        raise bad("name", name, f"is not a report file: use one of {', '.join(FILES)} or chart_<name>.svg")
    uri = f"{eval_output(dag_id, run_id) or output_uri_for(root, dag_id, key_safe(run_id), 'eval')}/{name}"
    data = read_object(uri)
    if data is None:
        raise HTTPException(404, f"{uri} does not exist: the run's eval stage has not committed a report (yet), "
                                 "or bucket/prefix differ from the run's Params")
    return Response(data, media_type=media, headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"})
