"""RayJobOperator / RayJobTrigger / RayJobHook against real components.

A real local Ray head (``ray_head``), moto's S3 server over HTTP (``s3_server``) and real Airflow:
each operator run is a one-task DAG written to a file, parsed into a DagBag, synced to the metadata
DB and run with ``dag.test()``, which executes the task, runs the real trigger loop (asyncio) when it
defers, and resumes it. The stage is a throwaway module in a temporary working_dir shipped to Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from plugins.hooks import RayJobHook, RayUnreachableError
from plugins.operators import RayJobOperator, cleared_by_user
from plugins.stage_cli import (
    build_entrypoint,
    failure_message,
    key_safe,
    output_uri_for,
    render_flags,
    submission_id_for,
    unknown_conf,
)
from plugins.triggers import RayJobTrigger, split_new_lines

from tests.conftest import REPO

STAGE_MODULE = '''\
"""A throwaway pipeline stage: prints, optionally sleeps or fails, writes a file and manifest.json."""
import argparse
import json
import sys
import time

import boto3

p = argparse.ArgumentParser()
p.add_argument("--output", required=True)
p.add_argument("--run_id", required=True)
p.add_argument("--message", default="hi")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--fail", default="false")
p.add_argument("--manifest", default="true")
p.add_argument("--refuse", default="")
a, rest = p.parse_known_args()
if a.refuse:  # what tasks/common/stage.py does with input it cannot use
    print("checking the input", flush=True)
    print(f"error: {a.refuse}", file=sys.stderr, flush=True)
    raise SystemExit(2)
print(f"stage starting run_id={a.run_id} extra={rest}", flush=True)
for i in range(3):
    print(f"driver line {i} message={a.message}", flush=True)
    time.sleep(0.3)
deadline = time.time() + a.sleep
while time.time() < deadline:
    print("still working", flush=True)
    time.sleep(0.5)
if a.fail == "true":
    print("about to fail: the cause is right here", flush=True)
    raise SystemExit("boom: failing on purpose")
bucket, _, key = a.output[len("s3://"):].partition("/")
s3 = boto3.client("s3")
put = s3.put_object(Bucket=bucket, Key=f"{key}/result.txt", Body=a.message.encode())
files = {"result.txt": {"size": len(a.message.encode()), "etag": put["ETag"]}}
if a.manifest == "true":
    s3.put_object(Bucket=bucket, Key=f"{key}/manifest.json",
                  Body=json.dumps({"files": files, "argv": sys.argv[1:]}).encode())
print("final line without newline", end="")
'''

DAG_FILE = """\
from airflow.sdk import DAG, Param
from plugins.operators import RayJobOperator

with DAG({dag_id!r}, schedule=None, default_args={{"retries": 0}},
         params={{"word": Param("bird", type="string"), "bucket": "", "prefix": "optest-default"}}):
    RayJobOperator(
        task_id="job",
        module="stage.job",
        args={args!r},{output_root}
        working_dir={working_dir!r},
        poll_interval=0.5,{extra}
    )
"""

# A run date known in advance (so the run id is too); fresh per session, as the metadata DB outlives sessions.
FIXED_DATE = datetime.now(timezone.utc).replace(microsecond=0)


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory):
    """A working_dir holding the throwaway stage package ``stage``."""
    root = tmp_path_factory.mktemp("stage_wd")
    (root / "stage").mkdir()
    (root / "stage" / "__init__.py").write_text("")
    (root / "stage" / "job.py").write_text(STAGE_MODULE)
    return root


@pytest.fixture
def env(airflow_db, s3_server, ray_head, stage_dir, tmp_path):
    return {"s3": s3_server, "ray": ray_head, "stage_dir": stage_dir, "dags": tmp_path / "dags"}


def make_dag(env, dag_id: str, args: dict, **operator_kwargs):
    """Write a one-task DAG file, parse it, sync it to the DB (what the DAG processor does); return the DAG."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    env["dags"].mkdir(parents=True, exist_ok=True)
    path = env["dags"] / f"{dag_id}.py"
    path.write_text(
        DAG_FILE.format(
            dag_id=dag_id,
            args=args,
            output_root=""
            if operator_kwargs.pop("default_output_root", False)
            else "\n        output_root=%r," % f"s3://{env['s3'].bucket}/optest",
            working_dir=str(env["stage_dir"]),
            extra="".join(f"\n        {k}={v!r}," for k, v in operator_kwargs.items()),
        )
    )
    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(bag, "dags-folder", None)
    return bag.dags[dag_id]


def run_dag(dag, when: datetime | None = None):
    """dag.test() with a known run id when ``when`` is given (run id = manual__<when>)."""
    if when is None:
        return dag.test()
    return dag.test(logical_date=when, run_after=when)


def ti_states(dr) -> dict[str, str]:
    return {ti.task_id: str(getattr(ti.state, "value", ti.state)) for ti in dr.get_task_instances()}


def xcom_return(dr, task_id: str):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=dr.run_id, dag_ids=dr.dag_id, task_ids=task_id, key="return_value")
        ).first()
        return XComModel.deserialize_value(row) if row is not None else None


def jobs_with_prefix(address: str, prefix: str) -> list:
    from ray.job_submission import JobSubmissionClient

    return [j for j in JobSubmissionClient(address).list_jobs() if (j.submission_id or "").startswith(prefix)]


def wait_status(hook: RayJobHook, sid: str, want: set[str], timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = hook.get_job_info(sid)
        status = str(getattr(info.status, "value", info.status)) if info else None
        if status in want:
            return status
        time.sleep(0.5)
    raise AssertionError(f"job {sid} did not reach {want} in {timeout}s (last: {status})")


def s3_json(s3, uri: str):
    bucket, _, key = uri[len("s3://") :].partition("/")
    return json.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def submit_like_operator(env, dag_id: str, when: datetime, args: dict) -> tuple[str, str]:
    """Submit, under the operator's deterministic id, the job an earlier attempt would have submitted."""
    run_id = f"manual__{when.isoformat()}"
    sid = submission_id_for(dag_id, run_id, "job")
    output = output_uri_for(f"s3://{env['s3'].bucket}/optest", dag_id, run_id, "job")
    hook = RayJobHook()
    hook.submit(
        entrypoint=build_entrypoint("stage.job", output, run_id, args),
        submission_id=sid,
        runtime_env={"working_dir": str(env["stage_dir"]), "env_vars": {"PYTHONUNBUFFERED": "1"}},
        entrypoint_num_cpus=1,
    )
    return sid, output


# ----------------------------------------------------------------------------- pure pieces


def test_submission_id_format():
    run_id = "manual__2026-11-30T08:47:45.202861+00:00"
    sid = submission_id_for("rlhf_pipeline", run_id, "sft")
    assert sid == "airflow-rlhf_pipeline--manual__2026-11-30T08_47_45_202861_00_00--sft"
    assert sid == submission_id_for("rlhf_pipeline", run_id, "sft")  # deterministic
    assert submission_id_for("d", run_id, "t", map_index=3).endswith("--t--m3")
    # Too long: keeps its head, gains a hash of the full id; still unique and deterministic.
    long_a = submission_id_for("d" * 150, run_id, "a")
    long_b = submission_id_for("d" * 150, run_id, "b")
    assert len(long_a) <= 120 and long_a != long_b and long_a == submission_id_for("d" * 150, run_id, "a")
    for s in (sid, long_a):
        assert all(c.isalnum() or c in "_-" for c in s)


def test_output_uri_is_key_safe():
    run_id = "manual__2026-11-30T08:47:45.202861+00:00"
    assert key_safe(run_id) == "manual__2026-11-30T08_47_45.202861_00_00"
    assert (
        output_uri_for("s3://b/p/", "rlhf_pipeline", run_id, "sft")
        == "s3://b/p/runs/rlhf_pipeline/manual__2026-11-30T08_47_45.202861_00_00/sft"
    )
    assert output_uri_for("s3://b", "d", "r", "t") == "s3://b/runs/d/r/t"


def test_flag_rendering():
    args = {
        "pretrain": "s3://b/runs/x/sft/manifest.json",
        "max_steps": 30,
        "learning_rate": 1e-3,
        "dropped": None,
        "packing": True,
        "shuffle": False,
        "note": "it's a 'quoted' $HOME; rm -rf /",
        "layers": [1, 2],
    }
    flags = render_flags(args)
    assert flags == [
        "--pretrain",
        "s3://b/runs/x/sft/manifest.json",
        "--max_steps",
        "30",
        "--learning_rate",
        "0.001",
        "--packing",
        "true",
        "--shuffle",
        "false",
        "--note",
        "it's a 'quoted' $HOME; rm -rf /",
        "--layers",
        "[1, 2]",
    ]
    entry = build_entrypoint("tasks.sft", "s3://b/o", "manual__2026-01-01T00:00:00+00:00", args)
    assert entry.startswith("python -m tasks.sft --output s3://b/o --run_id ")
    # The shell sees exactly the argv we meant: nothing is expanded or split.
    assert shlex.split(entry) == [
        "python",
        "-m",
        "tasks.sft",
        "--output",
        "s3://b/o",
        "--run_id",
        "manual__2026-01-01T00:00:00+00:00",
        *flags,
    ]
    with pytest.raises(ValueError, match="flag name"):
        render_flags({"bad key; rm": 1})
    with pytest.raises(ValueError, match="module"):
        build_entrypoint("tasks.sft; rm -rf /", "s3://b/o", "r", {})


def test_runtime_env_carries_no_credentials(tmp_path, monkeypatch):
    """... and carries the operator's allow-lists as the Airflow side has them (tasks/common/allowlist.py)."""
    monkeypatch.setenv("RLHF_ALLOWED_HOSTS", "judge.internal:443")
    monkeypatch.delenv("RLHF_USER_CODE_DIRS")
    op = RayJobOperator(task_id="t", module="tasks.sft", working_dir=str(tmp_path), env_vars={"LOG_LEVEL": "debug"})
    renv = op.runtime_env()
    assert renv["working_dir"] == str(tmp_path)
    assert {".venv", ".scratch", ".git", "__pycache__", "tests", "bench", "docker", "*.whl"} <= set(renv["excludes"])
    assert renv["env_vars"] == {
        "PYTHONUNBUFFERED": "1",
        "RLHF_ALLOWED_HOSTS": "judge.internal:443",
        "LOG_LEVEL": "debug",
    }
    for secret in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "WANDB_API_KEY", "HF_TOKEN", "DB_PASSWORD"):
        with pytest.raises(ValueError, match="credentials"):
            RayJobOperator(task_id="t", module="tasks.sft", env_vars={secret: "x"})
    # By default the project root (holding plugins/ and tasks/) is shipped.
    assert RayJobOperator(task_id="t", module="tasks.sft").runtime_env()["working_dir"] == str(REPO)


def test_plugins_import_no_torch():
    """The Airflow side's processes (worker, triggerer, API server) have no torch: the plugins read only the
    stage library's standard-library part (configs, names, manifests)."""
    code = (
        "import sys; import plugins.hooks, plugins.triggers, plugins.operators, plugins.form, plugins.pipeline; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed', 'peft', 'vllm')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr


def test_stage_library_common_part_needs_no_torch():
    """Every module directly in tasks/common (the part both sides import) loads without torch and its kin, or airflow; the
    torch side lives in tasks/common/nn."""
    import tasks.common

    common = Path(tasks.common.__file__).parent
    modules = sorted(p.stem for p in common.glob("*.py") if p.stem != "__init__")
    assert {"config", "manifest", "names", "storage"} <= set(modules)
    code = (
        "import importlib, sys; [importlib.import_module('tasks.common.' + m) for m in sys.argv[1:]]; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed', 'peft', 'vllm', 'ray', 'airflow')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr


def test_trigger_serializes_and_rebuilds():
    trig = RayJobTrigger(
        address="http://127.0.0.1:8265",
        submission_id="airflow-x--r--t",
        poll_interval=1.5,
        log_offset=7,
        not_before=1.8e9,
    )
    classpath, kwargs = trig.serialize()
    assert classpath == "plugins.triggers.RayJobTrigger"
    from airflow.sdk._shared.module_loading import import_string

    again = import_string(classpath)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    json.dumps(kwargs)  # plain JSON: the triggerer stores it in the DB


def test_log_offsets_keep_partial_lines_back():
    lines, off = split_new_lines("a\nb\npart", 0)
    assert lines == ["a", "b"] and off == 4
    lines, off = split_new_lines("a\nb\npartial\nc", off)
    assert lines == ["partial"] and off == 12
    lines, off = split_new_lines("a\nb\npartial\nc", off, final=True)
    assert lines == ["c"] and off == 13


def test_unreachable_ray_is_one_line_naming_the_address():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"http://127.0.0.1:{port}"
    hook = RayJobHook(address=address, http_timeout=5)
    with pytest.raises(RayUnreachableError) as sync_err:
        hook.get_job_info("whatever")
    with pytest.raises(RayUnreachableError) as async_err:
        asyncio.run(hook.get_status("whatever"))
    for err in (sync_err.value, async_err.value):
        assert address in str(err) and "\n" not in str(err), str(err)


def test_unreachable_s3_is_one_line_naming_the_uri(monkeypatch):
    import socket

    from airflow.sdk.exceptions import AirflowException

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(
        "AIRFLOW_CONN_DEAD_S3",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIDEXAMPLE",
                "password": "s3cr3t-pw",
                "extra": {
                    "endpoint_url": f"http://127.0.0.1:{port}",
                    "region_name": "us-east-1",
                    "config_kwargs": {"retries": {"total_max_attempts": 1}},
                },
            }
        ),
    )
    op = RayJobOperator(task_id="t", module="m", aws_conn_id="dead_s3")
    with pytest.raises(AirflowException) as err:
        op.s3.exists("s3://b/runs/x/sft/manifest.json")
    message = str(err.value)
    assert "\n" not in message and "cannot check s3://b/runs/x/sft/manifest.json" in message, message
    assert "s3cr3t-pw" not in message and "AKIDEXAMPLE" not in message


# ----------------------------------------------------------------------------- real Ray + S3 + Airflow


def test_hook_against_ray(ray_head, s3_server, stage_dir):
    hook = RayJobHook()  # address from AIRFLOW_CONN_RLHF_RAY
    assert hook.address == ray_head
    assert hook.get_job_info("airflow-no-such-job") is None
    assert asyncio.run(hook.get_status("airflow-no-such-job")) is None
    sid = f"airflow-hooktest-{int(time.time() * 1000)}"
    hook.submit(entrypoint="echo hello from the driver", submission_id=sid, entrypoint_num_cpus=0)
    assert wait_status(hook, sid, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    info = asyncio.run(hook.get_status(sid))
    assert info["status"] == "SUCCEEDED" and info["submission_id"] == sid
    assert "hello from the driver" in asyncio.run(hook.get_logs(sid))
    assert "hello from the driver" in hook.get_job_logs(sid)
    with pytest.raises(RuntimeError, match="already exists"):
        hook.submit(entrypoint="echo again", submission_id=sid)


def test_job_succeeds_returns_manifest_and_streams_the_driver_log(env, capfd):
    dag = make_dag(
        env,
        "optest_ok",
        {"message": "hello world", "dropped": None, "verbose": True, "tag": "{{ ti.task_id }}-{{ params.word }}"},
        follow_before_defer=0,  # straight to the triggerer, however short the job
    )
    dr = run_dag(dag)
    out = capfd.readouterr()
    text = out.out + out.err
    assert ti_states(dr) == {"job": "success"}, text[-5000:]

    sid = submission_id_for("optest_ok", dr.run_id, "job")
    assert sid.startswith("airflow-optest_ok--manual__")
    manifest = f"s3://{env['s3'].bucket}/optest/runs/optest_ok/{key_safe(dr.run_id)}/job/manifest.json"
    assert xcom_return(dr, "job") == manifest

    # Flags reached the stage as meant: templated, None dropped, bool as true/false, spaces intact.
    argv = s3_json(env["s3"], manifest)["argv"]
    assert argv[argv.index("--message") + 1] == "hello world"
    assert argv[argv.index("--verbose") + 1] == "true"
    assert argv[argv.index("--tag") + 1] == "job-bird"
    assert argv[argv.index("--run_id") + 1] == dr.run_id
    assert "--dropped" not in argv

    # One Ray job, under the deterministic id, with no credentials in its runtime_env.
    jobs = jobs_with_prefix(env["ray"], sid)
    assert [j.submission_id for j in jobs] == [sid]
    assert "AWS" not in json.dumps(jobs[0].runtime_env or {})
    assert jobs[0].metadata["airflow_task_id"] == "job"

    # The driver's lines were streamed through the trigger's logger, the last (unterminated) one too.
    assert f"Following Ray job {sid}" in text
    for line in (
        "driver line 0 message=hello world",
        "driver line 2 message=hello world",
        "final line without newline",
    ):
        assert f"[ray {sid}] {line}" in text, line
    assert "Submitting Ray job" in text and f"/#/jobs/{sid}" in text
    # The driver log is also kept beside the manifest.
    log = (
        env["s3"]
        .client()
        .get_object(Bucket=env["s3"].bucket, Key=manifest.split("/", 3)[3].replace("manifest.json", f"logs/{sid}.log"))
    )
    assert "driver line 2 message=hello world" in log["Body"].read().decode()


def test_failing_module_fails_the_task_with_the_log_tail(env, capfd):
    dag = make_dag(env, "optest_fail", {"fail": True})
    dr = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "failed"}
    sid = submission_id_for("optest_fail", dr.run_id, "job")
    # A job that ends within follow_before_defer is followed by the worker: no trigger, the same outcome.
    assert "Following Ray job" not in text
    assert f"Ray job {sid} FAILED" in text
    assert "--- last lines of the driver log ---" in text
    assert "about to fail: the cause is right here" in text
    assert "boom: failing on purpose" in text
    assert xcom_return(dr, "job") is None


def test_failure_message_is_one_line_cause_plus_tail():
    msg = failure_message(
        {
            "status": "STOPPED",
            "submission_id": "sid-1",
            "message": "Job was\nintentionally stopped.",
            "log_tail": "line a\nline b",
        }
    )
    first, *rest = msg.splitlines()
    assert first == "Ray job sid-1 STOPPED: Job was intentionally stopped."
    assert rest == ["--- last lines of the driver log ---", "line a", "line b"]
    # A stage that said why it stopped: its line first.
    msg = failure_message(
        {
            "status": "FAILED",
            "submission_id": "sid-2",
            "message": "Job entrypoint command failed",
            "exit_code": 2,
            "log_tail": "sft: config {}\nerror: no dataset at s3://b/d: check the URI",
        }
    )
    assert msg.splitlines()[0] == "no dataset at s3://b/d: check the URI (Ray job sid-2 FAILED, exit code 2)"


def test_succeeded_without_manifest_fails(env, capfd):
    dag = make_dag(env, "optest_nomanifest", {"manifest": False})
    dr = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "failed"}
    assert "succeeded but wrote no manifest at s3://" in text


def test_an_attempt_that_finds_its_job_succeeded_returns_without_a_second_job(env, capfd):
    # An earlier attempt's job succeeded and wrote its manifest, and that attempt's worker died before it
    # could say so: this attempt takes the result.
    dag = make_dag(env, "optest_rerun", {"message": "once"})
    sid, output = submit_like_operator(env, "optest_rerun", FIXED_DATE, {"message": "once"})
    assert wait_status(RayJobHook(), sid, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED"
    dr = run_dag(dag, FIXED_DATE)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "success"}
    assert "already SUCCEEDED and its manifest exists: not rerunning" in text
    assert xcom_return(dr, "job") == f"{output}/manifest.json"
    assert len(jobs_with_prefix(env["ray"], sid)) == 1
    # A user's clear computes it again: tests/e2e/test_operations.py clears a succeeded task through the REST API.


def test_a_committed_output_whose_files_changed_is_computed_again(env, capfd):
    dag = make_dag(env, "optest_corrupt", {"message": "whole"})
    sid, output = submit_like_operator(env, "optest_corrupt", FIXED_DATE, {"message": "whole"})
    assert wait_status(RayJobHook(), sid, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED"
    bucket, _, key = output[len("s3://") :].partition("/")
    env["s3"].client().put_object(Bucket=bucket, Key=f"{key}/result.txt", Body=b"WHOLE")  # same size, other bytes
    dr = run_dag(dag, FIXED_DATE)  # a retry: it would take the succeeded job's result, were it whole
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "success"}, text[-3000:]
    assert "changed since it was written (result.txt changed since it was committed" in text
    assert len(jobs_with_prefix(env["ray"], sid)) == 2
    assert env["s3"].client().get_object(Bucket=bucket, Key=f"{key}/result.txt")["Body"].read() == b"whole"


def test_refused_input_fails_at_once_with_the_stages_own_cause(env, capfd):
    dag = make_dag(env, "optest_refuse", {"refuse": "sft_steps: -3 must be at least 1"}, retries=3, retry_delay=0)
    dr = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "failed"}, text[-3000:]  # exit status 2: not retried
    sid = submission_id_for("optest_refuse", dr.run_id, "job")
    assert f"sft_steps: -3 must be at least 1 (Ray job {sid} FAILED, exit code 2)" in text
    assert len(jobs_with_prefix(env["ray"], sid)) == 1


def test_unknown_conf_keys_are_refused_before_any_job(env, capfd):
    dag = make_dag(env, "optest_conf", {"message": "{{ params.word }}"})
    dr = dag.test(run_conf={"wrod": "cat"})
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "failed"}
    assert "conf key 'wrod' (did you mean 'word'?) is not Params of this DAG" in text
    assert jobs_with_prefix(env["ray"], submission_id_for("optest_conf", dr.run_id, "job")) == []


def test_conf_and_clear_rules():
    assert unknown_conf({"sft_steps": 3}, ["sft_steps", "rm_steps"]) is None
    assert unknown_conf({"sft_step": 3, "zzz": 1}, ["sft_steps", "rm_steps"]) == (
        "conf keys 'sft_step' (did you mean 'sft_steps'?), 'zzz' are not Params of this DAG: fix the name and "
        "trigger again (the trigger form lists every Param)"
    )
    # retries=1: try 1 starts the run's budget; try 2 is its retry; a clear after try 2 makes max_tries 3.
    assert not cleared_by_user(1, 1, 1) and not cleared_by_user(2, 1, 1)
    assert cleared_by_user(3, 3, 1) and not cleared_by_user(4, 3, 1)
    assert cleared_by_user(2, 1, 0)  # retries=0: any later try follows a clear


def test_cache_checks_sizes_and_etags():
    from plugins import stage_cache

    files = {"a": {"size": 3, "sha256": "x", "etag": '"e1"'}, "b": {"size": 5, "sha256": "y"}}
    assert stage_cache.mismatches(files, {"a": (3, '"e1"'), "b": (5, '"anything"')}) == []
    assert stage_cache.mismatches(files, {"a": (3, '"e2"'), "b": (4, '"z"')}) == [
        'a changed since it was committed (ETag "e2", the manifest says "e1")',
        "b has 4 bytes, the manifest says 5",
    ]
    assert stage_cache.mismatches(files, {}) == ["a is missing", "b is missing"]


def test_reattaches_to_a_live_job_instead_of_submitting(env, capfd):
    # An earlier attempt submitted the job and its worker died: the job is still running in Ray.
    dag = make_dag(env, "optest_live", {"message": "slow", "sleep": 6})
    sid, output = submit_like_operator(env, "optest_live", FIXED_DATE, {"message": "slow", "sleep": 6})
    wait_status(RayJobHook(), sid, {"PENDING", "RUNNING"})
    dr = run_dag(dag, FIXED_DATE)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "success"}, text[-5000:]
    assert f"Ray job {sid} is still running: reattaching" in text
    assert "Submitting Ray job" not in text
    assert [j.submission_id for j in jobs_with_prefix(env["ray"], sid)] == [sid]
    assert xcom_return(dr, "job") == f"{output}/manifest.json"
    assert f"[ray {sid}] still working" in text


def test_ended_earlier_job_gets_an_attempt_suffix(env, capfd):
    # An earlier attempt's job failed; the next execute must not reuse (or reattach to) it.
    dag = make_dag(env, "optest_suffix", {"message": "second time lucky"})
    sid, _ = submit_like_operator(env, "optest_suffix", FIXED_DATE, {"fail": True})
    assert wait_status(RayJobHook(), sid, {"SUCCEEDED", "FAILED", "STOPPED"}) == "FAILED"
    dr = run_dag(dag, FIXED_DATE)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "success"}, text[-5000:]
    try_number = {ti.task_id: ti.try_number for ti in dr.get_task_instances()}["job"]
    jobs = {j.submission_id: str(j.status.value) for j in jobs_with_prefix(env["ray"], sid)}
    assert jobs == {sid: "FAILED", f"{sid}-try{try_number}": "SUCCEEDED"}
    assert f"Earlier job {sid} ended FAILED" in text


def test_on_kill_stops_the_job(env):
    hook = RayJobHook()
    sid = f"airflow-killtest-{int(time.time() * 1000)}"
    hook.submit(entrypoint="sleep 60", submission_id=sid, entrypoint_num_cpus=0)
    wait_status(hook, sid, {"RUNNING"})
    op = RayJobOperator(task_id="t", module="stage.job")
    op.submission_id = sid
    op.on_kill()
    assert wait_status(hook, sid, {"STOPPED", "FAILED", "SUCCEEDED"}, timeout=60) == "STOPPED"

    # The deferred side: a user killing a deferred task reaches the trigger's on_kill.
    sid2 = f"{sid}-b"
    hook.submit(entrypoint="sleep 60", submission_id=sid2, entrypoint_num_cpus=0)
    wait_status(hook, sid2, {"RUNNING"})
    asyncio.run(RayJobTrigger(address=hook.address, submission_id=sid2).on_kill())
    assert wait_status(hook, sid2, {"STOPPED", "FAILED", "SUCCEEDED"}, timeout=60) == "STOPPED"


def test_trigger_reports_an_unknown_job(ray_head):
    async def first_event():
        return await anext(
            RayJobTrigger(address=ray_head, submission_id="airflow-never-submitted", poll_interval=0.2).run()
        )

    event = asyncio.run(first_event())
    assert event.payload["status"] == "MISSING"
    assert event.payload["submission_id"] == "airflow-never-submitted"


def test_trigger_holds_its_event_until_not_before(ray_head):
    # The scheduler must see the deferral before the event (apache/airflow#66374): the operator sets not_before.
    async def first_event():
        trigger = RayJobTrigger(
            address=ray_head, submission_id="airflow-never-submitted", poll_interval=0.2, not_before=time.time() + 2.0
        )
        return await anext(trigger.run())

    t0 = time.time()
    assert asyncio.run(first_event()).payload["status"] == "MISSING"
    assert time.time() - t0 >= 1.9


def test_deadline_stops_the_job_and_fails_the_task_saying_so(env, capfd):
    dag = make_dag(env, "optest_deadline", {"sleep": 120}, deadline_minutes="{{ 0.1 }}")
    t0 = time.monotonic()
    dr = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(dr) == {"job": "failed"}, text[-3000:]
    assert time.monotonic() - t0 < 90
    sid = submission_id_for("optest_deadline", dr.run_id, "job")
    assert "ran past the stage deadline of 0.1 minutes and was stopped" in text
    assert str(RayJobHook().get_job_info(sid).status.value) == "STOPPED"


def test_cache_hit_reuses_the_earlier_output_without_a_job(env, capfd):
    args = {"message": f"cached-{time.time()}"}
    dag = make_dag(env, "optest_cache", args, cache=True)
    first = run_dag(dag)
    assert ti_states(first) == {"job": "success"}
    capfd.readouterr()
    second = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(second) == {"job": "success"}
    assert "Cache hit: key" in text
    assert xcom_return(second, "job") == xcom_return(first, "job")  # the earlier run's manifest
    assert jobs_with_prefix(env["ray"], submission_id_for("optest_cache", second.run_id, "job")) == []

    # The cached output's file changed since it was committed: not reused, computed again.
    bucket, _, key = xcom_return(first, "job")[len("s3://") :].rpartition("/")[0].partition("/")
    env["s3"].client().put_object(Bucket=bucket, Key=f"{key}/result.txt", Body=b"tampered")
    fourth = run_dag(dag)
    text = "".join(capfd.readouterr())
    assert ti_states(fourth) == {"job": "success"}
    assert "whose files changed since they were committed (result.txt has 8 bytes" in text and "Cache miss" in text
    assert len(jobs_with_prefix(env["ray"], submission_id_for("optest_cache", fourth.run_id, "job"))) == 1
    fifth = run_dag(dag)  # the recomputed output is indexed: a hit again
    assert "Cache hit: key" in "".join(capfd.readouterr())
    assert xcom_return(fifth, "job") == xcom_return(fourth, "job")

    # Another flag value is other work: a miss, and a job.
    dag = make_dag(env, "optest_cache", {**args, "message": "other"}, cache=True)
    third = run_dag(dag)
    assert ti_states(third) == {"job": "success"}
    assert "Cache miss: key" in "".join(capfd.readouterr())
    assert len(jobs_with_prefix(env["ray"], submission_id_for("optest_cache", third.run_id, "job"))) == 1


def test_cache_key_covers_flags_inputs_and_code(tmp_path):
    from plugins import stage_cache
    from tasks.common import provenance

    base = stage_cache.cache_key("tasks.sft", {"max_steps": "10", "output": "s3://a/x"}, {"pretrain": "d1"}, "c1")
    assert base == stage_cache.cache_key(
        "tasks.sft", {"max_steps": "10", "output": "s3://b/y"}, {"pretrain": "d1"}, "c1"
    )
    for other in (
        stage_cache.cache_key("tasks.sft", {"max_steps": "11"}, {"pretrain": "d1"}, "c1"),
        stage_cache.cache_key("tasks.sft", {"max_steps": "10"}, {"pretrain": "d2"}, "c1"),
        stage_cache.cache_key("tasks.sft", {"max_steps": "10"}, {"pretrain": "d1"}, "c2"),
        stage_cache.cache_key("tasks.rl", {"max_steps": "10"}, {"pretrain": "d1"}, "c1"),
    ):
        assert other != base
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "a.py").write_text("x = 1\n")
    first = stage_cache.code_digest(str(tmp_path))
    provenance.code_digest.cache_clear()  # computed once per process and folder
    (tmp_path / "tasks" / "a.py").write_text("x = 2\n")
    assert stage_cache.code_digest(str(tmp_path)) != first


def test_default_output_root_takes_the_bucket_from_the_s3_connection(env, capfd):
    # The bucket Param left empty: the rlhf_s3 connection's extra names the bucket (conftest sets it).
    dag = make_dag(env, "optest_connbucket", {"message": "where"}, default_output_root=True)
    dr = run_dag(dag)
    assert ti_states(dr) == {"job": "success"}, "".join(capfd.readouterr())[-3000:]
    assert (
        xcom_return(dr, "job")
        == f"s3://{env['s3'].bucket}/optest-default/runs/optest_connbucket/{key_safe(dr.run_id)}/job/manifest.json"
    )
