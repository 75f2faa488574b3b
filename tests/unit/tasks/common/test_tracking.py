"""Progress lines (tasks/common/tracking.py): where a long stage is, between its logged steps.

pytest tests/unit/tasks/common/test_tracking.py
"""

from tasks.common import tracking
from tasks.common.tracking import MetricsTracker, progress_line


def test_the_line_has_the_step_the_rate_and_the_time_left():
    assert (
        progress_line("sft", 12, 100, 1, 15.0, {"loss": 0.4123})
        == "sft: step 12/100, 0.8 steps/s, about 1m50s left, loss=0.4123"
    )
    assert progress_line("rl", 30, 30, 1, 60.0, {}) == "rl: step 30/30, 0.5 steps/s"  # done: nothing left
    # A resumed stage's rate is its own steps': 5 steps (11-15) in 10 s.
    assert progress_line("rl", 15, 20, 11, 10.0, {"reward": 0.5}).startswith(
        "rl: step 15/20, 0.5 steps/s, about 10s left"
    )
    assert "about 2h46m left" in progress_line("rl", 1, 1001, 1, 10.0, {})


def test_a_line_at_most_every_interval_and_at_the_last_step(tmp_path, capsys, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(tracking.time, "time", lambda: clock[0])
    tracker = MetricsTracker(tmp_path / "metrics.jsonl", name="sft")
    for step in range(1, 11):
        clock[0] += 3.0  # a step takes 3 s: the first step's line, then one every 4 steps (12 s), and the last
        tracker.progress(step, 10, {"loss": 1.0 / step})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "sft: step 1/10",
        "sft: step 5/10",
        "sft: step 9/10",
        "sft: step 10/10",
    ]
    assert lines[1] == "sft: step 5/10, 0.333 steps/s, about 15s left, loss=0.2"
    tracker.log(11, {"loss": 0.1})  # a logged step counts as a line printed
    clock[0] += 3.0
    tracker.progress(11, 20, {})
    assert capsys.readouterr().out.startswith("step 11/10 loss=0.1\n") is True  # the count progress() was last given
    tracker.close()
