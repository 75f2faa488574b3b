#!/usr/bin/env python3
"""The demo `make demo` runs after `make up`: one run of the rlhf_pipeline DAG, followed to the end.

Triggers the DAG through Airflow's REST API with an empty conf (the DAG's Param defaults are the demo's
parameters), prints each task's state as it changes, then either the failed task's log tail (exit 1) or
the evaluation report fetched from S3, where the artifacts are, and how to open the UI.

    python tools/demo.py [--dag-id rlhf_pipeline] [--conf '{"key": "value"}'] [--timeout 3600]

It talks to the stack in $RLHF_SCRATCH (default <repo>/.scratch), the one `make up` started.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.stage_cli import submission_id_for  # noqa: E402
from tasks.data import demo  # noqa: E402
from tools.stack.api import AirflowAPI, APIError, q  # noqa: E402
from tools.stack.config import Config, StackError, airflow_login, ray_auth_headers, ray_token_file  # noqa: E402
from tools.stack.health import healthy_airflow  # noqa: E402
from tools.stack.processes import current_config, reserialize  # noqa: E402
from tools.stack.s3 import s3_client  # noqa: E402

FINAL_RUN_STATES = {"success", "failed"}


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)


def wait_for_dag(api: AirflowAPI, cfg: Config, dag_id: str, t0: float, timeout: float = 180) -> dict:
    """The DAG's record; if the API does not know it yet, reserialize the DAG folder and wait for it."""
    deadline = time.monotonic() + timeout
    reserialized = False
    while True:
        try:
            return api.get(f"/api/v2/dags/{q(dag_id)}")
        except APIError as e:
            if e.status != 404:
                raise
        if not reserialized:
            log(t0, f"DAG {dag_id} not visible yet: reserializing {cfg.dags_folder}")
            try:
                reserialize(cfg)
            except StackError as e:
                log(t0, f"reserialize failed: {e}")
            reserialized = True
            continue
        if time.monotonic() > deadline:
            errors = api.get("/api/v2/importErrors", limit=20).get("import_errors", [])
            msg = f"DAG {dag_id} did not appear within {timeout:.0f}s (DAG folder {cfg.dags_folder})"
            for err in errors:
                msg += f"\n  import error in {err.get('filename')}:\n    " + str(err.get("stack_trace", "")).strip()[
                    -2000:
                ].replace("\n", "\n    ")
            raise SystemExit(msg)
        time.sleep(2)


#: A stage's progress in its driver log: `sft: step 12/100, …` (tasks/common/tracking.py) or a logged `step 12/100 …`.
PROGRESS = re.compile(r"^(\w+: step \d+/\d+.*|step \d+(/\d+)? .*)$")
PROGRESS_POLL_S, HEARTBEAT_S = 10.0, 25.0


class StageProgress:
    """The newest progress line of each running stage, read from its Ray job's driver log (with the stack's token),
    printed when it changes, and at least every HEARTBEAT_S while the stage runs, so the demo is never silent."""

    def __init__(self, cfg: Config, dag_id: str, run_id: str, t0: float):
        self.cfg, self.dag_id, self.run_id, self.t0 = cfg, dag_id, run_id, t0
        self.polled, self.printed, self.last = 0.0, time.monotonic(), {}

    def _get(self, path: str):
        req = urllib.request.Request(
            f"{self.cfg.dashboard_url}{path}",
            headers={"Accept": "application/json", **ray_auth_headers(self.cfg.scratch)},
        )
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.load(response)

    def latest(self, task_id: str, listed: list[dict]) -> str | None:
        """The newest line worth showing of the task's Ray job, among the jobs `listed` (GET /api/jobs/)."""
        prefix = submission_id_for(self.dag_id, self.run_id, task_id)
        jobs = [j for j in listed if (j.get("submission_id") or "").startswith(prefix)]
        if not jobs:
            return None
        job = max(jobs, key=lambda j: j.get("start_time") or 0)  # a retry's attempt is the newest
        logs = self._get(f"/api/jobs/{urllib.parse.quote(job['submission_id'])}/logs").get("logs", "")
        lines = [line.strip() for line in logs.splitlines() if line.strip()]
        # Its newest progress line, else (a stage that reports none: data, eval) its newest line of any kind.
        found = next((line for line in reversed(lines) if PROGRESS.match(line)), None)
        return found or (lines[-1][:160] if lines else None)

    def show(self, tis: list[dict]) -> None:
        now = time.monotonic()
        if now - self.polled < PROGRESS_POLL_S:
            return
        self.polled = now
        running = [ti for ti in tis if ti.get("state") in ("running", "deferred")]
        listed: list[dict] | None = None
        for ti in running:
            try:
                listed = self._get("/api/jobs/") if listed is None else listed  # once a poll, for every running task
                line = self.latest(ti["task_id"], listed)
            except (OSError, ValueError) as e:  # the dashboard busy or restarting: the next poll tries again
                line = f"(progress not readable: {e})"
            label = task_label(ti)
            if line and (line != self.last.get(label) or now - self.printed >= HEARTBEAT_S):
                log(self.t0, f"{label:<24} {line}")
                self.last[label], self.printed = line, now
        if now - self.printed >= HEARTBEAT_S:  # nothing running yet (queued, scheduled) or no log line so far
            active = [
                f"{task_label(ti)} {ti.get('state')}"
                for ti in tis
                if ti.get("state") not in (None, "success", "skipped", "failed", "upstream_failed")
            ]
            log(self.t0, "waiting: " + (", ".join(active) or "for the scheduler"))
            self.printed = now


def task_label(ti: dict) -> str:
    index = ti.get("map_index", -1)
    return ti["task_id"] if index is None or index < 0 else f"{ti['task_id']}[{index}]"


def task_instances(api: AirflowAPI, dag_id: str, run_id: str) -> list[dict]:
    out: list[dict] = []
    while True:
        page = api.get(f"/api/v2/dags/{q(dag_id)}/dagRuns/{q(run_id)}/taskInstances", limit=100, offset=len(out))
        out += page.get("task_instances", [])
        if not page.get("task_instances") or len(out) >= page.get("total_entries", 0):
            return out


# Context Airflow attaches to every structured log entry: the same on every line of one task's log.
LOG_CONTEXT = {
    "ti_id",
    "map_index",
    "run_id",
    "task_id",
    "dag_id",
    "try_number",
    "logger",
    "filename",
    "lineno",
    "bundle_name",
    "bundle_version",
    "event",
    "timestamp",
    "level",
    "error_detail",
}


def format_log(content: Any) -> list[str]:
    """Lines of a task log as the REST API returns it (structured entries or plain strings)."""
    lines: list[str] = []
    items = content if isinstance(content, list) else [content]
    for item in items:
        if isinstance(item, str):
            lines += item.splitlines()
            continue
        if not isinstance(item, dict):
            continue
        event = str(item.get("event", ""))
        if event.startswith(("::group::", "::endgroup::")):
            continue
        if "timestamp" not in item and "level" not in item:  # the header naming the log file
            lines.append(f"(log file: {event})" if event.startswith("/") else event)
            continue
        stamp = str(item.get("timestamp", ""))[11:19]
        extra = {k: v for k, v in item.items() if k not in LOG_CONTEXT}
        text = f"{stamp} {item.get('level', ''):<7} {event}".rstrip()
        if extra:
            text += "  " + " ".join(f"{k}={v}" for k, v in extra.items())
        lines += text.splitlines()
        for detail in item.get("error_detail") or []:
            if isinstance(detail, dict):
                lines.append(f"    {detail.get('exc_type')}: {detail.get('exc_value')}")
                for frame in (detail.get("frames") or [])[-6:]:
                    lines.append(f"      {frame.get('filename')}:{frame.get('lineno')} in {frame.get('name')}")
    return lines


def log_tail(api: AirflowAPI, dag_id: str, run_id: str, ti: dict, lines: int = 60) -> str:
    path = f"/api/v2/dags/{q(dag_id)}/dagRuns/{q(run_id)}/taskInstances/{q(ti['task_id'])}/logs/{ti['try_number']}"
    try:
        body = api.get(path, full_content="true", map_index=ti.get("map_index", -1))
    except APIError as e:
        return f"(log not available: {e})"
    rows = format_log(body.get("content", body) if isinstance(body, dict) else body)
    return "\n".join(rows[-lines:])


def xcom_value(api: AirflowAPI, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Any:
    path = f"/api/v2/dags/{q(dag_id)}/dagRuns/{q(run_id)}/taskInstances/{q(task_id)}/xcomEntries/return_value"
    try:
        value = api.get(path, map_index=map_index)["value"]
    except APIError as e:
        if e.status == 404:
            return None
        raise
    if isinstance(value, str):  # stored JSON-encoded
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value


def split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dag-id", default="rlhf_pipeline")
    parser.add_argument("--conf", default="{}", help="JSON conf for the run; {} keeps the DAG's Param defaults")
    parser.add_argument("--eval-task", default="eval", help="the task whose XCom is the eval manifest URI")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the run")
    parser.add_argument("--poll", type=float, default=2.0)
    args = parser.parse_args(argv)
    conf = json.loads(args.conf)

    cfg = current_config()
    ok, detail = healthy_airflow(cfg)
    if not ok:
        print(f"demo: Airflow at {cfg.airflow_url} is not healthy ({detail}): run `make up` first", file=sys.stderr)
        return 2
    api = AirflowAPI.for_stack(cfg)
    t0 = time.monotonic()
    dag_id = args.dag_id

    dag = wait_for_dag(api, cfg, dag_id, t0)
    if dag.get("is_paused"):
        api.patch(f"/api/v2/dags/{q(dag_id)}", {"is_paused": False})
        log(t0, f"unpaused {dag_id}")
    run = api.post(f"/api/v2/dags/{q(dag_id)}/dagRuns", {"logical_date": None, "conf": conf})
    run_id = run["dag_run_id"]
    ui = f"{cfg.airflow_url}/dags/{q(dag_id)}/runs/{q(run_id)}"
    log(t0, f"triggered {dag_id} run {run_id}")
    log(t0, f"follow it in the UI: {ui}")

    seen: dict[str, str] = {}
    progress = StageProgress(cfg, dag_id, run_id, t0)
    deadline = time.monotonic() + args.timeout
    state = run.get("state")
    while True:
        tis = task_instances(api, dag_id, run_id)
        for ti in sorted(tis, key=lambda t: (t.get("start_date") or "~", t["task_id"])):
            label, now = task_label(ti), ti.get("state") or "none"
            if seen.get(label, "none") != now:
                log(t0, f"{label:<24} {seen.get(label, '-'):>10} -> {now}")
                seen[label] = now
                progress.printed = time.monotonic()
        progress.show(tis)
        if state in FINAL_RUN_STATES:
            break
        if time.monotonic() > deadline:
            print(f"demo: run {run_id} still {state} after {args.timeout:.0f}s; see {ui}", file=sys.stderr)
            return 1
        time.sleep(args.poll)
        state = api.get(f"/api/v2/dags/{q(dag_id)}/dagRuns/{q(run_id)}")["state"]
    wall = time.monotonic() - t0
    user, password = airflow_login(cfg.scratch)

    if state != "success":
        failed = [ti for ti in tis if ti.get("state") == "failed"]
        print(f"\nrun {run_id} FAILED after {wall:.0f}s", flush=True)
        for ti in failed:
            print(f"\n--- failed task: {task_label(ti)} (try {ti['try_number']}); last lines of its log:")
            print(log_tail(api, dag_id, run_id, ti))
        if not failed:
            print("no task failed; task states: " + ", ".join(f"{k}={v}" for k, v in seen.items()))
        print(f"\nUI: {ui}  (login {user} / {password})")
        return 1

    manifest_uri = xcom_value(api, dag_id, run_id, args.eval_task)
    print(f"\nrun {run_id} succeeded in {wall:.0f}s\n", flush=True)
    if not isinstance(manifest_uri, str) or not manifest_uri.startswith("s3://"):
        print(f"demo: task {args.eval_task!r} returned {manifest_uri!r}, not an s3:// manifest URI", file=sys.stderr)
        return 1
    bucket, key = split_s3(manifest_uri)
    stage_dir = key.rsplit("/", 1)[0]
    s3 = s3_client(cfg)
    code = 0
    try:
        report = s3.get_object(Bucket=bucket, Key=f"{stage_dir}/report.md")["Body"].read().decode()
    except Exception as e:  # noqa: BLE001 - say what is missing, print the locations, exit 1
        report = f"(no report at s3://{bucket}/{stage_dir}/report.md: {e})"
        code = 1
    print("=" * 100)
    print(report.rstrip())
    print("=" * 100)
    if conf.get("dataset", "demo") == "demo" and dag_id == "rlhf_pipeline":
        try:
            metrics = json.loads(s3.get_object(Bucket=bucket, Key=f"{stage_dir}/report.json")["Body"].read())["metrics"]
            _, line = demo.verdict(metrics["baseline"], metrics["policy"])
        except Exception as e:  # noqa: BLE001 - the table above is still the result; say why there is no verdict
            line = f"no verdict: report.json unreadable ({e})"
        print(line)  # the run itself succeeded: the exit status stays 0 either way

    run_prefix = stage_dir.rsplit("/", 1)[0]
    print(f"\nArtifacts of this run: s3://{bucket}/{run_prefix}/   (S3 endpoint {cfg.s3_endpoint})")
    task_ids = sorted({ti["task_id"] for ti in tis}, key=lambda t: min(
        (ti.get("start_date") or "~") for ti in tis if ti["task_id"] == t))  # fmt: skip
    for task_id in task_ids:
        value = xcom_value(api, dag_id, run_id, task_id)
        if value is not None:
            print(f"  {task_id:<20} {value if isinstance(value, str) else json.dumps(value)}")
    print(f"\nTotal wall time: {wall:.0f}s")
    print(f"Airflow UI: {cfg.airflow_url}  (login {user} / {password})  this run: {ui}")
    print(f"Ray dashboard: {cfg.dashboard_url}  (it asks for the token in {ray_token_file(cfg.scratch)})")
    root = f"s3://{bucket}/{run_prefix.split('/runs/', 1)[0]}"
    print(
        f"The trained policy as a plain HF folder: make export RUN='{run_id}' ROOT={root} OUT=./policy  (tools/export.py)"
    )
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("demo: interrupted (the run goes on in Airflow)", file=sys.stderr)
        sys.exit(130)
    except (APIError, OSError) as e:  # the API refused something, or the stack went away
        print(f"demo: {e}", file=sys.stderr)
        sys.exit(1)
