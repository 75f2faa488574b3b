"""Stage caching: skip a stage whose exact work was already done, anywhere under the pipeline's prefix.

A stage's cache key is the sha256 of the canonical JSON of:

- ``module``: the stage module (``tasks.sft``);
- ``args``: every flag the stage gets, as rendered for this run (Params included), except ``--output``
  and ``--run_id``, which only say where and for whom;
- ``inputs``: for each flag whose value names stored content, a digest of that content, not of its
  location (:meth:`StageCache.content_digest`): a stage manifest (``s3://…/manifest.json``) by the sha256
  of its bytes (it lists every file of its stage with its sha256); any other S3 object or folder (a
  dataset file, a team's environment or reward file, a model folder) by the ETags and sizes S3 computed
  from its bytes; a file of the shipped code or of the operator's folders by its sha256. A replaced
  reward file or dataset is then a miss, and the stage runs again on what it holds now;
- ``code``: the sha256 of the stage code shipped to Ray (every ``tasks/**/*.py`` and pyproject.toml
  of the working_dir), or the installed rlhf-flow version when no code is shipped.

The index is one object per key, ``<output_root>/cache/<key>.json``, holding the URI of the manifest
that key produced; it is written after a stage succeeds. A hit returns that manifest's URI as the
stage's output, so downstream stages read the earlier run's artifacts and their own keys match too.
A hit also needs the output's files to still be what its manifest committed (:func:`mismatches`).

    cache = StageCache(S3Store(conn_id), "s3://bucket/prefix", log)
    key = cache.key("tasks.sft", {"pretrain": "s3://…/manifest.json", "max_steps": 30}, working_dir)
    cache.lookup(key)                       # the manifest URI of an earlier, still whole run, or None
    cache.record(key, {"manifest": uri, …})  # after a stage succeeded
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from plugins.s3 import S3Store, split_uri
from plugins.stage_cli import render_flag_value
from tasks.common import manifest as manifests
from tasks.common import provenance

#: Flags that say where the output goes and which run it belongs to, not what is computed.
NOT_IN_KEY = frozenset({"output", "run_id"})


def is_manifest_uri(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("s3://") and value.endswith("/manifest.json")


def code_digest(working_dir: str | None) -> str:
    """sha256 over the stage code a job runs (tasks.common.provenance.code_digest of ``working_dir``, the digest
    each stage records), or the installed rlhf-flow version when no code is shipped."""
    if not working_dir:
        try:
            return "rlhf-flow==" + metadata.version("rlhf-flow")
        except metadata.PackageNotFoundError:
            return "unknown"
    return provenance.code_digest(working_dir)


def cache_key(module: str, args: Mapping[str, str], input_digests: Mapping[str, str], code: str) -> str:
    """The key of a stage run: see the module docstring for what goes in."""
    payload = {
        "module": module,
        "args": {k: v for k, v in sorted(args.items()) if k not in NOT_IN_KEY},
        "inputs": dict(sorted(input_digests.items())),
        "code": code,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def index_uri(output_root: str, key: str) -> str:
    return f"{output_root.rstrip('/')}/cache/{key}.json"


def mismatches(files: Mapping[str, Mapping[str, Any]], stored: Mapping[str, tuple[int, str]]) -> list[str]:
    """Why a committed output cannot be reused as it is: one entry per file of the manifest's ``files``
    table ({path: {"size", "sha256", "etag"}}) that is missing from ``stored`` ({path: (size, etag)}, a
    listing of the output folder) or differs from it in size or ETag. Empty when everything matches.

    The ETag is what S3 computes from the bytes it holds (a manifest written before ETags were recorded
    is checked on sizes only); the sha256 needs the bytes and is checked by every stage that reads them.
    """
    problems = []
    for rel, entry in sorted(files.items()):
        if rel not in stored:
            problems.append(f"{rel} is missing")
            continue
        size, etag = stored[rel]
        if entry.get("size") is not None and int(entry["size"]) != int(size):
            problems.append(f"{rel} has {size} bytes, the manifest says {entry['size']}")
        elif entry.get("etag") and entry["etag"] != etag:
            problems.append(f"{rel} changed since it was committed (ETag {etag}, the manifest says {entry['etag']})")
    return problems


class StageCache:
    """The cache index under ``output_root``, and the check that a committed output is still whole, read and
    written through ``store``. Warnings go to ``log`` (the operator's: they belong in the task log)."""

    def __init__(self, store: S3Store, output_root: str, log: Any) -> None:
        self.store = store
        self.output_root = output_root
        self.log = log

    def key(self, module: str, args: Mapping[str, Any], working_dir: str | None) -> str:
        """The key of running ``module`` with ``args`` (the operator's {flag: value}, rendered as the
        entrypoint renders them) on the code of ``working_dir``; a manifest input counts by its bytes."""
        flags = {k: render_flag_value(v) for k, v in args.items() if v is not None}
        inputs = {}
        for flag, value in flags.items():
            digests = [self.content_digest(part.strip(), working_dir) for part in value.split(",")]
            if any(digests):
                inputs[flag] = ",".join(d or "" for d in digests)
        return cache_key(module, flags, inputs, code_digest(working_dir))

    def content_digest(self, value: str, working_dir: str | None = None) -> str | None:
        """A digest of what ``value`` names (see the module docstring), or None when it names no content this
        side can see (a number, a hub id, a path only a Ray node has)."""
        where = value.split("#", 1)[0]  # a user_code pin (#sha256=…) is in the flags already
        if is_manifest_uri(where):
            return hashlib.sha256(self.store.read_text(where).encode()).hexdigest()
        if where.startswith("s3://"):
            _, key = split_uri(where)
            listed = [
                o for o in self.store.objects(where) if o["Key"] == key or o["Key"].startswith(key.rstrip("/") + "/")
            ]
            entries = sorted((o["Key"][len(key) :], o["Size"], o.get("ETag", "")) for o in listed)
            return "s3:" + hashlib.sha256(json.dumps(entries).encode()).hexdigest() if entries else None
        if where.endswith(".py") or where.startswith(("/", "file://")):
            local = Path(where.removeprefix("file://"))
            if not local.is_absolute() and working_dir:
                local = Path(working_dir) / local
            if local.is_file():
                return "sha256:" + manifests.file_sha256(local)
        return None

    def lookup(self, key: str) -> str | None:
        """The manifest a completed run with this key produced, if it is still there and its files still
        are what it committed (a changed one makes the lookup a miss: the stage is computed again)."""
        index = index_uri(self.output_root, key)
        if not self.store.exists(index):
            return None
        manifest = self.store.read_json(index).get("manifest", "")
        if not manifest or not self.store.exists(manifest):
            return None
        problems = self.output_problems(manifest)
        if problems:
            self.log.warning(
                "Cache entry %s points at %s, whose files changed since they were committed (%s): not reusing it",
                key,
                manifest,
                "; ".join(problems[:3]),
            )
            return None
        return manifest

    def record(self, key: str, entry: Mapping[str, Any]) -> None:
        """Index a completed run under its key (``entry`` holds its ``manifest`` and who produced it)."""
        self.store.write_text(index_uri(self.output_root, key), json.dumps(entry, indent=2))

    def output_problems(self, manifest: str) -> list[str]:
        """How a committed output's folder differs from its manifest (sizes and S3's ETags; see
        mismatches); empty when it is whole."""
        files = self.store.read_json(manifest).get("files")
        if not isinstance(files, dict):  # not a stage manifest: nothing to check against
            return []
        folder = manifest.removesuffix("manifest.json")
        prefix = split_uri(folder)[1]
        stored = {obj["Key"][len(prefix) :]: (obj["Size"], obj.get("ETag", "")) for obj in self.store.objects(folder)}
        return mismatches(files, stored)
