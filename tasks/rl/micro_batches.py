"""The RL workers' micro-batches: inference passes in row slices of a rollout, training micro-batches of an
Experience by count, and a token-budget micro-batch cut to its own rows' widths (tasks.rl.workers.Trainer).

    for part in chunks(rollout, 8): ...                    # rollout.select of 8 rows at a time (0: all at once)
    logprobs = rollout_logprobs(model, rollout, cfg, device)  # [B, R] on the CPU, a micro-batch of rows at a time
    mb = trimmed(exp, [3, 7])                              # rows 3 and 7, their unused padding cut off
"""

from __future__ import annotations

import torch

from tasks.common.nn.engines.rollout import Rollout
from tasks.rl.experience import Experience, response_logprobs


def chunks(rollout: Rollout, size: int):
    """Row slices of a rollout for inference passes of at most `size` sequences (0: all at once)."""
    n = rollout.sequences.size(0)
    size = size or n
    for start in range(0, n, size):
        yield rollout.select(slice(start, start + size))


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, cfg, device, vision=None) -> torch.Tensor:
    """response_logprobs of a whole rollout at the sampling temperature, micro_rollout_batch_size rows at a time,
    gathered on the CPU: [B, R]. `cfg` is the run's RLConfig; `vision` a vision-language policy's VisionRows."""
    parts = [
        response_logprobs(
            model,
            r.sequences.to(device),
            r.attention_mask.to(device),
            r.prompt_width,
            temperature=cfg.temperature,
            packed=cfg.packing_samples,
            images=r.images,
            vision=vision,
        ).cpu()
        for r in chunks(rollout, cfg.micro_rollout_batch_size)
    ]
    return torch.cat(parts)


def _micro_batches(exp: Experience, size: int):
    n = exp.sequences.size(0)
    for start in range(0, n, size):
        yield exp.minibatch(torch.arange(start, min(n, start + size)))


def response_used(exp: Experience) -> torch.Tensor:
    """[B]: response positions each row uses, up to its last attended or trained token (0 for none). The
    responses are right-padded: past that, nothing is attended to and nothing enters a loss."""
    live = (exp.attention_mask[:, exp.prompt_width :] > 0) | (exp.action_mask > 0)
    positions = torch.arange(1, live.size(1) + 1, device=live.device)
    return (live * positions).amax(1)


def trimmed(exp: Experience, rows: list[int]) -> Experience:
    """The micro-batch of `rows`, cut to their own widths: the prompts' left padding that none of them uses, and
    the response positions past the longest of them. Every [B, R] tensor (log-probs, advantages, masks …) keeps its
    first columns, sequences and attention_mask the same response columns; the prompt width shrinks with the
    left cut. Causal attention and positions from the attention mask (cumsum - 1) leave every kept position's
    numbers as they were, to float rounding."""
    mb = exp.minibatch(torch.as_tensor(rows, dtype=torch.long, device=exp.sequences.device))
    width = mb.action_mask.size(1)
    keep = max(1, int(response_used(mb).max()))
    left = min(int((mb.attention_mask[:, : mb.prompt_width] > 0).int().argmax(1).min()), mb.prompt_width - 1)
    fields = {}
    for name, value in mb.__dict__.items():
        if name in ("sequences", "attention_mask"):
            value = value[:, left : mb.prompt_width + keep]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.size(1) != width:
                raise ValueError(
                    f"Experience.{name}: {list(value.shape)} is not per response token ([B, {width}]); say how to trim it"
                )
            value = value[:, :keep]
        fields[name] = value
    fields["prompt_width"] = mb.prompt_width - left
    return Experience(**fields)
