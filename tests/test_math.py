"""Losses, advantages and KL against values computed by hand (the arithmetic is in each comment)."""
import math

import pytest
import torch

from tasks.common.losses import bradley_terry_loss, masked_mean, policy_loss, sft_loss, value_loss
from tasks.rl.advantages import gae, kl_estimate, kl_penalized_rewards, whiten

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (a, b)


def test_masked_mean_ignores_masked_positions():
    close(masked_mean(T([[1.0, 2.0, 100.0]]), T([[1, 1, 0]])), 1.5)
    close(masked_mean(T([[1.0, 3.0], [5.0, 7.0]]), T([[1, 1], [1, 0]]), dim=1), [2.0, 5.0])


def test_sft_loss_averages_response_tokens_only():
    # prompt token (-1) masked out: -(-2 - 3) / 2 = 2.5
    close(sft_loss(T([[-1.0, -2.0, -3.0]]), T([[0, 1, 1]])), 2.5)


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
