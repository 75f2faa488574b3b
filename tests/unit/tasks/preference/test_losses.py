"""DPO / cDPO / IPO / KTO losses against values computed by hand (the arithmetic is in each comment)."""

import pytest
import torch

from tasks.common.nn.losses import bradley_terry_loss
from tasks.preference.config import DPO_LOSS_TYPES
from tasks.preference.losses import dpo_loss, kto_kl_baseline, kto_loss

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


# Two pairs. logits h = (π_c - π_r) - (ref_c - ref_r):
#   pair 1: (-1 - -3) - (-2 - -3) = 2 - 1 = 1
#   pair 2: (-2 - -2) - (-1 - -1) = 0 - 0 = 0
PI_C, PI_R, REF_C, REF_R = T([-1.0, -2.0]), T([-3.0, -2.0]), T([-2.0, -1.0]), T([-3.0, -1.0])


def test_dpo_sigmoid_loss_value():
    # β = 0.5, βh = (0.5, 0): -log σ(0.5) = log(1 + e^-0.5) = log 1.606531 = 0.474077; -log σ(0) = log 2 = 0.693147
    # mean (0.474077 + 0.693147) / 2 = 0.583612
    loss, _, _ = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5)
    close(loss, 0.5836121)
    assert loss.dim() == 0


def test_dpo_sigmoid_equals_bradley_terry_on_the_implicit_rewards():
    loss, chosen, rejected = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5)
    close(loss, bradley_terry_loss(chosen, rejected))


def test_dpo_label_smoothing_value():
    # cDPO, ε = 0.1: -(0.9)·log σ(x) - 0.1·log σ(-x), and -log σ(-x) = -log σ(x) + x
    #   pair 1, x = 0.5: 0.9·0.474077 + 0.1·(0.474077 + 0.5) = 0.474077 + 0.05 = 0.524077
    #   pair 2, x = 0:   0.9·0.693147 + 0.1·0.693147 = 0.693147
    # mean (0.524077 + 0.693147) / 2 = 0.608612
    loss, _, _ = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5, label_smoothing=0.1)
    close(loss, 0.6086121)


def test_dpo_reference_free_equals_zero_reference():
    # reference-free logits: (-1 - -3, -2 - -2) = (2, 0); β = 0.5:
    #   -log σ(1) = log(1 + e^-1) = 0.313262; log 2 = 0.693147; mean 0.503204
    free = dpo_loss(PI_C, PI_R, None, None, beta=0.5, reference_free=True)
    zero = dpo_loss(PI_C, PI_R, torch.zeros(2), torch.zeros(2), beta=0.5)
    close(free[0], 0.5032045)
    for a, b in zip(free, zero):
        close(a, b)
    close(free[1], [-0.5, -1.0])  # β·π_c
    close(free[2], [-1.5, -1.0])  # β·π_r
    # the reference tensors are ignored when reference_free, even if given
    close(dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5, reference_free=True)[0], 0.5032045)


def test_dpo_ipo_loss_value():
    # β = 0.25, 1/(2β) = 2: (1 - 2)² = 1, (0 - 2)² = 4, mean 2.5
    loss, _, _ = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.25, loss_type="ipo")
    close(loss, 2.5)


def test_dpo_rewards():
    # β = 0.5: chosen 0.5·((-1, -2) - (-2, -1)) = 0.5·(1, -1) = (0.5, -0.5)
    #          rejected 0.5·((-3, -2) - (-3, -1)) = 0.5·(0, -1) = (0, -0.5)
    # margins (0.5, 0) = β·h
    pi_c = PI_C.clone().requires_grad_(True)
    _, chosen, rejected = dpo_loss(pi_c, PI_R, REF_C, REF_R, beta=0.5)
    close(chosen, [0.5, -0.5])
    close(rejected, [0.0, -0.5])
    assert not chosen.requires_grad and not rejected.requires_grad


def test_dpo_gradient_flows_to_policy():
    # d/dπ_c of mean_i -log σ(βh_i) = -β·σ(-βh_i) / B: pair 1 -0.5·σ(-0.5)/2 = -0.5·0.377541/2 = -0.094385,
    # pair 2 -0.5·0.5/2 = -0.125; π_r gets the opposite sign
    pi_c, pi_r = PI_C.clone().requires_grad_(True), PI_R.clone().requires_grad_(True)
    loss, _, _ = dpo_loss(pi_c, pi_r, REF_C, REF_R, beta=0.5)
    loss.backward()
    assert pi_c.grad is not None and pi_r.grad is not None
    close(pi_c.grad, [-0.0943852, -0.125])
    close(pi_r.grad, [0.0943852, 0.125])
    # and through IPO: d/dπ_c mean (h - 2)² = 2(h - 2)/B = (-1, -2)
    pi_c = PI_C.clone().requires_grad_(True)
    dpo_loss(pi_c, PI_R, REF_C, REF_R, beta=0.25, loss_type="ipo")[0].backward()
    close(pi_c.grad, [-1.0, -2.0])


def test_dpo_errors():
    assert DPO_LOSS_TYPES == ("sigmoid", "ipo")
    with pytest.raises(ValueError, match="sigmoid, ipo") as err:
        dpo_loss(PI_C, PI_R, REF_C, REF_R, loss_type="hinge")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="ipo"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, loss_type="ipo", label_smoothing=0.1)
    for beta in (0.0, -0.1):
        with pytest.raises(ValueError, match="beta"):
            dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=beta)
    for eps in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(PI_C, PI_R, REF_C, REF_R, label_smoothing=eps)
    with pytest.raises(ValueError, match="reference_free"):
        dpo_loss(PI_C, PI_R, None, None)


def test_kto_loss_value_with_weights():
    # log ratio r = (-1, -2, -3, -4) - (-2, -2, -1, -5) = (1, 0, -2, 1); desirable (T, F, T, F);
    # z0 = 0.5, β = 1, λ_D = 2, λ_U = 0.5; 1 - σ(x) = σ(-x):
    #   1 (D): 2·σ(-(1 - 0.5))   = 2·σ(-0.5)  = 2·0.377541   = 0.755081
    #   2 (U): 0.5·σ(-(0.5 - 0)) = 0.5·σ(-0.5) = 0.5·0.377541 = 0.188770
    #   3 (D): 2·σ(-(-2 - 0.5))  = 2·σ(2.5)   = 2·0.924142   = 1.848284
    #   4 (U): 0.5·σ(-(0.5 - 1)) = 0.5·σ(0.5) = 0.5·0.622459 = 0.311230
    # mean over all four: 3.103365 / 4 = 0.775841
    pi, ref, desirable = T([-1.0, -2.0, -3.0, -4.0]), T([-2.0, -2.0, -1.0, -5.0]), T([True, False, True, False])
    loss, rewards = kto_loss(pi, ref, desirable, 0.5, beta=1.0, desirable_weight=2.0, undesirable_weight=0.5)
    close(loss, 0.7758412)
    close(rewards, [1.0, 0.0, -2.0, 1.0])
    # unit weights, β = 0.5, tensor z0 = 0: σ(-0.5), σ(0), σ(1), σ(0.5) -> (0.377541 + 0.5 + 0.731059 + 0.622459) / 4 = 0.557765
    loss, rewards = kto_loss(pi, ref, desirable, T(0.0), beta=0.5)
    close(loss, 0.5577645)
    close(rewards, [0.5, 0.0, -1.0, 0.5])
    assert not rewards.requires_grad


def test_kto_loss_clamps_and_detaches_baseline():
    pi, ref, desirable = T([-1.0, -2.0]), T([-2.0, -2.0]), T([True, False])
    # a negative z0 is clamped to 0
    close(kto_loss(pi, ref, desirable, -3.0)[0], kto_loss(pi, ref, desirable, 0.0)[0])
    # no gradient reaches z0, but it does reach the policy
    z0 = T(0.5, requires_grad=True)
    pi = pi.clone().requires_grad_(True)
    loss, _ = kto_loss(pi, ref, desirable, z0)
    loss.backward()
    assert z0.grad is None
    assert pi.grad is not None and (pi.grad != 0).all()
    # desirable pushes log π up (negative gradient), undesirable pushes it down
    assert pi.grad[0] < 0 < pi.grad[1]


def test_kto_kl_baseline():
    # mean((-1, -2) - (-2, -2)) = mean(1, 0) = 0.5
    pi = T([-1.0, -2.0], requires_grad=True)
    z0 = kto_kl_baseline(pi, T([-2.0, -2.0]))
    close(z0, 0.5)
    assert not z0.requires_grad and z0.dim() == 0
    # mean((-3, -2) - (-1, -2)) = mean(-2, 0) = -1 -> clamped to 0
    close(kto_kl_baseline(T([-3.0, -2.0]), T([-1.0, -2.0])), 0.0)


def test_kto_kl_baseline_averages_over_workers_before_the_clamp():
    # two workers; log ratios (-1, -1) and (0, 1): local means -1.0 and 0.5
    #   z0 = max(0, mean(-1.0, 0.5) = -0.25) = 0, where clamping each worker first gave mean(0, 0.5) = 0.25
    workers = [(T([-2.0, -2.0]), T([-1.0, -1.0])), (T([-1.0, -2.0]), T([-1.0, -3.0]))]
    means = [-1.0, 0.5]
    for rank, (pi, ref) in enumerate(workers):
        other = means[1 - rank]
        # the all-reduce (mean over 2 workers), simulated with the other worker's local mean
        z0 = kto_kl_baseline(pi, ref, reduce_mean=lambda local: (local + other) / 2)
        close(z0, 0.0)
    # local means 1.0 and -0.5: max(0, 0.25) = 0.25 (clamping first: mean(1.0, 0) = 0.5)
    z0 = kto_kl_baseline(T([0.0, 0.0]), T([-1.0, -1.0]), reduce_mean=lambda local: (local + -0.5) / 2)
    close(z0, 0.25)
    assert not z0.requires_grad


def test_kto_errors():
    pi, ref, desirable = T([-1.0]), T([-1.0]), T([True])
    for kwargs in ({"beta": 0.0}, {"beta": -1.0}, {"desirable_weight": 0.0}, {"undesirable_weight": -1.0}):
        with pytest.raises(ValueError):
            kto_loss(pi, ref, desirable, 0.0, **kwargs)
