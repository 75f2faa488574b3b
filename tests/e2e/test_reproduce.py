"""tasks.reproduce: rerun a stage from its manifest alone and reach the same metrics, on CPU.

prepare_data (in this process) and a tiny SFT (its CLI, one Ray worker) write to the S3 emulator; the
SFT output is then reproduced by `python -m tasks.reproduce … --check` into a new prefix. The
refusals (changed code, missing manifest, changed input, registry-writing stage) run without Ray.
"""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage, storage
from tasks.common.config import make_config
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig
from tasks.reproduce import rerun as reproduce
from tasks.sft.config import SFTConfig

from tests.conftest import REPO, SCRATCH

CODE = "reproduce-test-v1"  # the code version every run here records (not the checkout's HEAD, which may move)


def run_cli(*args, ray: str = "", code: str = CODE):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray, "RLHF_CODE_VERSION": code}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def flags(values: dict) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def original(s3_server, ray_address):
    """prepare_data -> sft on S3, with an explicit ckpt_path (a rerun must not resume from it)."""
    saved = {k: os.environ.get(k) for k in ("RLHF_CACHE_DIR", "RLHF_CODE_VERSION")}
    os.environ.update(RLHF_CACHE_DIR=str(SCRATCH / "cache-reproduce"), RLHF_CODE_VERSION=CODE)
    root = s3_server.uri("reproduce/r1")
    out = {"root": root, "prepare_data": f"{root}/prepare_data", "sft": f"{root}/sft"}
    try:
        stage.run(
            "prepare_data", make_config(PrepareDataConfig, {"output": out["prepare_data"], "run_id": "r1"}), prepare
        )
        done = run_cli(
            "tasks.sft",
            *flags(
                {
                    "output": out["sft"],
                    "run_id": "r1",
                    "pretrain": out["prepare_data"],
                    "dataset": out["prepare_data"],
                    "max_steps": 6,
                    "train_batch_size": 32,
                    "logging_steps": 2,
                    "save_steps": 3,
                    "ckpt_path": f"{root}/sft-ckpt",
                }
            ),
            ray=ray_address,
        )
        assert done.returncode == 0, f"sft failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        yield out
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.mark.slow  # make test-all: needs an SFT run to reproduce (50 s)
def test_the_manifest_pins_its_input_manifests(original):
    m = manifests.read_manifest(original["sft"])
    data_sha = manifests.manifest_digest(original["prepare_data"])
    assert m["input_manifests"] == {original["prepare_data"]: data_sha}
    assert data_sha == hashlib.sha256(storage.read_bytes(f"{original['prepare_data']}/manifest.json")).hexdigest()
    assert manifests.read_manifest(original["prepare_data"])["input_manifests"] == {}  # it reads no stage output


@pytest.mark.slow  # make test-all: needs an SFT run to reproduce (50 s)
def test_sft_reproduces_with_identical_metrics_and_weights(original, ray_address):
    new_uri = f"{original['root']}-reproduced/sft"
    done = run_cli(
        "tasks.reproduce", f"{original['sft']}/manifest.json", "--output", new_uri, "--check", ray=ray_address
    )
    if done.returncode == 2 and done.stderr.startswith("error: code_digest: "):
        pytest.skip(f"tasks/ was edited while this test ran, so there is nothing to reproduce: {done.stderr.strip()}")
    assert done.returncode == 0, f"reproduce failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().splitlines()[-1].startswith("reproduce: sft reproduced: "), done.stdout[-3000:]
    assert f"reproduce: input dataset: {original['prepare_data']}: same manifest sha256" in done.stdout, done.stdout[
        -3000:
    ]
    # Every output file but metrics.jsonl (each line has its time_s) came out byte-identical, the weights included.
    assert re.search(
        r"^reproduce: files: (\d+) of (\d+) byte-identical to the original's; differ: metrics.jsonl$", done.stdout, re.M
    ), done.stdout[-3000:]

    old, new = manifests.read_manifest(original["sft"]), manifests.read_manifest(new_uri)
    assert new["run_id"] == "reproduce-r1" and "resumed_from_step" not in new
    changed = {k for k in old["config"] if old["config"][k] != new["config"][k]}
    assert changed == {"output", "run_id", "ckpt_path"} and new["config"]["ckpt_path"] == ""
    assert storage.exists(f"{new_uri}/checkpoints/step_6/manifest.json")  # its own checkpoints, under --output

    def computed(metrics):
        return {k: v for k, v in metrics.items() if not reproduce.ignored(k)}

    assert computed(new["metrics"]) == computed(old["metrics"]) and old["metrics"]["train_loss"] is not None
    # Same seed, same data order, same init, one worker: the weights are bit-identical, not just the loss.
    assert new["files"]["model/model.safetensors"] == old["files"]["model/model.safetensors"], (
        old["metrics"],
        new["metrics"],
    )
    assert new["inputs"] == old["inputs"] and new["input_manifests"] == old["input_manifests"]

    def curve(uri):  # the per-step log without its timings
        rows = [json.loads(line) for line in storage.read_text(f"{uri}/metrics.jsonl").splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith("time_")} for row in rows]

    assert curve(new_uri) == curve(original["sft"]) and len(curve(new_uri)) == 3


@pytest.mark.slow  # make test-all: needs an SFT run to reproduce (50 s)
def test_a_changed_code_version_is_refused_in_one_line(original):
    new_uri = f"{original['root']}-other-code/sft"
    done = run_cli("tasks.reproduce", original["sft"], "--output", new_uri, "--check", code="reproduce-test-v2")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: code_version: the manifest records {CODE}, this checkout is reproduce-test-v2; "
        f"check out {CODE} (or set RLHF_CODE_VERSION) or pass --allow_code_change"
    )
    assert not storage.exists(new_uri)


def test_a_missing_manifest_is_one_line(s3_server):
    missing = s3_server.uri("reproduce/never-written/sft")
    done = run_cli("tasks.reproduce", missing, "--output", s3_server.uri("reproduce/never-written/again"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: no manifest.json at {missing}: ")


@pytest.mark.slow  # make test-all: needs an SFT run to reproduce (50 s)
def test_the_original_folder_is_never_the_output(original):
    with pytest.raises(reproduce.ReproduceError, match=r"^output: .* is the original's folder"):
        reproduce.preflight(original["sft"], original["sft"] + "/")


# ---------------------------------------------------------------- refusals on local manifests, no Ray


def commit_local(tmp_path, name: str, stage_name: str, config: dict, inputs: dict, code_digest: str = "", **kw) -> str:
    (tmp_path / f"{name}-local").mkdir()
    (tmp_path / f"{name}-local" / "x.txt").write_text(name)
    m = manifests.build_manifest(stage_name, "r1", config, inputs, {"steps": 1}, **kw)
    m["code_digest"] = code_digest or m["code_digest"]
    return manifests.commit(tmp_path / f"{name}-local", str(tmp_path / name), m)["uri"]


def sft_config(data: str, out: str) -> dict:
    return dataclasses.asdict(make_config(SFTConfig, {"output": out, "pretrain": data, "dataset": data}))


def test_a_rewritten_input_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CODE_VERSION", CODE)
    data = commit_local(tmp_path, "data", "prepare_data", {"seed": 0}, {})
    pinned = {data: manifests.manifest_digest(data)}
    sft = commit_local(
        tmp_path,
        "sft",
        "sft",
        sft_config(data, str(tmp_path / "sft")),
        {"pretrain": data, "dataset": data},
        input_manifests=pinned,
    )
    manifest, cfg, _ = reproduce.preflight(sft, str(tmp_path / "again"))  # unchanged: accepted
    assert cfg.run_id == "reproduce-r1" and cfg.output == str(tmp_path / "again")

    commit_local(tmp_path, "data2", "prepare_data", {"seed": 1}, {})
    (tmp_path / "data" / "manifest.json").write_bytes((tmp_path / "data2" / "manifest.json").read_bytes())
    with pytest.raises(
        reproduce.ReproduceError, match=r"^inputs\.dataset: .*/data/manifest\.json changed since the original run"
    ):
        reproduce.preflight(sft, str(tmp_path / "again"))


def test_an_input_disagreeing_with_the_config_and_a_gone_input_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CODE_VERSION", CODE)
    gone = str(tmp_path / "gone")
    sft = commit_local(
        tmp_path, "sft", "sft", sft_config(gone, str(tmp_path / "sft")), {"pretrain": gone, "dataset": gone}
    )
    with pytest.raises(reproduce.ReproduceError, match=rf"^inputs\.dataset: {gone} no longer exists"):
        reproduce.preflight(sft, str(tmp_path / "again"))
    odd = commit_local(tmp_path, "odd", "sft", sft_config(gone, str(tmp_path / "odd")), {"pretrain": "/elsewhere"})
    with pytest.raises(
        reproduce.ReproduceError, match=r"^inputs\.pretrain: the manifest records /elsewhere but its config names"
    ):
        reproduce.preflight(odd, str(tmp_path / "again"))


def test_uncommitted_code_edits_are_refused(tmp_path, monkeypatch):
    """Same code_version (git HEAD sees no uncommitted edit), other tasks/ code: refused unless allowed."""
    monkeypatch.setenv("RLHF_CODE_VERSION", CODE)
    data = commit_local(tmp_path, "data", "prepare_data", {"seed": 0}, {})
    sft = commit_local(
        tmp_path,
        "sft",
        "sft",
        sft_config(data, str(tmp_path / "sft")),
        {"pretrain": data, "dataset": data},
        code_digest="0" * 64,
    )
    with pytest.raises(
        reproduce.ReproduceError, match=r"^code_digest: tasks/ differs from the code that ran .*--allow_code_change$"
    ):
        reproduce.preflight(sft, str(tmp_path / "again"))
    _, cfg, _ = reproduce.preflight(sft, str(tmp_path / "again"), allow_code_change=True)
    assert cfg.output == str(tmp_path / "again")


def test_registry_writing_stages_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CODE_VERSION", CODE)
    for name in ("promote", "registry_rollback"):
        uri = commit_local(tmp_path, name, name, {"output": "x"}, {})
        with pytest.raises(reproduce.ReproduceError, match=rf"^stage: {name} is not reproducible: .*registry"):
            reproduce.preflight(uri, str(tmp_path / f"{name}-again"))


def test_metric_comparison_rules():
    recorded = {"steps": 6, "method": "dpo", "loss": 0.5, "wall_time_s": 10.0, "gpu_hours": 0.0, "rows": 100}
    rows = reproduce.compare_metrics(recorded, {**recorded, "loss": 0.5 * (1 + 5e-7), "wall_time_s": 99.0}, 1e-6)
    assert {k: v for k, _, _, v in rows} == {
        "steps": "ok",
        "method": "ok",
        "loss": "ok",
        "wall_time_s": "ignored",
        "gpu_hours": "ignored",
        "rows": "ok",
    }
    assert reproduce.summary("sft", rows, 1e-6)[0]
    rows = reproduce.compare_metrics(recorded, {**recorded, "loss": 0.5 * (1 + 2e-6), "steps": 7, "rows": 100.0}, 1e-6)
    verdicts = {k: v for k, _, _, v in rows}
    assert verdicts["loss"] == verdicts["steps"] == "DIFFERS" and verdicts["rows"] == "ok"  # 100 == 100.0 numerically
    ok, line = reproduce.summary("sft", rows, 1e-6)
    assert not ok and line.startswith("reproduce: sft NOT reproduced: 2 of 4 differ: ") and "\n" not in line
    assert reproduce.compare_metrics({"a": 1}, {}, 1e-6) == [("a", 1, "—", "MISSING")]
    lines = reproduce.table(rows).splitlines()
    assert lines[0].split() == ["metric", "recorded", "reproduced", "check"] and len(lines) == 1 + len(rows)
    assert lines[1].split() == ["gpu_hours", "0.0", "0.0", "ignored"]
