"""Advantages, returns and KL for the RL stage: small pure functions on [batch, tokens] tensors.

    kl = kl_estimate(logprobs, ref_logprobs, "k1")
    rewards = kl_penalized_rewards(scores, kl, mask, kl_coef=0.05)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambd=0.95)
    advantages = whiten(advantages, mask)

    # or all of the above, for any of OpenRLHF's --advantage_estimator values:
    advantages, returns = compute_advantages("group_norm", scores, kl, mask, None, n=4, kl_coef=0.0)
    keep = group_keep_mask(scores, n=4, low=0.0, high=1.0)       # --dynamic_filtering

Groups: with n samples per prompt, rows [k·n, (k+1)·n) are the samples of prompt k.
"""

from __future__ import annotations

import warnings

import torch

from tasks.common.nn.losses import kl_estimate, last_token_index, masked_mean
from tasks.rl.config import ADVANTAGE_ESTIMATORS as ESTIMATORS
from tasks.rl.config import (
    GROUP_ESTIMATORS,  # need n ≥ 2 samples per prompt
    uses_critic,
)

__all__ = [
    "ESTIMATORS",
    "compute_advantages",
    "discounted_returns",
    "gae",
    "group_keep_mask",
    "kl_estimate",
    "kl_penalized_rewards",
    "shape_scores",
    "uses_critic",
    "whiten",
]

WHITENED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")  # OpenRLHF normalises these advantages


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
    The mask may have gaps (a multi-turn episode's observation tokens): t+1 is then the next masked-in
    token, so the recursion runs over the model's own tokens only.
    """
    order, mask_c = _compacted(mask)
    rewards_c, values_c = rewards.gather(1, order) * mask_c, values.gather(1, order) * mask_c
    advantages = torch.zeros_like(rewards_c)
    next_value = torch.zeros_like(rewards_c[:, 0])
    running = torch.zeros_like(rewards_c[:, 0])
    for t in reversed(range(rewards_c.size(1))):
        delta = rewards_c[:, t] + gamma * next_value - values_c[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
        next_value = values_c[:, t]
    advantages = _scattered(advantages * mask_c, order)
    return advantages, advantages + values * mask


def _compacted(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked-in positions first, in order, then the rest: (gather index, gathered mask).
    The identity for a mask that is a prefix of ones (a single-turn response)."""
    order = torch.argsort((mask <= 0).to(torch.int8), dim=1, stable=True)
    return order, mask.gather(1, order)


def _scattered(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of gathering by `order`."""
    return torch.zeros_like(x).scatter_(1, order, x)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions; masked-out positions become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage_estimator: unknown {estimator!r}; use {', '.join(ESTIMATORS)}")


def _groups(scores: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """[B] -> [B/n, n], refusing batches that are not whole groups."""
    if n < 1 or scores.size(0) % n != 0:
        raise ValueError(f"{what}: batch of {scores.size(0)} is not whole groups of n_samples_per_prompt={n}")
    return scores.float().reshape(-1, n)


def shape_scores(scores: torch.Tensor, n: int, estimator: str, eps: float = 1e-9) -> torch.Tensor:
    """The sequence-level baseline of each estimator, within groups of n samples of one prompt: [B] -> [B].

    rloo:               r_i - mean_{j≠i} r_j, the leave-one-out baseline (Kool et al. 2019;
                        Ahmadian et al. 2024); equals n/(n-1)·(r_i - mean r).
    reinforce_baseline: r_i - mean_j r_j (REINFORCE++-baseline, Hu et al. 2025).
    group_norm:         (r_i - mean_j r_j) / (std_j r_j + eps) (GRPO outcome supervision, Shao et al.
                        2024, §4.1.2). std is torch.std's unbiased (n-1) one with eps = 1e-9, as in
                        OpenRLHF; a group with equal scores gets 0.
    dr_grpo:            r_i - mean_j r_j, no division by std (Liu et al. 2025, §3.2).
    gae, reinforce:     unchanged (they subtract no group baseline).
    The group estimators refuse n < 2; every estimator refuses a batch that is not whole groups.
    """
    _check_estimator(estimator)
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(f"{estimator}: needs n_samples_per_prompt >= 2, got {n}")
    grouped = _groups(scores, n, estimator)
    if estimator == "rloo":
        shaped = grouped - (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    elif estimator in ("reinforce_baseline", "dr_grpo"):
        shaped = grouped - grouped.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        shaped = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + eps)
    else:
        shaped = grouped
    return shaped.reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Returns-to-go G_t = Σ_k γ^k r_{t+k} over the response tokens: [B, T] -> [B, T].

    The critic-free (REINFORCE, Williams 1992) estimators use G_t itself as the advantage of
    token t. Rewards past the response are ignored; masked-out positions become 0 and do not count
    as steps (a multi-turn episode's observation tokens).
    """
    order, mask_c = _compacted(mask)
    rewards_c = rewards.gather(1, order) * mask_c
    returns = torch.zeros_like(rewards_c)
    running = torch.zeros_like(rewards_c[:, 0])
    for t in reversed(range(rewards_c.size(1))):
        running = rewards_c[:, t] + gamma * running
        returns[:, t] = running
    return _scattered(returns * mask_c, order)


def compute_advantages(
    estimator: str,
    scores: torch.Tensor,
    kl: torch.Tensor | None,
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    n: int = 1,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 0.95,
    reward_clip: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ([B, T] each) for one whole rollout batch, as OpenRLHF computes them.

    scores [B]: one reward per sequence; kl [B, T]: per-token KL to the reference (None = 0);
    mask [B, T]: response tokens; values [B, T]: the critic's, gae only; n: samples per prompt.
    Every estimator goes through the same steps, in OpenRLHF's order:
      1. shaped = shape_scores(scores, n, estimator)           (the group baseline, if any)
      2. shaped.clamp(*reward_clip), if given                   (--reward_clip_range; after shaping)
      3. rewards = kl_penalized_rewards(shaped, kl, mask, kl_coef)   (-β·KL_t per token, the shaped
         score on the last token; pass kl_coef=0 with --use_kl_loss, the KL is then in the loss)
      4. per estimator:
         gae:                rewards -> gae(γ, λ) -> advantages whitened; returns = A + V (unwhitened)
         reinforce:          rewards -> discounted_returns(γ) -> advantages = whiten(returns)
         reinforce_baseline: shaped rewards -> discounted_returns(γ=1) -> advantages = whiten(returns)
         rloo:               shaped rewards -> discounted_returns(γ=1) -> advantages = returns, NOT
                             whitened (OpenRLHF whitens only gae, reinforce and reinforce_baseline)
         group_norm:         shaped (already normalised) -> returns(γ=1) -> advantages = returns
         dr_grpo:            shaped (no std) -> returns(γ=1) -> advantages = returns, no whitening
    Whitening is over all response tokens of the batch, so call this on the whole rollout batch,
    never on a minibatch. Like OpenRLHF, the group estimators force γ = 1 (with a warning if another
    γ is given). For critic-free estimators `returns` is only for logging: there is no critic to fit.
    """
    _check_estimator(estimator)
    if estimator == "gae" and values is None:
        raise ValueError("gae: needs the critic's values")
    if estimator in GROUP_ESTIMATORS and gamma != 1.0:
        warnings.warn(f"{estimator}: gamma={gamma} ignored; group baselines use gamma = 1.0", stacklevel=2)
        gamma = 1.0
    shaped = shape_scores(scores, n, estimator)
    if reward_clip is not None:
        shaped = shaped.clamp(reward_clip[0], reward_clip[1])
    if kl is None:
        kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rewards = kl_penalized_rewards(shaped, kl.float(), mask, kl_coef)
    if estimator == "gae":
        advantages, returns = gae(rewards, values.float(), mask, gamma, lambd)
        return whiten(advantages, mask), returns
    returns = discounted_returns(rewards, mask, gamma)
    if estimator in WHITENED_ESTIMATORS:
        return whiten(returns, mask), returns
    return returns.clone(), returns


def group_keep_mask(scores: torch.Tensor, n: int, low: float, high: float) -> torch.Tensor:
    """Dynamic sampling: which rows to keep, a whole group at a time: [B] -> bool [B].

    A group is kept only if low < mean score < high and its scores are not all equal (equal scores
    give every sample a zero group-relative advantage: no signal). OpenRLHF's --dynamic_filtering
    --dynamic_filtering_reward_range low high; DAPO's dynamic sampling (Yu et al. 2025, §3.2). The
    interval is open, as in OpenRLHF, so with 0/1 rewards and (0, 1) all-wrong and all-right groups
    go. Apply it to the raw scores, before shaping. Needs n ≥ 2.
    """
    if n < 2:
        raise ValueError(f"dynamic_filtering: needs n_samples_per_prompt >= 2, got {n}")
    grouped = _groups(scores, n, "dynamic_filtering")
    mean = grouped.mean(-1)
    varied = grouped.amax(-1) > grouped.amin(-1)
    keep = (mean > low) & (mean < high) & varied
    return keep.repeat_interleave(n)
