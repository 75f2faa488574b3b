"""DPO's and KTO's losses: small, pure, tensor in, tensor out (tests/unit/tasks/preference/test_losses.py checks them by
hand). Inputs are each sequence's summed log-probabilities of its response tokens, [B].

    loss, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1)
    loss, rewards = kto_loss(policy, ref, desirable, kto_kl_baseline(policy_mismatched, ref_mismatched), beta=0.1)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tasks.preference.config import DPO_LOSS_TYPES


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
    policy_mismatched_logps: torch.Tensor,
    ref_mismatched_logps: torch.Tensor,
    reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
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
