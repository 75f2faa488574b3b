"""What the RL stage logs about its responses' lengths each step (tasks/rl/trainer.py response_lengths).

pytest tests/unit/test_rl_stats.py
"""

import pytest
import torch

from tasks.rl.experience import response_lengths


def test_mean_max_and_the_share_cut_at_the_cap():
    stats = response_lengths(torch.tensor([3, 8, 8, 1]), cap=8)
    assert stats == {
        "response_length": pytest.approx(5.0),
        "response_length_max": 8,
        "response_truncated": pytest.approx(0.5),
    }


def test_episodes_have_no_single_cap():
    assert "response_truncated" not in response_lengths(torch.tensor([5, 40]), cap=None)
