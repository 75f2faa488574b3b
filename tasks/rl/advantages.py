"""Advantages, returns and KL for the RL stage: small pure functions on [batch, tokens] tensors.

    kl = kl_estimate(logprobs, ref_logprobs, "k1")
    rewards = kl_penalized_rewards(scores, kl, mask, kl_coef=0.05)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambd=0.95)
    advantages = whiten(advantages, mask)
"""
from __future__ import annotations

import torch

from tasks.common.losses import last_token_index, masked_mean


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π, with r = log π_ref - log π.

    k1 = -r, k2 = r²/2, k3 = (e^r - 1) - r (Schulman, "Approximating KL divergence", 2020).
    k1 is unbiased, k3 unbiased and never negative, k2 biased but low-variance.
    """
    log_ratio = ref_logprobs.float() - logprobs.float()
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator: unknown {kind!r}; use k1, k2 or k3")


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards r_t = -β·KL_t, plus the sequence score on the last response token.

    Ziegler et al. 2019, eq. 2 (R(x, y) = r(x, y) - β log π(y|x)/ρ(y|x)), spread over tokens as
    in Ouyang et al. 2022. scores: [B]; kl, mask: [B, T] over response tokens.
    """
    rewards = -kl_coef * kl * mask
    rows = torch.arange(scores.size(0), device=scores.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lambd: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (advantages, returns).

    δ_t = r_t + γV_{t+1} - V_t,  A_t = Σ_l (γλ)^l δ_{t+l}  (Schulman et al. 2016, eqs. 11-16),
    with V = 0 past the last response token; returns R_t = A_t + V_t are the critic's targets.
    """
    rewards = rewards * mask
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
        next_value = values[:, t]
    advantages = advantages * mask
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions; masked-out positions become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask
