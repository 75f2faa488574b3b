"""manifest.json: the commit marker of a stage's output directory, in one import.

A stage writes its files into a local folder, then ``commit`` uploads them and writes
``<uri>/manifest.json`` LAST, listing every file with its size and sha256. A reader never consumes a
directory without it: ``read_manifest`` refuses one, and ``fetch`` verifies every byte it downloads.

    from tasks.common import manifest as mf

    m = mf.build_manifest("sft", run_id, config, inputs={"data": data_uri}, metrics={"loss": 1.2},
                          model="model")
    m = mf.commit("out/sft", "s3://ckpt/run1/sft", m)        # manifest.json written last

    # downstream (e.g. on every Ray worker of the RL stage):
    uri = "s3://ckpt/run1/sft"
    path, m = mf.fetch(uri, mf.local_cache_dir(uri), subdir="model")   # verified, cached per URI
    mf.resolve(m, "model")                                     # "s3://ckpt/run1/sft/model"

Works the same on local paths (``commit("out/sft", "/data/run1/sft", m)``). Each part changes for its own
reason and has its own module: the format (tasks.common.manifest_schema), the commit protocol
(tasks.common.manifest_commit), fetching and verifying (tasks.common.manifest_fetch), the folder lock
(tasks.common.folder_lock); the code digest a manifest records is tasks.common.provenance. This module only
hands their names on. No torch, no airflow here.
"""

from __future__ import annotations

from tasks.common.folder_lock import folder_lock
from tasks.common.manifest_commit import SUPERSEDED, commit, set_aside, upload_files
from tasks.common.manifest_fetch import fetch, local_cache_dir, repair_hint
from tasks.common.manifest_schema import (
    FORMAT,
    MANIFEST,
    RESERVED,
    build_manifest,
    check_relpath,
    config_hash,
    file_sha256,
    manifest_digest,
    read_manifest,
    resolve,
    stage_dir,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "RESERVED",
    "SUPERSEDED",
    "build_manifest",
    "check_relpath",
    "commit",
    "config_hash",
    "fetch",
    "file_sha256",
    "folder_lock",
    "local_cache_dir",
    "manifest_digest",
    "read_manifest",
    "repair_hint",
    "resolve",
    "set_aside",
    "stage_dir",
    "upload_files",
]
