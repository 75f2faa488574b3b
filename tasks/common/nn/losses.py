"""Loss functions shared by the stages: small, pure, tensor in, tensor out (the log-probabilities and entropies
they take come from tasks.common.nn.vocab).

    loss = sft_loss(token_logprobs, loss_mask)
    loss = bradley_terry_loss(chosen_scores, rejected_scores)
    loss, clip_frac = policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2)
    loss, clip_frac = policy_loss(..., clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0,
                                  loss_agg="seq_mean_token_sum_norm", max_len=1024)
    loss, clip_frac = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    kl = kl_estimate(logprobs, ref_logprobs, "k3")           # per token, [B, T]
    loss = kl_loss(logprobs, ref_logprobs, mask, "k3")        # --use_kl_loss; the caller multiplies by β
    loss = aggregate(per_token_loss, mask, "token_mean")      # how [B, T] losses become one number
    share = aggregate(mb_loss, mb_mask, "token_mean", normalizer=loss_normalizer(minibatch_mask))  # a micro-batch's part

Shapes: per-token tensors are [batch, tokens] with a 0/1 mask of the same shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Bounds that keep one far-off token from overflowing a step (issue 52, item 5).
LOG_RATIO_CLAMP = 20.0  # |log π/π_old| before exp, as verl and OpenRLHF: e^20 ≈ 4.9e8; e^89 is inf in float32
KL_CLAMP = 10.0  # |per-token KL estimate|, as OpenRLHF's compute_approx_kl
IS_MODES = ("tis", "mis", "reject")  # importance_weights; "none" is no correction


def masked_inputs(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with 0 where mask is 0, applied to a loss's inputs before any arithmetic. Masking the output
    (torch.where or × mask) keeps a padded position's inf/nan out of the forward pass but not the backward:
    the chain rule there multiplies a zero gradient by ∞ (e.g. exp(logπ - logπ_old) with logπ_old = -1000) = nan."""
    keep = mask > 0
    return tuple(torch.where(keep, t, 0.0) for t in tensors)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (all of them, or along `dim`)."""
    (x,) = masked_inputs(mask, x)  # an inf under the mask would make x · 0 = nan
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask ([B, T] -> [B])."""
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return (positions * mask.long()).argmax(dim=1)


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Negative log-likelihood of the response tokens (prompt tokens masked out), summed and divided
    by `num_tokens`, or averaged over this batch's response tokens without it.

    Data parallelism passes `num_tokens` = (response tokens of the whole global batch) / (number of
    micro-batches, over all workers): the workers' averaged gradients are then those of the global
    batch's token mean, whatever the split.
    """
    if num_tokens is None:
        return -masked_mean(logprobs, loss_mask)
    (logprobs,) = masked_inputs(loss_mask, logprobs)  # a -inf log-prob under the mask: -inf · 0 = nan
    return -(logprobs * loss_mask).sum() / num_tokens


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Pairwise reward-model loss, -log σ(r_chosen - r_rejected), averaged over pairs.

    Ouyang et al. 2022 (InstructGPT), eq. 1.
    """
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token_mean",
    max_len: int | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the response tokens (mask = 1).

    token_mean:              Σ_{i,t} l_it / Σ_{i,t} m_it — every token of the batch weighs the same
                             (OpenRLHF's default, token_level_loss=True; DAPO §3.3 "token-level loss").
    seq_mean_token_mean:     mean_i (Σ_t l_it / |o_i|) — each sequence weighs the same, so tokens of
                             short answers weigh more (GRPO's original, Shao et al. 2024, eq. 3).
    seq_mean_token_sum_norm: mean_i (Σ_t l_it / max_len) with a constant max_len, which removes the
                             length bias of 1/|o_i| (Dr. GRPO, Liu et al. 2025, §3.2); max_len is
                             the generation budget (generate_max_len), not the batch's padded width.

    The sequence-level forms average over the rows that hold at least one response token.
    Positions with mask 0 never contribute, even when the loss there is inf or nan.

    normalizer: the denominator to use instead of this batch's own (its tokens for token_mean, its rows with
    tokens for the sequence forms): loss_normalizer of the whole minibatch. Each micro-batch's loss is then its
    share of the minibatch's, and the shares sum to the minibatch's loss however its rows were split
    (micro-batches by token budget, --max_tokens_per_gpu).
    """
    mask = mask.to(loss.dtype)
    loss = torch.where(mask > 0, loss, torch.zeros_like(loss))
    if loss_agg == "token_mean":
        return masked_mean(loss, mask) if normalizer is None else (loss * mask).sum() / normalizer
    if loss_agg == "seq_mean_token_mean":
        per_sequence = masked_mean(loss, mask, dim=1)
    elif loss_agg == "seq_mean_token_sum_norm":
        if max_len is None or max_len <= 0:
            raise ValueError("loss_agg: seq_mean_token_sum_norm needs max_len > 0 (the generation budget)")
        per_sequence = (loss * mask).sum(1) / float(max_len)
    else:
        raise ValueError(f"loss_agg: unknown {loss_agg!r}; use {', '.join(LOSS_AGGREGATIONS)}")
    has_tokens = (mask.sum(1) > 0).to(loss.dtype)
    return (per_sequence * has_tokens).sum() / (has_tokens.sum().clamp(min=1.0) if normalizer is None else normalizer)


def loss_normalizer(mask: torch.Tensor, loss_agg: str = "token_mean", keep: torch.Tensor | None = None) -> torch.Tensor:
    """The denominator `aggregate` divides a batch's losses by, over a whole minibatch [B, T]: its response tokens
    (token_mean) or its rows holding at least one (the sequence forms), at least 1. `keep`: the bool keep mask of
    --is_correction reject (importance_weights), whose dropped tokens leave the denominator, as in policy_loss."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg: unknown {loss_agg!r}; use {', '.join(LOSS_AGGREGATIONS)}")
    kept = (mask > 0) if keep is None else (mask > 0) & keep.bool()
    count = kept.sum() if loss_agg == "token_mean" else kept.any(1).sum()
    return count.float().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token_mean",
    max_len: int | None = None,
    is_weights: torch.Tensor | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) with ρ = π/π_old, per token.

    Schulman et al. 2017, eq. 7, where ε_low = ε_high = clip_eps. Setting clip_eps_low/clip_eps_high
    gives the asymmetric bounds of DAPO's clip-higher (Yu et al. 2025, §3.1; e.g. 0.2 / 0.28); each
    one left None falls back to clip_eps.

    dual_clip = c > 1 (Ye et al. 2020, eq. 5): for tokens with A < 0 the surrogate is further
    bounded by max(min(ρA, clip(ρ)A), cA), i.e. the per-token loss is min(clipped loss, c·|A|), so a
    huge ratio on a bad token cannot dominate the batch. Tokens with A ≥ 0 are unchanged.

    loss_agg / max_len / normalizer: how per-token losses become one number (see `aggregate`; a normalizer for
    reject counts only the kept tokens: loss_normalizer(mask, loss_agg, keep=is_weights)).
    is_weights: per-token off-policy correction (importance_weights). A float tensor (tis, mis) multiplies each
    token's loss, the denominator unchanged; a bool one (reject) is a keep mask: the tokens it drops leave the
    aggregation altogether, so token_mean divides by the kept tokens (as a bool attn_mask in PyTorch's
    scaled_dot_product_attention masks, where a float one is added).
    The ratio is taken with its log clamped to ±20 (policy_ratio).
    Returns (loss, clip_fraction); clip_fraction is the token-mean fraction of response tokens where
    the ε-clipped term was the smaller one (the dual clip is not counted).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip: c must be > 1, got {dual_clip}")
    eps_low = clip_eps if clip_eps_low is None else clip_eps_low
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    logprobs, old_logprobs, advantages = masked_inputs(mask, logprobs, old_logprobs, advantages)  # ρ = 1, A = 0 there
    ratio = policy_ratio(logprobs, old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    clip_fraction = masked_mean((clipped < unclipped).float(), mask)
    kept = mask
    if is_weights is not None and is_weights.dtype == torch.bool:
        kept = mask * is_weights  # reject: a rejected token leaves the sum and its denominator
    elif is_weights is not None:
        (is_weights,) = masked_inputs(mask, is_weights.detach())
        surrogate = surrogate * is_weights
    return aggregate(-surrogate, kept, loss_agg, max_len, normalizer), clip_fraction


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """ρ = π/π_old = exp(log π - log π_old), the log-ratio clamped to ±LOG_RATIO_CLAMP (20) first, as verl and
    OpenRLHF do. A token the policy moved far from (log-ratio 25: ρ = 7.2e10) would otherwise give one token's
    loss of ρ·|A| with A < 0, or inf past a log-ratio of 88 in float32; clamped, ρ ≤ e^20 and a token past
    the bound gets no gradient."""
    return torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, cap: float = 2.0
) -> torch.Tensor | None:
    """Per-token weights correcting for rollouts sampled by another policy μ (a rollout engine's stale weights or
    its numerics) than the π_old the PPO ratio is taken against: w = π_old / μ per token, detached.

    tis:    min(w, cap), truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
            brings you off-policy RL training"; Espeholt et al. 2018's truncation).
    mis:    w where 1/cap <= w <= cap, else 0: IcePop (Ling Team 2025, Ring-1T; OpenRLHF's icepop, verl's token
            mask mode). Inside the band a token is fully corrected, outside it is dropped; a float weight, so a
            dropped token still counts in the token-mean denominator, as in OpenRLHF (verl takes it out).
    reject: a bool keep mask, True where 1/cap <= w <= cap: rejection with weight 1 and no correction inside the
            band. policy_loss takes the rejected tokens out of the aggregation, denominator included, as verl's
            rejection mask (rollout_rs) does.
    none:   None (no correction). Masked-out positions get 0 (False).
    """
    if mode == "none":
        return None
    if mode not in IS_MODES:
        raise ValueError(f"is_correction: unknown {mode!r}; use {', '.join(IS_MODES)} or none")
    old_logprobs, behaviour_logprobs = masked_inputs(mask, old_logprobs.detach().float(), behaviour_logprobs.float())
    log_w = old_logprobs - behaviour_logprobs
    if mode == "tis":
        return torch.exp(log_w.clamp(max=math.log(cap))) * (mask > 0)
    inside = in_band(log_w, cap) & (mask > 0)
    if mode == "reject":
        return inside
    return torch.where(inside, torch.exp(log_w.clamp(-math.log(cap), math.log(cap))), 0.0)  # clamped: no inf outside


def in_band(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """1/cap <= w <= cap, bounds included, compared in log space (w itself may overflow)."""
    return log_w.abs() <= math.log(cap)


def logprob_mismatch(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the trainer's log-probabilities of the sampled tokens are from the engine's that sampled them:
    the mean of log π_old - log μ and its largest magnitude (engine_logprob_max_diff, the weight-sync check's
    name) over response tokens, and KL(μ‖π_old) by the k3 estimator
    (E_μ[w - 1 - log w], w = π_old/μ: unbiased and never negative on samples from μ).

    corrected_mismatch_kl: the same k3 of what the correction leaves, r = w / is_weight over the tokens it keeps
    (none: r = w, the whole mismatch; tis: max(1, w/cap); mis: 1, IcePop corrects what it keeps fully; reject:
    w inside the band). The mismatch itself is the sampling weights' lag, which no correction changes; this is
    how much of it the loss still trains on."""
    old_logprobs, behaviour_logprobs = masked_inputs(mask, old_logprobs.detach().float(), behaviour_logprobs.float())
    log_w = old_logprobs - behaviour_logprobs
    if not (mask > 0).any():
        return {
            "mismatch_log_ratio_mean": 0.0,
            "engine_logprob_max_diff": 0.0,
            "mismatch_kl": 0.0,
            "corrected_mismatch_kl": 0.0,
        }
    k3 = torch.exp(log_w) - 1 - log_w
    kept = mask if is_weights is None else mask * (is_weights > 0)
    log_r = log_w if is_weights is None else log_w - torch.log(is_weights.float().clamp(min=1e-30))
    return {
        "mismatch_log_ratio_mean": masked_mean(log_w, mask).item(),
        "engine_logprob_max_diff": log_w.abs()[mask > 0].max().item(),
        "mismatch_kl": masked_mean(k3, mask).item(),
        "corrected_mismatch_kl": masked_mean(torch.exp(log_r) - 1 - log_r, kept).item() if (kept > 0).any() else 0.0,
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = 0.2,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic loss ½·max((V-R)², (V_clip-R)²), V_clip = V_old + clip(V-V_old, -ε, ε).

    The value clipping of the PPO reference implementation (Schulman et al. 2017, baselines
    ppo2; analysed by Engstrom et al. 2020, eq. 4). clip_eps=None gives the plain ½(V-R)².
    Returns the masked mean loss and the fraction of tokens where the clipped term was larger; with a
    normalizer (loss_normalizer of the minibatch), the loss is this batch's share of the minibatch's token mean.
    """
    values, old_values, returns = masked_inputs(mask, values, old_values, returns)
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * aggregate(unclipped, mask, normalizer=normalizer), torch.zeros((), device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return aggregate(loss, mask, normalizer=normalizer), masked_mean((clipped > unclipped).float(), mask)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π, with r = log π_ref - log π, clamped to ±KL_CLAMP.

    k1 = -r, k2 = r²/2, k3 = (e^r - 1) - r (Schulman, "Approximating KL divergence", 2020).
    k1 is unbiased, k3 unbiased and never negative, k2 biased but low-variance.

    Every estimator's value is clamped to ±10, as OpenRLHF's compute_approx_kl does: k3 of a token at log π = -30
    against log π_ref = -0.1 is e^29.9 ≈ 9.7e12, which would swamp the reward (-β·KL) or the KL loss; a clamped
    token's gradient is 0. r is clamped to ±20 first, which changes no value (every estimator is past ±10 there)
    but keeps e^r finite, so the gradient there is 0 and not 0·∞ = nan.
    (Also importable from tasks.rl.advantages, where it used to live.)
    """
    log_ratio = (ref_logprobs.float() - logprobs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio**2
    elif kind == "k3":
        kl = torch.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"kl_estimator: unknown {kind!r}; use k1, k2 or k3")
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg: str = "token_mean",
    max_len: int | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """KL(π || π_ref) as a loss term on the current policy's log-probs (OpenRLHF --use_kl_loss).

    The KL is taken out of the reward and added to the actor loss, loss = policy_loss + β·kl_loss;
    the caller multiplies by β. GRPO does this with k3 (Shao et al. 2024, eqs. 3-4). Note that on
    samples of π the gradient of k1 is ∇log π, which is 0 in expectation: k1 gives no KL pull as a
    loss, so use k3 (GRPO) or k2 (whose gradient is the true ∇KL on-policy). OpenRLHF aggregates
    this term as a token mean whatever the policy loss uses; loss_agg lets it follow the policy loss.
    Each token's estimate is clamped to ±10 (kl_estimate).
    """
    logprobs, ref_logprobs = masked_inputs(mask, logprobs, ref_logprobs)  # e^r of a padded position could be inf
    return aggregate(kl_estimate(logprobs, ref_logprobs, estimator), mask, loss_agg, max_len, normalizer)


# Offline preference optimisation: the inputs are per-sequence summed log-probabilities of the
# response tokens, [B] each (e.g. (token_logprobs(...) * loss_mask).sum(-1)).
#
#     loss, chosen_r, rejected_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)          # DPO
#     loss, chosen_r, rejected_r = dpo_loss(..., label_smoothing=0.1)                     # cDPO
#     loss, chosen_r, rejected_r = dpo_loss(..., loss_type="ipo")                         # IPO
#     loss, chosen_r, rejected_r = dpo_loss(pi_c, pi_r, None, None, reference_free=True)
#     z0 = kto_kl_baseline(pi_mismatched, ref_mismatched, reduce_mean=all_reduce_mean)  # mean, then clamp
#     loss, rewards = kto_loss(pi, ref, desirable, z0, beta=0.1)                          # KTO
