"""A user's dataset as a registered version: map its columns, validate every row, split it, register it.

    version = ingest(cfg, workdir)      # the version's manifest (new, or the one this data already made)

Each row becomes a canonical record through the column mapping (--input_key or --messages_key for the
prompt; --output_key, --chosen_key, --rejected_key, --label_key), and the records become the splits
the stages read, with the demo's names and columns:

    sft              {prompt, response}              response: --output_key, else the final assistant turn, else chosen
    preference       {prompt, chosen, rejected}      the reward model's pairs (and DPO's, as style_pairs)
    style_pairs      {prompt, chosen, rejected}
    unpaired         {prompt, completion, label}     KTO: chosen -> true, rejected -> false
    preference_eval  {prompt, chosen, rejected}      held out
    prompts          {prompt[, label]}               RL's prompts, each once
    eval             {prompt[, label]}               held out, each once

A prompt is a string, or with --messages_key a list of {"role", "content"}: every turn before the final
assistant turn. A dataset with an image column (--image_key, `images` by default) gives each record its images
(tasks/data/images.py: decoded once, checked, stored as base64 PNG in an `images` column of every split), one per
`<image>` tag or {"type": "image"} content block of its prompt; its images are part of the prompt's identity.
A prompt sits on one side of the split only: held out when a hash of it and --seed falls
under --eval_fraction. Every row is checked (see FIXES); a bad row is left out, counted under its check
with a few example row numbers, printed, and recorded in the manifest's `validation`; more than
--max_bad_fraction bad rows fail the step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tasks.common import cost, errors
from tasks.common import manifest as manifests
from tasks.common.config import ConfigError
from tasks.data import images, sources, versions
from tasks.data.config import PrepareDataConfig, default_dataset_name
from tasks.data.mapping import BadRow, canonical, held_out, length, normalized, prompt_key

#: In every version id: a change to how rows are mapped, checked or split must change it.
# v2: text that is not UTF-8 is a bad row (invalid_utf8), no longer U+FFFD. v3: an image column is kept (--image_key):
# a file with an `images` column registered before it was ingested without them.
INGEST_FORMAT = "rlhf-flow/ingest/v3"
EXAMPLES = 5  # example row numbers kept per check

#: Each check and what to change when it fails rows: the failure line names it.
FIXES = {
    "malformed": "fix the file: each row a JSON object, each CSV line as wide as the header",
    "invalid_utf8": "save the file as UTF-8 (those rows hold bytes of another encoding or a cut character)",
    "missing_field": "fill those rows or fix the column mapping",
    "empty_field": "fill those rows or fix the column mapping",
    "wrong_type": "prompts and responses must be text (a prompt may be chat messages via --messages_key)",
    "bad_messages": "each message needs a text role and content, and a turn before the final assistant turn",
    "identical_pair": "chosen and rejected must differ",
    "too_long": "raise --max_chars or shorten those rows",
    "duplicate": "deduplicate the data",
    "overlap": "held-out prompts equal to a training prompt up to case and spacing; deduplicate the prompts",
    "bad_image": "each image a path beside the dataset file, a data: URI, base64 or bytes of a PNG, JPEG, GIF, BMP, WebP or TIFF",
    "image_too_large": "downscale those images or raise --max_image_pixels",
    "image_count": "give each prompt one <image> tag (or {'type': 'image'} block) per image of the row, in order",
}


# ---------------------------------------------------------------- every row


class Tally:
    """Bad rows per check: a count, the first few row numbers, and the columns to blame."""

    def __init__(self):
        self.checks: dict[str, dict] = {}

    def add(self, bad: BadRow, number: int) -> None:
        check = self.checks.setdefault(bad.reason, {"count": 0, "rows": [], "fields": {}})
        check["count"] += 1
        if len(check["rows"]) < EXAMPLES:
            check["rows"].append(number)
        if bad.field:
            check["fields"][bad.field] = check["fields"].get(bad.field, 0) + 1

    @property
    def bad(self) -> int:
        return sum(c["count"] for c in self.checks.values())


def check_columns(rows: list[tuple[int, sources.Row]], cfg: PrepareDataConfig, source: str) -> None:
    """A mapped column that no row has is a mapping mistake, not bad rows: fail naming the flag."""
    columns: set[str] = set()
    for _, row in rows:
        if isinstance(row, dict):
            columns |= set(row)
    if not columns:
        return  # no readable row at all: validation reports them as malformed
    for flag, column in cfg.mapping().items():
        if column and column not in columns:
            optional = "" if flag in ("input_key", "messages_key") else f", or --{flag} '' to not use one"
            raise ConfigError(
                f"{flag}: no column {column!r} in {source} (columns: {', '.join(sorted(columns))}); pass --{flag} <column>{optional}"
            )


def image_source(rows: list[tuple[int, sources.Row]], cfg: PrepareDataConfig) -> images.ImageSource | None:
    """Where the rows' images come from, when some row has the --image_key column (else the data is text only)."""
    if cfg.image_key and any(isinstance(row, dict) and cfg.image_key in row for _, row in rows):
        return images.ImageSource.of(cfg.source, cfg.max_image_pixels)
    return None


def validate(rows: list[tuple[int, sources.Row]], cfg: PrepareDataConfig) -> tuple[list[dict], list[dict], dict]:
    """(train records, held-out records, validation summary) of the numbered rows."""
    tally, seen, kept = Tally(), set(), []
    source = image_source(rows, cfg)
    for number, row in rows:
        try:
            record = canonical(row, cfg, source)
            if length(record) > cfg.max_chars:
                raise BadRow("too_long")
            key = json.dumps(record, sort_keys=True, ensure_ascii=False)
            if key in seen:
                raise BadRow("duplicate")
            seen.add(key)
        except BadRow as bad:
            tally.add(bad, number)
            continue
        kept.append((number, record))
    sides = [
        (number, record, held_out(record["prompt"], cfg.seed, cfg.eval_fraction, record.get("images", ())))
        for number, record in kept
    ]
    train = [record for _, record, out in sides if not out]
    # The split keeps a prompt on one side; a near-copy (other case or spacing) hashes elsewhere and would
    # leak into the held-out side, so it leaves the held-out side and is counted.
    seen_in_train = {normalized(r["prompt"], r.get("images", ())) for r in train}
    held = []
    for number, record, out in sides:
        if out and normalized(record["prompt"], record.get("images", ())) in seen_in_train:
            tally.add(BadRow("overlap"), number)
        elif out:
            held.append(record)
    summary = {
        "rows": len(rows),
        "kept": len(train) + len(held),
        "bad": tally.bad,
        "bad_fraction": round(tally.bad / len(rows), 4) if rows else 0.0,
        "checks": tally.checks,
    }
    if source is not None:
        summary["images"] = sum(len(r["images"]) for r in train + held)
    if cfg.label_key:
        summary["unlabelled"] = sum(r.get("label") is None for r in train + held)
    return train, held, summary


def describe(summary: dict) -> str:
    """One line: rows read, kept, and each check's count with example rows."""
    checks = "; ".join(
        f"{name} {c['count']} (rows {', '.join(map(str, c['rows']))}{', …' if c['count'] > len(c['rows']) else ''})"
        for name, c in sorted(summary["checks"].items())
    )
    return (
        f"validation: {summary['rows']} rows, {summary['kept']} kept, {summary['bad']} bad ({100 * summary['bad_fraction']:.1f}%)"
        + (f": {checks}" if checks else "")
    )


def check_threshold(summary: dict, cfg: PrepareDataConfig, source: str) -> None:
    """Fail in one line when more rows failed than --max_bad_fraction allows, saying which checks and what to change."""
    if summary["bad"] <= cfg.max_bad_fraction * summary["rows"]:  # exact: bad_fraction is rounded for reading
        return
    parts, flags = [], {**cfg.mapping(), "image_key": cfg.image_key}
    for name, c in sorted(summary["checks"].items(), key=lambda kv: -kv[1]["count"]):
        fields = (
            f"{', '.join(f'--{flag} {col}' for flag, col in flags.items() if col in c['fields'])}; "
            if c["fields"]
            else ""
        )
        fix = {
            "too_long": f"raise --max_chars {cfg.max_chars}",
            "image_too_large": f"downscale those images or raise --max_image_pixels {cfg.max_image_pixels}",
        }.get(name, FIXES[name])
        parts.append(f"{name} {c['count']} ({fields}rows {', '.join(map(str, c['rows']))}: {fix})")
    raise ConfigError(
        f"max_bad_fraction: {summary['bad']} of {summary['rows']} rows of {source} ({100 * summary['bad_fraction']:.1f}%) "
        f"failed validation, more than {cfg.max_bad_fraction}: {'; '.join(parts)}; fix the data or raise --max_bad_fraction"
    )


# ---------------------------------------------------------------- splits


def unique_prompts(records: list[dict], with_label: bool) -> list[dict]:
    """Each prompt once (RL and eval sample prompts; a prompt with several pairs would weigh more)."""
    out, seen = [], set()
    for r in records:
        key = prompt_key(r["prompt"], r.get("images", ()))
        if key not in seen:
            seen.add(key)
            out.append({**context(r), **({"label": r.get("label")} if with_label else {})})
    return out


def context(record: dict) -> dict:
    """What every split's row starts with: the prompt, and its images when the dataset has an image column."""
    return {"prompt": record["prompt"], **({"images": record["images"]} if "images" in record else {})}


def make_splits(train: list[dict], held: list[dict], cfg: PrepareDataConfig) -> dict[str, list[dict]]:
    with_label = bool(cfg.label_key)
    splits = {"sft": [{**context(r), "response": r["response"]} for r in train]}
    if cfg.chosen_key:
        pairs = [{**context(r), "chosen": r["chosen"], "rejected": r["rejected"]} for r in train]
        splits["preference"] = pairs
        splits["style_pairs"] = pairs  # DPO's pairs: the reward model's, for user data
        splits["unpaired"] = [
            row
            for r in train
            for row in (
                {**context(r), "completion": r["chosen"], "label": True},
                {**context(r), "completion": r["rejected"], "label": False},
            )
        ]
        splits["preference_eval"] = [{**context(r), "chosen": r["chosen"], "rejected": r["rejected"]} for r in held]
    splits["prompts"] = unique_prompts(train, with_label)
    splits["eval"] = unique_prompts(held, with_label)
    return splits


def write_splits(splits: dict[str, list[dict]], data_dir: Path) -> dict[str, str]:
    """data/<split>.jsonl for each split; returns {split: path relative to the version folder}."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        path = data_dir / f"{name}.jsonl"
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        except OSError as error:
            # A write names no file, and the scratch folder is gone (its space freed) by the time the stage reports.
            if errors.disk_fault(error):
                raise errors.disk_error(error, path) from None
            raise
    return {name: f"{data_dir.name}/{name}.jsonl" for name in splits}


# ---------------------------------------------------------------- the version


def version_id(content_sha256: str, cfg: PrepareDataConfig) -> str:
    """What the version's rows depend on, hashed: the same data and settings give the same version."""
    spec = {
        "format": INGEST_FORMAT,
        "content_sha256": content_sha256,
        "mapping": cfg.mapping(),
        "seed": cfg.seed,
        "eval_fraction": cfg.eval_fraction,
        "max_chars": cfg.max_chars,
        "images": {"image_key": cfg.image_key, "max_image_pixels": cfg.max_image_pixels},
    }
    return manifests.config_hash(spec)[:16]


def ingest(cfg: PrepareDataConfig, workdir: Path) -> dict:
    """Register the source as a version (or find the one it already is); returns the version's manifest."""
    started = time.time()
    name = cfg.dataset_name or default_dataset_name(cfg.source)
    path, content_sha256 = sources.fetch(cfg.source, workdir / "source")
    version = version_id(content_sha256, cfg)
    existing = versions.find(cfg.datasets_root, name, version)
    if existing is not None:
        # Same bytes, mapping and split: the same rows. A stricter threshold than it passed still fails.
        print(f"dataset {name}: {cfg.source} is already version {version}; reusing {existing['uri']}", flush=True)
        print(describe(existing["validation"]), flush=True)
        check_threshold(existing["validation"], cfg, cfg.source)
        versions.ensure_listed(cfg.datasets_root, name, existing)
        return existing

    rows = list(sources.read_rows(path))
    if not rows:
        raise ConfigError(f"source: {cfg.source} holds no rows; pass a file with data")
    check_columns(rows, cfg, cfg.source)
    train, held, summary = validate(rows, cfg)
    print(describe(summary), flush=True)
    check_threshold(summary, cfg, cfg.source)
    if not train or not held:
        side, flag = ("training", "lower --eval_fraction") if not train else ("held-out", "raise --eval_fraction")
        raise ConfigError(
            f"eval_fraction: {cfg.eval_fraction} leaves the {side} side of {summary['kept']} rows empty; {flag} or add rows"
        )

    splits = make_splits(train, held, cfg)
    local = workdir / "version"
    datasets = write_splits(splits, local / "data")
    rows_per_split = {split: len(r) for split, r in splits.items()}
    info = {
        "name": name,
        "version": version,
        "source": cfg.source,
        "content_sha256": content_sha256,
        "mapping": cfg.mapping(),
        "split": {"seed": cfg.seed, "eval_fraction": cfg.eval_fraction, "max_chars": cfg.max_chars},
        "rows": rows_per_split,
        "format": INGEST_FORMAT,
        **({"images": {"image_key": cfg.image_key, "count": summary["images"]}} if "images" in summary else {}),
    }
    metrics = {
        **{f"rows_{split}": n for split, n in rows_per_split.items()},
        "rows_read": summary["rows"],
        "rows_bad": summary["bad"],
        **cost.stage_cost(time.time() - started, gpus=0, cpus=1),
    }
    manifest = manifests.build_manifest(
        "dataset",
        cfg.run_id,
        cfg.to_dict(),
        {"source": cfg.source},
        metrics,
        datasets=datasets,
        dataset=info,
        validation=summary,
    )
    committed, created = versions.register(cfg.datasets_root, name, version, local, manifest)
    print(f"dataset {name}: {'registered' if created else 'found'} version {version} at {committed['uri']}", flush=True)
    return committed
