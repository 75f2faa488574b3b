"""Registry and retention from the command line (no torch: runs anywhere boto3 does).

    python -m tasks.registry list      --registry s3://rlhf-flow/rlhf-flow/models/demo-policy [--json true]
    python -m tasks.registry promote   --registry … --candidate <run id> --expected_version 3 --by alice \
                                       [--override_gate true --reason "…"]
    python -m tasks.registry rollback  --registry … --to_version 2 --expected_version 4 --by alice --reason "…"
    python -m tasks.registry retention --root s3://rlhf-flow/rlhf-flow --max_age_days 30 \
                                       [--multipart_age_hours 24] [--dags rlhf_pipeline,rlhf_nightly] [--dry_run true]

``--expected_version`` is the champion version the caller saw (``list`` shows it; 0: none yet): promote and
rollback are a compare-and-swap on champion.json and refuse a stale view. ``--action <command>`` may replace
the first word, and ``--output``/``--run_id`` (what RayJobOperator always passes) make the command commit a
manifest holding its result at ``--output``, so the manual DAG (dags/rlhf_registry.py) runs it as a stage.
Bad input: one line on stderr naming the flag, exit status 2. S3 from the environment (tasks.common.storage).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from tasks.common import retention, storage
from tasks.common.config import ConfigError
from tasks.common.registry import Registry

COMMANDS = ("list", "promote", "rollback", "retention")


def _bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not true or false")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the flag, as every stage does
        command = self.prog.removeprefix("python -m tasks.registry").strip()
        raise ConfigError(f"{message}; see python -m tasks.registry {command + ' ' if command else ''}--help")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tasks.registry", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    common = _Parser(add_help=False)
    common.add_argument("--output", default="", help="commit the result as a manifest here (stage mode)")
    common.add_argument("--run_id", default="", help="the run recorded in that manifest")
    common.add_argument("--json", type=_bool, default=False, help="print JSON instead of a table")
    for name in ("list", "promote", "rollback"):
        s = sub.add_parser(name, parents=[common])
        s.add_argument("--registry", required=True, help="s3://<bucket>/<prefix>/models/<model name>")
        if name != "list":
            s.add_argument("--expected_version", type=int, required=True, help="the champion version you saw (0: none)")
            s.add_argument("--by", required=True, help="who promotes (recorded in the history)")
            s.add_argument("--reason", default="", help="why (recorded in the history)")
    sub.choices["promote"].add_argument("--candidate", required=True, help="the run id of a judged candidate")
    sub.choices["promote"].add_argument(
        "--override_gate", type=_bool, default=False, help="promote one that failed its gate"
    )
    sub.choices["rollback"].add_argument("--to_version", type=int, required=True, help="the earlier champion version")
    r = sub.add_parser("retention", parents=[common])
    r.add_argument("--root", required=True, help="s3://<bucket>/<prefix> of the pipeline")
    r.add_argument(
        "--max_age_days", type=float, required=True, help="expire failed runs and rejected candidates older than this"
    )
    r.add_argument(
        "--multipart_age_hours", type=float, default=24, help="abort unfinished multipart uploads older than this"
    )
    r.add_argument("--dags", default=",".join(retention.PIPELINE_DAGS), help="comma list of the pipeline DAG ids")
    r.add_argument("--dry_run", type=_bool, default=True, help="list what would be deleted, delete nothing (default)")
    return p


def _table(listing: dict) -> str:
    champ = listing["champion"]
    lines = [
        f"registry {listing['registry']}",
        f"champion: v{champ['version']} {champ['policy']} ({champ.get('action', 'promote')} by {champ['promoted_by']} at {champ['promoted_at']})"
        if champ
        else "champion: none yet (expected_version 0)",
        "",
        "history:",
    ]
    for h in listing["history"]:
        what = h.get("action", "promote") + (f" to v{h['rolled_back_to']}" if "rolled_back_to" in h else "")
        lines.append(
            f"  v{h['version']}  {h['promoted_at']}  {what:<16} by {h['promoted_by']:<28} run {h.get('run_id', '-')}"
            + (f"  reason: {h['reason']}" if h.get("reason") else "")
        )
    lines += ["", "candidates (newest last):"]
    for c in listing["candidates"]:
        m, cost = c.get("metrics") or {}, c.get("cost") or {}
        shown = "  ".join(f"{k}={v:.3f}" for k, v in sorted(m.items()) if isinstance(v, (int, float)))
        spent = (
            (
                f"{cost['gpu_hours']:.3f} GPU-h, {cost['wall_time_s']:.0f} s over {cost['stages']} stage(s)"
                + (f" ({cost['unknown']} without cost)" if cost.get("unknown") else "")
            )
            if cost
            else "cost unknown"
        )
        lines.append(
            f"  {c['run_id']}  {'PROMOTED' if c.get('promoted') else 'passed' if c.get('passed') else 'rejected'}  {shown}  [{spent}]"
        )
    return "\n".join(lines)


def run(argv: list[str]) -> dict:
    """Run one command; returns its result (what --json prints)."""
    argv = list(argv)
    if "--action" in argv[:-1] and (not argv or argv[0] not in COMMANDS):
        i = argv.index("--action")
        argv = [argv[i + 1], *argv[:i], *argv[i + 2 :]]
    args = parser().parse_args(argv)
    if args.command == "retention":
        dags = [d for d in args.dags.split(",") if d]
        p = retention.plan(args.root, args.max_age_days, args.multipart_age_hours, dags)
        result = {"dry_run": args.dry_run, "plan": p, "deleted": None if args.dry_run else retention.apply(p)}
        text = retention.describe(p, args.dry_run)
    else:
        reg = Registry(args.registry)
        if args.command == "list":
            result = reg.listing()
            text = _table(result)
        elif args.command == "promote":
            result = reg.promote_candidate(
                args.candidate, args.expected_version, args.by, args.override_gate, args.reason
            )
            text = f"promoted {args.candidate}: champion v{result['version']} {result['policy']}"
        else:
            result = reg.rollback(args.to_version, args.expected_version, args.by, args.reason)
            text = f"rolled back to v{args.to_version}: champion v{result['version']} {result['policy']}"
    print(json.dumps(result, indent=2, default=str) if args.json else text, flush=True)
    if args.output:
        _commit(args, result, text)
    return result


def _commit(args, result: dict, text: str) -> None:
    """Stage mode: the result as a manifest at --output (what RayJobOperator waits for)."""
    from tasks.common import manifest as manifests

    with tempfile.TemporaryDirectory(prefix="rlhf-registry-") as local:
        with open(f"{local}/result.json", "w") as f:
            json.dump(result, f, indent=2, default=str)
        metrics = {"champion_version": result["version"]} if "version" in result else {}
        if args.command == "retention":
            metrics = {
                "objects": len(result["plan"]["objects"]),
                "bytes": result["plan"]["bytes"],
                "multipart": len(result["plan"]["multipart"]),
                "dry_run": int(args.dry_run),
            }
        config = {k: v for k, v in vars(args).items() if k not in ("output", "run_id")}
        manifests.commit(
            local,
            args.output,
            manifests.build_manifest(
                f"registry_{args.command}", args.run_id, config, {}, metrics, result="result.json", summary=text[-2000:]
            ),
        )


def main(argv: list[str] | None = None) -> None:
    try:
        run(sys.argv[1:] if argv is None else argv)
    except (ConfigError, storage.StorageError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
