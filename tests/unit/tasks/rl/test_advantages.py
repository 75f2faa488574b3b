"""Advantages and returns (tasks/rl/advantages.py) against values computed by hand (the arithmetic is in each
comment): the KL-shaped reward, GAE, whitening, the group estimators and their keep mask."""

import pytest
import torch

from tasks.rl.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    group_keep_mask,
    kl_penalized_rewards,
    shape_scores,
    uses_critic,
    whiten,
)

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


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
