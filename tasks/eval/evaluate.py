"""Held-out evaluation of a trained policy against its baseline (and the registry's champion), with the
confidence a gate can act on.

Per policy, on the same prompts:
- the run's declared metrics (tasks/eval/metrics.py: built-ins by name, or a metric file), each on the greedy
  response (`<name>`) and on `n_samples_per_prompt` samples at the configured temperature (`sampled_<name>`);
- pass@k of every 0/1 sampled metric when there are several samples per prompt;
- from the models, on the samples: `reward_mean` (the reward model's raw score), `kl_to_ref` (the summed
  log-ratio to the baseline, k1) and `response_length` (tokens);
- with --lm_eval_tasks, every per-document metric of those lm-eval tasks (`lm_eval/<task>/<metric>`, scored
  on the tasks' own documents: tasks/eval/lm_eval_tasks.py), and lm-eval's own table under `lm_eval`.
Every number gets a 95% paired-bootstrap interval over prompts (tasks/eval/stats.py), as does every change
from the baseline and from the champion; the reward model also judges the policy against each pairwise
(win rate, ties within --win_margin). The reward-hacking alarm goes off when the reward rose significantly
while a verifiable (0/1) metric fell significantly; the report shows it first and the gate refuses.

Prompts are encoded as the training stages encoded them (strings or chat messages, with
--apply_chat_template through the tokenizer's chat template). Metrics that need reference answers are left
out when the data has no labels, which is not the same as scoring 0.
"""

from __future__ import annotations

import json
import time

from tasks.common.cost import lineage_cost
from tasks.common.image_tags import content_text
from tasks.common.nn import data
from tasks.common.nn.environment import EnvError, check_environment, load_environment
from tasks.common.nn.strategy import set_seed
from tasks.common.nn.workers import placed_group
from tasks.common.registry import Registry
from tasks.common.stage import StageRun
from tasks.eval import lm_eval_tasks, stats
from tasks.eval import metrics as metric_lib
from tasks.eval.config import EvalConfig
from tasks.eval.images import most_images, row_images
from tasks.eval.judge import ChatJudge
from tasks.eval.report import markdown, write_report
from tasks.eval.worker import EvalWorker, repeat

#: Measured from the models on the sampled responses (and, with --env_path, how its episodes went), whatever the
#: run declares: reported, never read as a task's success metric.
MODEL_METRICS = ("reward_mean", "kl_to_ref", "response_length", "env_turns", "env_tool_calls", "env_tool_errors")


def reference_answers(rows, cfg: EvalConfig) -> list[str | None] | None:
    """The label column as strings (None where a row has none); None when the data has no labels at all."""
    if not cfg.label_key or cfg.label_key not in rows.column_names:
        return None
    labels = [None if v is None else str(v) for v in rows[cfg.label_key]]
    return labels if any(label is not None for label in labels) else None


def shown(prompt) -> str:
    """A prompt on one line for the report: a string, or chat messages as 'role: content' turns."""
    text = (
        prompt if isinstance(prompt, str) else " | ".join(f"{m['role']}: {content_text(m['content'])}" for m in prompt)
    )
    return " ".join(text.split())


def pass_at_k_scores(values: list, n: int, k: int) -> list:
    """Per prompt, pass@k from its n consecutive 0/1 scores (None when any of them is unscored)."""
    out = []
    for i in range(0, len(values), n):
        group = values[i : i + n]
        out.append(None if any(v is None for v in group) else metric_lib.pass_at_k(n, int(sum(group)), k))
    return out


def side_scores(side: dict, texts: list, labels, rows: list[dict], scorers, cfg: EvalConfig) -> dict[str, list]:
    """{metric: one score per prompt (None: not scored)} of one side, from what its model generated on the eval
    worker (tasks.eval.worker.EvalWorker.generate_side)."""
    n = cfg.n_samples_per_prompt
    scores = metric_lib.score(scorers, texts, side["greedy"], labels, rows)
    sampled_labels = repeat(labels, n) if labels is not None else None
    per_sample = metric_lib.score(scorers, repeat(texts, n), side["sampled"], sampled_labels, repeat(rows, n))
    for name, values in per_sample.items():
        scores[f"sampled_{name}"] = stats.per_prompt(values, n)
        if n > 1 and metric_lib.is_success_metric(values):
            for k in cfg.ks():
                scores[f"pass@{k}_{name}"] = pass_at_k_scores(values, n, k)
    if side["episodes"] is not None:
        summaries = side["episodes"]
        scores.update(
            {
                "env_success": [float(s["success"]) for s in summaries],
                "env_turns": [float(s["turns"]) for s in summaries],
                "env_tool_calls": [float(s["tool_calls"]) for s in summaries],
                "env_tool_errors": [float(s["tool_errors"]) for s in summaries],
            }
        )
    for name in ("kl_to_ref", "response_length", "reward_mean"):
        if side[name] is not None:
            scores[name] = stats.per_prompt(side[name], n)
    if side["lm_eval"] is not None:  # one score per document of the lm-eval tasks, not per prompt
        scores.update(side["lm_eval"][0])
    return scores


def compare(candidate: dict[str, list], reference: dict[str, list], cfg: EvalConfig) -> dict:
    """{metric: {"delta", "interval"}}: candidate - reference per metric both have, paired over prompts."""
    out = {}
    for name in candidate:
        if name in reference:
            delta, interval = stats.delta_interval(
                candidate[name], reference[name], seed=cfg.seed, resamples=cfg.bootstrap_resamples
            )
            if delta is not None:
                out[name] = {"delta": delta, "interval": interval}
    return out


def summarise(scores: dict[str, dict[str, list]], verifiable: list[str], cfg: EvalConfig) -> dict:
    """The report's numbers from the per-prompt scores of each side (baseline, policy, champion)."""
    means = {
        side: {m: round(v, 4) for m, vals in s.items() if (v := metric_lib.mean(vals)) is not None}
        for side, s in scores.items()
    }
    intervals = {
        side: {m: stats.mean_interval(vals, seed=cfg.seed, resamples=cfg.bootstrap_resamples) for m, vals in s.items()}
        for side, s in scores.items()
    }
    references = [side for side in ("baseline", "champion") if side in scores]
    comparisons = {ref: compare(scores["policy"], scores[ref], cfg) for ref in references}
    win_rates = {
        ref: {
            "reward_model": stats.win_rate(
                scores["policy"]["reward_mean"],
                scores[ref]["reward_mean"],
                margin=cfg.win_margin,
                seed=cfg.seed,
                resamples=cfg.bootstrap_resamples,
            )
        }
        for ref in references
        if "reward_mean" in scores["policy"]
    }
    alarms = [
        f"against the {ref}: {line}"
        for ref in references
        for line in stats.hacking_alarms(comparisons[ref], verifiable)
    ]
    return {
        "metrics": means,
        "intervals": intervals,
        "comparisons": comparisons,
        "win_rates": win_rates,
        "alarms": alarms,
    }


def slices(scores: dict[str, dict[str, list]], keys: list, cfg: EvalConfig) -> dict:
    """Every metric per value of the slice column: prompts, means and intervals per side; names the smallest slice."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(str(key), []).append(i)
    out = {}
    for key, index in sorted(groups.items()):
        out[key] = {"prompts": len(index)}
        for side, side_scores in scores.items():
            out[key][side] = {}
            for name, values in side_scores.items():
                if name.startswith(lm_eval_tasks.PREFIX):
                    continue  # scored on the lm-eval tasks' documents, which have no slice column
                picked = [values[i] for i in index]
                value = metric_lib.mean(picked)
                if value is not None:
                    out[key][side][name] = {
                        "mean": round(value, 4),
                        "interval": stats.mean_interval(picked, seed=cfg.seed, resamples=cfg.bootstrap_resamples),
                    }
    return {"key": cfg.slice_key, "groups": out, "smallest": min(out, key=lambda k: out[k]["prompts"]) if out else None}


def evaluate(cfg: EvalConfig, run: StageRun) -> None:
    set_seed(cfg.seed)
    rows = data.load_rows(run.input("dataset", cfg.dataset), cfg.dataset_split, [cfg.input_key])
    rows = rows.select(range(min(cfg.max_samples, len(rows))))
    labels = reference_answers(rows, cfg)
    names = cfg.metric_names() or (["exact_match"] if labels is not None and not cfg.metric_func else [])
    metric_file = run.code_input("metric_func", cfg.metric_func, metric_lib.MetricError) if cfg.metric_func else None
    scorers = metric_lib.resolve(names, metric_file)
    if labels is None:
        print(
            f"eval: no reference answers (column {cfg.label_key!r}) in {cfg.dataset}; the metrics that need them are left out, the others stay",
            flush=True,
        )
    if cfg.slice_key and cfg.slice_key not in rows.column_names:
        raise metric_lib.MetricError(
            f"slice_key: the dataset has no column {cfg.slice_key!r}; it has {rows.column_names}"
        )
    texts = list(rows[cfg.input_key])
    records = rows.to_list()
    # A vision-language model's vLLM engine is sized for the most images a prompt carries (tasks/eval/images.py).
    cfg.max_images_per_prompt = cfg.max_images_per_prompt or most_images(records, cfg.image_key)
    if cfg.env_path:  # a file that does not load or reset fails here, before any model generates
        # The bytes the policy was trained with, when its manifest recorded the same file: a replaced file fails here.
        cfg.env_path = run.code_input("env_path", cfg.env_path, EnvError, recorded_in=(cfg.policy,))
        check_environment(load_environment(cfg.env_path), records[0], cfg.env_step_timeout)
    uris = {"baseline": run.input("baseline", cfg.baseline), "policy": run.input("policy", cfg.policy)}
    if cfg.reward_pretrain:
        run.input("reward_pretrain", cfg.reward_pretrain)
    # The champion of the registry, judged on the same prompts, so the promotion gate compares like with like.
    champion, _ = Registry(cfg.registry).champion() if cfg.registry else (None, None)
    if champion:
        print(f"eval: champion v{champion['version']} is {champion['policy']}", flush=True)
        uris["champion"] = run.input("champion", champion["policy"])
    scores, greedy, lm_eval_tables = {}, {}, {}
    with placed_group(EvalWorker, 1, 1, "eval") as group:
        run.placements.append(group.placement)  # what the stage held, for its cost
        group.run("setup", cfg, uris["baseline"])
        for side, uri in uris.items():
            started = time.monotonic()
            out = group.run("generate_side", uri, texts, records, labels)[0]
            scores[side], greedy[side] = side_scores(out, texts, labels, records, scorers, cfg), out["greedy"]
            if out["lm_eval"] is not None:
                lm_eval_tables[side] = out["lm_eval"][1]
            print(
                f"eval: scored the {side} on {len(texts)} prompts ({cfg.n_samples_per_prompt} sample(s) each) in "
                f"{time.monotonic() - started:.1f} s ({out['engine']} on the eval worker; "
                + ", ".join(f"{part} {s} s" for part, s in out["seconds"].items())
                + ")",
                flush=True,
            )
    declared = [m for m in scores["baseline"] if m not in MODEL_METRICS and not m.startswith("pass@")]
    verifiable = [m for m in declared if metric_lib.is_success_metric(scores["baseline"][m])]
    summary = summarise(scores, verifiable, cfg)
    order = (
        declared
        + [m for m in scores["baseline"] if m.startswith("pass@")]
        + [m for m in MODEL_METRICS if m in scores["baseline"]]
    )
    base_metrics, pol_metrics = summary["metrics"]["baseline"], summary["metrics"]["policy"]
    report = {
        **summary,
        "champion": {"version": champion["version"], "policy": champion["policy"]} if champion else None,
        "delta": {
            k: round(pol_metrics[k] - base_metrics[k], 4) for k in order if k in base_metrics and k in pol_metrics
        },
        "order": order,
        "declared_metrics": declared,
        "verifiable_metrics": verifiable,
        "num_prompts": len(texts),
        "samples_per_prompt": cfg.n_samples_per_prompt,
        "labelled": labels is not None,
        "temperature": cfg.temperature,
        "inputs": dict(run.inputs),
        # What producing the candidate took: wall time and GPU-hours over its lineage (SFT, RM, RL, ...).
        "cost": lineage_cost(cfg.policy),
        "samples": [
            {"prompt": shown(p), "label": label, "baseline": b, "policy": q}
            | ({"images": pictures} if pictures else {})  # base64 PNG, as stored: the report can show them
            for p, label, b, q, pictures in list(
                zip(
                    texts,
                    labels or [None] * len(texts),
                    greedy["baseline"],
                    greedy["policy"],
                    row_images(records, cfg.image_key),
                )
            )[: cfg.num_shown_samples]
        ],
    }
    if lm_eval_tables:
        report["lm_eval"] = lm_eval_tables  # lm-eval's own aggregates (with its standard errors), per side and task
    if cfg.judge_url:
        llm = ChatJudge(cfg.judge_url, cfg.judge_model)
        for ref in [side for side in ("baseline", "champion") if side in greedy]:
            outcomes = llm.compare([shown(t) for t in texts], greedy["policy"], greedy[ref])
            report["win_rates"].setdefault(ref, {})[f"llm_judge {cfg.judge_model}"] = stats.win_rate(
                outcomes, [0.5] * len(outcomes), margin=0.0, seed=cfg.seed, resamples=cfg.bootstrap_resamples
            )
            print(
                f"eval: the judge {cfg.judge_model} at {cfg.judge_url} compared the policy with the {ref} on {len(outcomes)} prompts, both orders",
                flush=True,
            )
    if cfg.slice_key:
        report["slices"] = slices(scores, list(rows[cfg.slice_key]), cfg)
    for alarm in report["alarms"]:
        print(f"eval: ALARM {alarm}", flush=True)
    (run.workdir / "report.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (run.workdir / "report.md").write_text("# Evaluation\n\n" + table)
    # report.html and chart_*.svg: the same report with the policy's training curves, readable as files
    write_report(run.workdir, report, policy_uri=cfg.policy, run_id=cfg.run_id)
    print(table, flush=True)
    run.commit(
        metrics={f"{side}_{k}": v for side in ("baseline", "policy") for k, v in report["metrics"][side].items()},
        report="report.json",
    )
