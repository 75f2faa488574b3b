"""Checked resumes: a resumed stage runs every update it planned, and its first resumed steps look like the
steps before the interruption.

    history = remember(history, {"step": 6, "reward": 3.1, "kl": 0.4}, WINDOW)   # each step; saved with the checkpoint
    problem = band_problem(history_at_resume, {"step": 7, "reward": 9.0}, ("reward", "kl"))   # None, or one line
    problem = steps_problem(planned=12, resumed_from=6, done=12)                           # None, or one line

A resume that exits 0 without doing its remaining updates (verl#7401) commits a model short of its training;
a resume whose state does not match the run that wrote it (optimizer state not restored, a changed learning
rate, a checkpoint with parts from different steps) trains on from the wrong place. Neither shows in the exit
status. The first is a count; the second shows in the first resumed steps' metrics, against the band of the
steps the checkpoint remembers. Standard library only: the pure part, unit-tested
(tests/unit/tasks/common/test_resume_check.py).
"""

from __future__ import annotations

import math

from tasks.common.config import ConfigError

#: Steps before the interruption a checkpoint remembers, per metric.
WINDOW = 8
#: Fewer remembered steps than this make no band (one or two steps say nothing of how much a metric moves).
MIN_HISTORY = 3
#: Resumed steps checked against the band. Two, not one: the first resumed step's rollout and gradients come
#: from the restored weights alone, so a lost optimizer state or a changed learning rate shows first in the second.
CHECKED_STEPS = 2
#: The band: the window's min and max, each widened by the largest of BAND_STDS standard deviations, BAND_RELATIVE
#: of the window's largest magnitude, and BAND_FLOOR (a metric constant at 0, such as KL with KL off, still admits
#: float noise). Wide on purpose: training moves the metrics, and a false alarm fails a good resume.
BAND_STDS = 3.0
BAND_RELATIVE = 0.25
BAND_FLOOR = 1e-6


class ResumeCheckError(ConfigError):
    """A resume that did not do what the run planned, or did not continue where it stopped. Not transient: the same
    checkpoint and flags trip it again, so the stage exits 2 (fix the input) and nothing is committed."""


def remember(history: list[dict], record: dict, window: int = WINDOW) -> list[dict]:
    """The newest `window` per-step records ({"step": n, metric: value, …}), `record` appended."""
    return [*history, record][-window:] if window > 0 else []


def band(
    values: list[float], stds: float = BAND_STDS, relative: float = BAND_RELATIVE, floor: float = BAND_FLOOR
) -> tuple[float, float]:
    """(low, high): min and max of `values`, widened by max(stds × their population std, relative × max |value|, floor)."""
    if not values:
        raise ValueError("band: no values")
    low, high = min(values), max(values)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    margin = max(stds * std, relative * max(abs(low), abs(high)), floor)
    return low - margin, high + margin


def band_problem(
    history: list[dict], record: dict, names: tuple[str, ...] | list[str], min_history: int = MIN_HISTORY, **band_args
) -> str | None:
    """The first of `names` whose value in `record` lies outside the band of its values in `history` (or is not
    finite), as one phrase; None when all are inside. Not checked: a metric the history or the record lacks (a
    checkpoint written before it was logged, a configuration that does not log it), one with fewer than `min_history`
    values, and one that was 0 throughout (a sparse reward before the first success, its zero gradients: no scale to
    judge the first nonzero value by)."""
    for name in names:
        values = [float(r[name]) for r in history if r.get(name) is not None]
        if len(values) < max(1, min_history) or record.get(name) is None or not any(values):
            continue
        value = float(record[name])
        low, high = band(values, **band_args)
        if not (math.isfinite(value) and low <= value <= high):
            steps = [r["step"] for r in history if r.get(name) is not None]
            return f"{name} {value:.6g} is outside [{low:.6g}, {high:.6g}], the band of steps {steps[0]}-{steps[-1]} before the interruption"
    return None


def steps_problem(planned: int, resumed_from: int, done: int) -> str | None:
    """Why a run that planned `planned` updates, resumed from step `resumed_from` (0: from scratch) and reached step
    `done` may not commit, as one phrase; None when it did every update."""
    if done == planned:
        return None
    if resumed_from > planned:
        return f"the checkpoint it resumed from is at step {resumed_from}, past the {planned} planned steps (was --max_steps or --num_episodes lowered?)"
    return f"it did {done} of its {planned} planned updates (resumed from step {resumed_from}, {done - resumed_from} run here, {planned - done} missing)"
