#!/usr/bin/env python3
"""Locked installs: one pinned constraints file per install set, made from pyproject.toml's ranges.

    python tools/lock.py generate        # `make lock`: resolve every set with uv, write locks/<set>.txt
    python tools/lock.py check           # `make test` runs it first: fail when a lock is stale
    python tools/lock.py hash dev        # sha256 of locks/dev.txt (what `make install` records in the venv)

As Airflow does with its constraints files: a range in pyproject.toml says what may work, a lock says
what was tested. Every install uses a lock as pip constraints (`pip install -c locks/<set>.txt …`), so two
fresh machines on two different days install the same versions. Each lock's header records the sha256
of the dependency tables its set was resolved from (requires-python, dependencies and the set's extras);
`check` recomputes it, so a range changed without `make lock` fails CI in one line, and only for the sets
that read it. `generate` keeps every version a lock already has unless a range now excludes it (uv prefers
the pins of the lock it rewrites), so adding one package to one set moves nothing else.

The sets and where they are installed:
    dev      .[airflow,train,dev]   Python 3.11: `make install` (this machine, CI)
    airflow  .[airflow,deploy]      Python 3.11: docker/Dockerfile.airflow
    train    .[train]               Python 3.11: a CPU Ray worker (`pip install -c locks/train.txt .[train]`)
    gpu      .[train,gpu]           Python 3.12: docker/Dockerfile.ray-gpu (CUDA torch, vLLM)

CPU sets take the CPU build of torch that lies in /opt/wheels on this kind of machine (PyPI's torch is
the CUDA build, whose nvidia-* wheels are gigabytes); locks/pins-<kind>.txt hold the few versions chosen
by hand, each with its reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
CPU_WHEELS = Path("/opt/wheels")
SETS = {
    "dev": {"extras": ["airflow", "train", "dev"], "python": "3.11", "pins": "pins-cpu.txt"},
    "airflow": {"extras": ["airflow", "deploy"], "python": "3.11", "pins": None},
    "train": {"extras": ["train"], "python": "3.11", "pins": "pins-cpu.txt"},
    "gpu": {"extras": ["train", "gpu"], "python": "3.12", "pins": "pins-gpu.txt"},
}
HEADER = re.compile(r"^# pyproject-dependencies-sha256: ([0-9a-f]{64})$", re.M)


class LockError(Exception):
    pass


def dependencies_digest(name: str, pyproject: Path = REPO / "pyproject.toml") -> str:
    """sha256 of what set `name`'s resolution reads from pyproject.toml: requires-python, dependencies and
    its extras. Other edits (another set's extra, pytest options, the description) leave its lock current."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    tables = {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies"),
        "optional-dependencies": {extra: extras.get(extra) for extra in SETS[name]["extras"]},
    }
    return hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()


def lock_path(name: str, locks: Path = LOCKS) -> Path:
    return locks / f"{name}.txt"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def uv() -> str:
    """The uv next to this interpreter (the dev extra installs it), else one on PATH."""
    local = Path(sys.executable).with_name("uv")
    return str(local) if local.exists() else "uv"


def generate(names: list[str]) -> None:
    import shutil
    import tempfile

    LOCKS.mkdir(exist_ok=True)
    for name in names:
        spec = SETS[name]
        # uv reads the file it writes to as preferences: a copy of the current lock keeps its versions.
        work = Path(tempfile.mkdtemp(prefix=f"lock-{name}-")) / "lock.txt"
        if lock_path(name).exists():
            shutil.copy(lock_path(name), work)
        cmd = [
            uv(),
            "pip",
            "compile",
            "pyproject.toml",
            *(f"--extra={e}" for e in spec["extras"]),
            f"--output-file={work}",
            f"--python-version={spec['python']}",
            "--python-platform=x86_64-manylinux_2_28",
            # DeepSpeed ships an sdist whose setup.py imports torch: build its metadata with this venv's torch
            # instead of letting uv download a CUDA torch into an isolated build environment.
            "--no-build-isolation-package=deepspeed",
            f"--python={sys.executable}",
            "--no-header",
            "--no-annotate",
            "--quiet",
        ]
        if spec["pins"]:
            cmd.append(f"--constraint=locks/{spec['pins']}")
        if spec["pins"] == "pins-cpu.txt":
            if not CPU_WHEELS.is_dir():
                raise LockError(
                    f"{name}: the CPU torch wheel folder {CPU_WHEELS} is missing; run `make lock` on the development machine image, which has it"
                )
            cmd.append(f"--find-links={CPU_WHEELS}")
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        if done.returncode != 0:
            raise LockError(
                f"{name}: uv could not resolve .[{','.join(spec['extras'])}]: {done.stderr.strip()[-2000:]}"
            )
        resolved = "".join(line + "\n" for line in work.read_text().splitlines() if line and not line.startswith("#"))
        shutil.rmtree(work.parent, ignore_errors=True)
        header = (
            f"# Lock of the `{name}` install set: .[{','.join(spec['extras'])}] on CPython {spec['python']}, Linux x86_64.\n"
            f"# Made by `make lock` (tools/lock.py) on {date.today().isoformat()}; use as pip constraints:\n"
            f'#   pip install -c locks/{name}.txt -e ".[{",".join(spec["extras"])}]"\n'
            f"# pyproject-dependencies-sha256: {dependencies_digest(name)}\n"
        )
        lock_path(name).write_text(header + resolved)
        print(f"locks/{name}.txt: {len(resolved.splitlines())} pins")


def check(pyproject: Path = REPO / "pyproject.toml", locks: Path = LOCKS) -> list[str]:
    """One line per lock that is missing or was made from other dependency tables than pyproject.toml's."""
    problems = []
    for name in SETS:
        digest = dependencies_digest(name, pyproject)
        path = lock_path(name, locks)
        if not path.exists():
            problems.append(f"locks/{name}.txt: missing; run `make lock` and commit locks/")
            continue
        found = HEADER.search(path.read_text())
        if not found or found.group(1) != digest:
            problems.append(
                f"locks/{name}.txt: stale against pyproject.toml's dependencies; run `make lock` and commit locks/"
            )
    return problems


def pins(name: str) -> dict[str, str]:
    """{normalised package name: version} of a lock."""
    out = {}
    for line in lock_path(name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            package, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", package.split("[")[0]).lower()] = version.split(";")[0].strip()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="resolve the sets with uv and write locks/<set>.txt")
    gen.add_argument("sets", nargs="*", help=f"some of {', '.join(SETS)} (default: all)")
    sub.add_parser("check", help="fail when a lock is missing or stale")
    digest = sub.add_parser("hash", help="print a lock's sha256")
    digest.add_argument("set", choices=list(SETS))
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            unknown = [name for name in args.sets if name not in SETS]
            if unknown:
                raise LockError(f"sets: unknown {', '.join(unknown)}; choose from {', '.join(SETS)}")
            generate(args.sets or list(SETS))
        elif args.command == "check":
            problems = check()
            for line in problems:
                print(f"error: {line}", file=sys.stderr)
            return 1 if problems else 0
        else:
            print(file_sha256(lock_path(args.set)))
    except LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
