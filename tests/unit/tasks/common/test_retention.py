"""Retention on the S3 emulator: failed runs and rejected candidates expire after the age asked, nothing a
champion (current or in history) or a kept run reaches through manifest inputs is touched, stale cache index
entries go with the manifests they pointed at, unfinished multipart uploads are aborted, and a dry run deletes
nothing. Stage outputs are committed as stages commit them; ages come from the objects' real LastModified."""

import time

import pytest

from tasks.common import manifest as manifests
from tasks.common import retention, storage
from tasks.common.config import ConfigError
from tasks.common.registry import Registry
from tasks.registry.__main__ import run as cli

DAY = 86400


def commit_stage(uri: str, stage: str, inputs: dict, tmp_path, metrics: dict | None = None) -> str:
    local = tmp_path / "stages" / uri.split("/runs/", 1)[1]
    local.mkdir(parents=True)
    (local / "model.bin").write_bytes(b"w" * 100)
    manifests.commit(local, uri, manifests.build_manifest(stage, "r", {}, inputs, metrics or {}))
    return f"{uri}/manifest.json"


def pipeline_run(
    root: str,
    run: str,
    tmp_path,
    upto: str = "promote",
    promote: dict | None = None,
    sft_input: str | None = None,
    dag: str = "rlhf_nightly",
) -> dict:
    base = f"{root}/runs/{dag}/{run}"
    out = {"data": commit_stage(f"{base}/prepare_data", "prepare_data", {"source": "demo"}, tmp_path)}
    out["sft"] = commit_stage(
        f"{base}/sft", "sft", {"pretrain": sft_input or out["data"], "dataset": out["data"]}, tmp_path
    )
    if upto == "rl-partial":  # killed mid-upload: files, no manifest
        storage.write_bytes(f"{base}/rl/checkpoints/step_10/shard.bin", b"x" * 50)
        return out
    out["rl"] = commit_stage(f"{base}/rl", "rl", {"pretrain": out["sft"], "prompt_data": out["data"]}, tmp_path)
    out["eval"] = commit_stage(f"{base}/eval", "eval", {"policy": out["rl"], "baseline": out["sft"]}, tmp_path)
    out["promote"] = commit_stage(f"{base}/promote", "promote", {"evaluation": out["eval"]}, tmp_path, promote)
    return out


def keys(s3_server, prefix: str) -> set[str]:
    return {
        f"s3://{s3_server.bucket}/{k}"
        for k in (
            o["Key"]
            for page in s3_server.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=s3_server.bucket, Prefix=prefix + "/")
            for o in page.get("Contents", [])
        )
    }


def test_retention_expires_failed_and_rejected_runs_but_never_a_champions_lineage(s3_server, tmp_path):
    t0 = time.monotonic()
    prefix = f"ret-{tmp_path.name}"
    root = s3_server.uri(prefix)
    reg = Registry(f"{root}/models/demo-policy")
    champ = pipeline_run(root, "n1", tmp_path, promote={"passed": 1, "promoted": 1})
    reg.promote({"policy": champ["rl"], "evaluation": champ["eval"]}, 0, "nightly")
    # Rejected by the gate, then promoted by hand (override): in history, so its model and lineage stay.
    forced = pipeline_run(root, "n2", tmp_path, promote={"passed": 0, "promoted": 0})
    reg.promote({"policy": forced["rl"], "evaluation": forced["eval"]}, 1, "alice")
    reg.promote({"policy": champ["rl"]}, 2, "rollback")  # the current champion is n1 again; n2 only in history
    rejected = pipeline_run(root, "n3", tmp_path, promote={"passed": 0, "promoted": 0})
    failed = pipeline_run(root, "n4", tmp_path, upto="rl-partial")
    # A kept run (passed, not promoted) whose SFT started from the failed run's data (a cache hit).
    kept = pipeline_run(root, "m5", tmp_path, promote={"passed": 1, "promoted": 0}, sft_input=failed["data"])
    other = pipeline_run(root, "x6", tmp_path, upto="rl-partial", dag="rlhf_registry")
    for name, target in (
        ("k-gone", rejected["sft"]),
        ("k-kept", champ["sft"]),
        ("k-dangling", f"{root}/runs/rlhf_nightly/zz/sft/manifest.json"),
    ):
        storage.write_json(f"{root}/cache/{name}.json", {"manifest": target})
    s3 = s3_server.client()
    old_upload = s3.create_multipart_upload(Bucket=s3_server.bucket, Key=f"{prefix}/runs/rlhf_nightly/n4/rl/model.bin")
    s3.upload_part(
        Bucket=s3_server.bucket,
        Key=f"{prefix}/runs/rlhf_nightly/n4/rl/model.bin",
        UploadId=old_upload["UploadId"],
        PartNumber=1,
        Body=b"p" * 1024,
    )
    elsewhere = s3.create_multipart_upload(Bucket=s3_server.bucket, Key=f"not-{prefix}/big.bin")
    before = keys(s3_server, prefix)

    # Nothing is old enough today: nothing goes. (moto reports every upload as initiated in 2010, so the
    # uploads' age threshold is tested from the other side: a century keeps them, 0 h aborts the old one.)
    young = retention.plan(root, max_age_days=30, multipart_age_hours=24 * 365 * 100)
    assert not young["objects"] and not young["multipart"] and not any(r["expire"] for r in young["runs"])

    # Ten days on, with a 7-day age: a dry run lists, deletes nothing.
    later = time.time() + 10 * DAY
    plan = retention.plan(root, max_age_days=7, multipart_age_hours=24, now=later)
    status = {r["run"]: (r["status"], r["expire"]) for r in plan["runs"]}
    assert status == {
        "rlhf_nightly/n1": ("promoted", False),
        "rlhf_nightly/n2": ("rejected", True),
        "rlhf_nightly/n3": ("rejected", True),
        "rlhf_nightly/n4": ("failed", True),
        "rlhf_nightly/m5": ("passed", False),
        "rlhf_registry/x6": ("other dag", False),
    }
    text = retention.describe(plan)
    assert "would delete" in text and "unfinished upload would be aborted" in text
    assert keys(s3_server, prefix) == before

    def folder(run_outputs, stage):
        return run_outputs[stage].removesuffix("/manifest.json")

    gone = {
        folder(forced, "promote"),
        *(folder(rejected, s) for s in ("data", "sft", "rl", "eval", "promote")),
        folder(failed, "sft"),
        f"{root}/runs/rlhf_nightly/n4/rl",
    }
    assert {f for r in plan["runs"] for f in r["delete"]} == gone
    # n2's model and what it was trained from stay (history); n4's data stays (m5 was trained on it)
    assert set(plan["protected_kept"]) == {folder(forced, s) for s in ("data", "sft", "rl", "eval")} | {
        folder(failed, "data")
    }
    assert {o["Key"].rsplit("/", 1)[-1] for o in plan["cache_entries"]} == {"k-gone.json", "k-dangling.json"}
    assert [u["UploadId"] for u in plan["multipart"]] == [old_upload["UploadId"]]

    # The real thing, through the CLI (its default is a dry run).
    result = cli(
        ["retention", "--root", root, "--max_age_days", "0", "--multipart_age_hours", "0", "--dry_run", "false"]
    )
    after = keys(s3_server, prefix)
    assert not any(k.startswith(tuple(f + "/" for f in gone)) for k in after)
    assert before - after == {k for k in before if k.startswith(tuple(f + "/" for f in gone))} | {
        f"{root}/cache/k-gone.json",
        f"{root}/cache/k-dangling.json",
    }
    assert result["deleted"]["multipart"] == 1
    uploads = s3.list_multipart_uploads(Bucket=s3_server.bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [elsewhere["UploadId"]]
    # Every champion in history still reads back whole, with its lineage.
    for entry in reg.history():
        assert manifests.read_manifest(entry["policy"])
    assert manifests.read_manifest(kept["sft"]) and manifests.read_manifest(failed["data"])
    assert storage.exists(f"{root}/runs/rlhf_registry/x6/sft/manifest.json") and other
    s3.abort_multipart_upload(Bucket=s3_server.bucket, Key=f"not-{prefix}/big.bin", UploadId=elsewhere["UploadId"])
    print(f"retention test: {time.monotonic() - t0:.1f} s")


def test_retention_refuses_bad_input_with_one_line(s3_server):
    with pytest.raises(ConfigError, match=r"^root: '/tmp/x' is not an s3:// URI"):
        retention.plan("/tmp/x", 7)
    with pytest.raises(ConfigError, match=r"^max_age_days: must be a number >= 0, got -1"):
        retention.plan(s3_server.uri("p"), -1)
    with pytest.raises(ConfigError, match=r"^argument --max_age_days: invalid float value: 'soon'"):
        cli(["retention", "--root", s3_server.uri("p"), "--max_age_days", "soon"])
