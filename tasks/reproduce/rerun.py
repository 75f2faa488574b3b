"""Rerun a committed stage from its manifest alone, and check that it reaches the same metrics.

    python -m tasks.reproduce <manifest URI> --output <new output URI> [--check] [--rtol 1e-6] \\
        [--allow_code_change]

    python -m tasks.reproduce s3://b/p/runs/rlhf_pipeline/r1/sft --output s3://b/p/repro/r1/sft --check

The manifest (a stage folder or its manifest.json, s3:// or local) says everything the rerun needs:
the stage, its whole resolved config (seed included), the inputs it read and, since manifests record
them, the sha256 of each input's manifest. The rerun:

1. refuses what it cannot reproduce (promote, see tasks.common.stages, and the registry commands change
   the model registry, so rerunning them is an action, not a check);
2. rebuilds the stage's config with only ``output`` replaced, ``run_id`` marked
   ``reproduce-<original run id>``, ``ckpt_path`` cleared (no resuming from the original's
   checkpoints), ``save_path`` cleared (it would overwrite the original's extra copy of its model) and
   the fault injection (``fail_after_step``) off;
3. refuses, in one line, an output that already holds something, inputs that are gone or whose
   manifest changed since, a manifest whose inputs disagree with its config, and code other than the
   recorded one unless ``--allow_code_change``: the ``code_version`` (git HEAD or RLHF_CODE_VERSION)
   and, in manifests that record it, the ``code_digest`` of tasks/**/*.py, which sees uncommitted edits;
4. runs the stage in this process through ``tasks.common.stage.run``, with the same config class and
   work function its ``python -m tasks.<stage>`` passes to ``tasks.common.stage.main``;
5. with ``--check``, compares the new manifest's metrics with the recorded ones (ints, strings and
   bools exactly, floats within ``--rtol``; the cost fields, which measure the machine and not the
   computation, are shown but not compared) and the inputs the rerun actually read (an eval stage
   reads the registry's *current* champion), prints a table, and fails on any difference.

Exit status: 0 reproduced (and matching, with --check); 1 metrics or inputs differ; 2 refused or
failed (one line on stderr, like every stage). No airflow here; torch only once the stage runs.
Run it where the stage itself would run: it places the stage's Ray workers like the stage does
(RAY_ADDRESS, or as a Ray job whose entrypoint is this command).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable

from tasks.common import cost, provenance, stages, storage
from tasks.common import manifest as manifests
from tasks.common.config import ConfigError, make_config, split_list

DEFAULT_RTOL = 1e-6
# Metrics that measure the run, not what it computed (tasks.common.cost adds them to every stage's).
IGNORED_METRICS = frozenset(cost.FIELDS)
IGNORED_PREFIXES = ("time_",)  # per-phase timings, should a stage ever put them into its manifest


class ReproduceError(ValueError):
    """A refusal: the message is one line naming the field and the fix."""


# ---------------------------------------------------------------- which code runs a stage


# Registry commands (promote, rollback, retention) are not stages: nothing names them in tasks.common.stages.
REGISTRY_COMMANDS = "registry_"
REGISTRY_REFUSAL = "it is a registry command (promote, rollback, retention) that changes the registry; run python -m tasks.registry list to see the registry's state instead"

# Config fields the rerun must not copy from the original: {field: value}.
RESET_FIELDS = {
    "ckpt_path": "",  # the original's checkpoints: resuming from them would skip the work being checked
    "save_path": "",  # writes outside --output: it would overwrite the original's copy of its model
    "fail_after_step": 0,  # fault injection (testing only)
}


def refusal(stage: str) -> str | None:
    """Why `stage` is not reproduced (its rerun would change shared state rather than recompute an output), or None."""
    if stage.startswith(REGISTRY_COMMANDS):
        return REGISTRY_REFUSAL
    entry = stages.STAGES.get(stage)
    return entry.not_reproducible if entry and entry.not_reproducible else None


def stage_code(stage: str) -> tuple[type, Callable]:
    """(config class, work function) of a stage, as tasks.common.stages names them (the same its
    python -m <package> passes to tasks.common.stage.main)."""
    why = refusal(stage)
    if why:
        raise ReproduceError(f"stage: {stage} is not reproducible: {why}")
    entry = stages.STAGES.get(stage)
    if entry is None:
        raise ReproduceError(
            f"stage: {stage!r} is not in tasks.common.stages.STAGES; add it there (known: {', '.join(stages.STAGES)})"
        )
    return entry.config_class(), entry.work_function()


# ---------------------------------------------------------------- the manifest and the rerun's config


def load_manifest(uri: str) -> dict:
    """The committed manifest at `uri`, its config hash checked (a hand-edited config is not the run)."""
    m = manifests.read_manifest(uri)
    for key in ("stage", "run_id", "config"):
        if key not in m:
            raise ReproduceError(f"{key}: missing from the manifest at {m['uri']}; it was not written by a stage")
    if m.get("config_hash") and manifests.config_hash(m["config"]) != m["config_hash"]:
        raise ReproduceError(
            f"config: the config in {m['uri']}/manifest.json does not match its config_hash; the manifest was edited, reproduce an untouched one"
        )
    return m


def same_uri(a: str, b: str) -> bool:
    return manifests.stage_dir(a) == manifests.stage_dir(b)


def rebuild_config(manifest: dict, config_cls: type, output: str):
    """The recorded config with the rerun's output, a marked run id, and RESET_FIELDS reset."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    values = {**manifest["config"], "output": output, "run_id": f"reproduce-{manifest['run_id']}"}
    values.update({k: v for k, v in RESET_FIELDS.items() if k in fields})
    try:
        return make_config(config_cls, values)
    except ConfigError as e:
        # The usual cause: the config class changed since (a field renamed or removed).
        raise ReproduceError(f"config: the recorded config no longer builds a {config_cls.__name__} ({e})") from None


def check_output(manifest: dict, output: str) -> None:
    """The rerun writes to a fresh place: never the original's folder, never over another output."""
    if not output:
        raise ReproduceError("output: missing; pass --output <new URI> (s3://… or a local folder)")
    if same_uri(output, manifest["uri"]):
        raise ReproduceError(
            f"output: {output} is the original's folder; pass another --output, the original stays as the reference"
        )
    local = None if storage.is_s3(output) else storage.local_path(output)
    empty_dir = local is not None and local.is_dir() and not any(local.iterdir())
    if storage.exists(output) and not empty_dir:
        raise ReproduceError(
            f"output: {output} already holds files (an earlier rerun's output or checkpoints it would resume from); pass an empty --output or delete it"
        )


# ---------------------------------------------------------------- inputs and code


def stored(uri: str) -> bool:
    """Whether `uri` names something in storage we can check (not a hub id or an http endpoint)."""
    if storage.is_s3(uri) or uri.startswith(("/", "./", "../", "file://")):
        return True
    return not uri.startswith(("http://", "https://")) and storage.local_path(uri).exists()


def check_input(name: str, uri: str, digests: dict | None) -> str:
    """Refuse an input that is gone or changed; returns how it was checked (for the log)."""
    recorded = (digests or {}).get(uri)
    if recorded:
        now = manifests.manifest_digest(uri)
        if now is None:
            raise ReproduceError(
                f"inputs.{name}: {uri} has no manifest.json any more; restore it, or reproduce the stage that wrote it to that URI first"
            )
        if now != recorded:
            raise ReproduceError(
                f"inputs.{name}: {uri}/manifest.json changed since the original run (sha256 "
                f"{recorded[:12]}… then, {now[:12]}… now): the rerun would read other data; "
                "restore the original input"
            )
        return "same manifest sha256"
    if not stored(uri):
        return "not checked (hub id or endpoint)"
    if not storage.exists(uri):
        raise ReproduceError(
            f"inputs.{name}: {uri} no longer exists; restore it, or reproduce the stage that wrote it first"
        )
    # Manifests written before input_manifests was recorded: existence is all we can check.
    return "exists" if digests is None else "exists (not a stage output)"


def check_inputs(manifest: dict, cfg) -> dict[str, str]:
    """Refuse inputs that disagree with the config or changed since; {input: how it was checked}."""
    values = cfg.to_dict()
    digests = manifest.get("input_manifests")
    checked = {}
    for name, uri in (manifest.get("inputs") or {}).items():
        named = values.get(name)
        # Inputs without a config field of their name, or with an empty one, are derived by the
        # stage (rl's critic from the first reward model, eval's champion from the registry).
        if isinstance(named, str) and named and named != uri:
            raise ReproduceError(
                f"inputs.{name}: the manifest records {uri} but its config names {named}; the manifest is inconsistent, rerun the pipeline instead"
            )
        for part in split_list(uri) if isinstance(uri, str) else []:
            checked[f"{name}: {part}"] = check_input(name, part, digests)
    return checked


def check_code(manifest: dict, allow_change: bool) -> list[str]:
    """Refuse code other than the recorded one unless allowed; returns notes on what was not matched.

    Both the version (git HEAD, or RLHF_CODE_VERSION) and, where recorded, the digest of tasks/**/*.py
    must match: the version alone misses uncommitted edits."""
    recorded, current = manifest.get("code_version") or "unknown", provenance.code_version()
    then, now = manifest.get("code_digest"), provenance.code_digest()
    if recorded == "unknown" and not allow_change:
        raise ReproduceError(
            f"code_version: the manifest records no code version, so this checkout ({current}) "
            "cannot be matched to it; pass --allow_code_change to rerun with it anyway"
        )
    if recorded != current and not allow_change:
        raise ReproduceError(
            f"code_version: the manifest records {recorded}, this checkout is {current}; check out "
            f"{recorded} (or set RLHF_CODE_VERSION) or pass --allow_code_change"
        )
    if then and then != now and not allow_change:
        raise ReproduceError(
            f"code_digest: tasks/ differs from the code that ran (sha256 {then[:12]}… then, {now[:12]}… "
            f"now) though both are version {current}: uncommitted edits? restore them or pass --allow_code_change"
        )
    notes = [f"code {current} instead of the recorded {recorded} (--allow_code_change)"] if recorded != current else []
    notes += (
        [f"tasks/ code digest {now[:12]}… instead of the recorded {then[:12]}… (--allow_code_change)"]
        if then and then != now
        else []
    )
    notes += (
        [] if then else ["the manifest records no code digest (written before it was): uncommitted edits go unseen"]
    )
    return notes


def version_changes(manifest: dict) -> list[str]:
    """Library versions that differ from the original run's (they can change floats)."""
    then, now = manifest.get("versions") or {}, provenance.package_versions()
    return [f"{k} {then.get(k)} -> {now.get(k)}" for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]


# ---------------------------------------------------------------- comparing


def ignored(metric: str) -> bool:
    return metric in IGNORED_METRICS or metric.startswith(IGNORED_PREFIXES)


def same_value(a: Any, b: Any, rtol: float) -> bool:
    """Ints, strings, bools, None and containers exactly; a float on either side within rtol."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if numbers and (isinstance(a, float) or isinstance(b, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    return type(a) is type(b) and a == b


def compare_metrics(recorded: dict, new: dict, rtol: float) -> list[tuple[str, Any, Any, str]]:
    """(metric, recorded, reproduced, verdict) rows; verdict is "ok", "DIFFERS", "MISSING" or "ignored"."""
    rows = []
    for key in sorted(set(recorded) | set(new)):
        a, b = recorded.get(key, "—"), new.get(key, "—")
        if ignored(key):
            verdict = "ignored"
        elif key not in recorded or key not in new:
            verdict = "MISSING"
        else:
            verdict = "ok" if same_value(a, b, rtol) else "DIFFERS"
        rows.append((key, a, b, verdict))
    return rows


def compare_inputs(original: dict, new: dict) -> list[tuple[str, Any, Any, str]]:
    """Rows for inputs the rerun read differently: another URI (an eval's registry champion moved on)
    or another manifest behind the same URI."""
    rows = []
    a_in, b_in = original.get("inputs") or {}, new.get("inputs") or {}
    for name in sorted(set(a_in) | set(b_in)):
        a, b = a_in.get(name, "—"), b_in.get(name, "—")
        if a != b:
            rows.append((f"inputs.{name}", a, b, "DIFFERS"))
    a_sha, b_sha = original.get("input_manifests"), new.get("input_manifests") or {}
    for uri, sha in (a_sha or {}).items():
        if uri in b_sha and b_sha[uri] != sha:
            rows.append((f"input_manifests[{uri}]", sha[:12], b_sha[uri][:12], "DIFFERS"))
    return rows


def files_line(original: dict, new: dict) -> str:
    """Which output files came out byte-identical (information only: a timing column in a log differs
    legitimately, and metrics are what the check decides on)."""
    a, b = original.get("files") or {}, new.get("files") or {}
    differ = sorted(rel for rel in set(a) | set(b) if a.get(rel, {}).get("sha256") != b.get(rel, {}).get("sha256"))
    shown = f"; differ: {', '.join(differ[:5])}{', …' if len(differ) > 5 else ''}" if differ else ""
    return f"reproduce: files: {len(set(a) | set(b)) - len(differ)} of {len(set(a) | set(b))} byte-identical to the original's{shown}"


def fmt(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def table(rows: list[tuple[str, Any, Any, str]]) -> str:
    """A plain fixed-width table: metric | recorded | reproduced | verdict."""
    cells = [("metric", "recorded", "reproduced", "check")] + [(k, fmt(a), fmt(b), v) for k, a, b, v in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells)


def summary(stage: str, rows: list[tuple[str, Any, Any, str]], rtol: float) -> tuple[bool, str]:
    """(matches, one line) for the rows of a check."""
    bad = [r for r in rows if r[3] not in ("ok", "ignored")]
    compared = sum(r[3] != "ignored" for r in rows)
    if not bad:
        return True, f"reproduce: {stage} reproduced: {compared} metrics match (rtol {rtol:g}; cost fields ignored)"
    shown = ", ".join(f"{k} ({fmt(a)} vs {fmt(b)})" for k, a, b, _ in bad[:3]) + (", …" if len(bad) > 3 else "")
    return False, f"reproduce: {stage} NOT reproduced: {len(bad)} of {compared} differ: {shown}"


# ---------------------------------------------------------------- the whole rerun


def preflight(uri: str, output: str, allow_code_change: bool = False):
    """Everything checked before any work: (manifest, config, work function). Raises ReproduceError
    or a StorageError (manifest missing or corrupt), each one line."""
    manifest = load_manifest(uri)
    config_cls, work = stage_code(manifest["stage"])
    # Before the config: changed code is what makes a recorded config no longer build.
    for note in check_code(manifest, allow_code_change):
        print(f"reproduce: note: {note}", flush=True)
    check_output(manifest, output)
    cfg = rebuild_config(manifest, config_cls, output)
    for what, how in check_inputs(manifest, cfg).items():
        print(f"reproduce: input {what}: {how}", flush=True)
    for change in version_changes(manifest):
        print(f"reproduce: note: {change} since the original run; floats may differ", flush=True)
    if manifest.get("resumed_from_step"):
        print(
            f"reproduce: note: the original resumed from its step {manifest['resumed_from_step']} checkpoint; this rerun starts from scratch",
            flush=True,
        )
    return manifest, cfg, work


def run_stage(stage: str, cfg, work: Callable) -> dict:
    """Run the stage in this process as its __main__ would (stage.main minus the flag parsing)."""
    from tasks.common import stage as stages

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"{stage}: config {cfg.to_dict()}", flush=True)
    stages.run(stage, cfg, work)
    return manifests.read_manifest(cfg.output)


def reproduce(
    uri: str, output: str, check: bool = False, rtol: float = DEFAULT_RTOL, allow_code_change: bool = False
) -> tuple[dict, list, bool, str]:
    """Rerun the stage committed at `uri` into `output`. Returns (new manifest, comparison rows,
    matches, one-line summary); without `check` the rows are empty and matches is True."""
    manifest, cfg, work = preflight(uri, output, allow_code_change)
    new = run_stage(manifest["stage"], cfg, work)
    if not check:
        return new, [], True, f"reproduce: {manifest['stage']} rerun committed to {new['uri']} (not checked)"
    print(files_line(manifest, new), flush=True)
    rows = compare_metrics(manifest.get("metrics") or {}, new.get("metrics") or {}, rtol) + compare_inputs(
        manifest, new
    )
    matches, line = summary(manifest["stage"], rows, rtol)
    return new, rows, matches, line
