"""Faults classified as what they are (issue 53, item 4): text that is not UTF-8 is a bad row with its reason;
a full or read-only disk is one line naming the path and its free space, exit 75 where a retry may help and 2
where it cannot; a placement that waits in vain on a busy cluster exits 75 naming what it lacked; the S3
emulator lists nothing that its folder does not hold; prepare_data's own tokenizer adds its BOS.

Nothing is mocked: real files, real subprocess exits, a real Ray and the real emulator over HTTP. Full and
read-only disks are real tmpfs mounts in a private mount namespace (`unshare -rm`: no privilege needed
beyond user namespaces, and root cannot write through a read-only mount, unlike through chmod 0555)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tasks.common import errors, stage, stages, storage
from tasks.common import manifest as manifests
from tasks.common.config import ConfigError, make_config
from tasks.common.nn.workers import busy_resources
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def can_mount() -> bool:
    """Whether this machine lets a process mount a tmpfs of its own (user and mount namespaces)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(
    not can_mount(), reason="no user+mount namespaces here (unshare -rm), so no real full or read-only disk"
)


def in_mounts(command: list[str], mounts: dict[Path, str]) -> list[str]:
    """`command` run where each folder is a fresh tmpfs with the given options ('size=256k', 'ro', …)."""
    setup = " && ".join(f"mount -t tmpfs -o {options} tmpfs {folder}" for folder, options in mounts.items())
    return ["unshare", "-rm", "sh", "-c", f'{setup} && exec "$0" "$@"', *command]


def prepare_config(tmp_path: Path, source: str, **flags) -> dict:
    base = tmp_path / "base-model"  # a folder the base-model check accepts: these runs are about data
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text("{}")
    return {
        "output": str(tmp_path / "out"),
        "source": source,
        "base_model": str(base),
        "datasets_root": str(tmp_path / "datasets"),
        **flags,
    }


def good_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} plus {i + 1}?", "chosen": str(2 * i + 1), "rejected": f"{2 * i + 1}, probably"}
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- invalid UTF-8


def test_invalid_utf8_in_a_value_is_a_bad_row_naming_its_column(tmp_path):
    lines = [json.dumps(r).encode() for r in good_rows(40)]
    lines += [
        b'{"prompt": "caf\xe9 au lait?", "chosen": "a", "rejected": "b"}',  # Latin-1, not UTF-8
        b'{"prompt": "a cut character", "chosen": "\xe2\x82", "rejected": "b"}',  # half of a three-byte character
        b'{"prompt": "an escaped half", "chosen": "a", "rejected": "\\udc80"}',  # valid JSON, but no UTF-8 can hold it
    ]
    source = tmp_path / "mixed.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    values = prepare_config(tmp_path, str(source), max_bad_fraction=0.1)
    stage.run("prepare_data", make_config(PrepareDataConfig, values), prepare)
    m = manifests.read_manifest(values["output"])
    check = m["validation"]["checks"]["invalid_utf8"]
    assert check == {"count": 3, "rows": [41, 42, 43], "fields": {"prompt": 1, "chosen": 1, "rejected": 1}}
    assert m["validation"]["kept"] == 40
    written = b"".join(p.read_bytes() for p in Path(m["uri"]).rglob("*.jsonl"))
    assert (
        "\ufffd".encode() not in written and b"\\ufffd" not in written
    )  # no replacement character stands in for the user's bytes


def test_invalid_utf8_in_a_csv_cell_counts_and_fails_the_threshold_with_the_fix(tmp_path):
    body = "prompt,chosen,rejected\n" + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}\n" for r in good_rows(10))
    source = tmp_path / "rows.csv"
    source.write_bytes(body.encode() + b"na\xefve?,a,b\n")
    with pytest.raises(ConfigError) as failed:
        stage.run("prepare_data", make_config(PrepareDataConfig, prepare_config(tmp_path, str(source))), prepare)
    assert "invalid_utf8 1 (--input_key prompt; rows 11: save the file as UTF-8" in str(failed.value)


# ----------------------------------------------------------------------------- full and read-only disks


@pytest.mark.parametrize(
    "code, transient",
    [
        (errno.ENOSPC, True),
        (errno.EDQUOT, True),
        (errno.EROFS, False),
        (errno.EACCES, False),
        (errno.EPERM, False),
        (errno.ENOENT, None),
    ],
)
def test_disk_faults_are_classified_by_errno(code, transient):
    fault = errors.disk_fault(OSError(code, os.strerror(code), "/somewhere/file"))
    assert (fault[1] if fault else None) == transient


def test_a_real_full_device_is_one_transient_line_with_the_free_space():
    with pytest.raises(OSError) as full:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x")
    error = stage.known_fault(full.value)
    assert isinstance(error, storage.StorageError) and error.transient
    assert str(error).startswith(
        "cannot write in the working folder "
    ) and "no space left on the device (ENOSPC), " in str(error)
    assert " free of " in str(error) and "\n" not in str(error)
    assert (
        stage.known_fault(PermissionError(errno.EACCES, "Permission denied")) is None
    )  # no file: a socket's, not a disk's


def run_prepare_subprocess(tmp_path: Path, mounts: dict[Path, str], env: dict, **flags) -> subprocess.CompletedProcess:
    """prepare_data as its own process (the Ray job's entrypoint) on 3000 rows, with tmpfs mounts in place."""
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in good_rows(3000)))
    values = prepare_config(tmp_path, str(source), **flags)
    argv = [arg for key, value in values.items() for arg in (f"--{key}", str(value))]
    command = in_mounts([sys.executable, "-m", "tasks.data", *argv], mounts)
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**ENV, **env}, timeout=300)


@needs_mounts
@pytest.mark.parametrize(
    "where, options, exit_code, cause",
    [
        ("work", "size=256k", stages.TRY_AGAIN_EXIT, "no space left on the device (ENOSPC)"),
        ("output", "size=256k", stages.TRY_AGAIN_EXIT, "no space left on the device (ENOSPC)"),
        ("output", "ro", stages.INPUT_ERROR_EXIT, "read-only file system (EROFS)"),
    ],
)
def test_a_full_or_read_only_folder_is_one_line_naming_it_and_exits_by_whether_a_retry_helps(
    tmp_path, where, options, exit_code, cause
):
    disk = tmp_path / "disk"
    disk.mkdir()
    env, flags = {}, {}
    if where == "work":
        env["TMPDIR"] = str(disk)  # the stage's working folder and ingest's scratch
    else:
        flags["output"] = str(disk / "out")
    done = run_prepare_subprocess(tmp_path, {disk: options}, env, **flags)
    assert done.returncode == exit_code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: cannot write {disk}/" if where == "work" else f"error: cannot upload to {disk}/out/"
    ), line
    assert str(disk / "out" if where == "output" else disk) in line and cause in line, line
    assert (
        " free of 256.0 KiB there: free space there" if "size" in options else " there: remount it read-write"
    ) in line, line
    if where == "work":
        assert ", 0 B free of 256.0 KiB there" in line, line  # read as the write failed, before the scratch folder went


# ----------------------------------------------------------------------------- placements on a busy cluster


def test_busy_resources_names_what_is_missing_only_when_the_cluster_could_hold_it():
    total, free = {"CPU": 4.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0}
    assert busy_resources({"CPU": 1}, 2, total, free) == "CPU 1 (needs 2, 1 free of 4)"
    assert busy_resources({"CPU": 1, "GPU": 1}, 3, total, free) == ""  # 3 GPUs on a 2-GPU cluster: never
    assert busy_resources({"CPU": 1, "node_a": 1}, 1, total, free) == ""  # no node advertises node_a
    assert busy_resources({"CPU": 1}, 1, total, free) == ""  # it fits what is free: not a busy cluster


PLACEMENT_PROBE = """
import sys
import ray
from ray.util.placement_group import placement_group

ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[2], logging_level="ERROR")
held = placement_group([{"CPU": 1}])  # another job holding the cluster's one CPU
ray.get(held.ready())

from tasks.common import stage
from tasks.common.config import ConfigError, StageConfig
from tasks.common.nn.workers import Placement

try:
    Placement.create(1, 2, "critic", use_gpu=False)  # 2 CPUs from a 1-CPU cluster: no retry can help
except ConfigError as error:
    print(f"never: {error}", flush=True)
stage.main("probe", StageConfig, lambda cfg, run: Placement.create(1, 1, "actor", use_gpu=False), ["--output", sys.argv[1]])
"""


def test_a_placement_that_times_out_on_a_busy_cluster_exits_75_naming_what_it_lacked(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rf-", dir="/tmp")  # Ray's socket paths are length-limited
    try:
        done = subprocess.run(
            [sys.executable, "-c", PLACEMENT_PROBE, str(tmp_path / "out"), temp_dir],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**ENV, "RLHF_PLACEMENT_TIMEOUT_S": "3"},
            timeout=300,
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == stages.TRY_AGAIN_EXIT, done.stdout[-2000:] + done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: actor_num_gpus_per_node: the actor workers need 1 bundle(s) of {'CPU': 1} and found no room after 3 s: "
    ), line
    assert "missing CPU 1 (needs 1, 0 free of 1), held by other jobs; a retry may succeed once they finish" in line, (
        line
    )
    assert "never: critic_num_gpus_per_node: the critic workers need 2 bundle(s)" in done.stdout, done.stdout


# ----------------------------------------------------------------------------- the S3 emulator


class Emulator:
    """tools/s3_server.py as its own process on a free port, optionally under tmpfs mounts."""

    def __init__(self, data: Path, mounts: dict[Path, str] | None = None):
        self.port = free_port()
        command = [sys.executable, str(REPO / "tools" / "s3_server.py"), "--port", str(self.port), "--data", str(data)]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            in_mounts(command, mounts) if mounts else command, stdout=self.log, stderr=subprocess.STDOUT, env=ENV
        )
        self.client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1, "mode": "standard"}),  # the 500 itself, not boto3's retries
        )
        deadline = time.time() + 60
        while True:
            try:
                self.client.list_buckets()
                return
            except Exception:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise AssertionError(f"the emulator did not start: {self.output()}") from None
                time.sleep(0.2)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def keys(self, bucket: str) -> dict[str, str]:
        return {o["Key"]: o["ETag"] for o in self.client.list_objects_v2(Bucket=bucket).get("Contents", [])}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(30)


@needs_mounts
def test_the_emulator_lists_nothing_its_full_disk_did_not_take(tmp_path):
    data = tmp_path / "s3-data"
    data.mkdir()
    s3 = Emulator(data, {data: "size=256k"})
    try:
        s3.client.create_bucket(Bucket="bkt")
        s3.client.put_object(Bucket="bkt", Key="small", Body=b"hello", ContentType="text/plain")
        kept = s3.keys("bkt")
        for key in ("big", "small"):  # a new object, and one replacing what is stored
            with pytest.raises(ClientError) as failed:
                s3.client.put_object(Bucket="bkt", Key=key, Body=os.urandom(400_000))
            assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
            assert failed.value.response["Error"]["Code"] == "InternalError"
            assert "No space left on device" in failed.value.response["Error"]["Message"]
        assert s3.keys("bkt") == kept  # the failed writes left nothing listable, and the old bytes in place
        obj = s3.client.get_object(Bucket="bkt", Key="small")
        assert obj["Body"].read() == b"hello" and obj["ContentType"] == "text/plain"
        with pytest.raises(ClientError, match="NoSuchKey"):
            s3.client.get_object(Bucket="bkt", Key="big")
        s3.client.put_object(Bucket="bkt", Key="later", Body=b"fits")  # the disk still takes what fits
        assert set(s3.keys("bkt")) == {"small", "later"}
    finally:
        s3.stop()
    assert "s3: cannot store PUT /bkt/big: [Errno 28] No space left on device; undone" in s3.output()


def test_the_emulator_keeps_what_it_acknowledged_across_kill_9_and_reads_its_older_folder(tmp_path):
    data = tmp_path / "s3-data"
    legacy = data / "old"  # a bucket written before the data file's name was recorded: <sha>.data beside <sha>.json
    legacy.mkdir(parents=True)
    digest = __import__("hashlib").sha256(b"k").hexdigest()
    (legacy / f"{digest}.data").write_bytes(b"from before")
    (legacy / f"{digest}.json").write_text(
        json.dumps({"key": "k", "etag": '"0123456789abcdef0123456789abcdef"', "content_type": None})
    )
    s3 = Emulator(data)
    try:
        assert s3.client.get_object(Bucket="old", Key="k")["Body"].read() == b"from before"
        s3.client.put_object(Bucket="old", Key="k", Body=b"replaced")
        s3.client.create_bucket(Bucket="bkt")
        s3.client.put_object(Bucket="bkt", Key="a", Body=b"one")
        s3.client.put_object(Bucket="bkt", Key="a", Body=b"two")
        s3.client.put_object(Bucket="bkt", Key="gone", Body=b"x")
        s3.client.delete_object(Bucket="bkt", Key="gone")
        before = {b: s3.keys(b) for b in ("old", "bkt")}
    finally:
        s3.stop(signal.SIGKILL)
    assert sorted(p.name.count(".") for p in (data / "bkt").iterdir()) == [
        1,
        2,
    ]  # one metadata file and its one data file
    assert not list(data.rglob(".*.tmp"))
    s3 = Emulator(data)
    try:
        assert {b: s3.keys(b) for b in ("old", "bkt")} == before
        assert s3.client.get_object(Bucket="bkt", Key="a")["Body"].read() == b"two"
        assert s3.client.get_object(Bucket="old", Key="k")["Body"].read() == b"replaced"
    finally:
        s3.stop()


# ----------------------------------------------------------------------------- prepare_data's tokenizer


def test_prepare_datas_own_tokenizer_adds_its_bos(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": str(out), "source": "demo"}), prepare)
    local, _ = manifests.fetch(str(out), tmp_path / "fetched", subdir="model")
    tokenizer = AutoTokenizer.from_pretrained(str(local))
    assert tokenizer.bos_token == "<bos>"
    assert tokenizer("12+34=")["input_ids"][0] == tokenizer.bos_token_id
    assert (
        tokenizer.encode("12+34=", add_special_tokens=False)[0] != tokenizer.bos_token_id
    )  # the stages' own encoding is unchanged
