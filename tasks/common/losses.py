"""Loss functions shared by the stages: small, pure, tensor in, tensor out.

    loss = sft_loss(token_logprobs, loss_mask)
    loss = bradley_terry_loss(chosen_scores, rejected_scores)
    loss, clip_frac = policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2)
    loss, clip_frac = value_loss(values, old_values, returns, mask, clip_eps=0.2)

Shapes: per-token tensors are [batch, tokens] with a 0/1 mask of the same shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (all of them, or along `dim`)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask ([B, T] -> [B])."""
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return (positions * mask.long()).argmax(dim=1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | ·) from logits of the same length: [B, T, V], [B, T] -> [B, T]."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood averaged over the response tokens only (prompt tokens masked out)."""
    return -masked_mean(logprobs, loss_mask)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Pairwise reward-model loss, -log σ(r_chosen - r_rejected), averaged over pairs.

    Ouyang et al. 2022 (InstructGPT), eq. 1.
    """
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, -min(ρA, clip(ρ, 1-ε, 1+ε)A) with ρ = π/π_old, per token.

    Schulman et al. 2017, eq. 7. Returns the masked mean loss and the fraction of tokens clipped.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clip_fraction = masked_mean((clipped < unclipped).float(), mask)
    return masked_mean(loss, mask), clip_fraction


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic loss ½·max((V-R)², (V_clip-R)²), V_clip = V_old + clip(V-V_old, -ε, ε).

    The value clipping of the PPO reference implementation (Schulman et al. 2017, baselines
    ppo2; analysed by Engstrom et al. 2020, eq. 4). clip_eps=None gives the plain ½(V-R)².
    Returns the masked mean loss and the fraction of tokens where the clipped term was larger.
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return masked_mean(loss, mask), masked_mean((clipped > unclipped).float(), mask)
