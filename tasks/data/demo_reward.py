"""The demo task's exact-match reward, as a reward-function file:

    python -m tasks.rl … --remote_rm_url tasks/data/demo_reward.py

`reward_func(queries, prompts, labels)` gives 1.0 where the answer parsed out of the response (in
either style, terse `082` or wordy `082 is the sum`) equals the label, else 0.0. It is loaded by
path, wherever the stage runs; the stage library is installed there, so it parses answers with
the demo task's own `extract_answer`.

A query is the decoded prompt + response, so the response is the query minus its prompt. The prompt
as the dataset wrote it need not appear verbatim in the decoded query: the RL stage may cut long
prompts from the left, and a tokenizer may normalise whitespace on the way through. `response_of`
therefore tries, in order: the prompt as a prefix; the prompt anywhere (a template wrapped it); the
longest tail of the prompt that starts the query, ignoring whitespace (a cut or re-spaced prompt);
and last the whole query.
"""

from __future__ import annotations

import torch

from tasks.data.demo import extract_answer


def response_of(query: str, prompt: str) -> str:
    """The response part of `query` (= prompt + response as decoded text)."""
    if not prompt:
        return query
    if query.startswith(prompt):
        return query[len(prompt) :]
    at = query.find(prompt)
    if at >= 0:
        return query[at + len(prompt) :]
    # Whitespace-insensitive: the longest tail of the prompt's characters that the query starts with.
    kept = [(i, c) for i, c in enumerate(query) if not c.isspace()]
    query_chars = "".join(c for _, c in kept)
    prompt_chars = "".join(c for c in prompt if not c.isspace())
    for start in range(len(prompt_chars)):
        tail = prompt_chars[start:]
        if query_chars.startswith(tail):
            return query[kept[len(tail) - 1][0] + 1 :]
    return query


def reward_func(queries: list[str], prompts: list[str], labels: list[str | None]) -> torch.Tensor:
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(
            f"demo reward: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels; need one each"
        )
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        answer = extract_answer(response_of(query, prompt))
        rewards.append(1.0 if label is not None and answer is not None and answer == str(label).strip() else 0.0)
    return torch.tensor(rewards, dtype=torch.float32)
