"""The policy's training curves in the eval report: read from the stage that trained it (its metrics.jsonl, a file
its manifest lists, verified like every read) and drawn as inline SVG in plain Python, with a note under each chart
saying what its numbers are. No torch here.

    from tasks.eval import curves
    records, source = curves.training_metrics(policy_uri)      # [] and None when the policy logged no curve
    svgs = curves.charts(records)                             # {"reward": "<svg …>", "kl": …, "loss": …}
    notes = curves.chart_notes(curves.policy_manifest(policy_uri))
"""

from __future__ import annotations

import hashlib
import html
import json
import math

from tasks.common import manifest as manifests
from tasks.common import storage

METRICS_FILE = "metrics.jsonl"
# chart name -> (title, metric keys in plotting order). An RL stage logs reward / kl / policy_loss /
# value_loss; DPO logs chosen/rejected rewards and their margin; KTO its z0 as kl and a margin. A chart
# shows the keys the stage logged and is left out when it logged none.
CHARTS = {
    "reward": ("Reward", ("reward", "chosen_reward", "rejected_reward", "margin")),
    "kl": ("KL to the reference", ("kl",)),
    "loss": ("Loss", ("policy_loss", "value_loss", "loss")),
}
#: The y axis of each chart: what its numbers are measured in.
Y_AXES = {"reward": "score", "kl": "nats per response", "loss": "loss"}
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
# ---------------------------------------------------------------- reading the curves


def parse_metrics(text: str) -> list[dict]:
    """metrics.jsonl's records; a torn last line (a stage killed mid-write) is dropped, not fatal."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
    return records


def series(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record with a finite number under `key`; a step logged twice (a resumed
    run appends) keeps its last value."""
    points: dict[float, float] = {}
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            points[float(r["step"])] = float(value)
    return sorted(points.items())


def policy_manifest(policy_uri: str) -> dict | None:
    """The manifest of the stage that trained the policy; None for a hub id or a plain folder."""
    if not policy_uri:
        return None
    is_output = (
        storage.is_s3(policy_uri)
        or policy_uri.endswith(manifests.MANIFEST)
        or ((storage.local_path(policy_uri) / manifests.MANIFEST).is_file())
    )
    return manifests.read_manifest(policy_uri) if is_output else None


def training_metrics(policy_uri: str) -> tuple[list[dict], str | None]:
    """The records of the policy stage's metrics.jsonl and its URI; ([], None) when the policy is not a
    stage output (a hub id, a plain folder) or its stage wrote no metrics.jsonl."""
    return stage_metrics(policy_manifest(policy_uri))


def stage_metrics(m: dict | None) -> tuple[list[dict], str | None]:
    """training_metrics from the stage's manifest `m` (None: not a stage output), checked against it."""
    if m is None:
        return [], None
    entry = m["files"].get(METRICS_FILE)
    if entry is None:
        return [], None
    uri = storage.join(m["uri"], METRICS_FILE)
    data = storage.read_bytes(uri)
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise storage.StorageError(
            f"{uri} does not match its manifest (size or sha256): rerun the stage that wrote it", uri
        )
    return parse_metrics(data.decode("utf-8", errors="replace")), uri


# ---------------------------------------------------------------- drawing


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values (1, 2 or 5 times a power of ten) covering [lo, hi]."""
    if not hi > lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t < hi + step * 0.5:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def svg_line_chart(
    title: str, lines: dict[str, list[tuple[float, float]]], y_label: str = "", width: int = 560, height: int = 280
) -> str:
    """A standalone SVG line chart: one polyline per named series against the step, ticks, axis names, a legend.
    It scales to its container's width (viewBox), so a page lays charts out as wide as it has room for."""
    left, right, top, bottom = 72, 16, 34, 44
    pw, ph = width - left - right, height - top - bottom
    points = [p for pts in lines.values() for p in pts]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{html.escape(title)}" font-family="sans-serif" font-size="12">',
        f"<title>{html.escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    if not points:
        out += [f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#666">no data</text>', "</svg>"]
        return "\n".join(out)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: top + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    for t in yt:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#e5e5e5"/>'
            f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>'
        )
    for t in xt:
        out.append(
            f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#333"/>'
            f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(t)}</text>'
        )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">training step</text>')
    if y_label:
        out.append(
            f'<text x="14" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {top + ph / 2})">'
            f"{html.escape(y_label)}</text>"
        )
    for i, (name, pts) in enumerate(lines.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        if len(pts) == 1:  # one logged step: a dot, a one-point polyline draws nothing
            out.append(f'<circle cx="{sx(pts[0][0]):.1f}" cy="{sy(pts[0][1]):.1f}" r="3" fill="{color}"/>')
        else:
            out.append(
                f'<polyline class="series" data-name="{html.escape(name)}" points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"/>'
            )
        lx = left + 8 + i * 130
        out.append(
            f'<line x1="{lx}" x2="{lx + 16}" y1="{top + 10}" y2="{top + 10}" stroke="{color}" stroke-width="3"/>'
            f'<text x="{lx + 20}" y="{top + 14}">{html.escape(name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def chart_notes(policy: dict | None) -> dict[str, str]:
    """What each chart's numbers are, beside the table's figures of the same name, for the stage that trained the
    policy (its manifest: stage and config)."""
    stage, cfg = (policy or {}).get("stage", ""), (policy or {}).get("config", {})
    if stage in ("dpo", "kto"):
        return {
            "reward": "The stage's implicit rewards: β times the policy's log-ratio to the reference on the chosen "
            "and rejected responses of each batch, and their margin. The table's reward_mean is a reward model's "
            "score: another scale.",
            "kl": "KTO's reference point z0: the batch's estimate of the KL from the policy to the reference.",
            "loss": f"The {stage.upper()} loss per logged step.",
        }
    if stage != "rl":
        return {"loss": "The stage's training loss per logged step."}
    if cfg.get("env_path") or cfg.get("remote_rm_url"):
        reward = "Each step's mean reward over its rollouts, as the environment or reward function returned it."
    elif cfg.get("normalize_reward", True):
        reward = (
            "Each step's mean reward over its rollouts: the reward model's score standardised by the mean and std "
            "of its scores on its stage's held-out preference pairs (--normalize_reward), so 0 is their average. "
            "The table's reward_mean is the raw score, on held-out prompts: another scale."
        )
    else:
        reward = "Each step's mean reward over its rollouts: the reward model's raw score, as the table's reward_mean."
    return {
        "reward": reward,
        "kl": "Each step's mean over its rollouts of the KL to the reference model, summed over the response's "
        "tokens: the table's kl_to_ref measures the same against the baseline, on held-out prompts.",
        "loss": "The actor's clipped policy loss and, where the run has a critic, its value loss, per logged step.",
    }


def charts(records: list[dict]) -> dict[str, str]:
    """{chart name: SVG} for each chart of CHARTS with at least one logged metric."""
    out = {}
    for name, (title, keys) in CHARTS.items():
        lines = {k: pts for k in keys if (pts := series(records, k))}
        if lines:
            out[name] = svg_line_chart(title, lines, Y_AXES.get(name, ""))
    return out
