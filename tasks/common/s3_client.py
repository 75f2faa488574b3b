"""The process's boto3 S3 client, configured only from the environment, and S3 failures as one-line errors.

    from tasks.common import s3_client

    s3_client.client().head_object(Bucket="ckpt", Key="run1/sft/manifest.json")
    try:
        s3_client.client().list_objects_v2(Bucket="ckpt", Prefix="run1/")
    except s3_client.S3_ERRORS as e:
        raise s3_client.storage_error(e, "s3://ckpt/run1", "list") from None   # StorageError naming URI and fix

The client reads its settings exactly where boto3 looks: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_MAX_ATTEMPTS, AWS_RETRY_MODE,
AWS_CONFIG_FILE, ... and is rebuilt after a fork or when one of them changes. What changes here is how this
process talks to S3 (retries, checksums, pools, error wording); tasks.common.storage builds its object API on it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from tasks.common.errors import NotFoundError, StorageError, disk_error, disk_fault, fault_path, one_line
from tasks.common.parallel import FILE_WORKERS
from tasks.common.uris import is_s3, split_s3

MB = 1024 * 1024
PART_THREADS = 8  # parts of one large file transferred at once
# Multipart above 8 MB: parts retry independently and large checkpoints use several connections.
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=8 * MB, multipart_chunksize=8 * MB, max_concurrency=PART_THREADS, use_threads=True
)

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


def storage_error(exc: BaseException, uri: str, action: str) -> StorageError:
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


S3_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, boto3.exceptions.Boto3Error)
