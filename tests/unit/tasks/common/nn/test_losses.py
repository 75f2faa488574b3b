"""The losses (tasks/common/nn/losses.py) against values computed by hand (the arithmetic is in each comment): the
SFT, Bradley-Terry, policy, value and KL losses, their aggregations and their finite gradients under the mask; and the
numerics that hold at scale (issue 52, item 5): the off-policy corrections (IcePop's mis, reject) and the clamps on
the policy log-ratio (±20) and on the per-token KL (±10)."""

import math

import pytest
import torch

from tasks.common.nn.losses import (
    aggregate,
    bradley_terry_loss,
    importance_weights,
    kl_estimate,
    kl_loss,
    logprob_mismatch,
    masked_mean,
    policy_loss,
    sft_loss,
    value_loss,
)
from tasks.rl.advantages import kl_penalized_rewards

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


# w = π_old / μ = (1.5, 0.6, 3, 0.4, 1.9 under the mask); behaviour log-probs 0, so log w = old.
W = [1.5, 0.6, 3.0, 0.4, 1.9]
OLD, BEHAVIOUR, MASK = torch.log(T([W])), torch.zeros(1, 5), T([[1, 1, 1, 1, 0]])


# ---------------------------------------------------------------------------------------------- importance weights


def test_mis_is_icepop_the_weight_itself_inside_the_band_and_0_outside():
    # cap 2, band [0.5, 2]: 1.5 and 0.6 are inside and keep w; 3 and 0.4 are outside; 1.9 is masked out.
    weights = importance_weights(OLD, BEHAVIOUR, MASK, "mis", cap=2.0)
    assert weights.dtype == torch.float32
    assert weights.tolist()[0] == pytest.approx([1.5, 0.6, 0.0, 0.0, 0.0], rel=1e-6)


def test_the_band_includes_its_bounds():
    # w = 2 and w = 1/2 are inside a cap-2 band (IcePop's and OpenRLHF's >= / <=); 2.5 and 0.25 are not.
    old = torch.log(T([[2.0, 0.5, 2.5, 0.25]]))
    weights = importance_weights(old, torch.zeros(1, 4), torch.ones(1, 4), "mis", cap=2.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 0.5, 0.0, 0.0], rel=1e-6)
    assert importance_weights(old, torch.zeros(1, 4), torch.ones(1, 4), "reject", cap=2.0).tolist()[0] == [
        True,
        True,
        False,
        False,
    ]


def test_reject_is_a_keep_mask_with_the_same_band():
    assert importance_weights(OLD, BEHAVIOUR, MASK, "reject", cap=2.0).tolist()[0] == [True, True, False, False, False]


def test_tis_truncates_and_unknown_modes_are_refused():
    assert importance_weights(OLD, BEHAVIOUR, MASK, "tis", cap=2.0).tolist()[0] == pytest.approx(
        [1.5, 0.6, 2.0, 0.4, 0.0], rel=1e-6
    )
    assert importance_weights(OLD, BEHAVIOUR, MASK, "none") is None
    with pytest.raises(ValueError, match="is_correction: unknown 'vtrace'; use tis, mis, reject or none"):
        importance_weights(OLD, BEHAVIOUR, MASK, "vtrace")


def test_a_huge_mismatch_gives_finite_weights():
    # log w = ±200: e^200 is inf in float32; mis and tis clamp before exp, so the weights are 0 and cap (and 0).
    old = T([[200.0, -200.0]])
    assert importance_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "mis", cap=2.0).tolist()[0] == [0.0, 0.0]
    assert importance_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "tis", cap=2.0).tolist()[0] == pytest.approx(
        [2.0, 0.0]
    )


# ---------------------------------------------------------------------------------------------- where the weights go


def _corrected_loss(mode: str, **kwargs) -> torch.Tensor:
    """The policy loss at ρ = 1 (π = π_old) with A = (1, 2, 4) and w = (1.5, 3, 0.6), cap 2."""
    logprobs = torch.zeros(1, 3, requires_grad=True)
    old, behaviour = torch.zeros(1, 3), -torch.log(T([[1.5, 3.0, 0.6]]))
    weights = importance_weights(old, behaviour, torch.ones(1, 3), mode, cap=2.0)
    loss, _ = policy_loss(logprobs, old, T([[1.0, 2.0, 4.0]]), torch.ones(1, 3), 0.2, is_weights=weights, **kwargs)
    return loss


def test_mis_weighs_each_kept_token_by_w_and_keeps_the_dropped_ones_in_the_token_mean():
    # weights (1.5, 0, 0.6): -(1.5·1 + 0·2 + 0.6·4) / 3 = -3.9 / 3 = -1.3 (3 tokens in the denominator, as OpenRLHF's icepop).
    assert _corrected_loss("mis").item() == pytest.approx(-1.3, rel=1e-6)


def test_reject_takes_the_rejected_tokens_out_of_the_denominator():
    # keep (1, 0, 1), weight 1: -(1 + 4) / 2 = -2.5, not -5/3 (the old mis, which kept them in the denominator).
    assert _corrected_loss("reject").item() == pytest.approx(-2.5, rel=1e-6)


def test_tis_weighs_every_token():
    # weights (1.5, 2, 0.6): -(1.5 + 4 + 2.4) / 3.
    assert _corrected_loss("tis").item() == pytest.approx(-7.9 / 3, rel=1e-6)


def test_reject_drops_a_fully_rejected_row_from_a_sequence_mean():
    # seq_mean_token_mean: row 1 keeps one token of two (loss -1 / 1), row 2 none: it leaves the mean, -1 not -0.5.
    logprobs = torch.zeros(2, 2, requires_grad=True)
    keep = T([[True, False], [False, False]])
    loss, _ = policy_loss(
        logprobs,
        torch.zeros(2, 2),
        torch.ones(2, 2),
        torch.ones(2, 2),
        0.2,
        loss_agg="seq_mean_token_mean",
        is_weights=keep,
    )
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert logprobs.grad.tolist() == [[-1.0, 0.0], [0.0, 0.0]]


def test_a_micro_batch_with_every_token_rejected_gives_0_and_zero_gradients():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(
        logprobs,
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        0.2,
        is_weights=torch.zeros(1, 2, dtype=torch.bool),
    )
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.tolist() == [[0.0, 0.0]]


def test_icepop_leaves_no_mismatch_over_the_tokens_it_keeps():
    # r = w / weight: 1 on the kept tokens for mis (k3 = 0); reject leaves w there, k3 = mean(k3(log 1.5), k3(log 0.6)).
    k3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    mis = logprob_mismatch(OLD, BEHAVIOUR, MASK, importance_weights(OLD, BEHAVIOUR, MASK, "mis", cap=2.0))
    reject = logprob_mismatch(OLD, BEHAVIOUR, MASK, importance_weights(OLD, BEHAVIOUR, MASK, "reject", cap=2.0))
    assert mis["corrected_mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert reject["corrected_mismatch_kl"] == pytest.approx((k3(1.5) + k3(0.6)) / 2, rel=1e-5)


# ---------------------------------------------------------------------------------------------- the policy ratio's clamp


def test_a_log_ratio_of_25_is_clamped_to_20_before_exp():
    # log π - log π_old = (25, 25, 0), A = (-1, 1, 1), ε = 0.2. ρ = (e^20, e^20, 1), not e^25 = 7.2e10:
    #   token 1: min(-e^20, -1.2) = -e^20 -> loss e^20; token 2: min(e^20, 1.2) = 1.2 -> -1.2; token 3: -1.
    #   token mean (e^20 - 2.2) / 3 = 1.617e8 (unclamped: (e^25 - 2.2) / 3 = 2.4e10).
    logprobs = torch.zeros(1, 3, requires_grad=True)
    loss, clip_fraction = policy_loss(logprobs, T([[-25.0, -25.0, 0.0]]), T([[-1.0, 1.0, 1.0]]), torch.ones(1, 3), 0.2)
    assert loss.item() == pytest.approx((math.exp(20) - 2.2) / 3, rel=1e-6)
    assert clip_fraction.item() == pytest.approx(1 / 3)  # token 2
    loss.backward()
    # Tokens past the clamp get no gradient (token 2 is clipped anyway); token 3's is -A·ρ/3 = -1/3.
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1 / 3])


def test_an_inf_log_ratio_gives_a_finite_loss_and_gradient():
    # A log-ratio of 200 (e^200 = inf in float32) is e^20 after the clamp.
    logprobs = torch.zeros(1, 1, requires_grad=True)
    loss, _ = policy_loss(logprobs, T([[-200.0]]), T([[-1.0]]), torch.ones(1, 1), 0.2, is_weights=T([[1.5]]))
    loss.backward()
    assert loss.item() == pytest.approx(1.5 * math.exp(20), rel=1e-6)
    assert logprobs.grad.tolist() == [[0.0]]


# ---------------------------------------------------------------------------------------------- the KL's clamp


def test_the_k3_kl_of_a_far_off_token_is_clamped_to_10():
    # log π = -30, log π_ref = -0.1: r = 29.9, k3 = e^29.9 - 1 - 29.9 = 9.7e12 -> 10, exactly.
    assert kl_estimate(T([-30.0]), T([-0.1]), "k3").item() == 10.0


@pytest.mark.parametrize(
    "kind, far_below, far_above",
    [
        ("k1", -10.0, 10.0),  # k1 = log π - log π_ref = ∓29.9
        ("k2", 10.0, 10.0),  # r²/2 = 447
        ("k3", 10.0, 10.0),  # e^29.9 - 30.9 = 9.7e12; e^-29.9 + 28.9 = 28.9
    ],
)
def test_every_estimator_is_clamped_to_10(kind, far_below, far_above):
    # far_below: π at -30 against π_ref at -0.1; far_above: π at -0.1 against π_ref at -30.
    assert kl_estimate(T([-30.0, -0.1]), T([-0.1, -30.0]), kind).tolist() == [far_below, far_above]


def test_the_clamp_changes_no_value_inside_the_bound():
    # r = log 0.25 - log 0.5 (test_kl_estimators, below): k1 0.693147, k2 0.240227, k3 0.193147; and r = ±2.
    logp, ref = T([math.log(0.5), 0.0, 0.0]), T([math.log(0.25), 2.0, -2.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.693147, -2.0, 2.0], abs=1e-6)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.240227, 2.0, 2.0], abs=1e-6)
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(
        [0.193147, math.exp(2) - 3, math.exp(-2) + 1], abs=1e-6
    )


def test_the_clamped_kl_has_finite_gradients_in_the_loss():
    # k3 at (-30, -0.1) is 10 and at (-1, -1) is 0; a log π of -200 (r = 199.9, e^r = inf unclamped) gives 10 too,
    # with gradient 0 rather than 0·∞ = nan: the mean is 20 / 3. Every token's gradient is 0 (r = 0 is k3's minimum).
    logprobs = T([[-30.0, -1.0, -200.0]], requires_grad=True)
    loss = kl_loss(logprobs, T([[-0.1, -1.0, -0.1]]), torch.ones(1, 3), "k3")
    assert loss.item() == pytest.approx(20 / 3)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, 0.0, 0.0]]
    logprobs.grad = None
    loss = kl_loss(logprobs, T([[-0.1, -1.0, -0.1]]), torch.ones(1, 3), "k2")
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_the_clamped_kl_bounds_the_reward_penalty():
    # The KL-in-reward path (tasks.rl.experience): β = 0.05 × k3 = 10 at token 1, 0 at token 2, the score 1 on the last.
    kl = kl_estimate(T([[-30.0, -1.0]]), T([[-0.1, -1.0]]), "k3")
    assert kl_penalized_rewards(T([1.0]), kl, torch.ones(1, 2), kl_coef=0.05).tolist()[0] == pytest.approx([-0.5, 1.0])


def test_masked_mean_ignores_masked_positions():
    close(masked_mean(T([[1.0, 2.0, 100.0]]), T([[1, 1, 0]])), 1.5)
    close(masked_mean(T([[1.0, 3.0], [5.0, 7.0]]), T([[1, 1], [1, 0]]), dim=1), [2.0, 5.0])


def test_sft_loss_averages_response_tokens_only():
    # prompt token (-1) masked out: -(-2 - 3) / 2 = 2.5
    close(sft_loss(T([[-1.0, -2.0, -3.0]]), T([[0, 1, 1]])), 2.5)


def test_sft_loss_with_a_global_token_count_splits_exactly():
    # Batch of 2 rows with 1 and 3 response tokens: token mean = (1 + 2 + 3 + 4) / 4 = 2.5. Split over two
    # workers, each normalised by 4 tokens / 2 micro-batches, the mean of the two losses is the same 2.5
    # (a plain per-worker mean would give (1 + 3) / 2 = 2).
    logprobs, mask = T([[-1.0, 0.0, 0.0], [-2.0, -3.0, -4.0]]), T([[1, 0, 0], [1, 1, 1]])
    close(sft_loss(logprobs, mask), 2.5)
    parts = [sft_loss(logprobs[i : i + 1], mask[i : i + 1], num_tokens=4 / 2) for i in range(2)]
    close((parts[0] + parts[1]) / 2, 2.5)


def test_bradley_terry_loss():
    # -log σ(2) = log(1 + e^-2) = 0.126928; -log σ(0) = log 2 = 0.693147; mean 0.410038
    close(bradley_terry_loss(T([2.0, 0.0]), T([0.0, 0.0])), 0.4100375)


def test_policy_loss_clips_both_directions():
    # ratios 1.5, 0.5, 1.0 with advantages 1, -1, 2 and ε = 0.2:
    #   min(1.5, 1.2) = 1.2 -> -1.2 (clipped); min(-0.5, -0.8) = -0.8 -> 0.8 (clipped); 2 -> -2
    logp = T([[math.log(1.5), math.log(0.5), 0.0]])
    loss, clip_fraction = policy_loss(logp, torch.zeros(1, 3), T([[1.0, -1.0, 2.0]]), torch.ones(1, 3), clip_eps=0.2)
    close(loss, (-1.2 + 0.8 - 2.0) / 3)
    close(clip_fraction, 2 / 3)


def test_policy_loss_respects_mask():
    loss, _ = policy_loss(T([[0.0, 5.0]]), T([[0.0, 0.0]]), T([[1.0, 1.0]]), T([[1, 0]]))
    close(loss, -1.0)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped():
    # V_old = 0, V = (0.5, 0.1), R = (1, -1), ε = 0.2
    #   token 1: (0.5-1)² = 0.25 vs clipped V 0.2: (0.2-1)² = 0.64 -> 0.64
    #   token 2: (0.1+1)² = 1.21 both ways -> 1.21;  loss = ½ (0.64 + 1.21) / 2 = 0.4625
    loss, clipped = value_loss(T([[0.5, 0.1]]), torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2), clip_eps=0.2)
    close(loss, 0.4625)
    close(clipped, 0.5)
    plain, _ = value_loss(T([[0.5, 0.1]]), torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2), clip_eps=None)
    close(plain, 0.5 * (0.25 + 1.21) / 2)


def test_kl_estimators():
    # π = 0.5, π_ref = 0.25: r = log(0.25/0.5) = -0.693147
    #   k1 = -r = 0.693147; k2 = r²/2 = 0.240227; k3 = e^r - 1 - r = 0.5 - 1 + 0.693147 = 0.193147
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    close(kl_estimate(logp, ref, "k1"), [0.693147])
    close(kl_estimate(logp, ref, "k2"), [0.240227])
    close(kl_estimate(logp, ref, "k3"), [0.193147])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_policy_loss_clip_higher_is_asymmetric():
    # ratios 1.5, 0.5, 1.25 with advantages 1, -1, 1; ε_low = 0.2, ε_high = 0.28: bounds [0.8, 1.28]
    #   min(1.5, 1.28) = 1.28 -> -1.28 (clipped); min(-0.5, -0.8) = -0.8 -> 0.8 (clipped);
    #   min(1.25, 1.25) = 1.25 -> -1.25 (inside 1.28; with symmetric ε = 0.2 it would clip to 1.2)
    logp = T([[math.log(1.5), math.log(0.5), math.log(1.25)]])
    args = (logp, torch.zeros(1, 3), T([[1.0, -1.0, 1.0]]), torch.ones(1, 3))
    loss, clip_fraction = policy_loss(*args, clip_eps=0.2, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, (-1.28 + 0.8 - 1.25) / 3)
    close(clip_fraction, 2 / 3)
    symmetric, _ = policy_loss(*args, clip_eps=0.2)
    close(symmetric, (-1.2 + 0.8 - 1.2) / 3)


def test_policy_loss_dual_clip_bounds_negative_advantages():
    # ratios 4, 0.5, 4 with advantages -1, -1, 1; ε = 0.2, c = 3
    #   token 1: min(-4, -1.2) = -4, max(-4, 3·-1 = -3) = -3 -> loss 3 = c·|A| (plain PPO: 4)
    #   token 2: min(-0.5, -0.8) = -0.8 > -3 -> loss 0.8 unchanged
    #   token 3: A > 0: min(4, 1.2) = 1.2 -> loss -1.2 unchanged
    logp = T([[math.log(4.0), math.log(0.5), math.log(4.0)]])
    args = (logp, torch.zeros(1, 3), T([[-1.0, -1.0, 1.0]]), torch.ones(1, 3))
    loss, _ = policy_loss(*args, dual_clip=3.0)
    close(loss, (3.0 + 0.8 - 1.2) / 3)
    plain, _ = policy_loss(*args)
    close(plain, (4.0 + 0.8 - 1.2) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(*args, dual_clip=1.0)


def test_loss_aggregations():
    # ρ = 1 so the per-token loss is -A; A = (1, 2, 3 | 4), the second row has one token
    #   token_mean:              -(1 + 2 + 3 + 4) / 4 = -2.5
    #   seq_mean_token_mean:     row means -2, -4 -> -3
    #   seq_mean_token_sum_norm: max_len 4: row sums -6/4 = -1.5, -4/4 = -1 -> -1.25
    adv, mask = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), T([[1, 1, 1], [1, 0, 0]])
    zeros = torch.zeros(2, 3)
    close(policy_loss(zeros, zeros, adv, mask)[0], -2.5)
    close(policy_loss(zeros, zeros, adv, mask, loss_agg="seq_mean_token_mean")[0], -3.0)
    close(policy_loss(zeros, zeros, adv, mask, loss_agg="seq_mean_token_sum_norm", max_len=4)[0], -1.25)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(zeros, zeros, adv, mask, loss_agg="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(adv, mask, "sum")


def test_aggregate_skips_empty_rows_and_masked_nonfinite_values():
    # the empty third row counts in no sequence mean; inf under the mask is ignored
    #   seq_mean_token_mean: (1 + 3) / 2 = 2;  token_mean: (1 + 3) / 2 = 2
    loss = T([[1.0, float("inf")], [3.0, float("nan")], [5.0, 7.0]])
    mask = T([[1, 0], [1, 0], [0, 0]])
    close(aggregate(loss, mask, "seq_mean_token_mean"), 2.0)
    close(aggregate(loss, mask, "token_mean"), 2.0)


def test_kl_loss_value_and_gradient():
    # token 1: π = 0.5, π_ref = 0.25 -> k3 = 0.193147, k1 = 0.693147; token 2: π = π_ref -> 0; token 3 masked
    #   token mean k3 = 0.193147 / 2 = 0.0965735;  k1: 0.693147 / 2 = 0.3465736
    #   ∂k3/∂log π = 1 - e^r = 1 - 0.5 = 0.5 on token 1, / 2 tokens = 0.25; 0 on token 2 (1 - e^0)
    logp = T([[math.log(0.5), math.log(0.3), 5.0]]).requires_grad_(True)
    ref = T([[math.log(0.25), math.log(0.3), 0.0]])
    mask = T([[1, 1, 0]])
    loss = kl_loss(logp, ref, mask, "k3")
    close(loss, 0.0965735)
    loss.backward()
    close(logp.grad, [[0.25, 0.0, 0.0]])
    close(kl_loss(logp.detach(), ref, mask, "k1"), 0.3465736)


def test_policy_loss_gradient_is_finite_with_an_extreme_old_logprob_under_the_mask():
    # token 1: ρ = 1.1 inside [0.8, 1.2], A = 1 -> loss -1.1, ∂/∂log π = -ρA = -1.1; token 2 masked with
    #   log π_old = -1000: e^(0 + 1000) = inf, whose backward gave 0 · inf = nan before the inputs were masked
    logp = T([[math.log(1.1), 0.0]]).requires_grad_(True)
    loss, clip_fraction = policy_loss(logp, T([[0.0, -1000.0]]), T([[1.0, 1.0]]), T([[1, 0]]))
    close(loss, -1.1)
    close(clip_fraction, 0.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [[-1.1, 0.0]])
    # the same with the masked token's ratio clipped (its gradient path through clamp was the nan one)
    logp = T([[math.log(1.1), 0.0]]).requires_grad_(True)
    loss, _ = policy_loss(
        logp, T([[0.0, -1000.0]]), T([[1.0, -1.0]]), T([[1, 0]]), dual_clip=3.0, loss_agg="seq_mean_token_mean"
    )
    loss.backward()
    close(loss, -1.1)
    close(logp.grad, [[-1.1, 0.0]])


def test_value_and_kl_losses_have_finite_gradients_with_extremes_under_the_mask():
    # value: token 1 V = 0.5, R = 1 -> ½·0.25 = 0.125, ∂/∂V = V - R = -0.5; token 2 masked with R = inf
    values = T([[0.5, 0.0]]).requires_grad_(True)
    loss, _ = value_loss(values, torch.zeros(1, 2), T([[1.0, float("inf")]]), T([[1, 0]]), clip_eps=None)
    loss.backward()
    close(loss, 0.125)
    close(values.grad, [[-0.5, 0.0]])
    # k3 KL: token 1 as in test_kl_loss_value_and_gradient (0.193147, ∂ = 0.5); token 2 masked with
    #   log π_ref = +1000: e^r = inf
    logp = T([[math.log(0.5), 0.0]]).requires_grad_(True)
    loss = kl_loss(logp, T([[math.log(0.25), 1000.0]]), T([[1, 0]]), "k3")
    loss.backward()
    close(loss, 0.193147)
    close(logp.grad, [[0.5, 0.0]])


def test_sft_loss_masked_mean_and_sync_check_ignore_nonfinite_masked_values():
    # a -inf log-prob on a prompt token: -inf · 0 = nan before; now -(-2 - 3) / 2 = 2.5 either way
    logprobs = T([[float("-inf"), -2.0, -3.0]]).requires_grad_(True)
    mask = T([[0, 1, 1]])
    close(sft_loss(logprobs, mask), 2.5)
    loss = sft_loss(logprobs, mask, num_tokens=2)
    loss.backward()
    close(loss, 2.5)
    close(logprobs.grad, [[0.0, -0.5, -0.5]])
    close(masked_mean(T([[1.0, 2.0, float("inf")]]), T([[1, 1, 0]])), 1.5)
    assert logprob_mismatch(T([[-1.0, float("-inf")]]), T([[-1.5, 0.0]]), T([[1, 0]]))[
        "engine_logprob_max_diff"
    ] == pytest.approx(0.5)
