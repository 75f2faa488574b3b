"""One storage layer for S3-compatible object stores and local paths.

A URI is either ``s3://bucket/key...`` or a local path (plain or ``file://``); every function takes
either, so the same stage code runs against MinIO/AWS/moto or a plain folder (debugging, tests).

    from tasks.common import storage

    storage.write_json("s3://ckpt/run1/sft/meta.json", {"step": 10})
    storage.read_json("s3://ckpt/run1/sft/meta.json")           # {"step": 10}
    storage.upload_dir("out/sft", "s3://ckpt/run1/sft", exclude=("*.tmp",))
    storage.download_dir("s3://ckpt/run1/sft", "/tmp/sft")       # parallel, multipart
    storage.list_files("s3://ckpt/run1/sft")                     # [("model/config.json", 812), ...]

The S3 client is configured only from the environment, exactly where boto3 looks:
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION,
AWS_MAX_ATTEMPTS, AWS_RETRY_MODE, AWS_CONFIG_FILE, ... Every failure raises StorageError with a
one-line message naming the URI and the fix. No torch and no airflow here: both sides import this.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from tasks.common.errors import (
    NotFoundError,
    PreconditionFailed,
    StorageError,
    disk_error,
    disk_fault,
    fault_path,
    one_line,
)

MB = 1024 * 1024
FILE_WORKERS = 8  # files transferred at once by upload_dir/download_dir
PART_THREADS = 8  # parts of one large file transferred at once
# Multipart above 8 MB: parts retry independently and large checkpoints use several connections.
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=8 * MB, multipart_chunksize=8 * MB, max_concurrency=PART_THREADS, use_threads=True
)

T = TypeVar("T")
R = TypeVar("R")


# ---------------------------------------------------------------- URIs


def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; the key may be empty (bucket root)."""
    if not is_s3(uri):
        raise StorageError(f"not an S3 URI: {uri}: use s3://bucket/key", uri)
    bucket, _, key = str(uri)[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"no bucket in {uri}: use s3://bucket/key", uri)
    return bucket, key


def join(uri: str | os.PathLike, *parts: str) -> str:
    """Append path parts to an S3 URI or local path (keeps ``s3://`` / ``file://`` as given)."""
    uri = str(uri)
    parts = tuple(p.strip("/") for p in map(str, parts) if p and p.strip("/"))
    if is_s3(uri) or uri.startswith("file://"):
        return "/".join((uri.rstrip("/"), *parts)) if parts else uri
    return os.path.join(uri, *parts)


def inside(root: str | os.PathLike, rel: str, source: str = "") -> Path:
    """``root / rel``, refused unless it stays under ``root``: every local path named by remote data (an object
    key, a manifest entry) goes through here, so a key such as ``model/../../etc/x`` or ``/tmp/x`` cannot
    write outside the folder it is downloaded into."""
    base, text = Path(root).resolve(), str(rel)
    if text and not text.startswith(("/", "\\")) and "\0" not in text:
        target = (base / text).resolve()
        if target.is_relative_to(base) and target != base:
            return target
    raise StorageError(
        f"{source or 'download'}: the key {text!r} leads outside {base}; refusing to write it (remove or rename that object in storage)",
        source or None,
    )


def local_path(uri: str | os.PathLike) -> Path:
    """The filesystem path of a local URI (plain or ``file://``)."""
    uri = str(uri)
    if is_s3(uri):
        raise StorageError(f"{uri} is an S3 URI, not a local path: download it first", uri)
    return Path(uri[len("file://") :] if uri.startswith("file://") else uri)


# ---------------------------------------------------------------- client

_ENV_KEYS = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
_client_lock = threading.Lock()
_client_cache: dict[tuple, Any] = {}


def _make_client():
    retries: dict[str, Any] = {}
    # Explicit Config values beat the environment, so only default what the environment leaves unset.
    if "AWS_RETRY_MODE" not in os.environ:
        retries["mode"] = "standard"
    if "AWS_MAX_ATTEMPTS" not in os.environ:
        retries["total_max_attempts"] = 6
    checksums: dict[str, str] = {}
    # boto3 >= 1.36 sends CRC checksums by default, which many S3-compatible servers reject.
    if "AWS_REQUEST_CHECKSUM_CALCULATION" not in os.environ:
        checksums["request_checksum_calculation"] = "when_required"
    if "AWS_RESPONSE_CHECKSUM_VALIDATION" not in os.environ:
        checksums["response_checksum_validation"] = "when_required"
    config = Config(
        retries=retries,
        max_pool_connections=FILE_WORKERS * PART_THREADS,
        connect_timeout=10,
        read_timeout=120,
        **checksums,
    )
    # A fresh Session: boto3's default session is not thread-safe and may hold stale settings.
    return boto3.session.Session().client("s3", config=config)


def client():
    """The process's boto3 S3 client (thread-safe; rebuilt after fork or when AWS_* env changes)."""
    key = (os.getpid(), *(os.environ.get(k) for k in _ENV_KEYS))
    c = _client_cache.get(key)
    if c is None:
        with _client_lock:
            c = _client_cache.get(key)
            if c is None:
                _client_cache.clear()
                c = _client_cache[key] = _make_client()
    return c


def reset_client() -> None:
    """Forget the cached client; the next call builds one from the current environment."""
    with _client_lock:
        _client_cache.clear()


def endpoint() -> str:
    return client().meta.endpoint_url


def _wrap(exc: BaseException, uri: str, action: str) -> StorageError:
    """Turn a botocore/boto3 exception into a one-line StorageError naming the URI and the fix."""
    # boto3's S3UploadFailedError hides the ClientError it came from in __context__.
    if isinstance(exc, boto3.exceptions.S3UploadFailedError) and exc.__context__ is not None:
        exc = exc.__context__
    if isinstance(exc, StorageError):
        return exc
    cause = one_line(exc)
    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        return StorageError(
            f"cannot reach S3 endpoint {endpoint()} for {uri}: {cause} (start the S3 service or fix AWS_ENDPOINT_URL_S3)",
            uri,
            transient=True,
        )
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return StorageError(
            f"no AWS credentials to {action} {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", uri
        )
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        bucket = split_s3(uri)[0] if is_s3(uri) else "?"
        if code == "NoSuchBucket":
            return NotFoundError(
                f"no bucket '{bucket}' at {endpoint()} for {uri}: create the bucket or fix the URI", uri
            )
        if code in ("404", "NoSuchKey", "NotFound"):
            return NotFoundError(f"no object at {uri}: check the URI or rerun the step that writes it", uri)
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(
                f"access denied to {action} {uri} ({code}): check the AWS_* credentials for {endpoint()}", uri
            )
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        busy = status >= 500 or code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout")
        return StorageError(f"cannot {action} {uri}: {code}: {err.get('Message') or cause}", uri, transient=busy)
    if isinstance(exc, (botocore.exceptions.BotoCoreError, boto3.exceptions.Boto3Error)):
        return StorageError(f"cannot {action} {uri}: {cause}", uri)
    if disk_fault(exc):
        # The file that failed (a temp file beside the target, or the local side of a transfer), else the URI.
        return disk_error(exc, fault_path(exc) or uri, action, target=uri)
    if isinstance(exc, OSError):
        return StorageError(f"cannot {action} {uri}: {cause}", uri)
    return StorageError(f"cannot {action} {uri}: {type(exc).__name__}: {cause}", uri)


_S3_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, boto3.exceptions.Boto3Error)


# ---------------------------------------------------------------- parallel helper


def parallel_map(fn: Callable[[T], R], items: Iterable[T], max_workers: int = FILE_WORKERS) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first failure cancels the rest and is raised."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise f.exception()
        return [f.result() for f in futures]


# ---------------------------------------------------------------- local helpers


def _atomic_copy(src: Path, dst: Path) -> None:
    """Copy via a temp file + rename so a reader never sees a half-written file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and os.path.samefile(src, dst):
        return  # e.g. commit() of a directory onto itself
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write(dst: Path, data: bytes) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def walk_local(local_dir: str | os.PathLike, exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Files under a local directory as sorted ``(relative POSIX path, size)``.

    ``exclude`` holds fnmatch patterns matched against the relative path ("manifest.json" is only the
    top-level one; "*.tmp" matches at any depth because fnmatch's * also matches "/").
    """
    root = local_path(local_dir)
    exclude = tuple(exclude)
    out = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if any(fnmatch.fnmatchcase(rel, pat) for pat in exclude):
            continue
        out.append((rel, path.stat().st_size))
    return sorted(out)


# ---------------------------------------------------------------- object API


def exists(uri: str) -> bool:
    """True if ``uri`` is an existing object/file, or a prefix/directory with something under it."""
    if not is_s3(uri):
        return local_path(uri).exists()
    bucket, key = split_s3(uri)
    try:
        if key and not key.endswith("/"):
            try:
                client().head_object(Bucket=bucket, Key=key)
                return True
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise
        prefix = key.rstrip("/") + "/" if key else ""
        resp = client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        return resp.get("KeyCount", 0) > 0
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "check") from None


def list_files(uri: str, etags: bool = False) -> list[tuple]:
    """Every file under a prefix/directory, recursively, as sorted ``(relative POSIX path, size)``; with
    ``etags``, ``(path, size, etag)``, the etag changing whenever the content does (S3's ETag, a local
    file's sha256)."""
    if not is_s3(uri):
        root = local_path(uri)
        files = walk_local(root) if root.is_dir() else []
        return [(rel, size, _local_etag(root / rel)) for rel, size in files] if etags else files
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    out = []
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/"):  # skip "folder" marker objects
                    out.append((rel, obj["Size"], obj.get("ETag", "")) if etags else (rel, obj["Size"]))
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "list") from None
    return sorted(out)


def read_bytes(uri: str) -> bytes:
    if not is_s3(uri):
        try:
            return local_path(uri).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"no file at {uri}: check the path or rerun the step that writes it", uri) from None
        except OSError as e:
            raise _wrap(e, uri, "read") from None
    bucket, key = split_s3(uri)
    try:
        return client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "read") from None


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def read_json(uri: str) -> Any:
    data = read_bytes(uri)
    try:
        return json.loads(data)
    except ValueError as e:
        raise StorageError(f"invalid JSON in {uri}: {e}: rewrite or delete the object", uri) from None


def write_bytes(uri: str, data: bytes) -> None:
    if not is_s3(uri):
        try:
            return _atomic_write(local_path(uri), data)
        except OSError as e:
            raise _wrap(e, uri, "write") from None
    bucket, key = split_s3(uri)
    try:
        client().put_object(Bucket=bucket, Key=key, Body=data)
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "write") from None


def _local_etag(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_versioned(uri: str) -> tuple[bytes | None, str | None]:
    """``(content, etag)`` of an object, ``(None, None)`` when it does not exist; the etag feeds write_if."""
    if not is_s3(uri):
        path = local_path(uri)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()
    bucket, key = split_s3(uri)
    try:
        resp = client().get_object(Bucket=bucket, Key=key)
        return resp["Body"].read(), resp["ETag"]
    except botocore.exceptions.ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None, None
        raise _wrap(e, uri, "read") from None
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "read") from None


def write_if(uri: str, data: bytes, etag: str | None) -> None:
    """Compare-and-swap: write only if the object still has ``etag`` (None: only if it does not exist).

    S3 does this itself (If-Match / If-None-Match on PutObject); a local file does it under a lock.
    Raises PreconditionFailed when another writer got there first.
    """
    lost = PreconditionFailed(f"{uri} changed since it was read: read it again and retry", uri)
    if not is_s3(uri):
        path = local_path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _local_etag(path) != etag:
                raise lost
            try:
                return _atomic_write(path, data)
            except OSError as e:
                raise _wrap(e, uri, "write") from None
    bucket, key = split_s3(uri)
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    try:
        client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
    except botocore.exceptions.ClientError as e:
        if e.response.get("Error", {}).get("Code") in (
            "PreconditionFailed",
            "ConditionalRequestConflict",
            "412",
            "409",
        ):
            raise lost from None
        raise _wrap(e, uri, "write") from None
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "write") from None


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def delete(uri: str) -> None:
    """Delete one object/file; a missing one is not an error."""
    if not is_s3(uri):
        try:
            return local_path(uri).unlink(missing_ok=True)
        except OSError as e:
            raise _wrap(e, uri, "delete") from None
    bucket, key = split_s3(uri)
    try:
        client().delete_object(Bucket=bucket, Key=key)
    except _S3_ERRORS as e:
        raise _wrap(e, uri, "delete") from None


def upload_file(local: str | os.PathLike, uri: str) -> None:
    src = local_path(local)
    if not src.is_file():
        raise NotFoundError(f"no local file {src} to upload to {uri}: check the path", uri)
    try:
        if not is_s3(uri):
            return _atomic_copy(src, local_path(uri))
        bucket, key = split_s3(uri)
        client().upload_file(str(src), bucket, key, Config=TRANSFER_CONFIG)
    except (*_S3_ERRORS, OSError) as e:
        raise _wrap(e, uri, "upload to") from None


def copy(src: str, dst: str) -> None:
    """Copy one object or file; S3 copies inside the store (the bytes never pass through this process)."""
    try:
        if is_s3(src) != is_s3(dst):
            raise StorageError(f"cannot copy {src} to {dst}: both must be S3 URIs or both local paths", src)
        if not is_s3(src):
            return _atomic_copy(local_path(src), local_path(dst))
        (src_bucket, src_key), (bucket, key) = split_s3(src), split_s3(dst)
        client().copy({"Bucket": src_bucket, "Key": src_key}, bucket, key, Config=TRANSFER_CONFIG)
    except (*_S3_ERRORS, OSError) as e:
        raise _wrap(e, src, f"copy to {dst}") from None


def download_file(uri: str, local: str | os.PathLike) -> Path:
    dst = local_path(local)
    try:
        if not is_s3(uri):
            src = local_path(uri)
            if not src.is_file():
                raise NotFoundError(f"no file at {uri}: check the path or rerun the step that writes it", uri)
            _atomic_copy(src, dst)
            return dst
        bucket, key = split_s3(uri)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # s3transfer writes to a temp name and renames, so a partial download never sits at dst.
        client().download_file(bucket, key, str(dst), Config=TRANSFER_CONFIG)
        return dst
    except (*_S3_ERRORS, OSError) as e:
        raise _wrap(e, uri, "download") from None


def upload_dir(local_dir: str | os.PathLike, uri: str, exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Upload every file under ``local_dir`` (minus ``exclude`` patterns) to ``uri``, files in parallel.

    Returns the uploaded ``(relative path, size)`` list.
    """
    root = local_path(local_dir)
    if not root.is_dir():
        raise NotFoundError(f"no local directory {root} to upload to {uri}: check the path", uri)
    files = walk_local(root, exclude)
    parallel_map(lambda f: upload_file(root / f[0], join(uri, f[0])), files)
    return files


def download_dir(uri: str, local_dir: str | os.PathLike, files: Iterable[str] | None = None) -> Path:
    """Download everything under ``uri`` (or just the relative paths in ``files``) into ``local_dir``."""
    root = local_path(local_dir)
    if files is None:
        files = [rel for rel, _ in list_files(uri)]
        if not files:
            raise NotFoundError(f"nothing under {uri}: check the URI or rerun the step that writes it", uri)
    targets = {rel: inside(root, rel, join(uri, rel)) for rel in files}  # every key checked before any download
    root.mkdir(parents=True, exist_ok=True)
    parallel_map(lambda rel: download_file(join(uri, rel), targets[rel]), list(targets))
    return root
