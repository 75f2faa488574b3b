"""The trained model in one command: a run's policy, the registry's champion or any stage output, copied to a local
folder as a plain Hugging Face model, every file checked against its stage's manifest (a LoRA adapter comes merged
into its base).

    python -m tools.export --run manual__2026-12-06T10:00:00+00:00 --out ./policy   # that run's policy (rlhf_pipeline)
    python -m tools.export --champion --out ./champion                               # the registry's champion (demo-policy)
    python -m tools.export s3://rlhf-flow/rlhf-flow/runs/rlhf_pipeline/<run_id>/sft --out ./sft
    make export RUN=<run_id> OUT=./policy            # or CHAMPION=1; OUT defaults to ./exported-model

It reaches the local stack's S3 by itself (its endpoint and keys from .scratch, as `python -m tools.stack env` prints
them) unless AWS_ENDPOINT_URL_S3 is set. Then:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tokenizer = AutoModelForCausalLM.from_pretrained("./policy"), AutoTokenizer.from_pretrained("./policy")
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import names, storage
from tasks.common.registry import Registry


class ExportError(Exception):
    """What to export cannot be found: one line naming it and what to pass instead."""


def use_local_stack() -> None:
    """The local stack's S3 endpoint and keys, unless the caller's environment names a store already."""
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        return
    from tools.stack.processes import current_config

    env = current_config().env()
    for key in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL_S3",
        "RLHF_BUCKET",
    ):
        os.environ.setdefault(key, env[key])


def default_root() -> str:
    """Where the pipeline writes with its form's defaults: s3://<the stack's bucket>/rlhf-flow."""
    return f"s3://{os.environ.get('RLHF_BUCKET', 'rlhf-flow')}/rlhf-flow"


def run_policy(root: str, dag_id: str, run_id: str) -> str:
    """The policy a pipeline run trained: the one its eval stage scored, else its rl, dpo or kto output."""
    run = storage.join(root, "runs", dag_id, run_id)
    evaluated = storage.join(run, "eval")
    if manifests.manifest_digest(evaluated):
        policy = manifests.read_manifest(evaluated).get("inputs", {}).get("policy")
        if policy:
            return policy
    for stage in ("rl", "dpo", "kto"):
        if manifests.manifest_digest(storage.join(run, stage)):
            return storage.join(run, stage)
    raise ExportError(
        f"run: no committed policy under {run}/ (eval, rl, dpo or kto); check --run, --dag and --root (the form's bucket and prefix)"
    )


def champion_policy(root: str, model_name: str) -> str:
    champion, _ = Registry(storage.join(root, "models", model_name)).champion()
    if not champion:
        raise ExportError(
            f"champion: nothing promoted yet in {storage.join(root, 'models', model_name)}; export a run's policy with --run"
        )
    return champion["policy"]


def export(uri: str, out: Path) -> Path:
    """Copy the model of the stage output `uri` (verified file by file, a LoRA adapter merged) into `out`."""
    from tasks.common.nn.models import resolve_model

    if out.exists() and any(out.iterdir()):
        raise ExportError(f"out: {out} is not empty; name a new folder (nothing was overwritten)")
    local = Path(resolve_model(uri))
    shutil.copytree(local, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(manifests.MANIFEST))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("uri", nargs="?", help="a stage output holding a model (s3://…/runs/<dag>/<run>/<stage>)")
    what.add_argument("--run", help="a pipeline run's id: its policy")
    what.add_argument("--champion", action="store_true", help="the registry's champion")
    parser.add_argument("--out", type=Path, default=Path("exported-model"), help="a new or empty local folder")
    parser.add_argument("--dag", default=names.PIPELINE_DAG, help="--run: the DAG the run belongs to")
    parser.add_argument(
        "--model_name", default="demo-policy", help="--champion: the registry's model name (the form's)"
    )
    parser.add_argument(
        "--root", help="the form's s3://<bucket>/<prefix> (default: the local stack's bucket, prefix rlhf-flow)"
    )
    args = parser.parse_args(argv)
    try:
        use_local_stack()
        root = args.root or default_root()
        uri = args.uri or (
            champion_policy(root, args.model_name) if args.champion else run_policy(root, args.dag, args.run)
        )
        out = export(uri, args.out)
    except (ExportError, storage.StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {uri} to {out}/, every file checked against its manifest. Load it with:")
    print("    from transformers import AutoModelForCausalLM, AutoTokenizer")
    print(
        f'    model, tokenizer = AutoModelForCausalLM.from_pretrained("{out}"), AutoTokenizer.from_pretrained("{out}")'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
