"""The KL coefficient's controllers (tasks/rl/kl_controller.py), adaptive and fixed, against values computed by hand."""

import pytest
import torch

from tasks.rl.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


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
