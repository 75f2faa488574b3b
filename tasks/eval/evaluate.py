"""Held-out evaluation of two policies, and the report it writes.

Per policy: `accuracy` (greedy decoding, the answer parsed out of either style against the label),
and on one sampled response per prompt at the configured temperature: `preferred_style_rate`,
`sampled_accuracy`, `reward_mean` (the reward model's raw score) and `kl_to_ref` (the summed
log-ratio to the baseline, k1, averaged over responses). Style is a property of the sampling
distribution, which a greedy decode of a 50/50 model hides, hence sampled.

Prompts are encoded as the training stages encoded them (strings or chat messages, with
--apply_chat_template through the tokenizer's chat template). Prompts without reference answers (no
label column: a team's own prompts) leave `accuracy` and `sampled_accuracy` out of the report, which
is not the same as scoring 0; the reward and KL metrics stay.
"""
from __future__ import annotations

import json

import torch

from tasks.common import data
from tasks.common.cost import lineage_cost
from tasks.common.models import load_causal_lm, load_tokenizer, resolve_model, sequence_logprobs
from tasks.common.rollout import HFRolloutEngine, Rollout
from tasks.common.registry import Registry
from tasks.common.stage import StageRun
from tasks.common.strategy import set_seed
from tasks.data.demo import extract_answer, is_preferred_style
from tasks.eval.config import EvalConfig
from tasks.eval.report import write_report
from tasks.rl.rewards import RewardModels, build_reward_batch

METRICS = ("accuracy", "preferred_style_rate", "sampled_accuracy", "reward_mean", "kl_to_ref", "response_length")
LABELLED_METRICS = ("accuracy", "sampled_accuracy")  # need reference answers


@torch.no_grad()
def summed_logprobs(model, rollout: Rollout, batch_size: int = 256) -> torch.Tensor:
    """Σ log π(response tokens) per sequence."""
    out = []
    for i in range(0, rollout.sequences.size(0), batch_size):
        seqs, mask = rollout.sequences[i:i + batch_size], rollout.attention_mask[i:i + batch_size]
        logprobs = sequence_logprobs(model, seqs, mask)[:, rollout.prompt_width - 1:]
        out.append((logprobs * rollout.response_mask[i:i + batch_size]).sum(-1))
    return torch.cat(out)


def reference_answers(rows, cfg: EvalConfig) -> list[str | None] | None:
    """The label column as strings (None where a row has none); None when the data has no labels at all."""
    if not cfg.label_key or cfg.label_key not in rows.column_names:
        return None
    labels = [None if v is None else str(v) for v in rows[cfg.label_key]]
    return labels if any(label is not None for label in labels) else None


def exact_match(responses: list[str], labels: list[str | None]) -> float:
    """Share of the labelled rows whose parsed answer equals the label."""
    scored = [(r, label) for r, label in zip(responses, labels) if label is not None]
    return sum(extract_answer(r) == label for r, label in scored) / len(scored)


def shown(prompt) -> str:
    """A prompt on one line for the report: a string, or chat messages as 'role: content' turns."""
    text = prompt if isinstance(prompt, str) else " | ".join(f"{m['role']}: {m['content']}" for m in prompt)
    return " ".join(text.split())


def policy_metrics(policy, reference, reward_model, tokenizer, prompts, prompt_texts, labels, cfg: EvalConfig) -> tuple[dict, list[str]]:
    """The metrics of one policy; without `labels` (None) the exact-match ones are left out."""
    engine = HFRolloutEngine(policy, tokenizer)
    greedy = engine.generate(prompts, cfg.generate_max_len, greedy=True).texts(tokenizer)
    set_seed(cfg.seed)  # both policies sample with the same seed
    sampled = engine.generate(prompts, cfg.generate_max_len, temperature=cfg.temperature)
    texts = sampled.texts(tokenizer)
    kl = summed_logprobs(policy, sampled) - summed_logprobs(reference, sampled)
    metrics = {
        "preferred_style_rate": sum(map(is_preferred_style, texts)) / len(texts),
        "kl_to_ref": kl.mean().item(),
        "response_length": sampled.response_lengths().float().mean().item(),
    }
    if labels is not None:
        metrics.update(accuracy=exact_match(greedy, labels), sampled_accuracy=exact_match(texts, labels))
    if reward_model is not None:
        metrics["reward_mean"] = reward_model.score(build_reward_batch(sampled, tokenizer, prompt_texts, labels)).mean().item()
    return {k: round(v, 4) for k, v in metrics.items()}, greedy


def markdown(report: dict) -> str:
    base, pol = report["metrics"]["baseline"], report["metrics"]["policy"]
    lines = ["| metric | baseline (SFT) | policy | change |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {base[k]:.3f} | {pol[k]:.3f} | {pol[k] - base[k]:+.3f} |" for k in METRICS if k in base]
    cost = report.get("cost") or {}
    lines += ["", f"Cost of the candidate: {cost.get('wall_time_s', 0):.0f} s of stage wall time, "
              f"{cost.get('gpu_hours', 0):.3f} GPU-hours over {cost.get('stages', 0)} stages."] if cost else []
    lines += ["", f"{report['num_prompts']} held-out prompts. accuracy: greedy exact match; the rest: one sample per prompt "
              f"at temperature {report['temperature']}."]
    if not report.get("labelled", True):
        lines.append(f"No reference answers (no label column): {' and '.join(LABELLED_METRICS)} are left out.")
    lines += ["", "| prompt | label | baseline | policy |", "|---|---|---|---|"]
    lines += [f"| `{s['prompt']}` | {'–' if s['label'] is None else s['label']} | `{s['baseline']}` | `{s['policy']}` |"
              for s in report["samples"]]
    return "\n".join(lines) + "\n"


def evaluate(cfg: EvalConfig, run: StageRun) -> None:
    set_seed(cfg.seed)
    rows = data.load_rows(run.input("dataset", cfg.dataset), cfg.dataset_split, [cfg.input_key])
    rows = rows.select(range(min(cfg.max_samples, len(rows))))
    labels = reference_answers(rows, cfg)
    if labels is None:
        print(f"eval: no reference answers (column {cfg.label_key!r}) in {cfg.dataset}; {' and '.join(LABELLED_METRICS)} "
              "are left out, the reward and KL metrics stay", flush=True)
    baseline_path = resolve_model(run.input("baseline", cfg.baseline))
    policy_path = resolve_model(run.input("policy", cfg.policy))
    tokenizer = load_tokenizer(policy_path)
    baseline, policy = load_causal_lm(baseline_path).eval(), load_causal_lm(policy_path).eval()
    # Raw scores (not standardised), summed over the models of a comma-separated list, as in RL.
    reward_model = RewardModels(run.input("reward_pretrain", cfg.reward_pretrain), normalize=False) if cfg.reward_pretrain else None
    texts = list(rows[cfg.input_key])
    prompts = [data.encode_prompt(tokenizer, p, cfg.apply_chat_template) for p in texts]

    base_metrics, base_greedy = policy_metrics(baseline, baseline, reward_model, tokenizer, prompts, texts, labels, cfg)
    pol_metrics, pol_greedy = policy_metrics(policy, baseline, reward_model, tokenizer, prompts, texts, labels, cfg)
    metrics = {"baseline": base_metrics, "policy": pol_metrics}
    # The champion of the registry, judged on the same prompts, so the promotion gate compares like with like.
    champion, _ = Registry(cfg.registry).champion() if cfg.registry else (None, None)
    if champion:
        print(f"eval: champion v{champion['version']} is {champion['policy']}", flush=True)
        champ_model = load_causal_lm(resolve_model(run.input("champion", champion["policy"]))).eval()
        metrics["champion"], _ = policy_metrics(champ_model, baseline, reward_model, tokenizer, prompts, texts, labels, cfg)
        del champ_model
    report = {
        "metrics": metrics,
        "champion": {"version": champion["version"], "policy": champion["policy"]} if champion else None,
        "delta": {k: round(pol_metrics[k] - base_metrics[k], 4) for k in METRICS if k in base_metrics},
        "num_prompts": len(prompts),
        "labelled": labels is not None,
        "temperature": cfg.temperature,
        "inputs": dict(run.inputs),
        # What producing the candidate took: wall time and GPU-hours over its lineage (SFT, RM, RL, ...).
        "cost": lineage_cost(cfg.policy),
        "samples": [{"prompt": shown(p), "label": l, "baseline": b, "policy": q}
                    for p, l, b, q in list(zip(texts, labels or [None] * len(texts), base_greedy, pol_greedy))[:cfg.num_shown_samples]],
    }
    (run.workdir / "report.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (run.workdir / "report.md").write_text("# Evaluation\n\n" + table)
    # report.html and chart_*.svg: the same report with the policy's training curves, readable as files
    write_report(run.workdir, report, policy_uri=cfg.policy, run_id=cfg.run_id)
    print(table, flush=True)
    run.commit(metrics={f"{side}_{k}": v for side in ("baseline", "policy") for k, v in report["metrics"][side].items()},
               report="report.json")
