"""The vision-language demo's verifiable reward, as a reward-function file (tasks/data/demo_vlm.py):

    python -m tasks.rl … --remote_rm_url tasks/data/demo_vlm_reward.py --label_key label

`reward_func(queries, prompts, labels)` gives 1.0 where the response is the label (the colour's letter), else 0.0.
A query is the decoded prompt + response with special tokens dropped (image placeholders and chat markers
included), so the response is what follows the prompt's last text: PROMPT's words, then the chat template's
"assistant" line when there is one.
"""

from __future__ import annotations

import torch

from tasks.common.image_tags import IMAGE_TAG


def response_of(query: str, prompt) -> str:
    """The response part of `query`: after the prompt's last text (its `<image>` tags decode to nothing), past the
    chat template's assistant opening if any."""
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    tail = text.split(IMAGE_TAG)[-1].strip()
    at = query.rfind(tail) if tail else -1
    rest = query[at + len(tail) :] if at >= 0 else query
    head, sep, after = rest.partition("assistant\n")
    return after if sep and not head.strip() else rest


def reward_func(queries: list[str], prompts: list, labels: list[str | None]) -> torch.Tensor:
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(
            f"demo_vlm reward: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels; need one each"
        )
    return torch.tensor(
        [
            float(label is not None and response_of(q, p).strip() == label)
            for q, p, label in zip(queries, prompts, labels)
        ]
    )
