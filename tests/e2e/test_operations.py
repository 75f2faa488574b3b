"""Operating the pipeline on the live stack (real scheduler, triggerer, Ray head, S3 emulator), all through
Airflow's REST API: a failed stage rerun alone from its checkpoint after the scheduler and triggerer were
restarted; stopping a stage or a whole run stops its Ray jobs; the nightly DAG promotes only a better
policy. Each starts from the session's demo run (tests/conftest.py), whose outputs fill the stage cache its
runs reuse: only the stages under test compute."""

import json
import time
import urllib.request

import pytest

from plugins.stage_cli import key_safe, submission_id_for

pytestmark = pytest.mark.e2e


def trigger(live, dag_id: str, conf: dict) -> str:
    dag = live.rest("GET", f"/api/v2/dags/{dag_id}")
    if dag["is_paused"]:
        live.rest("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
    return live.rest("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]


def task_states(live, dag_id: str, run_id: str) -> dict:
    tis = live.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {t["task_id"]: t["state"] for t in tis}


def wait(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_run(live, dag_id: str, run_id: str, timeout: float = 1800) -> str:
    def ended():
        state = live.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
        return state if state in ("success", "failed") else None

    return wait(f"run {run_id} to end", ended, timeout, every=3)


def ray_jobs(live, prefix: str) -> dict[str, str]:
    """{submission id: status} of the Ray jobs whose id starts with `prefix`."""
    with urllib.request.urlopen(
        urllib.request.Request(f"{live.ray_dashboard}/api/jobs/", headers=live.ray_headers()), timeout=30
    ) as response:
        return {
            j["submission_id"]: j["status"]
            for j in json.load(response)
            if (j.get("submission_id") or "").startswith(prefix)
        }


def running_job(live, dag_id: str, run_id: str, task_id: str, timeout: float = 300) -> str:
    prefix = submission_id_for(dag_id, run_id, task_id)
    return wait(
        f"{task_id}'s Ray job to run",
        lambda: next((s for s, st in ray_jobs(live, prefix).items() if st == "RUNNING"), None),
        timeout,
    )


def s3_json(live, uri: str) -> dict:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return json.loads(live.s3().get_object(Bucket=bucket, Key=key)["Body"].read())


def xcom(live, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
    value = live.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")[
        "value"
    ]
    return json.loads(value) if isinstance(value, str) and value.startswith('"') else value


def test_a_failed_stage_reruns_alone_from_its_checkpoint_across_restarts(demo_run, tmp_path, monkeypatch):
    live, dag_id = demo_run.live, "rlhf_pipeline"
    # The demo's Params (its data, SFT and reward model are cache hits) with a shorter RL stage that fails
    # right after its step-6 checkpoint (it checkpoints every 3 steps) and a smaller evaluation.
    run_id = trigger(
        live, dag_id, {"rl_steps": 12, "eval_max_samples": 50, "fault_injection": {"stage": "rl", "after_step": 6}}
    )

    # Restart the scheduler and the triggerer while RL's job runs: the run carries on with that job.
    running_job(live, dag_id, run_id, "rl")
    from tools.stack.processes import stop_process

    for name in ("airflow-scheduler", "airflow-triggerer"):
        stop_process(live.pids()[name])
    up = live.stack("up")
    assert up.returncode == 0, up.stdout + up.stderr

    # The RL stage fails after its step-6 checkpoint; an operator clears it through the REST API.
    wait("rl to fail", lambda: task_states(live, dag_id, run_id).get("rl") in ("up_for_retry", "failed"), 900, every=2)
    live.rest(
        "POST",
        f"/api/v2/dags/{dag_id}/clearTaskInstances",
        {"dag_run_id": run_id, "task_ids": ["rl"], "only_failed": False, "dry_run": False},
    )
    assert wait_run(live, dag_id, run_id) == "success", task_states(live, dag_id, run_id)

    # The upstream stages ran no job (the demo's outputs); RL ran twice: the failed job, then the rerun.
    for task_id in ("prepare_data", "sft", "reward_model"):
        assert ray_jobs(live, submission_id_for(dag_id, run_id, task_id)) == {}, task_id
        assert xcom(live, dag_id, run_id, task_id) == demo_run.xcom(task_id)
    rl_jobs = ray_jobs(live, submission_id_for(dag_id, run_id, "rl"))
    assert sorted(rl_jobs.values()) == ["FAILED", "SUCCEEDED"], rl_jobs

    rl = s3_json(live, xcom(live, dag_id, run_id, "rl"))
    assert rl["resumed_from_step"] == 6
    # Checked resumes (tasks/common/resume_check.py): every planned update ran, here or before the checkpoint.
    assert (rl["planned_steps"], rl["done_steps"]) == (12, 12)
    assert rl["inputs"]["pretrain"] == xcom(live, dag_id, run_id, "sft")  # the same run's upstream manifests
    # Each attempt's driver log sits beside the manifest; the task links to its Ray job.
    output = f"rlhf-flow/runs/{dag_id}/{key_safe(run_id)}/rl"
    logs = {
        o["Key"].rsplit("/", 1)[1]
        for o in live.s3().list_objects_v2(Bucket=live.bucket, Prefix=f"{output}/logs/")["Contents"]
    }
    assert logs == {f"{sid}.log" for sid in rl_jobs}
    assert xcom(live, dag_id, run_id, "rl", "ray_job_url").startswith(f"{live.ray_dashboard}/#/jobs/")

    # Lineage: each stage's Asset event carries its manifest and metrics, and whether it was a cache hit.
    events = live.rest("GET", "/api/v2/assets/events", source_run_id=run_id, limit=100)["asset_events"]
    by_task = {e["source_task_id"]: e for e in events}
    assert set(by_task) == {"prepare_data", "sft", "reward_model", "rl", "eval"}
    assert (
        by_task["sft"]["extra"]["manifest"] == xcom(live, dag_id, run_id, "sft")
        and by_task["sft"]["extra"]["cache_hit"] is True
    )
    assert by_task["rl"]["extra"]["metrics"]["wall_time_s"] > 0 and by_task["rl"]["extra"]["cache_hit"] is False

    # A committed output damaged in the store: clearing its task (succeeded) computes it again, the damaged
    # output set aside whole, and the new one verifies.
    eval_uri = xcom(live, dag_id, run_id, "eval")
    bucket, key = eval_uri.removeprefix("s3://").rsplit("/", 1)[0].split("/", 1)
    files = s3_json(live, eval_uri)["files"]
    damaged = "report.json"
    body = live.s3().get_object(Bucket=bucket, Key=f"{key}/{damaged}")["Body"].read()
    live.s3().put_object(Bucket=bucket, Key=f"{key}/{damaged}", Body=bytes(b ^ 0xFF for b in body[:32]) + body[32:])
    live.rest(
        "POST",
        f"/api/v2/dags/{dag_id}/clearTaskInstances",
        {"dag_run_id": run_id, "task_ids": ["eval"], "only_failed": False, "dry_run": False},
    )
    assert wait_run(live, dag_id, run_id) == "success", task_states(live, dag_id, run_id)
    jobs = ray_jobs(live, submission_id_for(dag_id, run_id, "eval"))
    assert sorted(jobs.values()) == ["SUCCEEDED", "SUCCEEDED"], jobs  # the clear ran a second job
    from tasks.common import manifest as manifests

    for name, value in live.stage_env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    _, fresh = manifests.fetch(eval_uri, tmp_path / "fresh")  # every byte checked against the new manifest
    assert fresh["files"][damaged]["size"] == files[damaged]["size"]
    aside = {o["Key"] for o in live.s3().list_objects_v2(Bucket=bucket, Prefix=f"{key}/superseded/")["Contents"]}
    assert any(k.endswith(f"/{damaged}") for k in aside) and any(k.endswith("/manifest.json") for k in aside)


@pytest.mark.slow  # make test-all (27 s); make test stops a job on kill in tests/unit/plugins/test_operators.py
@pytest.mark.parametrize("target", ["task", "run"])
def test_marking_failed_stops_the_ray_job(target, demo_run):
    live, dag_id = demo_run.live, "rlhf_pipeline"
    run_id = trigger(live, dag_id, {"sft_steps": 100_000})  # prepare_data: the demo's
    sid = running_job(live, dag_id, run_id, "sft")
    if target == "task":
        live.rest("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/sft", {"new_state": "failed"})
    else:
        live.rest("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", {"state": "failed"})
    assert (
        wait(
            f"{sid} to stop",
            lambda: ray_jobs(live, sid).get(sid) if ray_jobs(live, sid).get(sid) != "RUNNING" else None,
            90,
        )
        == "STOPPED"
    )
    assert wait_run(live, dag_id, run_id, timeout=120) == "failed"


@pytest.mark.slow  # make test-all (115 s): two nightly runs on the live stack
def test_nightly_promotes_the_better_policy_only(demo_run):
    live, dag_id = demo_run.live, "rlhf_nightly"
    name = f"nightly-{int(time.time())}"  # a registry of its own
    # 100 held-out prompts are enough here: the two policies' style rates differ by about 40 points.
    good = trigger(live, dag_id, {"model_name": name, "eval_max_samples": 100})
    assert wait_run(live, dag_id, good) == "success", task_states(live, dag_id, good)
    # The next night trains far less: it beats the SFT model, not the champion.
    worse = trigger(live, dag_id, {"model_name": name, "rl_steps": 2, "eval_max_samples": 100})
    assert wait_run(live, dag_id, worse) == "success", task_states(live, dag_id, worse)

    # The second night reused the unchanged stages (same data, flags and code): no Ray job, the first
    # night's manifests, cache hits in their Asset events.
    events = {
        e["source_task_id"]: e
        for e in live.rest("GET", "/api/v2/assets/events", source_run_id=worse, limit=100)["asset_events"]
    }
    for task_id in ("prepare_data", "sft", "reward_model"):
        assert ray_jobs(live, submission_id_for(dag_id, worse, task_id)) == {}, task_id
        assert xcom(live, dag_id, worse, task_id) == xcom(live, dag_id, good, task_id)
        assert events[task_id]["extra"]["cache_hit"] is True
    assert events["rl"]["extra"]["cache_hit"] is False

    registry = f"s3://{live.bucket}/rlhf-flow/models/{name}"
    champion = s3_json(live, f"{registry}/champion.json")
    assert champion["version"] == 1 and champion["policy"] == xcom(live, dag_id, good, "rl")
    assert champion["promoted_by"] == f"{dag_id} run {good}"
    assert task_states(live, dag_id, good)["champion"] == "success"
    assert task_states(live, dag_id, worse)["champion"] == "skipped"

    judged = {run: s3_json(live, f"{registry}/candidates/{key_safe(run)}.json") for run in (good, worse)}
    assert judged[good]["promoted"] is True and judged[worse]["promoted"] is False
    assert judged[worse]["decision"].startswith("rejected")
    assert judged[worse]["against"]["version"] == 1  # judged against the champion, on the same prompts
    report = s3_json(live, xcom(live, dag_id, worse, "eval").replace("manifest.json", "report.json"))
    assert (
        report["metrics"]["champion"]["sampled_preferred_style_rate"]
        > report["metrics"]["policy"]["sampled_preferred_style_rate"]
    )

    # One champion Asset event, from the good night, carrying the new champion.
    asset = live.rest("GET", "/api/v2/assets", name_pattern="rlhf_flow.champion")["assets"][0]
    events = [
        e
        for e in live.rest("GET", "/api/v2/assets/events", asset_id=asset["id"], limit=100)["asset_events"]
        if e["source_dag_id"] == dag_id and e["source_run_id"] in (good, worse)
    ]
    assert [e["source_run_id"] for e in events] == [good]
    assert events[0]["extra"]["champion"] == f"{registry}/champion.json"
