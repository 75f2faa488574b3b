"""The product end to end: the stack as `make up` starts it, the demo run as `make demo` triggers it
(REST API, the DAG's default Params), and the result RLHF is for.

With the SFT data half terse, the RL policy must prefer the terse style far more often than the SFT
policy while its held-out answer accuracy holds: the demo's claim (tasks/data/demo.py's verdict, +30 points
of style, accuracy down 3 points at most), which `make demo` prints as its last line and which
tests/test_demo_claim.py checks on seeds 0, 1 and 2 under `make test-all`.
"""
import json
import urllib.request

import pytest

from tasks.data import demo

pytestmark = pytest.mark.e2e
STAGES = ["prepare_data", "sft", "reward_model", "rl", "eval"]


def test_the_demo_run_succeeds_through_the_rest_api(demo_run):
    live, run, stdout = demo_run.live, demo_run.run, demo_run.stdout
    assert run["state"] == "success"
    tasks = live.rest("GET", f"/api/v2/dags/rlhf_pipeline/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
    # The default method is rl: the branch task picks reward_model -> rl; the dpo and kto tasks are skipped.
    # A manual run judges the policy (promote) but may not promote it: the champion task is skipped.
    assert {t["task_id"]: t["state"] for t in tasks} == {**{s: "success" for s in STAGES + ["choose_method", "promote"]},
                                                         "dpo": "skipped", "kto": "skipped", "champion": "skipped"}
    assert "| preferred_style_rate |" in stdout
    assert "PASS: the policy gained the preferred style with accuracy held" in stdout  # the demo's verdict line


def test_each_stage_ran_as_exactly_one_ray_job(demo_run):
    live = demo_run.live
    with urllib.request.urlopen(f"{live.ray_dashboard}/api/jobs/", timeout=30) as response:
        jobs = json.load(response)
    for stage in STAGES:
        mine = [j for j in jobs if (j.get("submission_id") or "").endswith(f"--{stage}") and j["status"] == "SUCCEEDED"]
        assert len(mine) == 1, (stage, [j.get("submission_id") for j in jobs])


def test_stages_pass_checkpoints_through_their_manifests(demo_run):
    live = demo_run.live
    uris = {stage: demo_run.xcom(stage) for stage in STAGES}
    for stage, uri in uris.items():
        assert uri.startswith(f"s3://{live.bucket}/") and "/runs/rlhf_pipeline/" in uri and uri.endswith(f"/{stage}/manifest.json")
    manifests = {stage: demo_run.read_json(uri) for stage, uri in uris.items()}
    assert manifests["sft"]["inputs"]["pretrain"] == uris["prepare_data"]
    assert manifests["rl"]["inputs"] == {"pretrain": uris["sft"], "reward_pretrain": uris["reward_model"],
                                         "critic_pretrain": uris["reward_model"], "prompt_data": uris["prepare_data"],
                                         "pretrain_data": uris["prepare_data"]}  # PPO-ptx's SFT rows
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
