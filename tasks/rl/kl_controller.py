"""The coefficient β of the KL penalty to the reference, fixed or adapted towards a target KL.

    kl_ctl = make_kl_controller(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
    ... compute_advantages(..., kl_coef=kl_ctl.value) ...
    kl_ctl.update(mean_kl, n_steps=samples_in_the_batch)
    checkpoint["kl_controller"] = kl_ctl.state_dict();  kl_ctl.load_state_dict(checkpoint["kl_controller"])

Both controllers keep β as a plain float in `.value`.
"""

from __future__ import annotations

from typing import Any


def _clip(x: float, low: float, high: float) -> float:
    return max(low, min(high, x))


class FixedKLController:
    """β stays at its initial value; update() does nothing."""

    kind = "fixed"

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """β steered so the measured KL tracks a target (Ziegler et al. 2019, §2.2).

    e = clip(KL / KL_target - 1, -0.2, 0.2);  β ← β·(1 + e·n_steps / horizon).
    Ziegler's K_β is n_steps/horizon here, as in OpenRLHF: n_steps is the number of samples the
    KL was measured on (OpenRLHF passes rollout_batch_size × n_samples_per_prompt) and horizon is
    in samples too. current_kl must be in the units of kl_target: OpenRLHF passes the batch mean
    of each sequence's per-token mean KL; Ziegler's targets are per-sequence sums.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: float):
        if kl_target <= 0:
            raise ValueError(f"kl_target: must be > 0, got {kl_target}")
        if kl_horizon <= 0:
            raise ValueError(f"kl_horizon: must be > 0, got {kl_horizon}")
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = float(kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = _clip(float(current_kl) / self.target - 1.0, -0.2, 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores β only; target and horizon come from the (possibly changed) config."""
        self.value = float(state["value"])


def make_kl_controller(init_kl_coef: float, kl_target: float | None = None, kl_horizon: float = 10000):
    """AdaptiveKLController when a kl_target is set (not None, not 0), else FixedKLController (as OpenRLHF)."""
    if kl_target:
        return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
    return FixedKLController(init_kl_coef)
