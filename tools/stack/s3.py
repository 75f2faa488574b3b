"""The stack's S3 emulator as a client sees it: a boto3 client, the default bucket, and the one-time
migration of a snapshot an older `down` saved (the emulator now writes through to <scratch>/s3-data)."""

from __future__ import annotations

import json

from tools.stack.config import Config, s3_keys


def s3_client(cfg: Config):
    import boto3
    from botocore.config import Config as BotoConfig

    key_id, secret = s3_keys(cfg.scratch)
    return boto3.client(
        "s3",
        endpoint_url=cfg.s3_endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=BotoConfig(retries={"max_attempts": 2}, connect_timeout=3, read_timeout=60),
    )


def migrate_snapshot(cfg: Config) -> tuple[int, int]:
    """Load a snapshot an older `down` saved into the running emulator (which writes it to s3-data),
    then rename it to s3-snapshot.migrated. Returns (objects, bytes); (0, 0) when there is none."""
    manifest_path = cfg.snapshot / "manifest.json"
    if not manifest_path.exists():
        return 0, 0
    manifest = json.loads(manifest_path.read_text())
    s3 = s3_client(cfg)
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    count = size = 0
    for bucket, objects in manifest["buckets"].items():
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        for obj in objects:
            extra = {"Metadata": obj.get("metadata") or {}}
            if obj.get("content_type"):
                extra["ContentType"] = obj["content_type"]
            s3.upload_file(str(cfg.snapshot / obj["file"]), bucket, obj["key"], ExtraArgs=extra)
            count += 1
            size += obj.get("size", 0)
    cfg.snapshot.rename(cfg.scratch / "s3-snapshot.migrated")
    return count, size


def ensure_bucket(cfg: Config) -> None:
    s3 = s3_client(cfg)
    if cfg.bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=cfg.bucket)
