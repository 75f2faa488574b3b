"""The demo's preferred (terse) style as a reward function: 1.0 for a terse response, else 0.0.

The GPU learning check uses it in place of a reward model, so an RL run there needs no reward-model
group: the actor on one GPU and, off-policy, a vLLM engine on the other.
"""

import torch

from tasks.data.demo import is_preferred_style
from tasks.data.demo_reward import response_of


def reward_func(queries, prompts, labels):
    return torch.tensor([float(is_preferred_style(response_of(q, p))) for q, p in zip(queries, prompts)])
