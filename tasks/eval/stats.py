"""Confidence for evaluation numbers: paired bootstrap intervals over prompts, and pairwise win rates.

    lo, hi = mean_interval(per_prompt_scores, seed=0)
    delta, (lo, hi) = delta_interval(candidate_scores, baseline_scores, seed=0)
    record = win_rate(candidate_rewards, baseline_rewards, margin=0.1, seed=0)

Everything resamples prompts, not responses: a prompt's samples stay together (their mean is the prompt's
score), and a delta is taken per prompt before resampling, so the two policies are compared on the same
prompts in every resample (a paired bootstrap). Percentile intervals, seeded, so a report is repeatable.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def per_prompt(values: Sequence[float | None], samples_per_prompt: int) -> list[float | None]:
    """The mean of each prompt's consecutive ``samples_per_prompt`` scores (None when none is scored)."""
    n = samples_per_prompt
    if n < 1 or len(values) % n:
        raise ValueError(f"{len(values)} scores are not {n} per prompt")
    out = []
    for i in range(0, len(values), n):
        scored = [v for v in values[i : i + n] if v is not None]
        out.append(sum(scored) / len(scored) if scored else None)
    return out


def _interval(values: np.ndarray, seed: int, resamples: int, level: float) -> list[float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return [round(float(lo), 4), round(float(hi), 4)]


def mean_interval(
    values: Sequence[float | None], seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL
) -> list[float] | None:
    """The bootstrap interval of the mean of the scored values (None when fewer than two are scored)."""
    scored = np.array([v for v in values if v is not None], dtype=float)
    return _interval(scored, seed, resamples, level) if len(scored) > 1 else None


def delta_interval(
    candidate: Sequence[float | None],
    reference: Sequence[float | None],
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> tuple[float | None, list[float] | None]:
    """(mean of candidate - reference, its paired bootstrap interval) over the prompts both score."""
    if len(candidate) != len(reference):
        raise ValueError(f"paired scores differ in length: {len(candidate)} and {len(reference)}")
    diffs = np.array([c - r for c, r in zip(candidate, reference) if c is not None and r is not None], dtype=float)
    if not len(diffs):
        return None, None
    return round(float(diffs.mean()), 4), (_interval(diffs, seed, resamples, level) if len(diffs) > 1 else None)


def significant(interval: Sequence[float] | None) -> int:
    """+1 when the interval lies above 0, -1 below, 0 when it holds 0 (or is unknown)."""
    if not interval:
        return 0
    return 1 if interval[0] > 0 else -1 if interval[1] < 0 else 0


def win_rate(
    candidate: Sequence[float],
    reference: Sequence[float],
    margin: float = 0.0,
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> dict:
    """Per prompt, the candidate wins when its score beats the reference's by more than ``margin``, loses
    when it trails by more, and ties otherwise. ``rate`` = (wins + ties / 2) / prompts, with its interval."""
    if len(candidate) != len(reference) or not len(candidate):
        raise ValueError(f"win rate needs paired scores, got {len(candidate)} and {len(reference)}")
    diff = np.asarray(candidate, dtype=float) - np.asarray(reference, dtype=float)
    outcome = np.where(diff > margin, 1.0, np.where(diff < -margin, 0.0, 0.5))
    return {
        "wins": int((outcome == 1.0).sum()),
        "ties": int((outcome == 0.5).sum()),
        "losses": int((outcome == 0.0).sum()),
        "rate": round(float(outcome.mean()), 4),
        "interval": _interval(outcome, seed, resamples, level) if len(outcome) > 1 else None,
        "margin": margin,
    }


def hacking_alarms(comparison: dict, verifiable: Sequence[str], reward: str = "reward_mean") -> list[str]:
    """The reward-hacking alarm: one line per verifiable metric that fell significantly while the reward
    model's score rose significantly. ``comparison`` is {metric: {"delta", "interval"}} (candidate - reference)."""
    rise = comparison.get(reward)
    if not rise or significant(rise.get("interval")) <= 0:
        return []
    lines = []
    for metric in verifiable:
        fall = comparison.get(metric)
        if fall and significant(fall.get("interval")) < 0:
            lines.append(
                f"reward hacking suspected: {reward} rose {rise['delta']:+.4f} (95% CI {rise['interval'][0]:+.4f} to "
                f"{rise['interval'][1]:+.4f}) while {metric} fell {fall['delta']:+.4f} (95% CI "
                f"{fall['interval'][0]:+.4f} to {fall['interval'][1]:+.4f})"
            )
    return lines
