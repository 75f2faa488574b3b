"""Webhook notifications through Airflow's notifier mechanism: nightly failure, promotion, rejection.

    from plugins.notifiers import WebhookNotifier
    DAG(..., on_failure_callback=WebhookNotifier("nightly_failure"))           # a nightly run failed
    promote_task = RayJobOperator(..., on_success_callback=WebhookNotifier("decision"))  # promotion or rejection

Each call POSTs one JSON object to the webhook: ``event`` (nightly_failure, promotion, rejection or
passed_not_promoted), ``text`` (one line, so a Slack-style incoming webhook shows it as is), ``dag_id``,
``run_id`` and, for a decision, ``decision``, ``champion_version``, the candidate's gate ``metrics``, the
``gate`` rules and one ``reasons`` line per rule, read from the promote stage's manifest (its XCom) and the
candidate record it names, through the S3 connection ``rlhf_s3``.

The webhook: ``url`` (templated, e.g. "{{ params.webhook_url }}") when set, else the http connection
``conn_id`` (default ``rlhf_webhook``) whose host is the full URL, or host/port/schema plus
``extra.endpoint``. With neither, the notifier logs that it has nowhere to post and returns: a stack
without a webhook still runs. A failed POST raises, and Airflow logs it beside the task (a callback never
changes a task's state).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from airflow.sdk import BaseNotifier

from plugins.s3 import S3Store
from tasks.common import names

EVENTS = ("nightly_failure", "decision")
AWS_CONN_ID = names.S3_CONN
TIMEOUT_S = 10


def webhook_url(conn_id: str) -> str | None:
    """The URL of an http connection: a host holding the whole URL, or schema://host:port/endpoint."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None
    host = conn.host or ""
    if host.startswith(("http://", "https://")):
        return host
    scheme = conn.schema if conn.schema in ("http", "https") else "http"
    endpoint = (conn.extra_dejson or {}).get("endpoint", "")
    return f"{scheme}://{host}{f':{conn.port}' if conn.port else ''}/{endpoint.lstrip('/')}"


def post_json(url: str, payload: dict) -> int:
    """POST payload as JSON; returns the HTTP status, raises with one line on anything but 2xx."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"url: {url[:80]!r} is not an http(s) URL; set the webhook Param or the rlhf_webhook connection's host"
        )
    request = urllib.request.Request(
        url, data=json.dumps(payload, default=str).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"webhook {url} answered HTTP {e.code}: check the rlhf_webhook connection") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(
            f"webhook {url} unreachable ({getattr(e, 'reason', e)}): check the rlhf_webhook connection"
        ) from None


def _read_s3_json(uri: str) -> dict:
    return S3Store(AWS_CONN_ID).read_json(uri)


def decision_payload(manifest_uri: str, read=_read_s3_json) -> dict:
    """What the promote stage decided, from its manifest and the candidate record it wrote."""
    manifest = read(manifest_uri)
    m = manifest.get("metrics") or {}
    event = "promotion" if m.get("promoted") else "passed_not_promoted" if m.get("passed") else "rejection"
    record = read(manifest["candidate"]) if manifest.get("candidate") else {}
    return {
        "event": event,
        "decision": manifest.get("decision"),
        "champion_version": m.get("champion_version"),
        "metrics": record.get("metrics") or {},
        "gate": record.get("gate") or {},
        "reasons": record.get("reasons") or [],
        "against": record.get("against"),
        "policy": record.get("policy"),
        "promote_manifest": manifest_uri,
    }


class WebhookNotifier(BaseNotifier):
    """POST a JSON summary of a failed run or a promotion decision to a webhook (see the module docstring)."""

    template_fields = ("url", "manifest")

    def __init__(
        self,
        event: str,
        url: str = "",
        conn_id: str = names.WEBHOOK_CONN,
        manifest: str | None = None,
        read=_read_s3_json,
    ):
        """``manifest``: the promote stage's manifest URI (default: the XCom of the task it is the callback of)."""
        super().__init__()
        if event not in EVENTS:
            raise ValueError(f"event: {event!r} is not one of {list(EVENTS)}")
        if manifest is None:  # only a decision has a manifest; a DAG-level failure context has no ti to render it
            manifest = "{{ ti.xcom_pull(task_ids=ti.task_id) }}" if event == "decision" else ""
        self.event, self.url, self.conn_id, self.manifest, self.read = event, url, conn_id, manifest, read

    def payload(self, context: dict[str, Any]) -> dict:
        dag_run = context.get("dag_run")
        dag_id = getattr(context.get("dag"), "dag_id", None) or getattr(dag_run, "dag_id", None)
        run_id = context.get("run_id") or getattr(dag_run, "run_id", None)
        base = {"dag_id": dag_id, "run_id": run_id}
        if self.event == "nightly_failure":
            ti = context.get("ti") or context.get("task_instance")
            failed = getattr(ti, "task_id", None)
            reason = context.get("reason") or str(context.get("exception") or "") or "a task failed"
            return {
                **base,
                "event": "nightly_failure",
                "failed_task": failed,
                "reason": reason,
                "text": f"{dag_id} run {run_id} FAILED" + (f" at {failed}" if failed else "") + f": {reason}"[:300],
            }
        if not str(self.manifest).startswith("s3://"):
            raise ValueError(
                f"manifest: {str(self.manifest)[:80]!r} is not the promote stage's manifest URI; attach the decision notifier to the promote task"
            )
        decision = decision_payload(self.manifest, self.read)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(decision["metrics"].items()) if isinstance(v, (int, float)))
        return {**base, **decision, "text": f"{dag_id} run {run_id}: {decision['decision']} ({shown})"}

    def notify(self, context: dict[str, Any]) -> None:
        url = self.url or webhook_url(self.conn_id)
        if not url:
            self.log.warning(
                "No webhook: set the %s connection or the url; not posting the %s event", self.conn_id, self.event
            )
            return
        payload = self.payload(context)
        status = post_json(url, payload)
        self.log.info("Posted %s to the webhook (HTTP %s)", payload["event"], status)
