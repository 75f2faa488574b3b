"""The Airflow side's one way to S3: objects by URI through an Airflow connection (default ``rlhf_s3``).

    from plugins.s3 import S3Error, S3Store

    s3 = S3Store()                                   # or S3Store("other_conn")
    s3.exists("s3://b/runs/d/r/sft/manifest.json")   # False when there is no such object
    s3.read_json(uri); s3.read_text(uri)
    s3.read(uri, missing_ok=True)                    # bytes; None when the object or its bucket is not there
    s3.write_text(uri, text)
    s3.objects("s3://b/runs/d/r/sft/")               # [{"Key", "Size", "ETag", ...}]; limit=n: at most n
    s3.folders("s3://b/runs/d/")                     # the keys' prefixes one level down ("runs/d/r/")
    s3.connection_extra()                            # the connection's extra, {} without one

Every failure of an S3 call is an S3Error (an AirflowException, so a task fails with it as is), on one line
and without credentials: ``S3 (<conn>): cannot <action> <uri>: <cause>``. Its ``code`` is S3's error code
when S3 answered ("NoSuchKey", "NoSuchBucket", "404", ...; None when it did not), ``unreachable`` is set for
botocore's own errors (no endpoint, no credentials), and ``__cause__`` is the original exception: a caller
with answers of its own (the views' HTTP statuses) builds them from these.

Each store makes its S3Hook on first use; callers make a store per use, as the connection may change
between uses. The amazon provider and botocore are imported lazily: every Airflow process loads the plugins.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from airflow.sdk.exceptions import AirflowException

from tasks.common import names

#: S3's error codes for an object or bucket that is not there (a HEAD's 404 has no other code).
MISSING = frozenset({"NoSuchKey", "NoSuchBucket", "404"})


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); the key may be empty."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


class S3Error(AirflowException):
    """An S3 call failed; see the module docstring for ``code`` and ``unreachable``."""

    def __init__(self, message: str, code: str | None = None, unreachable: bool = False):
        super().__init__(message)
        self.code = code
        self.unreachable = unreachable


class S3Store:
    """Objects by ``s3://`` URI through the Airflow connection ``aws_conn_id`` (None: boto3's defaults)."""

    def __init__(self, aws_conn_id: str | None = names.S3_CONN) -> None:
        self.aws_conn_id = aws_conn_id

    @functools.cached_property
    def _hook(self):
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def _call(self, action: str, uri: str, fn):
        """``fn(hook)``; any failure (making the hook included) becomes one S3Error naming the URI."""
        try:
            return fn(self._hook)
        except Exception as exc:  # botocore's errors have no common base worth naming here
            from botocore.exceptions import BotoCoreError, ClientError

            cause = " ".join(str(exc).split())[:300] or type(exc).__name__
            code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else None
            raise S3Error(
                f"S3 ({self.aws_conn_id}): cannot {action} {uri}: {cause}", code, isinstance(exc, BotoCoreError)
            ) from exc

    # ------------------------------------------------------------------ objects

    def exists(self, uri: str) -> bool:
        bucket, key = split_uri(uri)
        return self._call("check", uri, lambda hook: hook.check_for_key(key, bucket))

    def _get(self, hook, uri: str) -> bytes:
        bucket, key = split_uri(uri)
        return hook.get_conn().get_object(Bucket=bucket, Key=key)["Body"].read()

    def read(self, uri: str, missing_ok: bool = False) -> bytes | None:
        """The object's bytes. ``missing_ok``: None when it or its bucket is not there, instead of an S3Error
        (a view shows "not there yet"; the operator reads only what a manifest committed, so it fails)."""
        try:
            return self._call("read", uri, lambda hook: self._get(hook, uri))
        except S3Error as e:
            if missing_ok and e.code in MISSING:
                return None
            raise

    def read_head(self, uri: str, size: int) -> tuple[bytes, bool] | None:
        """(the object's first `size` bytes, whether that is all of it), one ranged GET; None when it is not there."""
        bucket, key = split_uri(uri)

        def get(hook):
            found = hook.get_conn().get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{size - 1}")
            total = int(found.get("ContentRange", "").rpartition("/")[2] or found["ContentLength"])
            return found["Body"].read(), total <= size

        try:
            return self._call("read", uri, get)
        except S3Error as e:
            if e.code in MISSING or e.code == "InvalidRange":  # InvalidRange: an empty object
                return None
            raise

    def read_text(self, uri: str) -> str:
        return self._call("read", uri, lambda hook: self._get(hook, uri).decode("utf-8"))

    def read_json(self, uri: str) -> Any:
        return json.loads(self.read_text(uri))

    def write_text(self, uri: str, text: str) -> None:
        bucket, key = split_uri(uri)
        self._call("write", uri, lambda hook: hook.load_string(text, key, bucket, replace=True))

    # ------------------------------------------------------------------ listings

    def _list(self, uri: str, folders: bool, limit: int | None) -> list:
        bucket, prefix = split_uri(uri)
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if folders:
            params["Delimiter"] = "/"
        if limit:
            params["PaginationConfig"] = {"MaxItems": limit}
        field = "CommonPrefixes" if folders else "Contents"

        def run(hook):
            pages = hook.get_conn().get_paginator("list_objects_v2").paginate(**params)
            return [item for page in pages for item in page.get(field, [])]

        return self._call("list", uri, run)

    def objects(self, uri: str, limit: int | None = None) -> list[dict]:
        """Every object whose key starts with the URI's key (S3's listing entries: Key, Size, ETag, ...)."""
        return self._list(uri, False, limit)

    def folders(self, uri: str) -> list[str]:
        """The prefixes one level below the URI's key ("<key><name>/"), as S3 lists them with delimiter "/"."""
        return [item["Prefix"] for item in self._list(uri, True, None)]

    # ------------------------------------------------------------------ connection

    def connection_extra(self) -> dict:
        """The connection's extra; {} when there is no such connection (callers then use their defaults)."""
        try:
            return self._hook.get_connection(self.aws_conn_id).extra_dejson
        except Exception:
            return {}
