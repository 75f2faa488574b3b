"""Checked resumes (tasks/common/resume_check.py): the band, the band check and the step count, against values
computed by hand."""

import math

import pytest

from tasks.common.config import ConfigError
from tasks.common.resume_check import ResumeCheckError, band, band_problem, remember, steps_problem


def test_the_band_is_the_windows_range_widened_by_the_largest_margin():
    # [1, 2, 3]: population std sqrt(2/3) = 0.8165; 3 std = 2.4495 beats 25% of 3 = 0.75.
    low, high = band([1.0, 2.0, 3.0])
    assert low == pytest.approx(1 - 3 * math.sqrt(2 / 3)) and high == pytest.approx(3 + 3 * math.sqrt(2 / 3))
    assert low == pytest.approx(-1.4495, abs=1e-4) and high == pytest.approx(5.4495, abs=1e-4)
    # [10, 10.2]: std 0.1, 3 std = 0.3; 25% of 10.2 = 2.55 is wider.
    assert band([10.0, 10.2]) == pytest.approx((7.45, 12.75))
    # One step: no spread, the relative margin alone (25% of 4).
    assert band([4.0]) == pytest.approx((3.0, 5.0))
    # Negative values: the margin is relative to the largest magnitude (25% of |-8| = 2; std 1, 3 std = 3 wins).
    assert band([-8.0, -6.0]) == pytest.approx((-11.0, -3.0))
    # A metric constant at 0 (KL with KL off): the floor.
    assert band([0.0, 0.0, 0.0]) == pytest.approx((-1e-6, 1e-6))
    # The widths are arguments: 1 std, no relative margin, no floor.
    assert band([1.0, 2.0, 3.0], stds=1.0, relative=0.0, floor=0.0) == pytest.approx(
        (1 - math.sqrt(2 / 3), 3 + math.sqrt(2 / 3))
    )
    with pytest.raises(ValueError):
        band([])


HISTORY = [
    {"step": 4, "reward": 1.0, "kl": 0.10, "entropy": 2.0, "grad_norm": 0.5},
    {"step": 5, "reward": 2.0, "kl": 0.12, "entropy": 1.9, "grad_norm": 0.6},
    {"step": 6, "reward": 3.0, "kl": 0.14, "entropy": 1.8, "grad_norm": 0.7},
]
NAMES = ("reward", "kl", "entropy", "grad_norm")


def test_a_resumed_step_inside_every_band_passes():
    assert (
        band_problem(HISTORY, {"step": 7, "reward": 3.5, "kl": 0.15, "entropy": 1.75, "grad_norm": 0.72}, NAMES) is None
    )
    # The band's edges are inside: reward's is [-1.4495, 5.4495].
    assert band_problem(HISTORY, {"step": 7, "reward": 5.449}, NAMES) is None


def test_an_off_metric_trips_the_check_naming_the_metric_its_value_and_the_band():
    # grad_norm [0.5, 0.7]: std 0.08165, 3 std = 0.2449 beats 25% of 0.7 = 0.175: the band is [0.2551, 0.9449].
    problem = band_problem(HISTORY, {"step": 7, "reward": 3.0, "kl": 0.14, "entropy": 1.8, "grad_norm": 12.0}, NAMES)
    assert problem == "grad_norm 12 is outside [0.255051, 0.944949], the band of steps 4-6 before the interruption"
    # Below the band trips too, and the first metric outside is named (reward before grad_norm).
    problem = band_problem(HISTORY, {"step": 7, "reward": -2.0, "grad_norm": 12.0}, NAMES)
    assert problem == "reward -2 is outside [-1.44949, 5.44949], the band of steps 4-6 before the interruption"
    # A NaN is never inside.
    assert band_problem(HISTORY, {"step": 7, "kl": float("nan")}, NAMES).startswith("kl nan is outside")


def test_a_metric_missing_on_either_side_is_not_checked():
    old = [
        {k: v for k, v in r.items() if k != "grad_norm"} for r in HISTORY
    ]  # a checkpoint from before grad_norm was logged
    assert band_problem(old, {"step": 7, "reward": 3.0, "grad_norm": 1e9}, NAMES) is None
    assert band_problem(HISTORY, {"step": 7}, NAMES) is None  # e.g. ZeRO-0 in fp32 reports no gradient norm
    assert band_problem([], {"step": 7, "reward": 1e9}, NAMES) is None  # no history at all


def test_too_short_or_all_zero_a_window_is_not_checked():
    # Two steps say nothing of how much a metric moves (the default needs 3); with min_history 2 they do.
    assert band_problem(HISTORY[:2], {"step": 6, "reward": 100.0}, NAMES) is None
    assert band_problem(HISTORY[:2], {"step": 6, "reward": 100.0}, NAMES, min_history=2).startswith(
        "reward 100 is outside"
    )
    # A sparse reward at 0 before the first success (and the zero gradients it gives): its first nonzero value is not a fault.
    zeros = [{"step": s, "reward": 0.0, "grad_norm": 0.0, "entropy": 2.0} for s in (1, 2, 3)]
    assert band_problem(zeros, {"step": 4, "reward": 0.25, "grad_norm": 0.3, "entropy": 2.0}, NAMES) is None
    # ...while the metrics that did move are still checked (entropy [2, 2]: 25% of 2, so [1.5, 2.5]).
    assert (
        band_problem(zeros, {"step": 4, "reward": 0.25, "entropy": 0.1}, NAMES)
        == "entropy 0.1 is outside [1.5, 2.5], the band of steps 1-3 before the interruption"
    )


def test_the_history_keeps_the_newest_window():
    history: list[dict] = []
    for step in range(1, 6):
        history = remember(history, {"step": step, "reward": float(step)}, window=3)
    assert [r["step"] for r in history] == [3, 4, 5]
    assert remember(history, {"step": 6}, window=0) == []


def test_the_step_count_passes_only_when_every_planned_update_ran():
    assert steps_problem(planned=12, resumed_from=0, done=12) is None
    assert steps_problem(planned=12, resumed_from=6, done=12) is None
    # verl#7401: resumed, exited without running the rest.
    assert (
        steps_problem(planned=12, resumed_from=6, done=6)
        == "it did 6 of its 12 planned updates (resumed from step 6, 0 run here, 6 missing)"
    )
    assert (
        steps_problem(planned=12, resumed_from=6, done=10)
        == "it did 10 of its 12 planned updates (resumed from step 6, 4 run here, 2 missing)"
    )
    # A checkpoint past the plan (a lowered --max_steps) commits a model trained longer than its config says.
    assert steps_problem(planned=4, resumed_from=6, done=6).startswith(
        "the checkpoint it resumed from is at step 6, past the 4 planned steps"
    )


def test_a_failed_check_is_a_one_line_input_error():
    # A ConfigError: tasks.common.stage.main prints its one line and exits 2, which the operator does not retry.
    assert issubclass(ResumeCheckError, ConfigError) and not getattr(ResumeCheckError, "transient", False)
