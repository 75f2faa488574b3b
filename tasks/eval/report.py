"""The eval stage's readable report: report.html (self-contained) and one SVG chart per training curve.

    from tasks.eval.report import write_report
    write_report(run.workdir, report, policy_uri=cfg.policy, run_id=cfg.run_id)

The curves come from the policy's training stage: its metrics.jsonl, one of the files its manifest
lists (verified against the manifest's size and sha256 like every other read). Charts are inline SVG
drawn here in plain Python, so the report opens from S3, a laptop or the Airflow UI with nothing else
loaded. No torch here: the unit tests build reports from hand-made metrics.

A sample whose prompt had images (a vision-language eval: the sample's `images`, base64 PNG as prepare_data stores
them, or data: URIs) shows them beside its prompt as inline data: URIs, scaled down (tasks/eval/sample_images.py; the
reports view's CSP allows images from data: only: plugins/reports.py).
"""

from __future__ import annotations

import hashlib
import html
import json
import math
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.eval.sample_images import images_cell

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
# The metrics table's rows when the report gives no order (older reports); any other metric follows.
ORDER = (
    "accuracy",
    "preferred_style_rate",
    "sampled_accuracy",
    "sampled_preferred_style_rate",
    "reward_mean",
    "kl_to_ref",
    "response_length",
)


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


# ---------------------------------------------------------------- the page

# As wide as the page it opens in: a full window, the grid view's tab, or the graph view's narrow side panel,
# where tables scroll sideways within their box, intervals drop below their value and charts stack.
_CSS = """body{font-family:sans-serif;margin:16px;color:#222}h1{overflow-wrap:anywhere;font-size:1.6em}
.wide{overflow-x:auto;max-width:100%}table{border-collapse:collapse;margin:8px 0 16px}
td,th{border:1px solid #ccc;padding:4px 10px}td.num{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f3f3f3}.up{color:#1a7f37}.down{color:#b42318}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,460px),1fr));gap:16px}
figure{margin:0}figcaption{color:#555;font-size:90%;margin-top:4px}
code{background:#f6f6f6;padding:1px 3px;overflow-wrap:anywhere}.note{color:#555}.ci{color:#666;font-size:90%;white-space:nowrap}
.own{float:right;font-size:90%}td img{max-width:128px;image-rendering:pixelated;vertical-align:middle}
.alarm{background:#fde8e8;border:1px solid #b42318;color:#b42318;padding:8px 12px;font-weight:bold}
@media (max-width:720px){body{margin:8px}.ci{display:block}td,th{padding:3px 6px}}"""


def ci(interval, signed: bool = True) -> str:
    return (
        (f"[{interval[0]:+.3f}, {interval[1]:+.3f}]" if signed else f"[{interval[0]:.3f}, {interval[1]:.3f}]")
        if interval
        else ""
    )


def results_markdown(report: dict) -> list[str]:
    """The report's alarms, its metrics table and its win rates: the lines the README's demo table is made of
    (tools/readme_table.py)."""
    base, pol = report["metrics"]["baseline"], report["metrics"]["policy"]
    change = report.get("comparisons", {}).get("baseline", {})
    lines = [f"**{alarm}**" for alarm in report.get("alarms", [])] + ([""] if report.get("alarms") else [])
    lines += ["| metric | baseline (SFT) | policy | change (95% CI) |", "|---|---:|---:|---:|"]
    lines += [
        f"| {k} | {base[k]:.3f} | {pol[k]:.3f} | {pol[k] - base[k]:+.3f} {ci(change.get(k, {}).get('interval'))} |"
        for k in report["order"]
        if k in base and k in pol
    ]
    for ref, judges in report.get("win_rates", {}).items():
        for name, w in judges.items():
            lines.append(
                f"\nWin rate against the {ref} ({name}, ties within {w['margin']}): {w['rate']:.3f} {ci(w['interval'], signed=False)} "
                f"({w['wins']} wins, {w['ties']} ties, {w['losses']} losses)"
            )
    return lines


def markdown(report: dict) -> str:
    lines = results_markdown(report)
    cost = report.get("cost") or {}
    lines += (
        [
            "",
            f"Cost of the candidate: {cost.get('wall_time_s', 0):.0f} s of stage wall time, "
            f"{cost.get('gpu_hours', 0):.3f} GPU-hours over {cost.get('stages', 0)} stages.",
        ]
        if cost
        else []
    )
    lines += [
        "",
        f"{report['num_prompts']} held-out prompts. <metric>: the greedy response; sampled_<metric> and the model "
        f"metrics: {report.get('samples_per_prompt', 1)} sample(s) per prompt at temperature {report['temperature']}.",
    ]
    if not report.get("labelled", True):
        lines.append("No reference answers (no label column): the metrics that need them are left out.")
    lines += ["", "| prompt | label | baseline | policy |", "|---|---|---|---|"]
    lines += [
        f"| `{s['prompt']}`{_image_count(s)} | {'–' if s['label'] is None else s['label']} | `{s['baseline']}` | `{s['policy']}` |"
        for s in report["samples"]
    ]
    return "\n".join(lines) + "\n"


def _image_count(sample: dict) -> str:
    n = len(sample.get("images") or [])
    return f" ({n} image{'s' * (n > 1)}: see report.html)" if n else ""


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else html.escape(str(v))


def _interval(interval) -> str:
    return f' <span class="ci">[{interval[0]:.3f}, {interval[1]:.3f}]</span>' if interval else ""


def metrics_table(report: dict) -> str:
    """Every side's mean with its 95% interval, and the policy's change from the baseline with the paired
    interval of that change."""
    sides = list(report["metrics"])  # baseline, policy, and any other model the eval scored
    base, pol = report["metrics"].get("baseline", {}), report["metrics"].get("policy", {})
    intervals = report.get("intervals", {})
    change_ci = report.get("comparisons", {}).get("baseline", {})
    first = report.get("order") or ORDER
    names = [k for k in first if any(k in report["metrics"][s] for s in sides)]
    names += sorted({k for s in sides for k in report["metrics"][s]} - set(names))
    head = "".join(f"<th>{html.escape(s)}</th>" for s in sides)
    rows = [f'<table id="metrics"><tr><th>metric</th>{head}<th>change (policy − baseline)</th></tr>']
    for k in names:
        cells = "".join(
            f'<td class="num">{_num(report["metrics"][s].get(k, "–"))}{_interval(intervals.get(s, {}).get(k))}</td>'
            for s in sides
        )
        change = ""
        if isinstance(base.get(k), (int, float)) and isinstance(pol.get(k), (int, float)):
            d = pol[k] - base[k]
            change = f'<span class="{"up" if d > 0 else "down" if d < 0 else ""}">{d:+.3f}</span>{_interval(change_ci.get(k, {}).get("interval"))}'
        rows.append(f'<tr><td>{html.escape(k)}</td>{cells}<td class="num">{change}</td></tr>')
    return "\n".join(rows) + "</table>"


def win_rates_table(report: dict) -> str:
    rows = [
        '<table id="win-rates"><tr><th>policy against</th><th>judge</th><th>win rate</th><th>wins</th><th>ties</th><th>losses</th></tr>'
    ]
    for ref, judges in report.get("win_rates", {}).items():
        for judge, w in judges.items():
            rows.append(
                f"<tr><td>{html.escape(ref)}</td><td>{html.escape(judge)} (ties within {w['margin']})</td>"
                f'<td class="num">{w["rate"]:.3f}{_interval(w.get("interval"))}</td><td class="num">{w["wins"]}</td>'
                f'<td class="num">{w["ties"]}</td><td class="num">{w["losses"]}</td></tr>'
            )
    return "\n".join(rows) + "</table>"


def slices_table(report: dict) -> str:
    sliced = report["slices"]
    names = [k for k in report.get("order", []) if any(k in g.get("policy", {}) for g in sliced["groups"].values())]
    head = "".join(f"<th>{html.escape(n)} (policy)</th>" for n in names)
    rows = [f'<table id="slices"><tr><th>{html.escape(sliced["key"])}</th><th>prompts</th>{head}</tr>']
    for value, group in sliced["groups"].items():
        cells = "".join(
            f'<td class="num">{_num(group["policy"][n]["mean"])}{_interval(group["policy"][n]["interval"])}</td>'
            if n in group.get("policy", {})
            else "<td>–</td>"
            for n in names
        )
        rows.append(f'<tr><td>{html.escape(value)}</td><td class="num">{group["prompts"]}</td>{cells}</tr>')
    return "\n".join(rows) + "</table>"


def render_html(
    report: dict,
    chart_svgs: dict[str, str],
    metrics_uri: str | None,
    run_id: str = "",
    notes: dict[str, str] | None = None,
) -> str:
    """The report page; `notes` says under each chart what its numbers are (chart_notes)."""
    e, notes = html.escape, notes or {}
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rlhf-flow evaluation {e(run_id)}</title><style>{_CSS}</style></head><body>",
        # An empty href is this page's own address, query included: out of an Airflow tab into a window of its own.
        '<a class="own" href="" target="_blank" rel="noopener">open on its own page</a>',
        f"<h1>Evaluation{' of ' + e(run_id) if run_id else ''}</h1>",
    ]
    parts += [f'<p class="alarm">{e(alarm)}</p>' for alarm in report.get("alarms", [])]
    parts += [
        f'<p class="note">{report.get("num_prompts", "?")} held-out prompts. &lt;metric&gt;: the greedy response; '
        f"sampled_&lt;metric&gt; and the model metrics: {report.get('samples_per_prompt', 1)} sample(s) per prompt at "
        f"temperature {e(str(report.get('temperature', '?')))}. Intervals: 95%, paired bootstrap over prompts."
        f"{'' if report.get('labelled', True) else ' No reference answers (no label column): the metrics that need them are left out.'}</p>",
        "<h2>Metrics</h2>",
        f'<div class="wide">{metrics_table(report)}</div>',
    ]
    if report.get("win_rates"):
        parts += ["<h2>Win rates</h2>", f'<div class="wide">{win_rates_table(report)}</div>']
    if report.get("slices"):
        parts += [
            f"<h2>By {e(report['slices']['key'])}</h2>",
            f'<div class="wide">{slices_table(report)}</div>',
            f'<p class="note">Smallest slice: {e(str(report["slices"]["smallest"]))}.</p>',
        ]
    parts.append("<h2>Training curves of the policy</h2>")
    if chart_svgs:
        parts.append(f'<p class="note">From <code>{e(metrics_uri or "")}</code>, per logged step.</p>')
        parts.append(
            '<div class="charts">'
            + "".join(
                f'<figure id="chart-{e(n)}">{s}'
                + (f"<figcaption>{e(notes[n])}</figcaption>" if n in notes else "")
                + "</figure>"
                for n, s in chart_svgs.items()
            )
            + "</div>"
        )
    else:
        parts.append(
            '<p class="note">None: the policy is not a stage output with a metrics.jsonl (a hub id or plain folder), '
            "or its stage logged no reward, KL or loss.</p>"
        )
    if report.get("samples"):
        pictures = any(s.get("images") for s in report["samples"])  # a vision-language eval's prompts
        parts.append(
            '<h2>Samples (greedy)</h2><div class="wide"><table><tr>'
            + ("<th>images</th>" if pictures else "")
            + "<th>prompt</th><th>label</th><th>baseline</th><th>policy</th></tr>"
        )
        parts += [
            "<tr>"
            + (f"<td>{images_cell(s.get('images'))}</td>" if pictures else "")
            + f"<td><code>{e(str(s['prompt']))}</code></td><td>{e('–' if s['label'] is None else str(s['label']))}</td>"
            f"<td><code>{e(str(s['baseline']))}</code></td><td><code>{e(str(s['policy']))}</code></td></tr>"
            for s in report["samples"]
        ]
        parts.append("</table></div>")
    if report.get("inputs"):
        parts.append(
            '<h2>Inputs</h2><div class="wide"><table>'
            + "".join(f"<tr><td>{e(k)}</td><td><code>{e(str(v))}</code></td></tr>" for k, v in report["inputs"].items())
            + "</table></div>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(workdir: Path, report: dict, policy_uri: str, run_id: str = "") -> list[str]:
    """Write report.html and chart_<name>.svg into `workdir`; returns the file names written."""
    policy = policy_manifest(policy_uri)  # read once: the curves and what they are
    records, metrics_uri = stage_metrics(policy)
    chart_svgs = charts(records)
    notes = chart_notes(policy) if chart_svgs else {}
    workdir = Path(workdir)
    written = []
    for name, svg in chart_svgs.items():
        (workdir / f"chart_{name}.svg").write_text(svg + "\n")
        written.append(f"chart_{name}.svg")
    (workdir / "report.html").write_text(render_html(report, chart_svgs, metrics_uri, run_id, notes))
    return ["report.html", *written]
