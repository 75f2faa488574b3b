"""One storage layer for S3-compatible object stores and local paths: read, write, list, copy and move files.

A URI is either ``s3://bucket/key...`` or a local path (plain or ``file://``); every function takes
either, so the same stage code runs against MinIO/AWS/moto or a plain folder (debugging, tests).

    from tasks.common import storage

    storage.write_json("s3://ckpt/run1/sft/meta.json", {"step": 10})
    storage.read_json("s3://ckpt/run1/sft/meta.json")           # {"step": 10}
    storage.upload_dir("out/sft", "s3://ckpt/run1/sft", exclude=("*.tmp",))
    storage.download_dir("s3://ckpt/run1/sft", "/tmp/sft")       # parallel, multipart
    storage.list_files("s3://ckpt/run1/sft")                     # [("model/config.json", 812), ...]

Every failure raises StorageError with a one-line message naming the URI and the fix. The parts this builds
on each have a module, and every name of theirs is importable from here too (``storage.join``,
``storage.client``): tasks.common.uris (the URI grammar), tasks.common.s3_client (the client, configured
only from the environment, and S3's errors in one line), tasks.common.local_files (atomic local writes),
tasks.common.parallel (many files at once). No torch and no airflow here: both sides import this.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

import botocore.exceptions

from tasks.common.errors import NotFoundError, PreconditionFailed, StorageError
from tasks.common.local_files import atomic_copy, atomic_write, local_etag, walk_local
from tasks.common.parallel import FILE_WORKERS, parallel_map
from tasks.common.s3_client import (
    MB,
    PART_THREADS,
    S3_ERRORS,
    TRANSFER_CONFIG,
    client,
    endpoint,
    reset_client,
    storage_error,
)
from tasks.common.uris import inside, is_s3, join, local_path, split_s3

# The storage layer's names, its parts' included: callers write storage.join, storage.client, storage.walk_local.
__all__ = [
    "FILE_WORKERS",
    "MB",
    "PART_THREADS",
    "TRANSFER_CONFIG",
    "NotFoundError",
    "PreconditionFailed",
    "StorageError",
    "client",
    "copy",
    "delete",
    "download_dir",
    "download_file",
    "endpoint",
    "exists",
    "inside",
    "is_s3",
    "join",
    "list_files",
    "local_path",
    "parallel_map",
    "read_bytes",
    "read_json",
    "read_text",
    "read_versioned",
    "reset_client",
    "split_s3",
    "upload_dir",
    "upload_file",
    "walk_local",
    "write_bytes",
    "write_if",
    "write_json",
    "write_text",
]


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
    except S3_ERRORS as e:
        raise storage_error(e, uri, "check") from None


def list_files(uri: str, etags: bool = False) -> list[tuple]:
    """Every file under a prefix/directory, recursively, as sorted ``(relative POSIX path, size)``; with
    ``etags``, ``(path, size, etag)``, the etag changing whenever the content does (S3's ETag, a local
    file's sha256)."""
    if not is_s3(uri):
        root = local_path(uri)
        files = walk_local(root) if root.is_dir() else []
        return [(rel, size, local_etag(root / rel)) for rel, size in files] if etags else files
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    out = []
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/"):  # skip "folder" marker objects
                    out.append((rel, obj["Size"], obj.get("ETag", "")) if etags else (rel, obj["Size"]))
    except S3_ERRORS as e:
        raise storage_error(e, uri, "list") from None
    return sorted(out)


def read_bytes(uri: str) -> bytes:
    if not is_s3(uri):
        try:
            return local_path(uri).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"no file at {uri}: check the path or rerun the step that writes it", uri) from None
        except OSError as e:
            raise storage_error(e, uri, "read") from None
    bucket, key = split_s3(uri)
    try:
        return client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except S3_ERRORS as e:
        raise storage_error(e, uri, "read") from None


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
            return atomic_write(local_path(uri), data)
        except OSError as e:
            raise storage_error(e, uri, "write") from None
    bucket, key = split_s3(uri)
    try:
        client().put_object(Bucket=bucket, Key=key, Body=data)
    except S3_ERRORS as e:
        raise storage_error(e, uri, "write") from None


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
        raise storage_error(e, uri, "read") from None
    except S3_ERRORS as e:
        raise storage_error(e, uri, "read") from None


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
            if local_etag(path) != etag:
                raise lost
            try:
                return atomic_write(path, data)
            except OSError as e:
                raise storage_error(e, uri, "write") from None
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
        raise storage_error(e, uri, "write") from None
    except S3_ERRORS as e:
        raise storage_error(e, uri, "write") from None


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
            raise storage_error(e, uri, "delete") from None
    bucket, key = split_s3(uri)
    try:
        client().delete_object(Bucket=bucket, Key=key)
    except S3_ERRORS as e:
        raise storage_error(e, uri, "delete") from None


def upload_file(local: str | os.PathLike, uri: str) -> None:
    src = local_path(local)
    if not src.is_file():
        raise NotFoundError(f"no local file {src} to upload to {uri}: check the path", uri)
    try:
        if not is_s3(uri):
            return atomic_copy(src, local_path(uri))
        bucket, key = split_s3(uri)
        client().upload_file(str(src), bucket, key, Config=TRANSFER_CONFIG)
    except (*S3_ERRORS, OSError) as e:
        raise storage_error(e, uri, "upload to") from None


def copy(src: str, dst: str) -> None:
    """Copy one object or file; S3 copies inside the store (the bytes never pass through this process)."""
    try:
        if is_s3(src) != is_s3(dst):
            raise StorageError(f"cannot copy {src} to {dst}: both must be S3 URIs or both local paths", src)
        if not is_s3(src):
            return atomic_copy(local_path(src), local_path(dst))
        (src_bucket, src_key), (bucket, key) = split_s3(src), split_s3(dst)
        client().copy({"Bucket": src_bucket, "Key": src_key}, bucket, key, Config=TRANSFER_CONFIG)
    except (*S3_ERRORS, OSError) as e:
        raise storage_error(e, src, f"copy to {dst}") from None


def download_file(uri: str, local: str | os.PathLike) -> Path:
    dst = local_path(local)
    try:
        if not is_s3(uri):
            src = local_path(uri)
            if not src.is_file():
                raise NotFoundError(f"no file at {uri}: check the path or rerun the step that writes it", uri)
            atomic_copy(src, dst)
            return dst
        bucket, key = split_s3(uri)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # s3transfer writes to a temp name and renames, so a partial download never sits at dst.
        client().download_file(bucket, key, str(dst), Config=TRANSFER_CONFIG)
        return dst
    except (*S3_ERRORS, OSError) as e:
        raise storage_error(e, uri, "download") from None


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
