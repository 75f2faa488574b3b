"""The eval stage's readable report: report.html (self-contained) and one SVG chart per training curve.

    from tasks.eval.report import write_report
    write_report(run.workdir, report, policy_uri=cfg.policy, run_id=cfg.run_id)

The curves come from the policy's training stage: its metrics.jsonl, one of the files its manifest
lists (verified against the manifest's size and sha256 like every other read). Charts are inline SVG
drawn in plain Python (tasks/eval/curves.py), so the report opens from S3, a laptop or the Airflow UI with nothing else
loaded. No torch here: the unit tests build reports from hand-made metrics.

A sample whose prompt had images (a vision-language eval: the sample's `images`, base64 PNG as prepare_data stores
them, or data: URIs) shows them beside its prompt as inline data: URIs, scaled down (tasks/eval/sample_images.py; the
reports view's CSP allows images from data: only: plugins/reports.py).
"""

from __future__ import annotations

import html
from pathlib import Path

from tasks.eval.curves import (  # noqa: F401 (the report's curves: tests read them here too)
    CHARTS,
    chart_notes,
    charts,
    nice_ticks,
    policy_manifest,
    series,
    stage_metrics,
    svg_line_chart,
    training_metrics,
)
from tasks.eval.sample_images import images_cell

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
