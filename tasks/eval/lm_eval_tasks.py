"""lm-eval tasks in the eval stage: each compared model on EleutherAI's evaluation harness, scored per document.

    manager = task_manager(["arc_easy", "team_sums"], include_path="my_tasks/")   # unknown names refused here
    scores, results = run_tasks(model, tokenizer, ["arc_easy", "team_sums"], manager, limit=200, seed=0)
    scores["lm_eval/arc_easy/acc"]     # one score per document, in document order
    results["arc_easy"]["acc,none"]    # lm-eval's own aggregate (and "acc_stderr,none")

The tasks are lm-eval's (`--lm_eval_tasks arc_easy,gsm8k`: their data comes from the Hugging Face hub, so a
machine that reaches it or has it cached) and a team's own, as YAML files in `--lm_eval_include_path` (a
folder or an s3:// prefix) whose data may be local files (`dataset_path: json` with
`dataset_kwargs: {data_files: …}`). The scores come from lm-eval's sample logs, one per document, so every
task metric gets the stage's paired intervals and deltas against the baseline and the champion, feeds the
reward-hacking alarm when it is a 0/1 metric, and can be named in a promotion gate. A corpus-level metric
(BLEU, TER, …) has no per-document score: it is in lm-eval's aggregate table only.
"""

from __future__ import annotations

PREFIX = "lm_eval/"


class LmEvalError(ValueError):
    """A task list or task folder lm-eval cannot use; the message names the fix."""


def metric_name(task: str, metric: str, filter_name: str = "none") -> str:
    """The report's name of a task's metric: lm_eval/<task>/<metric>, and /<filter> for a filter other than none."""
    return f"{PREFIX}{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's task registry with the team's folder added; an unknown task name is refused in one line. When
    the team's folder holds every task named, lm-eval's own 14,000 task files are not scanned (about 20 s)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in manager.all_tasks for name in tasks):
            return manager
    manager = TaskManager(include_path=include_path or None)
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        where = f" nor in {include_path}" if include_path else ""
        raise LmEvalError(
            f"lm_eval_tasks: {unknown[0]!r} is not an lm-eval task{where}; `lm-eval ls tasks` lists them, or put its YAML in --lm_eval_include_path"
        )
    return manager


def per_document_scores(samples: dict[str, list[dict]]) -> dict[str, list[float]]:
    """{metric name: one score per document} from lm-eval's sample logs ({task: [sample, …]}): every numeric
    per-document metric, in document order; a corpus-level metric's per-document value (a tuple) is skipped."""
    scores: dict[str, list[float]] = {}
    for task, logged in samples.items():
        for sample in sorted(logged, key=lambda s: s["doc_id"]):
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if isinstance(value, (bool, int, float)):
                    scores.setdefault(metric_name(task, metric, sample.get("filter", "none")), []).append(float(value))
    return scores


def run_tasks(
    model,
    tokenizer,
    tasks: list[str],
    manager,
    limit: int = 0,
    num_fewshot: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[dict[str, list[float]], dict]:
    """`tasks` on the loaded `model`: (per-document scores by metric name, lm-eval's aggregate results by task)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit or None,
        num_fewshot=num_fewshot,
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return per_document_scores(out["samples"]), out["results"]
