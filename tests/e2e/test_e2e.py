"""The product end to end: the stack as `make up` starts it, the demo run as `make demo` triggers it
(REST API, the DAG's default Params), and the result RLHF is for.

With the SFT data half terse, the RL policy must prefer the terse style far more often than the SFT
policy while its held-out answer accuracy holds: the demo's claim (tasks/data/demo.py's verdict, +30 points
of style, accuracy down 3 points at most), which `make demo` prints as its last line and which
tests/e2e/test_demo_claim.py checks on seeds 0, 1 and 2 under `make test-all`.
"""

import json
import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from plugins.stage_cli import submission_id_for
from tasks.data import demo
from tools import readme_table

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
STAGES = ["prepare_data", "sft", "reward_model", "rl", "eval"]


def test_the_demo_run_succeeds_through_the_rest_api(demo_run):
    live, run, stdout = demo_run.live, demo_run.run, demo_run.stdout
    assert run["state"] == "success"
    tasks = live.rest("GET", f"/api/v2/dags/rlhf_pipeline/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
    # The default method is rl: the branch task picks reward_model -> rl; the dpo and kto tasks are skipped.
    # A manual run judges the policy (promote) but may not promote it: the champion task is skipped.
    assert {t["task_id"]: t["state"] for t in tasks} == {
        **{s: "success" for s in STAGES + ["validate", "choose_method", "promote"]},
        "dpo": "skipped",
        "kto": "skipped",
        "champion": "skipped",
    }
    assert "| sampled_preferred_style_rate |" in stdout
    assert "PASS: the policy gained the preferred style with accuracy held" in stdout  # the demo's verdict line


def test_the_readme_shows_the_table_this_code_prints(demo_run):
    """README.md's demo table is what this code prints (tools/readme_table.py wrote it from a real run) on the
    machine and lock that made it."""
    manifest = demo_run.read_json(demo_run.xcom("eval"))
    shown = readme_table.current((REPO / "README.md").read_text())
    made = (readme_table.recorded_machine(shown), readme_table.recorded_lock(shown))
    here = (readme_table.machine(), manifest["versions"]["lock"])
    if made != here:  # another processor may reduce in another order; the verdict's bounds still hold there
        pytest.skip(f"README's table is from {made}; this is {here}")
    difference = readme_table.first_difference(shown, demo_run.report())
    assert difference is None, (
        f"README.md's demo table is not what this code prints: {difference}. If the change is meant, "
        f"`make readme-table RUN='{demo_run.run_id}'` writes this run's table there."
    )


def test_the_demo_is_never_silent_and_shows_each_stages_progress(demo_run):
    """tools/demo.py prints each running stage's newest progress line from its Ray job's log (with the stack's token),
    at least every 25 s; a line every 30 s at most apart, with slack for a loaded 2-core machine."""
    stamps = [float(m.group(1)) for m in re.finditer(r"^\[\s*([\d.]+)s\]", demo_run.stdout, re.M)]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) <= 45, f"{max(gaps):.0f} s without a line"
    for stage in ("sft", "reward_model", "rl"):
        # its progress line, or its logged step (the RL stage logs every step), both with the step count
        assert re.search(rf"^\[.*\] {stage}\s+({stage}: )?step \d+/\d+[ ,]", demo_run.stdout, re.M), stage
    assert "make export RUN=" in demo_run.stdout


def test_each_stage_ran_as_exactly_one_ray_job(demo_run):
    live = demo_run.live
    with urllib.request.urlopen(
        urllib.request.Request(f"{live.ray_dashboard}/api/jobs/", headers=live.ray_headers()), timeout=30
    ) as response:
        jobs = json.load(response)
    for stage in STAGES:  # this run's jobs: other runs may share the stack (a nightly run that came due, say)
        sid = submission_id_for("rlhf_pipeline", demo_run.run_id, stage)
        mine = [j for j in jobs if j.get("submission_id") == sid and j["status"] == "SUCCEEDED"]
        assert len(mine) == 1, (stage, [j.get("submission_id") for j in jobs])


def test_stages_pass_checkpoints_through_their_manifests(demo_run):
    live = demo_run.live
    uris = {stage: demo_run.xcom(stage) for stage in STAGES}
    for stage, uri in uris.items():
        assert (
            uri.startswith(f"s3://{live.bucket}/")
            and "/runs/rlhf_pipeline/" in uri
            and uri.endswith(f"/{stage}/manifest.json")
        )
    manifests = {stage: demo_run.read_json(uri) for stage, uri in uris.items()}
    assert manifests["sft"]["inputs"]["pretrain"] == uris["prepare_data"]
    assert manifests["rl"]["inputs"] == {
        "pretrain": uris["sft"],
        "reward_pretrain": uris["reward_model"],
        "critic_pretrain": uris["reward_model"],
        "prompt_data": uris["prepare_data"],
        "pretrain_data": uris["prepare_data"],
    }  # PPO-ptx's SFT rows
    assert manifests["eval"]["inputs"]["policy"] == uris["rl"]


def test_rl_gains_the_preferred_style_and_keeps_accuracy(demo_run):
    report = demo_run.report()
    data = demo_run.read_json(demo_run.xcom("prepare_data"))
    sft, rl = report["metrics"]["baseline"], report["metrics"]["policy"]
    print(json.dumps(report["metrics"], indent=1))
    assert 0.4 <= data["metrics"]["sft_terse_fraction"] <= 0.6
    assert sft["accuracy"] >= 0.5
    ok, line = demo.verdict(sft, rl)
    assert ok, line
    assert report["num_prompts"] == 500


def test_no_secret_reaches_rays_api_or_logs(demo_run):
    """The stack's S3 secret (its own, made per stack) is in no actor's or job's runtime_env as Ray's
    dashboard serves them (no authentication there) and in no Ray, Airflow or stack log: the workers take
    their credentials from their node."""
    from tools.stack.config import s3_keys

    live = demo_run.live
    secret = s3_keys(live.scratch)[1].encode()
    with urllib.request.urlopen(
        urllib.request.Request(f"{live.ray_dashboard}/api/v0/actors?detail=1&limit=10000", headers=live.ray_headers()),
        timeout=60,
    ) as response:
        actors = response.read()
    # The RL stage's worker actors are listed with their runtime_env (it carries their forwarded settings).
    assert actors.count(b"RLHF_") >= 4 and b"serialized_runtime_env" in actors
    assert secret not in actors
    with urllib.request.urlopen(
        urllib.request.Request(f"{live.ray_dashboard}/api/jobs/", headers=live.ray_headers()), timeout=30
    ) as response:
        assert secret not in response.read()
    logs = [live.cfg.ray_temp_dir, live.cfg.logs, live.cfg.airflow_home / "logs"]
    read = [p for root in logs for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(read) > 20
    assert not [p for p in read if secret in p.read_bytes()]


def test_the_report_views_serve_only_served_buckets_and_existing_runs(demo_run):
    """Another tenant's bucket is not read even when the S3 connection can read it; a report belongs to a
    run Airflow has (its location comes from the run, never from the query); a missing bucket is a 4xx."""
    live = demo_run.live
    s3 = live.s3()
    s3.create_bucket(Bucket="other-tenant")
    s3.put_object(
        Bucket="other-tenant",
        Key=f"rlhf-flow/runs/rlhf_pipeline/{demo_run.run_id}/eval/report.json",
        Body=b'{"secret": "of another tenant"}',
    )

    def get(path: str) -> tuple[int, str]:
        request = urllib.request.Request(
            f"{live.airflow_url}{path}", headers={"Authorization": f"Bearer {live.token()}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    run = urllib.parse.quote(demo_run.run_id, safe="")
    status, body = get(f"/rlhf-flow/dags/rlhf_pipeline/runs/{run}/report.json?bucket=other-tenant")
    assert status == 200 and "of another tenant" not in body and json.loads(body)["metrics"]["policy"]
    for path, want in [
        ("/rlhf-flow/?bucket=other-tenant", (403, "bucket: 'other-tenant' is not served here")),
        ("/rlhf-flow/?prefix=elsewhere", (404, "prefix: no run of DAG 'rlhf_pipeline' writes under")),
        (
            "/rlhf-flow/dags/rlhf_pipeline/runs/manual__never/report.json",
            (404, "run_id: DAG 'rlhf_pipeline' has no run"),
        ),
        ("/rlhf-registry/api?bucket=other-tenant", (403, "bucket: 'other-tenant' is not served here")),
    ]:
        status, body = get(path)
        assert (status, json.loads(body)["detail"][: len(want[1])]) == want, (path, body)
        assert "\n" not in json.loads(body)["detail"]
