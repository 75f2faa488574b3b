"""Storage layer and manifests against moto's S3 server over real HTTP (no mocks), and local paths."""

import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from tasks.common import manifest as mf
from tasks.common import provenance, storage
from tasks.common.storage import NotFoundError, StorageError

from tests.conftest import REPO, free_port

BIG = 11 * 1024 * 1024  # above the 8 MB multipart threshold


@pytest.fixture
def s3(s3_server):
    storage.reset_client()  # another test file may have built a client before the server's env existed
    return s3_server


@pytest.fixture
def prefix(request):
    """A fresh key prefix per test, so tests never see each other's objects."""
    return f"t/{request.node.name}-{os.urandom(4).hex()}"


def make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"a": 1}\n',
        "model/weights.bin": os.urandom(BIG),
        "model/tokenizer/vocab.txt": b"hello\nworld\n",
        "logs/deep/nested/run.log": b"step 1\n" * 100,
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def assert_one_line(err: Exception, *needles: str):
    msg = str(err)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


# ---------------------------------------------------------------- URIs


def test_uri_helpers():
    assert storage.is_s3("s3://b/k") and not storage.is_s3("/tmp/x") and not storage.is_s3("file:///x")
    assert storage.split_s3("s3://b/a/b.txt") == ("b", "a/b.txt")
    assert storage.split_s3("s3://b") == ("b", "")
    assert storage.join("s3://b/a/", "c", "/d.txt") == "s3://b/a/c/d.txt"
    assert storage.join("file:///x/y", "z") == "file:///x/y/z"
    assert storage.join("/x/y", "z", "w") == "/x/y/z/w"
    assert storage.local_path("file:///x/y") == Path("/x/y")
    with pytest.raises(StorageError, match="not an S3 URI"):
        storage.split_s3("/tmp/x")
    with pytest.raises(StorageError, match="no bucket"):
        storage.split_s3("s3:///key")


# ---------------------------------------------------------------- objects and directories


@pytest.mark.parametrize("where", ["s3", "local", "file"])
def test_objects_round_trip(where, s3, prefix, tmp_path):
    base = {"s3": s3.uri(prefix), "local": str(tmp_path / "store"), "file": f"file://{tmp_path}/store"}[where]
    u = storage.join(base, "a", "obj.json")
    assert not storage.exists(u)
    storage.write_json(u, {"x": [1, 2]})
    assert storage.exists(u) and storage.exists(storage.join(base, "a"))  # object and its "directory"
    assert storage.read_json(u) == {"x": [1, 2]}
    storage.write_text(storage.join(base, "t.txt"), "héllo")
    assert storage.read_text(storage.join(base, "t.txt")) == "héllo"
    storage.write_bytes(storage.join(base, "a", "b", "raw"), b"\x00\x01")
    assert storage.list_files(base) == [("a/b/raw", 2), ("a/obj.json", len(storage.read_bytes(u))), ("t.txt", 6)]
    # With etags: the same files, each with a tag that changes with its content.
    tagged = storage.list_files(base, etags=True)
    assert [(rel, size) for rel, size, _ in tagged] == storage.list_files(base)
    storage.write_text(storage.join(base, "t.txt"), "hullo!")
    retagged = dict((rel, tag) for rel, _, tag in storage.list_files(base, etags=True))
    assert (
        retagged["t.txt"] != dict((rel, tag) for rel, _, tag in tagged)["t.txt"] and retagged["a/b/raw"] == tagged[0][2]
    )
    storage.delete(u)
    assert not storage.exists(u)
    with pytest.raises(NotFoundError) as e:
        storage.read_bytes(u)
    assert_one_line(e.value, u)


def test_dir_round_trip_s3_multipart(s3, prefix, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src)
    (src / "scratch.tmp").write_bytes(b"junk")
    uri = s3.uri(prefix)
    uploaded = storage.upload_dir(src, uri, exclude=("*.tmp",))
    assert uploaded == sorted((rel, len(d)) for rel, d in files.items())
    assert storage.list_files(uri) == uploaded
    # The big file went up as a multipart upload (its ETag is "<md5-of-md5s>-<parts>").
    head = s3.client().head_object(Bucket=s3.bucket, Key=f"{prefix}/model/weights.bin")
    assert "-" in head["ETag"]
    storage.download_dir(uri, dst)
    assert read_tree(dst) == files
    # A chosen subset only.
    storage.download_dir(uri, tmp_path / "part", files=["model/tokenizer/vocab.txt"])
    assert read_tree(tmp_path / "part") == {"model/tokenizer/vocab.txt": files["model/tokenizer/vocab.txt"]}
    # Single files, both directions.
    storage.upload_file(src / "config.json", s3.uri(f"{prefix}/single.json"))
    storage.download_file(s3.uri(f"{prefix}/single.json"), tmp_path / "x" / "single.json")
    assert (tmp_path / "x" / "single.json").read_bytes() == files["config.json"]


def test_dir_round_trip_local(tmp_path):
    files = make_tree(tmp_path / "src")
    storage.upload_dir(tmp_path / "src", f"file://{tmp_path}/store")
    storage.download_dir(str(tmp_path / "store"), tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == files


def test_missing_things_are_one_line(s3, prefix, tmp_path):
    with pytest.raises(NotFoundError) as e:
        storage.download_dir(s3.uri(f"{prefix}/nothing"), tmp_path / "d")
    assert_one_line(e.value, s3.uri(f"{prefix}/nothing"))
    with pytest.raises(NotFoundError) as e:
        storage.read_bytes("s3://no-such-bucket-here/k")
    assert_one_line(e.value, "no bucket 'no-such-bucket-here'", "s3://no-such-bucket-here/k", "create the bucket")
    with pytest.raises(NotFoundError) as e:
        storage.download_file(s3.uri(f"{prefix}/nope.bin"), tmp_path / "nope.bin")
    assert_one_line(e.value, s3.uri(f"{prefix}/nope.bin"))
    with pytest.raises(NotFoundError) as e:
        storage.upload_file(tmp_path / "absent.bin", s3.uri(f"{prefix}/absent.bin"))
    assert_one_line(e.value, "absent.bin")


@pytest.fixture
def dead_endpoint(s3, monkeypatch):
    """Point the environment at a port nobody listens on; the client is rebuilt from env both ways."""
    port = free_port()  # bound then released: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no retry backoff in the test; also shows env is honoured
    storage.reset_client()
    yield f"http://127.0.0.1:{port}"
    storage.reset_client()  # runs before monkeypatch restores the env; next call rebuilds from it


def test_unreachable_endpoint(dead_endpoint, s3, tmp_path):
    uri = s3.uri("x/y.json")
    for call in (
        lambda: storage.read_json(uri),
        lambda: storage.exists(uri),
        lambda: storage.write_bytes(uri, b"1"),
        lambda: mf.read_manifest(uri),
        lambda: storage.download_file(uri, tmp_path / "y"),
    ):
        with pytest.raises(StorageError) as e:
            call()
        assert_one_line(e.value, f"cannot reach S3 endpoint {dead_endpoint} for s3://rlhf-test/x/y.json")


def test_endpoint_restored_after_dead_endpoint(s3, prefix):
    storage.write_text(s3.uri(f"{prefix}/ok"), "ok")  # the env (and client) came back
    assert storage.endpoint() == s3.endpoint


# ---------------------------------------------------------------- manifests


def test_config_hash_and_build_manifest(monkeypatch):
    assert mf.config_hash({"b": 1, "a": {"y": 2, "x": 1}}) == mf.config_hash({"a": {"x": 1, "y": 2}, "b": 1})
    assert mf.config_hash({"a": 1}) == hashlib.sha256(b'{"a":1}').hexdigest()
    assert mf.config_hash({"a": 1}) != mf.config_hash({"a": 2})
    monkeypatch.setenv("RLHF_CODE_VERSION", "abc123")
    m = mf.build_manifest("sft", "run-1", {"lr": 1e-5}, {"data": "s3://b/d"}, {"loss": 0.5}, model="model")
    assert m["format"] == "rlhf-flow/manifest/v1" and m["stage"] == "sft" and m["run_id"] == "run-1"
    assert m["config_hash"] == mf.config_hash({"lr": 1e-5}) and m["model"] == "model"
    assert m["code_version"] == "abc123" and m["created_at"].endswith("+00:00")
    assert m["versions"]["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert "torch" in m["versions"] and set(m["versions"]) <= {
        "python",
        "lock",
        "cpu_numerics",
        *provenance.TRACKED_PACKAGES,
    }
    # The lock `make install` recorded in the venv, and the CPU code paths tasks/__init__.py pins.
    lock = Path(sys.prefix) / provenance.LOCK_RECORD
    if lock.exists():
        assert m["versions"]["lock"] == "dev sha256:" + json.loads(lock.read_text())["sha256"]
    assert "MKL_CBWR=AVX2,STRICT" in m["versions"]["cpu_numerics"]
    json.dumps(m)  # JSON-serialisable as built
    monkeypatch.delenv("RLHF_CODE_VERSION")
    assert mf.build_manifest("x", "r", {}, {}, {})["code_version"]
    with pytest.raises(ValueError, match="reserved"):
        mf.build_manifest("x", "r", {}, {}, {}, files={})


def test_modules_import_without_torch_or_airflow():
    import subprocess

    code = (
        "import sys; import tasks.common.storage, tasks.common.manifest; "
        "bad = [m for m in ('torch', 'airflow', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def committed(s3, prefix, tmp_path, **extra):
    files = make_tree(tmp_path / "out")
    m = mf.build_manifest("sft", "run-1", {"lr": 1}, {"data": "s3://x/y"}, {"loss": 1.0}, model="model", **extra)
    return files, mf.commit(tmp_path / "out", s3.uri(prefix), m)


def test_commit_writes_manifest_last_and_fetch_verifies(s3, prefix, tmp_path):
    uri = s3.uri(prefix)
    files = make_tree(tmp_path / "out")
    m = mf.build_manifest("sft", "run-1", {"lr": 1}, {}, {}, model="model")
    # Watch the bucket while committing: manifest.json must never appear before every file is there.
    seen_early, done = [], threading.Event()

    def watch():
        c = s3.client()
        while not done.is_set():
            keys = {o["Key"] for o in c.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])}
            if f"{prefix}/manifest.json" in keys and not {f"{prefix}/{r}" for r in files} <= keys:
                seen_early.append(keys)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = mf.commit(tmp_path / "out", uri, m)
    finally:
        done.set()
        watcher.join()
    assert not seen_early
    assert out["uri"] == uri
    # Each file with the store's own checksum (ETag): of a single-part upload, the MD5 of its bytes.
    etags = {
        o["Key"][len(prefix) + 1 :]: o["ETag"]
        for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)["Contents"]
    }
    assert out["files"] == {
        rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest(), "etag": etags[rel]} for rel, d in files.items()
    }
    assert etags["config.json"] == f'"{hashlib.md5(files["config.json"]).hexdigest()}"'
    assert storage.read_json(storage.join(uri, "manifest.json"))["files"] == out["files"]

    # Both spellings of the URI read the same manifest, with "uri" the directory.
    assert mf.read_manifest(uri)["uri"] == uri
    assert mf.read_manifest(uri + "/manifest.json") == mf.read_manifest(uri + "/")

    path, got = mf.fetch(uri, tmp_path / "all")
    assert path == tmp_path / "all" and got["files"] == out["files"]
    assert {k: v for k, v in read_tree(path).items() if k != "manifest.json"} == files
    path, _ = mf.fetch(uri, tmp_path / "sub", subdir="model")
    assert path == tmp_path / "sub" / "model"
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == [
        "tokenizer/vocab.txt",
        "weights.bin",
    ]
    assert not (tmp_path / "sub" / "config.json").exists()  # only the subdir was downloaded
    with pytest.raises(NotFoundError, match="no files under 'nope'"):
        mf.fetch(uri, tmp_path / "sub", subdir="nope")


def test_uncommitted_directory_is_refused(s3, prefix, tmp_path):
    make_tree(tmp_path / "out")
    uri = s3.uri(prefix)
    storage.upload_dir(tmp_path / "out", uri)  # files present, no manifest: a crashed stage
    for call in (lambda: mf.read_manifest(uri), lambda: mf.fetch(uri, tmp_path / "f")):
        with pytest.raises(NotFoundError) as e:
            call()
        assert_one_line(e.value, f"no manifest.json at {uri}: the stage writing it did not finish (rerun it)")


def test_recommit_replaces_marker_and_a_failed_one_leaves_none(s3, prefix, tmp_path):
    files, out = committed(s3, prefix, tmp_path)
    (tmp_path / "out" / "config.json").write_bytes(b'{"a": 2}\n')
    out2 = mf.commit(tmp_path / "out", s3.uri(prefix), mf.build_manifest("sft", "run-2", {}, {}, {}))
    assert out2["files"]["config.json"]["sha256"] != out["files"]["config.json"]["sha256"]
    assert mf.read_manifest(s3.uri(prefix))["run_id"] == "run-2"
    # The replaced output was set aside whole, its manifest with it: it still verifies.
    [aside] = {rel.split("/")[0] for rel, _ in storage.list_files(s3.uri(f"{prefix}/superseded"))}
    old = mf.read_manifest(s3.uri(f"{prefix}/superseded/{aside}"))
    assert old["run_id"] == "run-1" and old["files"] == out["files"]
    path, _ = mf.fetch(s3.uri(f"{prefix}/superseded/{aside}"), tmp_path / "old")
    assert (path / "config.json").read_bytes() == files["config.json"]
    assert not [rel for rel in out2["files"] if rel.startswith("superseded/")]
    # A recommit that dies half-way must not leave the old manifest vouching for a mix of files.
    dest = tmp_path / "store"
    mf.commit(tmp_path / "out", dest, mf.build_manifest("sft", "run-1", {}, {}, {}))
    (dest / "config.json").unlink()
    (dest / "config.json").mkdir()  # the upload of config.json will fail
    with pytest.raises(StorageError) as e:
        mf.commit(tmp_path / "out", dest, mf.build_manifest("sft", "run-2", {}, {}, {}))
    assert_one_line(e.value, str(dest / "config.json"))
    assert not (dest / "manifest.json").exists()


@pytest.mark.parametrize("damage", ["overwrite_same_size", "truncate", "delete"])
def test_fetch_refuses_damaged_files(damage, s3, prefix, tmp_path):
    files, out = committed(s3, prefix, tmp_path)
    rel = "model/tokenizer/vocab.txt"
    key, file_uri = f"{prefix}/{rel}", s3.uri(f"{prefix}/{rel}")
    c = s3.client()
    if damage == "overwrite_same_size":
        c.put_object(Bucket=s3.bucket, Key=key, Body=files[rel].upper())
        expect = "sha256 mismatch"
    elif damage == "truncate":
        c.put_object(Bucket=s3.bucket, Key=key, Body=files[rel][:3])
        expect = "size mismatch"
    else:
        c.delete_object(Bucket=s3.bucket, Key=key)
        expect = "missing"
    with pytest.raises(StorageError) as e:
        mf.fetch(s3.uri(prefix), tmp_path / "f", subdir="model")
    assert_one_line(e.value, expect, file_uri, "rerun")
    assert e.value.uri == file_uri
    assert not (tmp_path / "f" / rel).exists()  # bad bytes are not left behind
    assert not (tmp_path / "f" / "manifest.json").exists()  # nor a marker vouching for them


def test_missing_manifest_names_uri(s3, tmp_path):
    uri = s3.uri("never/written")
    with pytest.raises(NotFoundError) as e:
        mf.read_manifest(uri + "/manifest.json")
    assert_one_line(e.value, f"no manifest.json at {uri}:", "rerun it")
    with pytest.raises(NotFoundError) as e:
        mf.read_manifest(str(tmp_path / "nothing"))
    assert_one_line(e.value, f"no manifest.json at {tmp_path / 'nothing'}:")


def test_not_a_manifest_is_refused(s3, prefix, tmp_path):
    storage.write_json(s3.uri(f"{prefix}/manifest.json"), {"hello": 1})
    with pytest.raises(StorageError) as e:
        mf.read_manifest(s3.uri(prefix))
    assert_one_line(e.value, "is not a rlhf-flow/manifest/v1 manifest")
    m = mf.build_manifest("x", "r", {}, {}, {})
    storage.write_json(s3.uri(f"{prefix}/manifest.json"), {**m, "files": {"../../etc/x": {"size": 1, "sha256": "0"}}})
    with pytest.raises(StorageError, match="unsafe path"):
        mf.fetch(s3.uri(prefix), tmp_path / "f")


@pytest.mark.parametrize("form", ["plain", "file"])
def test_local_commit_and_fetch(form, tmp_path):
    files = make_tree(tmp_path / "out")
    dest = str(tmp_path / "store" / "sft") if form == "plain" else f"file://{tmp_path}/store/sft"
    out = mf.commit(tmp_path / "out", dest, mf.build_manifest("sft", "r", {}, {}, {}, model="model"))
    assert (tmp_path / "store" / "sft" / "manifest.json").is_file()
    path, m = mf.fetch(dest, tmp_path / "f", subdir="model")
    assert m["files"] == out["files"] and (path / "weights.bin").read_bytes() == files["model/weights.bin"]
    assert mf.resolve(m, "model") == storage.join(dest, "model")
    (tmp_path / "store" / "sft" / "model" / "tokenizer" / "vocab.txt").write_bytes(b"HELLO\nWORLD\n")
    with pytest.raises(StorageError) as e:
        mf.fetch(dest, tmp_path / "g")
    assert_one_line(e.value, "sha256 mismatch", storage.join(dest, "model/tokenizer/vocab.txt"))


def test_resolve():
    m = {
        "uri": "s3://b/run/sft",
        "model": "model",
        "data": "data/sft.jsonl",
        "abs": "s3://other/x",
        "local": "/mnt/x",
        "datasets": {"train": "data/train.jsonl", "ext": "s3://d/e"},
    }
    assert mf.resolve(m, "model") == "s3://b/run/sft/model"
    assert mf.resolve(m, "data") == "s3://b/run/sft/data/sft.jsonl"
    assert mf.resolve(m, "abs") == "s3://other/x"
    assert mf.resolve(m, "local") == "/mnt/x"
    assert mf.resolve(m, "datasets.train") == "s3://b/run/sft/data/train.jsonl"
    assert mf.resolve(m, "datasets.ext") == "s3://d/e"
    assert mf.resolve({**m, "uri": "/data/run/sft"}, "model") == "/data/run/sft/model"
    with pytest.raises(StorageError, match="no field 'nope'"):
        mf.resolve(m, "nope")


def test_local_cache_dir_reuses_verified_files(s3, prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    uri = s3.uri(prefix)
    d = mf.local_cache_dir(uri)
    assert d == mf.local_cache_dir(uri + "/") == mf.local_cache_dir(uri + "/manifest.json")
    assert d.parent == tmp_path / "cache" and d.is_dir() and d != mf.local_cache_dir(uri + "x")
    files, out = committed(s3, prefix, tmp_path)
    path, _ = mf.fetch(uri, d, subdir="model")
    # Delete the big object remotely: a second fetch must reuse the cache and not download it.
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/model/weights.bin")
    path2, _ = mf.fetch(uri, d, subdir="model")
    assert path2 == path and (path / "weights.bin").read_bytes() == files["model/weights.bin"]
    # Fetching the rest adds to the cache; the marker then vouches for everything present.
    mf.fetch(uri, d, subdir="logs")
    assert set(json.loads((d / "manifest.json").read_text())["files"]) == {
        "model/weights.bin",
        "model/tokenizer/vocab.txt",
        "logs/deep/nested/run.log",
    }
    # A truncated cached file is noticed by the cheap size check and downloaded again.
    (d / "model" / "tokenizer" / "vocab.txt").write_bytes(b"x")
    mf.fetch(uri, d, subdir="model/tokenizer")
    assert (d / "model" / "tokenizer" / "vocab.txt").read_bytes() == files["model/tokenizer/vocab.txt"]


def test_a_same_size_corrupted_cached_copy_is_not_reused(s3, prefix, tmp_path, monkeypatch):
    """The cache reuses a verified copy on its stat alone; a copy rewritten since (same size, other bytes) is
    hashed again and fetched again: eval never scores corrupted weights (issue 53, item 3)."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    uri = s3.uri(prefix)
    files, _ = committed(s3, prefix, tmp_path)
    d = mf.local_cache_dir(uri)
    mf.fetch(uri, d, subdir="model")
    entry = json.loads((d / "manifest.json").read_text())["files"]["model/weights.bin"]
    assert entry["mtime_ns"] == (d / "model" / "weights.bin").stat().st_mtime_ns  # the stat the digest was checked at
    weights = d / "model" / "weights.bin"
    corrupted = bytearray(weights.read_bytes())
    corrupted[12345] ^= 0xFF
    weights.write_bytes(bytes(corrupted))
    os.utime(weights, ns=(entry["mtime_ns"] + 10**9, entry["mtime_ns"] + 10**9))  # a later write, as any rewrite is
    path, _ = mf.fetch(uri, d, subdir="model")
    assert (path / "weights.bin").read_bytes() == files["model/weights.bin"]


def test_the_cache_folder_is_keyed_by_the_s3_endpoint(s3, prefix, tmp_path, monkeypatch):
    """Two stacks on one host (two emulators) may hold different objects under the same bucket and key."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    uri = s3.uri(prefix)
    here = mf.local_cache_dir(uri)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    storage.reset_client()
    try:
        assert mf.local_cache_dir(uri).name != here.name
    finally:
        monkeypatch.undo()
        storage.reset_client()
    assert mf.local_cache_dir(uri).name == here.name


# ---------------------------------------------------------------- keys that lead outside the target folder


@pytest.mark.parametrize("bad", ["../../escaped.txt", "sub/../../escaped.txt", "/escaped.txt", "a/../../escaped.txt"])
def test_a_key_leading_outside_the_folder_is_refused_before_any_download(s3, prefix, tmp_path, bad):
    """An object key (or a manifest entry) names a local path: one that leaves the folder fails in one line
    naming the key, and nothing is written, inside the folder or out."""
    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key=f"{prefix}/model/config.json", Body=b"{}")
    client.put_object(
        Bucket=s3.bucket, Key=f"{prefix}/model/{bad.lstrip('/') if bad.startswith('/') else bad}", Body=b"x"
    )
    if bad.startswith("/"):  # an absolute path: a key with an empty segment, listed as '/escaped.txt'
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/model//escaped.txt", Body=b"x")
    listed = [rel for rel, _ in storage.list_files(s3.uri(f"{prefix}/model"))]
    assert any("escaped" in rel for rel in listed), listed  # the store keeps such keys as they are
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(storage.StorageError) as err:
        storage.download_dir(s3.uri(f"{prefix}/model"), dest)
    assert "leads outside" in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.rglob("escaped.txt")) and not dest.exists()

    for rel in ("../x", "/etc/x", "", "a/../../x"):
        with pytest.raises(storage.StorageError, match="leads outside"):
            storage.inside(dest, rel)
    assert storage.inside(dest, "a/../b/c.txt") == (dest / "b" / "c.txt").resolve()


def test_a_damaged_stage_output_names_the_task_to_clear(s3, tmp_path):
    prefix = "p/runs/rlhf_pipeline/manual__2026-12-01T10_00_00+00_00/sft"
    files, _ = committed(s3, prefix, tmp_path)
    s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/config.json", Body=files["config.json"].upper())
    with pytest.raises(StorageError) as e:
        mf.fetch(s3.uri(prefix), tmp_path / "f")
    assert_one_line(
        e.value,
        "sha256 mismatch",
        "clear task sft of run manual__2026-12-01T10_00_00+00_00 of DAG rlhf_pipeline (Airflow UI: Clear, or `airflow tasks clear rlhf_pipeline -t '^sft$'`)",
    )
