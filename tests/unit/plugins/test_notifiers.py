"""The webhook notifier (plugins/notifiers.py) posting to a real HTTP receiver on 127.0.0.1: a failed nightly
run, and the promote stage's decisions (promotion, rejection) with the gate's metrics read back from the
promote manifest and candidate record on the S3 emulator, through the Airflow connection rlhf_s3."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("airflow")

from tasks.common import manifest as manifests  # noqa: E402
from tasks.common.registry import Registry  # noqa: E402


@pytest.fixture
def receiver():
    """An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it."""
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


@pytest.fixture
def connections(s3_server, receiver, monkeypatch):
    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint))
    monkeypatch.setenv(
        "AIRFLOW_CONN_RLHF_WEBHOOK", json.dumps({"conn_type": "http", "host": f"{receiver[0]}/hooks/rlhf"})
    )


def promote_output(s3_server, tmp_path, run: str, passed: bool, promoted: bool) -> str:
    """A promote stage's output as the stage commits it, with the candidate record it writes."""
    root = s3_server.uri(f"notify-{tmp_path.name}")
    reg = Registry(f"{root}/models/demo-policy")
    metrics = {"accuracy": 0.846, "preferred_style_rate": 0.99 if passed else 0.6, "kl_to_ref": 0.74}
    decision = "promoted: champion v1" if promoted else "rejected: the gate failed"
    candidate = reg.record_candidate(
        run,
        {
            "policy": f"{root}/runs/rlhf_nightly/{run}/rl/manifest.json",
            "metrics": metrics,
            "gate": {"accuracy": {"max_drop": 0.02}},
            "passed": passed,
            "promoted": promoted,
            "decision": decision,
            "reasons": ["pass: accuracy drop +0.0000 from 0.8460 <= 0.02"],
        },
    )
    local = tmp_path / run
    local.mkdir()
    (local / "decision.json").write_text(json.dumps({"decision": decision}))
    out = f"{root}/runs/rlhf_nightly/{run}/promote"
    manifests.commit(
        local,
        out,
        manifests.build_manifest(
            "promote",
            run,
            {},
            {},
            {"passed": int(passed), "promoted": int(promoted), "champion_version": 1 if promoted else 0},
            decision=decision,
            candidate=candidate,
        ),
    )
    return f"{out}/manifest.json"


def test_promotion_and_rejection_post_the_gate_metrics(s3_server, receiver, connections, tmp_path):
    from plugins.notifiers import WebhookNotifier

    url, received = receiver
    for run, passed in (("night1", True), ("night2", False)):
        manifest = promote_output(s3_server, tmp_path, run, passed, promoted=passed)
        # What the promote task's on_success_callback gets: the run's context; the manifest is its XCom.
        WebhookNotifier("decision", manifest=manifest)({"dag": None, "run_id": run, "params": {}})
    (path1, promotion), (_, rejection) = received
    assert path1 == "/hooks/rlhf"
    assert promotion["event"] == "promotion" and promotion["champion_version"] == 1
    assert promotion["metrics"] == {"accuracy": 0.846, "preferred_style_rate": 0.99, "kl_to_ref": 0.74}
    assert promotion["gate"] == {"accuracy": {"max_drop": 0.02}} and promotion["reasons"][0].startswith(
        "pass: accuracy"
    )
    assert (
        promotion["text"]
        == "None run night1: promoted: champion v1 (accuracy 0.846, kl_to_ref 0.740, preferred_style_rate 0.990)"
    )
    assert rejection["event"] == "rejection" and rejection["decision"].startswith("rejected")
    assert rejection["metrics"]["preferred_style_rate"] == 0.6


def test_nightly_failure_posts_and_a_url_param_overrides_the_connection(receiver, connections, tmp_path):
    from airflow.sdk import DAG

    from plugins.notifiers import WebhookNotifier

    url, received = receiver
    with DAG("rlhf_nightly_notify_test", schedule=None, params={"webhook_url": f"{url}/from-param"}) as dag:
        pass
    context = {
        "dag": dag,
        "run_id": "scheduled__2026-01-02T02:00:00+00:00",
        "reason": "task_failure",
        "params": {"webhook_url": f"{url}/from-param"},
    }
    WebhookNotifier("nightly_failure")(dict(context))
    WebhookNotifier("nightly_failure", url="{{ params.webhook_url }}")(dict(context))
    (p1, first), (p2, second) = received
    assert (p1, p2) == ("/hooks/rlhf", "/from-param")
    assert first["event"] == "nightly_failure" and first["dag_id"] == "rlhf_nightly_notify_test"
    assert first["text"] == "rlhf_nightly_notify_test run scheduled__2026-01-02T02:00:00+00:00 FAILED: task_failure"


def test_no_webhook_logs_and_a_dead_one_raises_with_one_line(receiver, monkeypatch):
    from plugins.notifiers import WebhookNotifier, post_json

    monkeypatch.delenv("AIRFLOW_CONN_RLHF_WEBHOOK", raising=False)
    WebhookNotifier("nightly_failure")({"dag": None, "run_id": "r"})  # nowhere to post: logged, no error
    assert receiver[1] == []
    with pytest.raises(RuntimeError, match=r"^webhook http://127.0.0.1:9/x unreachable"):
        post_json("http://127.0.0.1:9/x", {})
    with pytest.raises(ValueError, match=r"^url: 'ftp://x' is not an http\(s\) URL"):
        post_json("ftp://x", {})
    with pytest.raises(ValueError, match=r"^event: 'oops'"):
        WebhookNotifier("oops")
