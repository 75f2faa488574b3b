"""The registry's manual moves (promote a judged candidate, roll back to any earlier champion), each a
compare-and-swap refusing a stale view, the history they leave, the listing with each candidate's cost, and
the CLI (python -m tasks.registry) — on the S3 emulator, stage outputs committed like a stage commits them."""

import json
import os
import subprocess
import sys
import time

import pytest

from tasks.common import cost
from tasks.common import manifest as manifests
from tasks.common.config import ConfigError
from tasks.common.registry import Registry, StaleChampion
from tasks.registry.__main__ import run as cli


def commit_stage(uri: str, stage: str, inputs: dict, metrics: dict, tmp_path) -> str:
    local = tmp_path / f"{stage}-{abs(hash(uri))}"
    local.mkdir()
    (local / "data.txt").write_text(uri)
    manifests.commit(local, uri, manifests.build_manifest(stage, "r", {}, inputs, metrics))
    return f"{uri}/manifest.json"


def candidate(reg: Registry, root: str, run: str, passed: bool, tmp_path, gpus: int = 1) -> dict:
    """A run's stage outputs (data -> sft -> rl -> eval) with cost metrics, judged into candidates/."""
    base = f"{root}/runs/rlhf_nightly/{run}"
    data = commit_stage(f"{base}/prepare_data", "prepare_data", {"source": "demo"}, cost.stage_cost(10, 0, 1), tmp_path)
    sft = commit_stage(
        f"{base}/sft", "sft", {"pretrain": data, "dataset": data}, cost.stage_cost(3600, gpus, 2), tmp_path
    )
    rl = commit_stage(
        f"{base}/rl", "rl", {"pretrain": sft, "prompt_data": data}, cost.stage_cost(1800, 2 * gpus, 3), tmp_path
    )
    # eval also scores the champion: that model's training is not this candidate's cost
    ev = commit_stage(
        f"{base}/eval",
        "eval",
        {"policy": rl, "baseline": sft, "champion": f"{root}/runs/other/x/rl/manifest.json"},
        cost.stage_cost(60, 0, 1),
        tmp_path,
    )
    metrics = {"accuracy": 0.85, "preferred_style_rate": 0.99 if passed else 0.5}
    reg.record_candidate(
        run,
        {
            "policy": rl,
            "evaluation": ev,
            "metrics": metrics,
            "passed": passed,
            "promoted": False,
            "decision": "passed" if passed else "rejected: the gate failed",
            "reasons": ["…"],
        },
    )
    return {"policy": rl, "evaluation": ev, "run_id": run, "metrics": metrics}


def test_promote_rollback_history_and_listing_with_cost(s3_server, tmp_path):
    root = s3_server.uri(f"reg-{tmp_path.name}")
    reg = Registry(f"{root}/models/demo-policy")
    first = candidate(reg, root, "night1", True, tmp_path)
    reg.promote(first, expected_version=0, promoted_by="rlhf_nightly run night1")
    second = candidate(reg, root, "night2", True, tmp_path)
    reg.promote(second, expected_version=1, promoted_by="rlhf_nightly run night2")
    bad = candidate(reg, root, "night3", False, tmp_path)

    # Roll back to v1: a new version (3) with v1's policy; history keeps every step.
    back = reg.rollback(to_version=1, expected_version=2, promoted_by="alice", reason="v2 regressed")
    assert (back["version"], back["policy"], back["action"], back["rolled_back_to"]) == (
        3,
        first["policy"],
        "rollback",
        1,
    )
    assert back["previous"] == second["policy"] and back["previous_version"] == 2 and back["reason"] == "v2 regressed"
    # A stale view (the caller still saw v2) is refused, and nothing moves.
    with pytest.raises(StaleChampion, match="version 3, not the version 2"):
        reg.rollback(to_version=2, expected_version=2, promoted_by="bob")
    with pytest.raises(ConfigError, match=r"^to_version: 3 is not an earlier champion"):
        reg.rollback(to_version=3, expected_version=3, promoted_by="bob")

    # Manual promotion of a judged candidate: one that failed its gate needs the override, recorded.
    with pytest.raises(ConfigError, match=r"^candidate: 'night3' failed its gate .* --override_gate true"):
        reg.promote_candidate("night3", expected_version=3, promoted_by="alice")
    with pytest.raises(ConfigError, match=r"^candidate: no candidate 'nope'.*night3"):
        reg.promote_candidate("nope", expected_version=3, promoted_by="alice")
    forced = reg.promote_candidate(
        "night3", expected_version=3, promoted_by="alice", override_gate=True, reason="hotfix"
    )
    assert forced["version"] == 4 and forced["policy"] == bad["policy"] and forced["override_gate"] is True

    listing = reg.listing()
    assert listing["champion"]["version"] == 4
    assert [(h["version"], h["action"], h["promoted_by"]) for h in listing["history"]] == [
        (1, "promote", "rlhf_nightly run night1"),
        (2, "promote", "rlhf_nightly run night2"),
        (3, "rollback", "alice"),
        (4, "manual promote", "alice"),
    ]
    assert listing["history"][0]["metrics"] == first["metrics"]
    assert [c["run_id"] for c in listing["candidates"]] == ["night1", "night2", "night3"]
    # data 10 s + sft 1 h on 1 GPU + rl 0.5 h on 2 GPUs + eval 60 s; the champion's lineage not counted
    assert listing["candidates"][0]["cost"] == {"wall_time_s": 5470.0, "gpu_hours": 2.0, "stages": 4, "unknown": 0}


def test_concurrent_rollbacks_exactly_one_wins(s3_server, tmp_path):
    import threading

    root = s3_server.uri(f"reg-{tmp_path.name}")
    reg = Registry(f"{root}/models/m")
    for n in (1, 2, 3):
        reg.promote({"policy": f"s3://b/run{n}/rl/manifest.json"}, expected_version=n - 1, promoted_by="t")
    results = []

    def contender(to: int) -> None:
        try:
            results.append(reg.rollback(to_version=to, expected_version=3, promoted_by=f"p{to}"))
        except StaleChampion as e:
            results.append(e)

    threads = [threading.Thread(target=contender, args=(to,)) for to in (1, 2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    won = [r for r in results if isinstance(r, dict)]
    assert len(won) == 1 and len(results) == 2
    assert reg.champion()[0]["policy"] == won[0]["policy"] and len(reg.history()) == 4


def test_cli_list_promote_rollback_and_one_line_errors(s3_server, tmp_path, capsys):
    root = s3_server.uri(f"reg-{tmp_path.name}")
    registry = f"{root}/models/demo-policy"
    reg = Registry(registry)
    candidate(reg, root, "night1", True, tmp_path)
    candidate(reg, root, "night2", True, tmp_path)

    assert (
        cli(["promote", "--registry", registry, "--candidate", "night1", "--expected_version", "0", "--by", "alice"])[
            "version"
        ]
        == 1
    )
    # The form RayJobOperator renders: --action instead of the first word, plus --output/--run_id (stage mode).
    out = s3_server.uri(f"reg-{tmp_path.name}/runs/rlhf_registry/m1/registry")
    cli(
        [
            "--output",
            out,
            "--run_id",
            "m1",
            "--action",
            "promote",
            "--registry",
            registry,
            "--candidate",
            "night2",
            "--expected_version",
            "1",
            "--by",
            "rlhf_registry run m1",
        ]
    )
    assert manifests.read_manifest(out)["metrics"]["champion_version"] == 2
    cli(
        [
            "rollback",
            "--registry",
            registry,
            "--to_version",
            "1",
            "--expected_version",
            "2",
            "--by",
            "bob",
            "--reason",
            "regressed",
        ]
    )
    capsys.readouterr()
    cli(["list", "--registry", registry])
    table = capsys.readouterr().out
    assert "champion: v3 " in table and "rollback to v1" in table and "reason: regressed" in table
    assert "night2  passed  accuracy=0.850  preferred_style_rate=0.990  [2.000 GPU-h, 5470 s over 4 stage(s)]" in table

    # A real process: JSON on stdout, and bad input as one line on stderr with exit status 2.
    t0 = time.monotonic()
    env = {**os.environ}
    listed = subprocess.run(
        [sys.executable, "-m", "tasks.registry", "list", "--registry", registry, "--json", "true"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["champion"]["version"] == 3
    stale = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks.registry",
            "rollback",
            "--registry",
            registry,
            "--to_version",
            "2",
            "--expected_version",
            "2",
            "--by",
            "bob",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert stale.returncode == 2 and stale.stderr.count("\n") == 1
    assert stale.stderr.startswith("error: ") and "version 3, not the version 2" in stale.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "tasks.registry", "promote", "--registry", registry, "--candidate", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "--expected_version" in missing.stderr
    print(f"3 CLI processes: {time.monotonic() - t0:.1f} s")


def test_cost_fields_and_bad_input():
    class Placement:  # what tasks.common.nn.workers.Placement exposes
        size, use_gpu = 4, True

    held = cost.held_resources([Placement(), (2, False)], driver_cpus=1)
    assert held == {"gpus": 4, "cpus": 7}
    assert cost.stage_cost(900, **held) == {"wall_time_s": 900, "gpus": 4, "cpus": 7, "gpu_hours": 1.0}
    with pytest.raises(ConfigError, match=r"^wall_time_s: must be a number >= 0, got -1"):
        cost.stage_cost(-1, 1, 1)
    with pytest.raises(ConfigError, match=r"^driver_cpus: "):
        cost.held_resources([], driver_cpus="one")


def test_ui_view_lists_what_the_cli_lists(s3_server, tmp_path, monkeypatch):
    pytest.importorskip("airflow")
    from fastapi import HTTPException

    from plugins import registry_view
    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint))
    root = s3_server.uri(f"reg-{tmp_path.name}")
    reg = Registry(f"{root}/models/demo-policy")
    reg.promote(candidate(reg, root, "night1", True, tmp_path), 0, "nightly")
    candidate(reg, root, "night2", False, tmp_path)
    view = registry_view.listing(registry_view.registry_root(s3_server.bucket, f"reg-{tmp_path.name}", "demo-policy"))
    cli_view = reg.listing()
    assert view["champion"] == cli_view["champion"] and view["history"] == cli_view["history"]
    assert [(c["run_id"], c["cost"]) for c in view["candidates"]] == [
        (c["run_id"], c["cost"]) for c in cli_view["candidates"]
    ]
    with pytest.raises(HTTPException) as err:
        registry_view.registry_root("rlhf-flow", "p", "../etc")
    assert err.value.status_code == 400 and err.value.detail.startswith("model_name: ")
    with pytest.raises(HTTPException) as err:  # a bucket that does not exist: one line, not a 500
        registry_view.listing(registry_view.registry_root("no-such-bucket", "p", "demo-policy"))
    assert err.value.status_code == 404 and err.value.detail.startswith("bucket: 'no-such-bucket' does not exist")
