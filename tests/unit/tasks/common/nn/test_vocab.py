"""Losses, advantages and KL against values computed by hand (the arithmetic is in each comment)."""

import math

import pytest
import torch

from tasks.common.nn.losses import (
    aggregate,
    bradley_terry_loss,
    kl_loss,
    logprob_mismatch,
    masked_mean,
    policy_loss,
    sft_loss,
    value_loss,
)
from tasks.common.nn.models import sequence_logprobs
from tasks.common.nn.vocab import fused_entropy, fused_token_logprobs, token_logprobs
from tasks.rl.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    group_keep_mask,
    kl_estimate,
    kl_penalized_rewards,
    shape_scores,
    uses_critic,
    whiten,
)
from tasks.rl.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


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


def test_kl_penalized_rewards_put_the_score_on_the_last_response_token():
    # β = 0.5: -0.5·(0.1, 0.2) and the score 2 on token 2 (token 3 is padding)
    rewards = kl_penalized_rewards(T([2.0]), T([[0.1, 0.2, 0.3]]), T([[1, 1, 0]]), kl_coef=0.5)
    close(rewards, [[-0.05, 1.9, 0.0]])


def test_gae_full_length():
    # γ = 1, λ = 0.9, V = (0.5, 0.6, 0.7), r = (0, 0, 1)
    #   δ2 = 1 - 0.7 = 0.3                 A2 = 0.3
    #   δ1 = 0.7 - 0.6 = 0.1               A1 = 0.1 + 0.9·0.3 = 0.37
    #   δ0 = 0.6 - 0.5 = 0.1               A0 = 0.1 + 0.9·0.37 = 0.433
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lambd=0.9)
    close(adv, [[0.433, 0.37, 0.3]])
    close(ret, [[0.933, 0.97, 1.0]])


def test_gae_stops_at_the_end_of_the_response():
    # last token is padding: V beyond the response is 0
    #   δ1 = 1 + 0 - 0.6 = 0.4   A1 = 0.4;   δ0 = 0.6 - 0.5 = 0.1   A0 = 0.1 + 0.9·0.4 = 0.46
    adv, _ = gae(T([[0.0, 1.0, 0.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 0]]), gamma=1.0, lambd=0.9)
    close(adv, [[0.46, 0.4, 0.0]])
    # γ = 0.5, λ = 1 on a single reward: A0 = 0 + 0.5·0 ... δ0 = 0 + 0.5·V1 - V0 with V = 0: A = (0.5, 1)
    adv, _ = gae(T([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), gamma=0.5, lambd=1.0)
    close(adv, [[0.5, 1.0]])


def test_whiten():
    # over (1, 2, 3): mean 2, std sqrt(2/3) = 0.816497
    close(whiten(T([[1.0, 2.0, 3.0, 100.0]]), T([[1, 1, 1, 0]])), [[-1.224745, 0.0, 1.224745, 0.0]], tol=1e-4)


# ---- policy loss options ---------------------------------------------------------------------------


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


# ---- advantage estimators ---------------------------------------------------------------------------


def test_uses_critic():
    assert uses_critic("gae")
    assert not any(uses_critic(e) for e in ("reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"))
    with pytest.raises(ValueError, match="advantage_estimator"):
        uses_critic("ppo")


def test_shape_scores_one_group_of_three():
    # r = (1, 2, 6), mean 3
    #   rloo: 1 - (2+6)/2 = -3;  2 - (1+6)/2 = -1.5;  6 - (1+2)/2 = 4.5
    #   reinforce_baseline, dr_grpo: (-2, -1, 3)
    #   group_norm: unbiased std = sqrt((4 + 1 + 9) / 2) = sqrt(7) = 2.645751 -> (-0.755929, -0.377964, 1.133893)
    r = T([1.0, 2.0, 6.0])
    close(shape_scores(r, 3, "rloo"), [-3.0, -1.5, 4.5])
    close(shape_scores(r, 3, "reinforce_baseline"), [-2.0, -1.0, 3.0])
    close(shape_scores(r, 3, "dr_grpo"), [-2.0, -1.0, 3.0])
    close(shape_scores(r, 3, "group_norm"), [-0.755929, -0.377964, 1.133893])
    close(shape_scores(r, 3, "gae"), [1.0, 2.0, 6.0])
    close(shape_scores(r, 1, "reinforce"), [1.0, 2.0, 6.0])


def test_shape_scores_refuses_bad_groups():
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        shape_scores(T([1.0, 2.0]), 1, "rloo")
    with pytest.raises(ValueError, match="whole groups"):
        shape_scores(T([1.0, 2.0, 3.0]), 2, "group_norm")
    with pytest.raises(ValueError, match="advantage_estimator"):
        shape_scores(T([1.0, 2.0]), 2, "grpo")


def test_discounted_returns():
    # γ = 0.5, r = (1, 2, 3 | pad 9): G2 = 3; G1 = 2 + 0.5·3 = 3.5; G0 = 1 + 0.5·3.5 = 2.75; pad -> 0
    close(discounted_returns(T([[1.0, 2.0, 3.0, 9.0]]), T([[1, 1, 1, 0]]), gamma=0.5), [[2.75, 3.5, 3.0, 0.0]])


# 2 prompts × 2 samples: scores (1, 0 | 2, 2); sample 2 has one response token, the others two
SCORES = T([1.0, 0.0, 2.0, 2.0])
MASK = T([[1, 1], [1, 0], [1, 1], [1, 1]])
KL = torch.full((4, 2), 0.2)  # β = 0.5 -> -0.1 per response token


def test_dr_grpo_advantages():
    # shaped: group means 0.5, 2 -> (0.5, -0.5 | 0, 0); token rewards -0.1 each, shaped score on the last token
    #   row 0: (-0.1, 0.4) -> returns (0.3, 0.4);  row 1: (-0.6 | pad) -> (-0.6, 0)
    #   rows 2, 3: (-0.1, -0.1) -> (-0.2, -0.1);   advantages = returns (no whitening)
    adv, ret = compute_advantages("dr_grpo", SCORES, KL, MASK, None, n=2, kl_coef=0.5)
    expected = [[0.3, 0.4], [-0.6, 0.0], [-0.2, -0.1], [-0.2, -0.1]]
    close(adv, expected)
    close(ret, expected)


def test_group_norm_advantages():
    # shaped: group 0 std (unbiased) = sqrt(0.25 + 0.25) = 0.707107 -> ±0.5 / 0.707107 = ±0.707107;
    #   group 1 std 0 -> 0 / 1e-9 = 0.  row 0: (-0.1, 0.607107) -> (0.507107, 0.607107)
    #   row 1: (-0.1 - 0.707107 = -0.807107 | pad);  rows 2, 3: (-0.2, -0.1); not whitened
    adv, ret = compute_advantages("group_norm", SCORES, KL, MASK, None, n=2, kl_coef=0.5)
    close(adv, [[0.507107, 0.607107], [-0.807107, 0.0], [-0.2, -0.1], [-0.2, -0.1]])
    close(ret, adv)


def test_rloo_advantages():
    # shaped: 1 - 0 = 1, 0 - 1 = -1 | 2 - 2 = 0, 0
    #   row 0: (-0.1, 0.9) -> (0.8, 0.9);  row 1: (-1.1 | pad);  rows 2, 3: (-0.2, -0.1); not whitened
    adv, ret = compute_advantages("rloo", SCORES, KL, MASK, None, n=2, kl_coef=0.5)
    close(adv, [[0.8, 0.9], [-1.1, 0.0], [-0.2, -0.1], [-0.2, -0.1]])
    close(ret, adv)


def test_reinforce_baseline_advantages_are_whitened():
    # full mask, β = 0: shaped (0.5, -0.5 | 0, 0) on the last token -> returns (0.5, 0.5), (-0.5, -0.5), 0, 0
    #   over 8 tokens: mean 0, var = 4·0.25 / 8 = 0.125, std 0.353553 -> ±0.5 / 0.353553 = ±1.414214
    adv, ret = compute_advantages("reinforce_baseline", SCORES, None, torch.ones(4, 2), None, n=2)
    close(ret, [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])
    close(adv, [[1.414214, 1.414214], [-1.414214, -1.414214], [0.0, 0.0], [0.0, 0.0]], tol=1e-4)


def test_reinforce_advantages_discount_then_whiten():
    # raw scores, β = 0, γ = 0.5, full mask: returns (0.5, 1), (0, 0), (1, 2), (1, 2)
    #   mean 7.5 / 8 = 0.9375; deviations -0.4375, 0.0625, -0.9375 ×2, 0.0625, 1.0625, 0.0625, 1.0625
    #   var = (0.19140625 + 3·0.00390625 + 2·0.87890625 + 2·1.12890625) / 8 = 4.21875 / 8 = 0.52734375
    #   std 0.726184 -> -0.602464, 0.086066, -1.290994, 1.463127
    adv, ret = compute_advantages("reinforce", SCORES, None, torch.ones(4, 2), None, n=2, gamma=0.5)
    close(ret, [[0.5, 1.0], [0.0, 0.0], [1.0, 2.0], [1.0, 2.0]])
    close(adv, [[-0.602464, 0.086066], [-1.290994, -1.290994], [0.086066, 1.463127], [0.086066, 1.463127]], tol=1e-4)


def test_gae_advantages_via_dispatcher():
    # raw scores, β = 0, γ = λ = 1, V = 0.5 everywhere: δ1 = r - 0.5, δ0 = 0.5 - 0.5 = 0 -> A = (r - 0.5, r - 0.5)
    #   A: (0.5, 0.5), (-0.5, -0.5), (1.5, 1.5) ×2; returns A + V = (1, 1), (0, 0), (2, 2), (2, 2)
    #   whitened: mean of A = 6 / 8 = 0.75; deviations -0.25 ×2, -1.25 ×2, 0.75 ×4
    #   var = (0.125 + 3.125 + 2.25) / 8 = 0.6875, std 0.829156 -> -0.301511, -1.507557, 0.904534
    values = torch.full((4, 2), 0.5)
    adv, ret = compute_advantages("gae", SCORES, None, torch.ones(4, 2), values, n=2, gamma=1.0, lambd=1.0)
    close(ret, [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]])
    close(adv, [[-0.301511] * 2, [-1.507557] * 2, [0.904534] * 2, [0.904534] * 2], tol=1e-4)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", SCORES, None, torch.ones(4, 2), None)


def test_group_estimators_force_gamma_one_and_clip_after_shaping():
    # dr_grpo with γ = 0.5 still sums undiscounted; reward_clip (-0.4, 0.4) clips the shaped ±0.5
    #   row 0: (0, 0.4) -> returns (0.4, 0.4);  row 1: (0, -0.4) -> (-0.4, -0.4);  rows 2, 3: 0
    with pytest.warns(UserWarning, match="gamma"):
        adv, _ = compute_advantages(
            "dr_grpo", SCORES, None, torch.ones(4, 2), None, n=2, gamma=0.5, reward_clip=(-0.4, 0.4)
        )
    close(adv, [[0.4, 0.4], [-0.4, -0.4], [0.0, 0.0], [0.0, 0.0]])


def test_group_keep_mask():
    # n = 2, range (0, 1): (0, 1) mean 0.5 varied -> keep; (1, 1) mean 1 not < 1 -> drop;
    #   (0, 0) -> drop; (0.5, 0.5) inside but all equal -> drop; (0.2, 0.9) -> keep; (-1, 1) mean 0 not > 0 -> drop
    scores = T([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.2, 0.9, -1.0, 1.0])
    keep = group_keep_mask(scores, 2, 0.0, 1.0)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, True, True, False, False]
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        group_keep_mask(scores, 1, 0.0, 1.0)


# ---- KL controllers ---------------------------------------------------------------------------------


def test_adaptive_kl_controller():
    # β = 0.1, target 6, horizon 10000, 1000 samples per update:
    #   KL 9:   e = clip(9/6 - 1 = 0.5) = 0.2;   β = 0.1 · (1 + 0.2·0.1) = 0.102
    #   KL 5.4: e = 5.4/6 - 1 = -0.1;            β = 0.102 · (1 - 0.1·0.1) = 0.10098
    ctl = make_kl_controller(0.1, kl_target=6.0, kl_horizon=10000)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(9.0, 1000)
    close(ctl.value, 0.102)
    ctl.update(5.4, 1000)
    close(ctl.value, 0.10098)
    resumed = make_kl_controller(0.1, kl_target=6.0)
    resumed.load_state_dict(ctl.state_dict())
    close(resumed.value, 0.10098)
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_fixed_kl_controller():
    ctl = make_kl_controller(0.05)
    assert isinstance(ctl, FixedKLController) and isinstance(make_kl_controller(0.05, kl_target=0), FixedKLController)
    ctl.update(100.0, 1000)
    close(ctl.value, 0.05)
    assert ctl.state_dict() == {"kind": "fixed", "value": 0.05}


def test_lr_multiplier_warmup_then_constant_or_cosine():
    from tasks.common.nn.strategy import lr_multiplier

    # warmup 4: (step + 1) / 4
    assert [lr_multiplier(s, 100, 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # cosine over steps 4..104: 1 at the start, 0.1 + 0.9·½ = 0.55 halfway, 0.1 at the end
    close(lr_multiplier(4, 104, 4, "cosine"), 1.0)
    close(lr_multiplier(54, 104, 4, "cosine"), 0.55)
    close(lr_multiplier(104, 104, 4, "cosine"), 0.1)


def test_token_logprobs_by_hand():
    # logits (0, ln 3) over two tokens: p = (1/4, 3/4)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    got = token_logprobs(logits, torch.tensor([[0, 1]]))
    assert torch.allclose(got, torch.tensor([[math.log(0.25), math.log(0.75)]]), atol=1e-6)


def test_fused_token_logprobs_compiled_matches_eager_values_and_gradients():
    """What runs on a GPU (the compiled fused form), here compiled for the CPU, against eager log-softmax."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 37, (2, 5))
    weights = torch.randn(2, 5)
    eager = token_logprobs(logits, labels)
    (grad_eager,) = torch.autograd.grad((eager * weights).sum(), logits)
    fused = torch.compile(fused_token_logprobs, dynamic=True)(logits, labels)
    (grad_fused,) = torch.autograd.grad((fused * weights).sum(), logits)
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, eager, atol=1e-5)
    assert torch.allclose(grad_fused.float(), grad_eager.float(), atol=1e-2)  # bf16 gradients: 8 bits of mantissa


def test_entropy_by_hand_and_compiled_as_on_a_gpu():
    """token_entropy's expression: by hand, then compiled for the CPU (a GPU runs it compiled) against the eager
    log-softmax form, values and gradients."""
    # logits (0, ln 3): p = (1/4, 3/4); at temperature 0.5 the logits double: p = (1/10, 9/10)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    for temperature, p in ((1.0, 0.25), (0.5, 0.1)):
        want = -(p * math.log(p) + (1 - p) * math.log(1 - p))
        assert fused_entropy(logits, temperature).item() == pytest.approx(want, abs=1e-6)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16).requires_grad_()
    weights = torch.randn(2, 5)
    log_p = torch.log_softmax(logits.float() / 0.7, -1)
    eager = -(log_p.exp() * log_p).sum(-1)
    (grad_eager,) = torch.autograd.grad((eager * weights).sum(), logits)
    fused = torch.compile(fused_entropy, dynamic=True)(logits, 0.7)
    (grad_fused,) = torch.autograd.grad((fused * weights).sum(), logits)
    assert fused.dtype == torch.float32 and torch.allclose(fused, eager, atol=1e-5)
    assert torch.allclose(grad_fused.float(), grad_eager.float(), atol=1e-2)  # bf16 gradients


def test_head_logprobs_a_chunk_at_a_time_equal_the_full_logits_values_and_gradients():
    """head_logprobs (what a Liger-loaded model uses: no full logits) against token_logprobs(head(hidden)),
    chunks that do not divide the tokens, a temperature, the entropy too; gradients to the hidden states and
    the head's weight."""
    from tasks.common.nn.vocab import head_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    head = torch.nn.Linear(8, 37, bias=False)
    labels = torch.randint(0, 37, (2, 7))
    w1, w2 = torch.randn(2, 7), torch.randn(2, 7)

    def full():
        logits = head(hidden)
        log_p = torch.log_softmax(logits.float() / 0.7, -1)
        return token_logprobs(logits, labels, 0.7), -(log_p.exp() * log_p).sum(-1)

    results = []
    for fn in (full, lambda: head_logprobs(hidden, head, labels, 0.7, return_entropy=True, chunk_tokens=3)):
        logprobs, entropy = fn()
        grads = torch.autograd.grad((logprobs * w1 + entropy * w2).sum(), [hidden, head.weight])
        results.append((logprobs, entropy, *grads))
    for want, got in zip(*results):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # scoring passes (reference, old log-probs) take the same path without checkpointing
        close(head_logprobs(hidden, head, labels, chunk_tokens=4), token_logprobs(head(hidden), labels))


def test_a_model_that_takes_log_probs_a_chunk_at_a_time_gives_the_full_logits_numbers():
    """sequence_logprobs and packed_logprobs of the demo model marked as load_causal_lm marks a Liger model (the Liger kernels
    themselves need CUDA: tests/e2e/test_gpu.py) against the same model's full-logits path: values, entropy and the
    parameters' gradients."""
    from tasks.common.nn import data
    from tasks.common.nn.models import packed_logprobs
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1)
    sequences = [data.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82", "1+1=")]
    ids, mask = data.pad(sequences, tok.pad_token_id, side="left")
    packed = data.pack(sequences)
    runs = []
    for chunked in (False, True):
        model.chunked_logprobs = chunked
        model.zero_grad()
        logprobs, entropy = sequence_logprobs(model, ids, mask, return_entropy=True, temperature=0.8)
        packed_lp = packed_logprobs(model, *packed)
        ((logprobs * mask[:, 1:]).sum() + entropy.sum() + packed_lp.sum()).backward()
        runs.append((logprobs, entropy, packed_lp, [p.grad.clone() for p in model.parameters()]))
    for want, got in zip(runs[0][:3], runs[1][:3]):
        assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(g, w, atol=1e-5) for w, g in zip(runs[0][3], runs[1][3]))


def test_log_probs_from_a_start_position_are_the_full_ones_sliced_and_a_logged_entropy_takes_no_gradient():
    """RL scores response tokens only (start = prompt width - 1): the same numbers and parameter gradients as
    computing every position and slicing, on the full-logits path and the chunked one. An entropy asked for
    without entropy_grad has the same values, stays out of autograd and leaves the log-probs' gradients as they are."""
    from tasks.common.nn import data
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1)
    ids, mask = data.pad(
        [data.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82", "1+1=")], tok.pad_token_id, side="left"
    )
    start = 4
    for chunked in (False, True):
        model.chunked_logprobs = chunked
        runs = []
        for kwargs in ({}, {"start": start}, {"start": start, "entropy_grad": False}):
            model.zero_grad()
            logprobs, entropy = sequence_logprobs(model, ids, mask, return_entropy=True, temperature=0.8, **kwargs)
            if "start" not in kwargs:
                logprobs, entropy = logprobs[:, start:], entropy[:, start:]
            assert entropy.requires_grad == kwargs.get("entropy_grad", True)
            (logprobs * mask[:, start + 1 :]).sum().backward()
            runs.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
        for got in runs[1:]:
            assert got[0].shape == runs[0][0].shape == (3, ids.size(1) - 1 - start)
            assert torch.allclose(got[0], runs[0][0], atol=1e-6) and torch.allclose(got[1], runs[0][1], atol=1e-6)
            assert all(torch.allclose(g, w, atol=1e-6) for w, g in zip(runs[0][2], got[2]))


# ---- sampling temperature -----------------------------------------------------------------------------


class FixedLogits(torch.nn.Module):
    """A causal LM whose logits are (0, ln 3) at every position, whatever the input."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        row = torch.tensor([0.0, math.log(3.0)])
        return type("Output", (), {"logits": row.expand(*input_ids.shape, 2)})()


def test_token_logprobs_at_a_temperature_by_hand():
    # logits (0, ln 3) / 0.5 = (0, ln 9): p = (1/10, 9/10)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(token_logprobs(logits, torch.tensor([[0, 1]]), temperature=0.5), [[math.log(0.1), math.log(0.9)]])
    # temperature 1.0 is the untempered formula bit for bit
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    untempered = torch.gather(torch.log_softmax(logits.float(), -1), -1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(token_logprobs(logits, labels, temperature=1.0), untempered)


def test_sequence_logprobs_and_entropy_are_those_of_the_tempered_distribution():
    # every position: p = (1/4, 3/4) untempered, (1/10, 9/10) at temperature 0.5
    #   entropy: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335;  -(0.1 ln 0.1 + 0.9 ln 0.9) = 0.325083
    ids, mask = torch.tensor([[0, 1, 1]]), torch.ones(1, 3)
    logprobs, entropy = sequence_logprobs(FixedLogits(), ids, mask, return_entropy=True)
    close(logprobs, [[math.log(0.75), math.log(0.75)]])
    close(entropy, [[0.562335, 0.562335]])
    logprobs, entropy = sequence_logprobs(FixedLogits(), ids, mask, return_entropy=True, temperature=0.5)
    close(logprobs, [[math.log(0.9), math.log(0.9)]])
    close(entropy, [[0.325083, 0.325083]])
    # the RL helper passes it through: response tokens only (prompt width 2 -> the last position)
    from tasks.rl.experience import response_logprobs

    close(response_logprobs(FixedLogits(), ids, mask, 2, temperature=0.5), [[math.log(0.9)]])


def test_fused_token_logprobs_compiled_applies_the_temperature():
    """The compiled GPU path divides by the temperature too (here compiled for the CPU)."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16)
    labels = torch.randint(0, 37, (2, 5))
    expected = torch.gather(torch.log_softmax(logits.float() / 0.7, -1), -1, labels.unsqueeze(-1)).squeeze(-1)
    close(token_logprobs(logits, labels, temperature=0.7), expected)
    close(torch.compile(fused_token_logprobs, dynamic=True)(logits, labels, 0.7), expected)


def test_actor_logprobs_at_the_temperature_are_those_generate_sampled_from():
    """HF generate's processed scores (logits / temperature) give the sampled tokens the log-probs that
    response_logprobs computes at that temperature; untempered ones differ."""
    from tasks.common.nn.data import encode_prompt
    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.data import demo
    from tasks.rl.experience import response_logprobs

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1).eval()
    prompts = [encode_prompt(tok, "3+4="), encode_prompt(tok, "37+45=")]
    rollout = HFRolloutEngine(model, tok).generate(prompts, max_new_tokens=4)
    width = rollout.prompt_width
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=rollout.sequences[:, :width],
            attention_mask=rollout.attention_mask[:, :width],
            max_new_tokens=4,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        sampled = sampled.gather(-1, out.sequences[:, width:].unsqueeze(-1)).squeeze(-1)
        seqs, attention = (
            out.sequences,
            torch.cat([rollout.attention_mask[:, :width], torch.ones_like(out.sequences[:, width:])], 1),
        )
        tempered = response_logprobs(model, seqs, attention, width, temperature=0.7)
        untempered = response_logprobs(model, seqs, attention, width)
    first = slice(0, 1)  # the first response token is never after an EOS, so always a response token
    assert torch.allclose(tempered[:, first], sampled[:, first], atol=1e-4)
    assert not torch.allclose(untempered[:, first], sampled[:, first], atol=1e-3)


# ---- masked positions: no inf/nan in the forward pass or the gradients -----------------------------------


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
