"""Loss functions shared by the stages: small, pure, tensor in, tensor out.

    loss = sft_loss(token_logprobs, loss_mask)
    logprobs = head_logprobs(hidden, lm_head, labels)         # token_logprobs(lm_head(hidden), labels), a chunk at a time
    entropy = token_entropy(logits, temperature=0.7)          # of the sampling distribution, per token
    nll = fused_linear_nll_sum(hidden, lm_head.weight, labels, mask)   # Σ -logprobs under the mask, Liger's fused kernel (CUDA)
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

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

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


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t] | ·) under softmax(logits / temperature), logits of the same length: [B, T, V], [B, T] -> [B, T].

    The temperature is applied inside either path, in float32 after the upcast: dividing the bf16 logits
    beforehand would round them again and, on a GPU, write one more [B, T, V] copy.

    On a GPU this runs compiled (fused_token_logprobs): eager PyTorch makes a float32 copy of the logits,
    log-softmaxes it and, in backward, scatters into a zero tensor of the same size. At 8 × 2048 tokens and
    a 152k vocabulary each of those is 10 GB written and read; compiled, one pass reads the logits each way.
    """
    if logits.is_cuda:
        return _compiled_token_logprobs()(logits, labels, temperature)
    return torch.gather(F.log_softmax(tempered(logits.float(), temperature), dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature: the logits of the distribution sampled at that temperature (vLLM's and HF's
    sampling divide them the same way). At 1.0 the logits themselves, so untempered paths stay bit-for-bit."""
    return logits if temperature == 1.0 else logits / temperature


def fused_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """token_logprobs as logit[label] - logsumexp(logits), written so torch.compile fuses it: the label's
    logit is picked by comparison rather than gather, so backward is one elementwise expression
    (onehot - softmax) × grad instead of a scatter. Eager, it would build a [B, T, V] mask: compile it."""
    x = tempered(logits.float(), temperature)
    hit = torch.arange(x.size(-1), device=x.device) == labels.unsqueeze(-1)
    return torch.where(hit, x, 0.0).sum(-1) - torch.logsumexp(x, dim=-1)


@functools.cache
def _compiled_token_logprobs():
    return torch.compile(fused_token_logprobs, dynamic=True)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable,
    labels: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_tokens: int = 1024,
    entropy_grad: bool = True,
):
    """token_logprobs(head(hidden), labels, temperature) (and the distribution's entropy) without ever holding
    the logits of more than `chunk_tokens` tokens: [..., H] hidden states, [...] labels -> [...].
    entropy_grad=False leaves the entropy out of autograd: logged, not trained on, it then costs no backward
    passes over the vocabulary.

    The logits are the largest tensor of a causal LM's step (8 × 2048 tokens × a 152k vocabulary is 10 GB in
    float32, and eager backward makes two more); here each chunk's logits are made, reduced to log-probs and
    dropped, and the backward pass remakes them one chunk at a time (activation checkpointing), so the peak is
    one chunk's. The same numbers as the full-logits path, to float rounding (tests/unit/test_math.py)."""
    shape = labels.shape
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    checkpointed = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in _parameters(head)))
    parts = []
    for start in range(0, flat_labels.numel(), chunk_tokens):
        args = (head, flat_hidden[start : start + chunk_tokens], flat_labels[start : start + chunk_tokens], temperature, return_entropy, entropy_grad)
        parts.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False) if checkpointed else _chunk_logprobs(*args))
    out = torch.cat(parts, dim=-1)
    if not return_entropy:
        return out.reshape(shape)
    entropy = out[1].reshape(shape)
    return out[0].reshape(shape), (entropy if entropy_grad else entropy.detach())


def _parameters(head) -> list[torch.Tensor]:
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []


def _chunk_logprobs(head, hidden, labels, temperature: float, return_entropy: bool, entropy_grad: bool = True) -> torch.Tensor:
    """One chunk of head_logprobs: [N, H] -> [N] log-probs, or [2, N] log-probs and entropies."""
    logits = head(hidden)
    logprobs = token_logprobs(logits, labels, temperature)
    if not return_entropy:
        return logprobs
    return torch.stack([logprobs, token_entropy(logits, temperature, entropy_grad)])


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, grad: bool = True) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dimension: [..., V] -> [...]; outside autograd
    unless grad. On a GPU compiled (fused_entropy), as token_logprobs is: eager, the upcast, log-softmax, exp
    and product each wrote a float32 copy of the logits, 0.6 GB each for 1,024 tokens of a 152k vocabulary."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return (_compiled_entropy() if logits.is_cuda else fused_entropy)(logits, temperature)


def fused_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-Σ p log p, written so torch.compile fuses it into reductions over the logits as they are."""
    log_p = tempered(logits.float(), temperature)
    log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return -(log_p.exp() * log_p).sum(-1)


@functools.cache
def _compiled_entropy():
    return torch.compile(fused_entropy, dynamic=True)


def fused_linear_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ -log softmax(hidden @ weight.T)[label] over the positions where mask is 1: [..., H], [V, H], [...], [...] -> [].
    Liger's fused linear cross-entropy (CUDA only; its kernels are Triton's): a chunk of tokens at a time it makes
    the logits in the weight's precision, and one kernel reduces them and writes their gradient in place, float32
    inside; the head's gradients are taken then, in the forward pass, so backward only scales them. Against
    head_logprobs it never writes float32 logits nor remakes them in backward (on the H200 the log-softmax and the
    copies were 56 of SFT's 195 ms of kernels a step: bench/RESULTS.md, 2026-12-04 seventh lease)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    targets = labels.masked_fill(mask == 0, -100)  # Liger's ignore_index
    return liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        reduction="sum",
        accum_dtype=torch.float32,  # the head's gradient summed over chunks in float32, not bf16
        chunk_mem_const=8,  # chunks of ~1k tokens rather than ~128 at a 152k vocabulary: 8x fewer launches
    )


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
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
    loss: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token_mean", max_len: int | None = None, normalizer: torch.Tensor | float | None = None
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


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, cap: float = 2.0) -> torch.Tensor | None:
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
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None = None
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
        return {"mismatch_log_ratio_mean": 0.0, "engine_logprob_max_diff": 0.0, "mismatch_kl": 0.0, "corrected_mismatch_kl": 0.0}
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

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairwise preference loss on h = (log π(y_w) - log π(y_l)) - (log π_ref(y_w) - log π_ref(y_l)).

    sigmoid: -log σ(βh), Rafailov et al. 2023 (DPO), eq. 7; with label_smoothing ε the target is
             flipped with probability ε, -(1-ε)·log σ(βh) - ε·log σ(-βh) (conservative DPO, cDPO;
             Mitchell 2023), 0 ≤ ε < 0.5.
    ipo:     (h - 1/(2β))², Azar et al. 2023 (IPO), eq. 17; no label smoothing.
    reference_free: the reference terms are 0 (ref_chosen / ref_rejected may be None).

    Returns (mean loss, chosen_rewards, rejected_rewards) with the implicit rewards
    β·(log π(y) - log π_ref(y)) per pair, detached (for logging: margins, accuracies).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo loss_type: unknown {loss_type!r}; use {', '.join(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"dpo beta: must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo label_smoothing: must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing != 0.0:
        raise ValueError(f"dpo label_smoothing: must be 0 with loss_type 'ipo', got {label_smoothing}")
    policy_chosen, policy_rejected = policy_chosen.float(), policy_rejected.float()
    if reference_free:
        ref_chosen, ref_rejected = torch.zeros_like(policy_chosen), torch.zeros_like(policy_rejected)
    elif ref_chosen is None or ref_rejected is None:
        raise ValueError("dpo: ref_chosen and ref_rejected are needed unless reference_free=True")
    else:
        ref_chosen, ref_rejected = ref_chosen.float(), ref_rejected.float()
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1.0 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    else:
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


def kto_kl_baseline(
    policy_mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor, reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """KTO's reference point z0 = max(0, mean(log π - log π_ref)) over mismatched (prompt, other completion)
    pairs, detached. Ethayarajh et al. 2024 (KTO), §4. With data parallelism `reduce_mean` averages this
    worker's mean over the world (strategy.all_reduce(·, op="mean")) before the clamp: clamping each
    worker's mean first would bias z0 upwards (local means -1.0 and 0.5 give 0.25 instead of 0).
    """
    local = (policy_mismatched_logps.float() - ref_mismatched_logps.float()).mean().detach()
    return (local if reduce_mean is None else reduce_mean(local)).clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl_baseline: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahneman-Tversky loss on unpaired examples, Ethayarajh et al. 2024 (KTO), eq. 8, in the form
    of TRL / OpenRLHF. With r = log π(y|x) - log π_ref(y|x) and z0 = kl_baseline (clamped at 0,
    detached; see `kto_kl_baseline`):

        desirable:   λ_D·(1 - σ(β(r - z0)))
        undesirable: λ_U·(1 - σ(β(z0 - r)))

    averaged over all B examples. `desirable` is a bool [B].
    Returns (loss, rewards) with rewards = β·r, detached.
    """
    if beta <= 0:
        raise ValueError(f"kto beta: must be > 0, got {beta}")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"kto weights: must be > 0, got {desirable_weight} and {undesirable_weight}")
    log_ratio = policy_logps.float() - ref_logps.float()
    z0 = torch.as_tensor(kl_baseline, dtype=log_ratio.dtype, device=log_ratio.device).detach().clamp(min=0)
    desirable = desirable.to(device=log_ratio.device, dtype=torch.bool)
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (log_ratio - z0))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - log_ratio))),
    )
    return losses.mean(), (beta * log_ratio).detach()
