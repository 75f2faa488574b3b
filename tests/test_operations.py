"""Operating the pipeline on the live stack (real scheduler, triggerer, Ray head, S3 emulator), all through
Airflow's REST API: a failed stage rerun alone from its checkpoint after the scheduler and triggerer were
restarted; stopping a stage or a whole run stops its Ray jobs; the nightly DAG promotes only a better
policy. Runs after test_e2e, whose demo run fills the stage cache the nightly runs reuse."""
import json
import time
import urllib.request

import pytest

from plugins.operators import key_safe, submission_id_for

pytestmark = pytest.mark.e2e

# Small stages: these tests check operations, not learning (the RL stage checkpoints every 3 steps).
SMALL = {"sft_steps": 40, "rm_steps": 20, "rl_steps": 12, "checkpoints_per_stage": 4, "eval_max_samples": 50,
         "use_cache": False}


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
    with urllib.request.urlopen(f"{live.ray_dashboard}/api/jobs/", timeout=30) as response:
        return {j["submission_id"]: j["status"] for j in json.load(response)
                if (j.get("submission_id") or "").startswith(prefix)}


def running_job(live, dag_id: str, run_id: str, task_id: str, timeout: float = 300) -> str:
    prefix = submission_id_for(dag_id, run_id, task_id)
    return wait(f"{task_id}'s Ray job to run", lambda: next((s for s, st in ray_jobs(live, prefix).items() if st == "RUNNING"), None),
                timeout)


def s3_json(live, uri: str) -> dict:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return json.loads(live.s3().get_object(Bucket=bucket, Key=key)["Body"].read())


def xcom(live, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
    value = live.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")["value"]
    return json.loads(value) if isinstance(value, str) and value.startswith('"') else value


def test_a_failed_stage_reruns_alone_from_its_checkpoint_across_restarts(live_stack):
    live, dag_id = live_stack, "rlhf_pipeline"
    run_id = trigger(live, dag_id, {**SMALL, "prefix": "ops-rerun", "fault_injection": {"stage": "rl", "after_step": 6}})

    # Restart the scheduler and the triggerer while SFT's job runs: the run carries on with that job.
    running_job(live, dag_id, run_id, "sft")
    from tools import stack

    for name in ("airflow-scheduler", "airflow-triggerer"):
        stack.stop_process(live.pids()[name])
    up = live.stack("up")
    assert up.returncode == 0, up.stdout + up.stderr

    # The RL stage fails right after its step-6 checkpoint; an operator clears it through the REST API.
    wait("rl to fail", lambda: task_states(live, dag_id, run_id).get("rl") in ("up_for_retry", "failed"), 900, every=2)
    live.rest("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances",
              {"dag_run_id": run_id, "task_ids": ["rl"], "only_failed": False, "dry_run": False})
    assert wait_run(live, dag_id, run_id) == "success", task_states(live, dag_id, run_id)

    # Every upstream stage ran as exactly one Ray job, SFT's through the restarts included; RL twice.
    for task_id in ("prepare_data", "sft", "reward_model"):
        jobs = ray_jobs(live, submission_id_for(dag_id, run_id, task_id))
        assert list(jobs.values()) == ["SUCCEEDED"], (task_id, jobs)
    rl_jobs = ray_jobs(live, submission_id_for(dag_id, run_id, "rl"))
    assert sorted(rl_jobs.values()) == ["FAILED", "SUCCEEDED"], rl_jobs

    rl = s3_json(live, xcom(live, dag_id, run_id, "rl"))
    assert rl["resumed_from_step"] == 6
    assert rl["inputs"]["pretrain"] == xcom(live, dag_id, run_id, "sft")  # the same run's upstream manifests
    # Each attempt's driver log sits beside the manifest; the task links to its Ray job.
    output = f"ops-rerun/runs/{dag_id}/{key_safe(run_id)}/rl"
    logs = {o["Key"].rsplit("/", 1)[1] for o in live.s3().list_objects_v2(Bucket=live.bucket, Prefix=f"{output}/logs/")["Contents"]}
    assert logs == {f"{sid}.log" for sid in rl_jobs}
    assert xcom(live, dag_id, run_id, "rl", "ray_job_url").startswith(f"{live.ray_dashboard}/#/jobs/")

    # Lineage: each stage's Asset event carries its manifest and metrics.
    events = live.rest("GET", "/api/v2/assets/events", source_run_id=run_id, limit=100)["asset_events"]
    by_task = {e["source_task_id"]: e for e in events}
    assert set(by_task) == {"prepare_data", "sft", "reward_model", "rl", "eval"}
    assert by_task["sft"]["extra"]["manifest"] == xcom(live, dag_id, run_id, "sft")
    assert by_task["rl"]["extra"]["metrics"]["wall_time_s"] > 0 and by_task["rl"]["extra"]["cache_hit"] is False


@pytest.mark.parametrize("target", ["task", "run"])
def test_marking_failed_stops_the_ray_job(target, live_stack):
    live, dag_id = live_stack, "rlhf_pipeline"
    run_id = trigger(live, dag_id, {"prefix": f"ops-stop-{target}", "use_cache": False, "sft_steps": 100_000})
    sid = running_job(live, dag_id, run_id, "sft")
    if target == "task":
        live.rest("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/sft", {"new_state": "failed"})
    else:
        live.rest("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", {"state": "failed"})
    assert wait(f"{sid} to stop", lambda: ray_jobs(live, sid).get(sid) if ray_jobs(live, sid).get(sid) != "RUNNING" else None,
                90) == "STOPPED"
    assert wait_run(live, dag_id, run_id, timeout=120) == "failed"


def test_nightly_promotes_the_better_policy_only(live_stack):
    live, dag_id = live_stack, "rlhf_nightly"
    name = f"nightly-{int(time.time())}"  # a registry of its own
    good = trigger(live, dag_id, {"model_name": name})
    assert wait_run(live, dag_id, good) == "success", task_states(live, dag_id, good)
    # The next night trains far less: it beats the SFT model, not the champion.
    worse = trigger(live, dag_id, {"model_name": name, "rl_steps": 2})
    assert wait_run(live, dag_id, worse) == "success", task_states(live, dag_id, worse)

    # The second night reused the unchanged stages (same data, flags and code): no Ray job, the first
    # night's manifests, cache hits in their Asset events.
    events = {e["source_task_id"]: e for e in live.rest("GET", "/api/v2/assets/events", source_run_id=worse, limit=100)["asset_events"]}
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
    assert report["metrics"]["champion"]["preferred_style_rate"] > report["metrics"]["policy"]["preferred_style_rate"]

    # One champion Asset event, from the good night, carrying the new champion.
    asset = live.rest("GET", "/api/v2/assets", name_pattern="rlhf_flow.champion")["assets"][0]
    events = [e for e in live.rest("GET", "/api/v2/assets/events", asset_id=asset["id"], limit=100)["asset_events"]
              if e["source_dag_id"] == dag_id and e["source_run_id"] in (good, worse)]
    assert [e["source_run_id"] for e in events] == [good]
    assert events[0]["extra"]["champion"] == f"{registry}/champion.json"
