"""The report view: a FastAPI app the API server mounts at /rlhf-flow (AirflowPlugin.fastapi_apps).

    GET /rlhf-flow/?bucket=rlhf-flow&prefix=rlhf-flow&dag_id=rlhf_pipeline   runs with an eval report
    GET /rlhf-flow/dags/<dag_id>/runs/<run_id>/report.html                    a run's report (also
        report.json, report.md, chart_<name>.svg), read from the eval stage's output in S3

S3 through the Airflow connection ``rlhf_s3`` (plugins/s3.py). A report belongs to a run
that exists in Airflow: it is found through the manifest URI the run's eval task returned (XCom), else
through the operator's layout (``plugins.stage_cli.output_uri_for``) under the run's own bucket and prefix
Params. The list reads only a served bucket (the connection's extra ``bucket``, the pipeline's default, and
``buckets``, the others runs may name) under a prefix the DAG's runs use. Callers need read access to the
DAG's runs, checked by Airflow's own auth manager for that DAG (the UI's session cookie, or a Bearer
token). Every name that reaches a key is validated first: a run id becomes its key-safe form, file names
come from a fixed set.
"""

from __future__ import annotations

import html
import json
import re
from urllib.parse import quote

from airflow.api_fastapi.core_api.security import DagAccessEntity, GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

from plugins.s3 import S3Error, S3Store, split_uri
from plugins.stage_cli import key_safe, output_uri_for
from tasks.common import names

AWS_CONN_ID = names.S3_CONN
DEFAULTS = {"bucket": "rlhf-flow", "prefix": "rlhf-flow", "dag_id": names.PIPELINE_DAG}
# The DAG's Params' patterns for bucket and prefix; dag and run ids as Airflow allows them.
BUCKET = re.compile(names.BUCKET_PATTERN)
PREFIX = re.compile(r"^[A-Za-z0-9._\-/]{0,200}$")
DAG_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")
RUN_ID = re.compile(r"^[A-Za-z0-9_.:+\-]{1,250}$")
FILES = {
    "report.html": "text/html; charset=utf-8",
    "report.json": "application/json",
    "report.md": "text/markdown; charset=utf-8",
}
CHART = re.compile(r"^chart_[a-z]{1,20}\.svg$")
#: The reports list's figures of each run's policy (eval's manifest metrics), named for how each was measured.
REPORT_COLUMNS = {
    "policy_accuracy": "accuracy (greedy)",
    "policy_preferred_style_rate": "style rate (greedy)",
    "policy_sampled_preferred_style_rate": "style rate (sampled)",
    "policy_kl_to_ref": "KL to baseline (sampled)",
}
# report.html is data from S3: no scripts, nothing loaded from elsewhere, framed only by Airflow's UI.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'"


def bad(field: str, value: str, fix: str) -> HTTPException:
    return HTTPException(400, f"{field}: {value[:80]!r} {fix}")


def check_location(bucket: str, prefix: str, dag_id: str | None = None) -> str:
    """The runs' root URI ``s3://<bucket>/<prefix>``, after validating each part."""
    if not BUCKET.match(bucket):
        raise bad("bucket", bucket, "is not an S3 bucket name: use 3-63 lowercase letters, digits, '.' and '-'")
    if not PREFIX.match(prefix) or ".." in prefix.split("/"):
        raise bad("prefix", prefix, "is not a key prefix: use letters, digits, '.', '_', '-' and '/', no '..' segment")
    if dag_id is not None:
        check_dag_id(dag_id)
    return f"s3://{bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{bucket}"


def check_dag_id(dag_id: str) -> str:
    if not DAG_ID.match(dag_id) or set(dag_id) == {"."}:
        raise bad("dag_id", dag_id, "is not a DAG id: use letters, digits, '_', '.' and '-'")
    return dag_id


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id) or set(run_id) == {"."}:
        raise bad("run_id", run_id, "is not a DAG run id: use letters, digits and _ . : + -")
    return run_id


def served_buckets() -> tuple[str, list[str]]:
    """(the default bucket, every bucket the views read): the rlhf_s3 connection's extra ``bucket`` (the
    pipeline's default, as for the operator) and ``buckets`` (a list, or names separated by commas)."""
    extra = S3Store(AWS_CONN_ID).connection_extra()  # none: the operator then writes to the default bucket
    default = extra.get("bucket") or DEFAULTS["bucket"]
    others = extra.get("buckets") or []
    others = others.split(",") if isinstance(others, str) else list(others)
    return default, sorted({b.strip() for b in [default, *others] if b and b.strip()})


def check_served(bucket: str) -> None:
    served = served_buckets()[1]
    if bucket not in served:
        raise HTTPException(
            403,
            f"bucket: {bucket[:80]!r} is not served here: add it to the extra 'buckets' of the {AWS_CONN_ID} connection (served: {', '.join(served)})",
        )


def run_confs(dag_id: str | None, run_id: str | None = None) -> list[dict]:
    """The conf of the DAG's run ``run_id`` (of every run of the DAG when None, of every DAG's runs when
    ``dag_id`` is None too); [] when there is none."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = select(DagRun.conf)
    if dag_id is not None:
        query = query.where(DagRun.dag_id == dag_id)
    if run_id is not None:
        query = query.where(DagRun.run_id == run_id)
    with create_session() as session:
        return [conf if isinstance(conf, dict) else {} for conf in session.scalars(query)]


def check_prefix(prefix: str, dag_id: str | None) -> None:
    """A prefix is read only when it is the default or a run (of the DAG ``dag_id``; of any DAG when
    None) wrote under it."""
    used = {DEFAULTS["prefix"]} | {str(c["prefix"]).strip("/") for c in run_confs(dag_id) if c.get("prefix")}
    if prefix.strip("/") not in used:
        whose = f"of DAG {dag_id!r} " if dag_id else ""
        raise HTTPException(
            404, f"prefix: no run {whose}writes under {prefix[:80]!r} (runs use: {', '.join(sorted(used)[:20])})"
        )


def run_location(dag_id: str, run_id: str) -> str:
    """``s3://<bucket>/<prefix>`` of the run's own bucket and prefix Params (404: Airflow has no such run)."""
    confs = run_confs(dag_id, run_id)
    if not confs:
        raise HTTPException(404, f"run_id: DAG {dag_id!r} has no run {run_id[:80]!r}")
    bucket = str(confs[0].get("bucket") or served_buckets()[0])
    check_served(bucket)
    return check_location(bucket, str(confs[0].get("prefix") or DEFAULTS["prefix"]), dag_id)


def _s3_failed(e: S3Error, failed: str) -> HTTPException:
    """A view's answer to an S3 failure, one line: 502 when S3 answered with an error or was not reached. Any
    other failure is no answer of S3's: raised as is (a 500)."""
    if e.code is not None:
        return HTTPException(502, f"S3 (connection {AWS_CONN_ID}): {failed}: {e.__cause__}")
    if e.unreachable:
        return HTTPException(502, f"S3 (connection {AWS_CONN_ID}) is unreachable: {e.__cause__}")
    raise e


def read_object(uri: str) -> bytes | None:
    """The object's bytes, None when it (or its bucket) does not exist; 502 with one line otherwise."""
    try:
        return S3Store(AWS_CONN_ID).read(uri, missing_ok=True)
    except S3Error as e:
        raise _s3_failed(e, f"reading {uri} failed") from None


def eval_output(dag_id: str, run_id: str) -> str | None:
    """The folder of the manifest the run's eval task returned (its XCom), None when Airflow has none.

    Preferred over the layout: a cache hit returns another run's eval output, and the run's own Params
    (bucket, prefix) are in it already."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        value = session.scalar(
            XComModel.get_many(
                key="return_value", run_id=run_id, dag_ids=dag_id, task_ids="eval", map_indexes=-1
            ).with_only_columns(XComModel.value)
        )
    if isinstance(value, str) and value.startswith("s3://") and value.endswith("/manifest.json"):
        return value.removesuffix("/manifest.json")
    return None


def list_pages(bucket: str, prefix: str, field: str = "Contents") -> list[str]:
    """The keys under ``prefix`` ("Contents"), or its sub-folders ("CommonPrefixes"); a missing bucket is a
    one-line 404, any other failure a one-line 502."""
    store, uri = S3Store(AWS_CONN_ID), f"s3://{bucket}/{prefix}"
    try:
        return store.folders(uri) if field == "CommonPrefixes" else [obj["Key"] for obj in store.objects(uri)]
    except S3Error as e:
        if e.code == "NoSuchBucket":
            raise HTTPException(
                404, f"bucket: {bucket!r} does not exist: create it or fix the {AWS_CONN_ID} connection's extra"
            ) from None
        raise _s3_failed(e, f"listing s3://{bucket}/{prefix} failed") from None


def list_runs(root: str, dag_id: str) -> list[dict]:
    """Every run under <root>/runs/<dag_id>/ whose eval stage committed its manifest, newest first."""
    bucket, key = split_uri(f"{root}/runs/{dag_id}/")
    runs = []
    for folder in list_pages(bucket, key, "CommonPrefixes"):
        raw = read_object(f"s3://{bucket}/{folder}eval/manifest.json")  # the manifest commits the report
        if raw is None:
            continue
        try:
            manifest = json.loads(raw)
        except ValueError:
            continue
        runs.append(
            {
                "run": folder[len(key) :].rstrip("/"),
                "created_at": manifest.get("created_at", ""),
                "run_id": manifest.get("run_id", ""),
                "metrics": manifest.get("metrics", {}),
            }
        )
    return sorted(runs, key=lambda r: r["created_at"], reverse=True)


def can_read_runs_of(dag_id: str | None = None):
    """A dependency: the caller may read the runs of `dag_id` or, without one, of the DAG the request names (its
    path's or query's `dag_id`, else the default DAG), as Airflow's auth manager decides for that DAG. Airflow's
    own `requires_access_dag` asks about "any DAG" when the request names none, which lets in a user of another."""

    def check(request: Request, user: GetUserDep) -> None:
        named = dag_id or request.path_params.get("dag_id") or request.query_params.get("dag_id") or DEFAULTS["dag_id"]
        requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=named)(request, user)

    return Depends(check)


app = FastAPI(title="rlhf-flow reports", docs_url=None, redoc_url=None, openapi_url=None)
# Reading a report is reading a DAG run's results.
can_read_runs = can_read_runs_of()


@app.get("/", response_class=HTMLResponse, dependencies=[can_read_runs])
def index(
    request: Request,
    bucket: str | None = Query(None),
    prefix: str = Query(DEFAULTS["prefix"]),
    dag_id: str = Query(DEFAULTS["dag_id"]),
) -> HTMLResponse:
    bucket = bucket or served_buckets()[0]
    root = check_location(bucket, prefix, dag_id)
    check_served(bucket)
    check_prefix(prefix, dag_id)
    runs = list_runs(root, dag_id)
    e = html.escape
    rows = []
    for r in runs:
        # The run id itself (not its key-safe folder name), so the report is found through the run's XCom.
        run_id = r["run_id"] if RUN_ID.match(r["run_id"] or "") else r["run"]
        base = f"{e(request.scope.get('root_path', ''))}/dags/{e(dag_id)}/runs/{quote(run_id, safe='')}"
        m = r["metrics"]
        cells = "".join(
            f'<td class="num">{m[k]:.3f}</td>' if isinstance(m.get(k), (int, float)) else "<td></td>"
            for k in REPORT_COLUMNS
        )
        rows.append(
            f'<tr><td><a class="report" href="{base}/report.html">{e(r["run_id"] or r["run"])}</a></td>'
            f"<td>{e(r['created_at'])}</td>{cells}"
            f'<td><a href="{base}/report.json">json</a> <a href="{base}/report.md">md</a></td></tr>'
        )
    body = (
        (
            "<table><tr><th>run</th><th>evaluated at</th>"
            + "".join(f"<th>{e(title)}</th>" for title in REPORT_COLUMNS.values())
            + "<th>files</th></tr>"
            + "".join(rows)
            + "</table>"
        )
        if rows
        else f"<p>No evaluated runs under <code>{e(root)}/runs/{e(dag_id)}/</code> yet.</p>"
    )
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>rlhf-flow reports</title><style>'
        "body{font-family:sans-serif;margin:24px}td,th{border:1px solid #ccc;padding:4px 10px}table{border-collapse:collapse}"
        f".num{{text-align:right}}</style></head><body><h1>Evaluation reports</h1><p><code>{e(root)}/runs/{e(dag_id)}/</code> "
        f"({len(runs)} evaluated runs)</p>{body}</body></html>"
    )
    return HTMLResponse(page, headers={"Content-Security-Policy": CSP})


@app.get("/dags/{dag_id}/runs/{run_id}/{name}", dependencies=[can_read_runs])
def report_file(dag_id: str, run_id: str, name: str) -> Response:
    check_dag_id(dag_id)
    check_run_id(run_id)
    media = FILES.get(name) or ("image/svg+xml" if CHART.match(name) else None)
    if media is None:
        raise bad("name", name, f"is not a report file: use one of {', '.join(FILES)} or chart_<name>.svg")
    folder = eval_output(dag_id, run_id)  # None too when Airflow has no such run: run_location says so
    if folder:
        check_served(split_uri(folder)[0])
    else:
        folder = output_uri_for(run_location(dag_id, run_id), dag_id, key_safe(run_id), "eval")
    uri = f"{folder}/{name}"
    data = read_object(uri)
    if data is None:
        raise HTTPException(404, f"{uri} does not exist: the run's eval stage has not committed a report (yet)")
    return Response(
        data, media_type=media, headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}
    )
