"""The benchmark's reward, the same for both trainers: the fraction of a completion's filler tokens
(`<x123>`, what the random-weight model mostly samples) with an even id. Cheap, and with variance inside
a group, so group-normalised advantages are not all zero.

Ours calls reward_func (tasks.rl's --remote_rm_url contract); TRL calls trl_reward.
"""

import re

import torch

FILLER = re.compile(r"<x(\d+)>")


def even_fraction(text: str) -> float:
    ids = [int(m) for m in FILLER.findall(text)]
    return sum(i % 2 == 0 for i in ids) / max(1, len(ids))


def reward_func(queries, prompts, labels):
    return torch.tensor([even_fraction(q[len(p) :]) for q, p in zip(queries, prompts)])


def trl_reward(completions, **kwargs):
    return [even_fraction(c) for c in completions]
