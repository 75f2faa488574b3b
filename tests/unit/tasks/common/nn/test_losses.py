"""Numerics that hold at scale (issue 52, item 5): the off-policy corrections (IcePop's mis, reject) and the
clamps on the policy log-ratio (±20) and on the per-token KL (±10), against values computed by hand."""

import math

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn.losses import importance_weights, kl_estimate, kl_loss, logprob_mismatch, policy_loss
from tasks.rl.advantages import kl_penalized_rewards
from tasks.rl.config import RLConfig

T = torch.tensor

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


def test_the_config_takes_reject():
    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    assert make_config(RLConfig, {**base, "is_correction": "reject"}).correction() == "reject"
    with pytest.raises(ConfigError, match="is_correction: use auto, tis, mis, reject, none with an is_cap above 1"):
        make_config(RLConfig, {**base, "is_correction": "icepop"})


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
    # r = log 0.25 - log 0.5 (tests/unit/test_math.py): k1 0.693147, k2 0.240227, k3 0.193147; and r = ±2.
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
