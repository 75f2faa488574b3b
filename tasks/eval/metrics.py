"""Per-response metrics of the evaluation stage: built-ins chosen by name, or a team's own metric file.

    scorers = resolve(["exact_match", r"regex:answer is (\\d+)"], metric_file="my_metrics.py")
    scores = score(scorers, prompts, responses, labels, rows)    # {name: [score or None, one per response]}

Built-ins (several at once, comma-separated in --metrics):
    exact_match      the response equals the label after normalisation (case, spaces, punctuation at the ends)
    math_verify      the math-verify library parses both (LaTeX, numbers, expressions) and compares them
    regex:<pattern>  the pattern's first group (or whole match) found in the response equals the label
    json_valid       the response parses as JSON
    length           the response's length in characters

A metric file is a Python file defining
    metrics(prompts, responses, labels, rows) -> {name: [score per response]}
where labels may be None (no reference answers) and rows are the dataset's rows (dicts) of the responses.
A score of None means "not scored" (a row without a label, say): it is left out of the mean, never read
as 0. Metrics needing labels are left out when the data has none.

A metric whose scores are all 0 or 1 is a success metric: pass@k is reported for it (:func:`pass_at_k`).
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from tasks.common import user_code

Scores = list  # list[float | None], one per response
Scorer = Callable[[list, list[str], "list[str | None] | None", list[dict]], dict[str, Scores]]


class MetricError(ValueError):
    """A metric name or file that cannot be used; the message names the fix."""


def normalise(text: str) -> str:
    """Lower case, inner whitespace collapsed, punctuation and spaces stripped from both ends."""
    return " ".join(str(text).lower().split()).strip(string.punctuation + " ")


def exact_match(responses: Sequence[str], labels: Sequence[str | None]) -> Scores:
    return [None if label is None else float(normalise(r) == normalise(label)) for r, label in zip(responses, labels)]


def regex_match(pattern: str, responses: Sequence[str], labels: Sequence[str | None]) -> Scores:
    """1 when the pattern's first group (the whole match without groups) equals the label, normalised."""
    compiled = re.compile(pattern)
    out: Scores = []
    for response, label in zip(responses, labels):
        if label is None:
            out.append(None)
            continue
        found = compiled.search(response)
        got = (found.group(1) if compiled.groups else found.group(0)) if found else None
        out.append(float(got is not None and normalise(got) == normalise(label)))
    return out


def json_valid(responses: Sequence[str]) -> Scores:
    out: Scores = []
    for response in responses:
        try:
            json.loads(response)
            out.append(1.0)
        except ValueError:
            out.append(0.0)
    return out


def math_verify(responses: Sequence[str], labels: Sequence[str | None]) -> Scores:
    """1 when math-verify finds the response's answer equal to the label's (parsed as LaTeX or plain math)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # the train extra installs it
        raise MetricError("math_verify: the math-verify library is not installed; pip install math-verify") from exc
    out: Scores = []
    for response, label in zip(responses, labels):
        if label is None:
            out.append(None)
            continue
        gold, answer = parse(label), parse(response)
        out.append(float(bool(gold) and bool(answer) and verify(gold, answer)))
    return out


def length(responses: Sequence[str]) -> Scores:
    return [float(len(r)) for r in responses]


#: Built-ins that compare with a reference answer (left out when the data has no labels), and the others.
LABELLED = {"exact_match": exact_match, "math_verify": math_verify}
UNLABELLED = {"json_valid": json_valid, "length": length}


def builtin(name: str) -> Scorer:
    """The scorer of one built-in metric name."""
    if name.startswith("regex:"):
        pattern = name[len("regex:") :]
        try:
            re.compile(pattern)
        except re.error as exc:
            raise MetricError(f"metrics: {name!r} is not a valid regular expression ({exc})") from exc
        return lambda prompts, responses, labels, rows: (
            {name: regex_match(pattern, responses, labels)} if labels else {}
        )
    if name in LABELLED:
        return lambda prompts, responses, labels, rows: {name: LABELLED[name](responses, labels)} if labels else {}
    if name in UNLABELLED:
        return lambda prompts, responses, labels, rows: {name: UNLABELLED[name](responses)}
    raise MetricError(
        f"metrics: unknown metric {name!r}; use exact_match, math_verify, regex:<pattern>, json_valid or length, or a metric file (--metric_func)"
    )


def resolve(names: Sequence[str], metric_file: str | None = None) -> list[Scorer]:
    """The scorers for the built-in ``names`` and the ``metrics`` function of ``metric_file`` (a local path,
    file:// or s3:// URI of a .py file)."""
    scorers = [builtin(n) for n in names]
    if metric_file:
        scorers.append(
            user_code.load_function(
                metric_file,
                "metrics",
                who="metric_func",
                error=MetricError,
                signature="prompts, responses, labels, rows",
            )
        )
    return scorers


def score(
    scorers: Sequence[Scorer],
    prompts: Sequence[Any],
    responses: Sequence[str],
    labels: Sequence[str | None] | None,
    rows: Sequence[dict],
) -> dict[str, Scores]:
    """{metric name: one score (float or None) per response}, checked: one score per response, numbers only."""
    out: dict[str, Scores] = {}
    for scorer in scorers:
        for name, values in (
            scorer(list(prompts), list(responses), None if labels is None else list(labels), list(rows)) or {}
        ).items():
            values = list(values)
            if len(values) != len(responses):
                raise MetricError(
                    f"metric {name!r}: {len(values)} scores for {len(responses)} responses; return one per response"
                )
            if name in out:
                raise MetricError(f"metric {name!r}: given twice (a built-in and the metric file?); rename one")
            bad = [v for v in values if v is not None and not isinstance(v, (int, float))]
            if bad:
                raise MetricError(f"metric {name!r}: scores must be numbers or None, got {bad[0]!r}")
            out[name] = [None if v is None else float(v) for v in values]
    return out


def is_success_metric(values: Scores) -> bool:
    """All scored values are 0 or 1 (and at least one is scored)."""
    scored = [v for v in values if v is not None]
    return bool(scored) and all(v in (0.0, 1.0) for v in scored)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` successes among ``n`` samples: 1 - C(n-c, k) / C(n, k)
    (Chen et al., 2021)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean(values: Scores) -> float | None:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None
