"""Rerun a committed stage from its manifest and (with --check) compare its metrics with the recorded ones.

    python -m tasks.reproduce <manifest URI> --output <new output URI> [--check] [--rtol 1e-6] \\
        [--allow_code_change]

<manifest URI> is a stage folder or its manifest.json, s3://… or local. Exit status: 0 reproduced
(metrics match, with --check), 1 metrics or inputs differ (the table, then a one-line summary),
2 refused or failed (one line on stderr). See tasks/reproduce/rerun.py for what is checked.
"""

from __future__ import annotations

import argparse
import sys

from tasks.reproduce import rerun as reproduce


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and status 2, as every stage's flag errors
        print(f"error: {message}; see python -m tasks.reproduce --help", file=sys.stderr, flush=True)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tasks.reproduce",
        allow_abbrev=False,
        description="Rerun a committed stage from its manifest alone (config, inputs, code version, seed).",
    )
    p.add_argument("manifest", help="the original stage output: its folder or manifest.json URI (s3://… or local)")
    p.add_argument("--output", required=True, help="a new, empty URI for the rerun's output (never the original's)")
    p.add_argument("--check", action="store_true", help="compare the rerun's metrics and inputs with the recorded ones")
    p.add_argument(
        "--rtol",
        type=float,
        default=reproduce.DEFAULT_RTOL,
        help="relative tolerance for float metrics (ints and strings compare exactly)",
    )
    p.add_argument(
        "--allow_code_change",
        action="store_true",
        help="rerun even though this checkout's code version differs from the recorded one",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    from tasks.common.stage import USER_ERRORS

    args = parser().parse_args(argv)
    if not args.rtol >= 0:
        parser().error(f"--rtol: must be >= 0, got {args.rtol}")
    try:
        _, rows, matches, line = reproduce.reproduce(
            args.manifest, args.output, check=args.check, rtol=args.rtol, allow_code_change=args.allow_code_change
        )
    except (reproduce.ReproduceError, *USER_ERRORS) as error:
        # A worker's error reaches us wrapped by Ray; the cause's one line is what the user needs.
        print(f"error: {getattr(error, 'cause', None) or error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if rows:
        print(reproduce.table(rows), flush=True)
    # The verdict is the last line: on stdout when it matches, on stderr (like every error) when not.
    print(line, file=sys.stdout if matches else sys.stderr, flush=True)
    sys.exit(0 if matches else 1)


if __name__ == "__main__":
    main()
