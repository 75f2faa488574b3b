"""What produced a stage's output, as its manifest records it: the code (git HEAD, and a digest of the stage code
that sees uncommitted edits), the versions of the packages that decide its numbers, the lock the environment was
installed from and the pinned CPU code paths. No torch: versions come from package metadata.

    from tasks.common import provenance
    provenance.code_version()      # "3f2c…" (RLHF_CODE_VERSION, git HEAD, or the installed version)
    provenance.code_digest()       # sha256 of tasks/**/*.py and pyproject.toml
    provenance.package_versions()  # {"python": "3.11.9", "torch": "2.11.0", "lock": "dev sha256:…", …}
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# Versions recorded for reproducibility, the packages that decide a stage's numbers; read from package
# metadata so nothing heavy is imported.
TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "accelerate",
    "peft",
    "deepspeed",
    "numpy",
    "safetensors",
    "ray",
    "datasets",
    "vllm",
)
# Written by `make install` and the images (tools/lock.py): which lock the environment was installed from.
LOCK_RECORD = "rlhf-flow-lock.json"
# The CPU code paths tasks/__init__.py pins; recorded because they change floats as much as a version does.
NUMERICS_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
REPO = Path(__file__).resolve().parents[2]


def code_version() -> str:
    """RLHF_CODE_VERSION, else the repo's git HEAD, else the installed rlhf-flow version."""
    if os.environ.get("RLHF_CODE_VERSION"):
        return os.environ["RLHF_CODE_VERSION"]
    # Only ask git when this file sits in a checkout: an installed copy could be inside another repo.
    if (REPO / ".git").exists():
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return metadata.version("rlhf-flow")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=8)
def code_digest(root: str | Path = REPO) -> str:
    """sha256 over the stage code under `root`: every tasks/**/*.py and pyproject.toml (default: beside this
    package, a checkout, a Ray job's working_dir or an install). The stage records it in its manifest, and the
    Airflow side keys its stage cache on it for the working_dir it ships (plugins/stage_cache.py).

    Unlike code_version (git HEAD), it changes with uncommitted edits, which tasks.reproduce must see.
    Computed once per process and root, at the first call (StageRun makes it when the stage starts), so a file
    edited while the stage runs is not taken for the code that ran."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted([*root.glob("tasks/**/*.py"), root / "pyproject.toml"]):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_versions() -> dict[str, str]:
    """Python, the tracked packages, the lock this environment was installed from (`lock`: set and sha256)
    and the pinned CPU code paths (`cpu_numerics`)."""
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    try:
        record = json.loads((Path(sys.prefix) / LOCK_RECORD).read_text())
        versions["lock"] = f"{record['set']} sha256:{record['sha256']}"
    except (OSError, ValueError, KeyError, TypeError):
        versions["lock"] = "none"  # installed without a lock (pip install -e . by hand)
    versions["cpu_numerics"] = " ".join(f"{k}={os.environ.get(k, '')}" for k in NUMERICS_VARIABLES)
    return versions
