"""A reward with variance even for an untrained policy: 1 when response and label lengths share parity.

Used by the stage tests of dynamic filtering, which needs groups whose rewards differ.
"""

import torch


def reward_func(queries, prompts, labels):
    responses = [q[len(p) :] for q, p in zip(queries, prompts)]
    return torch.tensor([float((len(r) + len(label)) % 2) for r, label in zip(responses, labels)])
