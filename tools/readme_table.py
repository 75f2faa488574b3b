"""The README's demo table, written from a real demo run's eval report; tests/e2e/test_e2e.py holds the README to it.

    python -m tools.readme_table --run manual__2026-12-07T06:00:00+00:00   # that rlhf_pipeline run, on the stack's S3
    python -m tools.readme_table --report s3://…/eval/report.json          # or a report (and its manifest) anywhere
    make readme-table RUN=<run id>

Only the block between README.md's demo-table markers changes: the metrics table and win rate the run's eval
printed, under a line naming the commit, the machine, the lock and the CPU code paths that made them. The e2e test
that runs the demo compares its own table with that block on the same machine and lock, and names the first cell
that differs; after a change that moves the demo's numbers on purpose, rerun the demo and this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from tasks.common import storage
from tasks.eval.report import results_markdown

REPO = Path(__file__).resolve().parents[1]
BEGIN = (
    "<!-- demo-table: written by `make readme-table` from a demo run's eval report; tests/e2e/test_e2e.py compares -->"
)
END = "<!-- /demo-table -->"


class ReadmeTableError(Exception):
    """The README has no demo-table block, or the report cannot be read: one line saying which."""


def machine() -> str:
    """This machine as the block names it: its processor and core count (other ones may reduce in another order)."""
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def provenance_line(manifest: dict, on: str) -> str:
    versions = manifest.get("versions", {})
    return (
        f"From one run of commit {manifest.get('code_version', 'unknown')[:12]} on {manifest.get('created_at', '?')[:10]}, "
        f"seed {manifest.get('config', {}).get('seed', '?')}, on `{on}`; installed from lock "
        f"`{versions.get('lock', 'none')}`, torch {versions.get('torch', '?')}, CPU code paths "
        f"`{versions.get('cpu_numerics', '')}`."
    )


def block(report: dict, manifest: dict, on: str | None = None) -> str:
    """The README's block for this report, made on machine `on` (default: this one): the provenance line, then what
    the eval printed first."""
    lines = "\n".join(results_markdown(report)).splitlines()
    return "\n".join([provenance_line(manifest, on or machine()), "", *lines])


def current(readme: str) -> str:
    """The block between the markers in the README's text."""
    if BEGIN not in readme or END not in readme:
        raise ReadmeTableError(f"README.md has no demo-table block: add the lines {BEGIN!r} and {END!r}")
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def _recorded(readme_block: str, after: str) -> str | None:
    first = readme_block.splitlines()[0] if readme_block else ""
    return first.split(after, 1)[1].split("`", 1)[0] if after in first else None


def recorded_lock(readme_block: str) -> str | None:
    """The lock the block's numbers were made with (its provenance line), or None."""
    return _recorded(readme_block, "installed from lock `")


def recorded_machine(readme_block: str) -> str | None:
    """The machine the block's numbers were made on, or None."""
    return _recorded(readme_block, ", on `")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def first_difference(readme_block: str, report: dict) -> str | None:
    """None when the block shows the report's numbers; else the first differing cell, named by row and column."""
    want = [line for line in readme_block.splitlines()[1:] if line.strip()]
    got = [line for line in "\n".join(results_markdown(report)).splitlines() if line.strip()]
    header = _cells(got[0]) if got and got[0].startswith("|") else []
    for i in range(max(len(want), len(got))):
        w, g = (want[i] if i < len(want) else "(nothing)"), (got[i] if i < len(got) else "(nothing)")
        if w == g:
            continue
        if w.startswith("|") and g.startswith("|"):
            for j, (wc, gc) in enumerate(zip(_cells(w), _cells(g), strict=False)):
                if wc != gc:
                    column = header[j] if j < len(header) else f"column {j + 1}"
                    return f"row {_cells(g)[0]!r}, {column!r}: the README has {wc!r}, this run {gc!r}"
        return f"line {i + 1} of the table: the README has {w!r}, this run {g!r}"
    return None


def write(readme_path: Path, new_block: str) -> None:
    text = readme_path.read_text()
    current(text)  # the markers are there
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme_path.write_text(f"{head}{BEGIN}\n{new_block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.readme_table", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", help="an rlhf_pipeline run id: its eval report on the local stack's S3")
    which.add_argument("--report", help="a report.json (local or s3://); its manifest.json is read beside it")
    parser.add_argument("--root", default="", help="where the pipeline writes (default: the form's, on the stack's S3)")
    parser.add_argument("--readme", default=str(REPO / "README.md"), help="the README to rewrite")
    args = parser.parse_args(argv)
    from tools.export import default_root, use_local_stack

    try:
        if args.run:
            use_local_stack()
            report_uri = storage.join(
                args.root or default_root(), "runs", "rlhf_pipeline", args.run, "eval", "report.json"
            )
        else:
            report_uri = args.report
        folder = report_uri.rsplit("/", 1)[0]
        try:
            report = json.loads(storage.read_bytes(report_uri))
            manifest = json.loads(storage.read_bytes(storage.join(folder, "manifest.json")))
        except (storage.StorageError, ValueError) as e:
            raise ReadmeTableError(f"cannot read the eval report at {report_uri}: {e}") from None
        write(Path(args.readme), block(report, manifest))
    except ReadmeTableError as e:
        print(f"readme_table: {e}", file=sys.stderr)
        return 2
    print(f"{args.readme}: demo table written from {report_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
