"""The promotion gate: does a candidate policy beat the reference (the champion, or the SFT baseline when
there is no champion yet) by the margins asked, on metrics measured on the same held-out prompts?

    rules = {"preferred_style_rate": {"min_gain": 0.0}, "accuracy": {"max_drop": 0.02}, "kl_to_ref": {"max": 2.0}}
    passed, reasons = judge(candidate_metrics, reference_metrics, rules)

Per metric, any of: ``min`` / ``max`` (absolute bounds on the candidate), ``min_gain`` (candidate -
reference >= min_gain) and ``max_drop`` (reference - candidate <= max_drop). A gate must hold at least
one metric the reward model does not produce (INDEPENDENT_METRICS), so a policy that games its reward
model cannot pass on reward alone.
"""
from __future__ import annotations

from tasks.common.config import ConfigError

RULE_KINDS = ("min", "max", "min_gain", "max_drop")
# Measured without the reward model being optimised: exact-match accuracy and the KL to the SFT policy.
INDEPENDENT_METRICS = ("accuracy", "sampled_accuracy", "kl_to_ref")


def check_rules(rules: dict) -> None:
    """Refuse a malformed gate with one line naming the fault."""
    if not isinstance(rules, dict) or not rules:
        raise ConfigError('gate: must be a non-empty JSON object such as {"accuracy": {"max_drop": 0.02}}')
    for metric, rule in rules.items():
        if not isinstance(rule, dict) or not rule or set(rule) - set(RULE_KINDS):
            raise ConfigError(f"gate: rule for {metric!r} must be an object with keys from {list(RULE_KINDS)}, got {rule!r}")
        for kind, value in rule.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"gate: {metric}.{kind} must be a number, got {value!r}")
    if not set(rules) & set(INDEPENDENT_METRICS):
        raise ConfigError(f"gate: needs at least one metric the reward model does not produce, one of {list(INDEPENDENT_METRICS)}")


def judge(candidate: dict, reference: dict, rules: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rule saying how it went). A metric missing on either side fails its rule."""
    reasons, passed = [], True
    for metric, rule in rules.items():
        value, ref = candidate.get(metric), reference.get(metric)
        for kind, bound in rule.items():
            if value is None or (kind in ("min_gain", "max_drop") and ref is None):
                ok, line = False, f"{metric}: missing from the evaluation report"
            elif kind == "min":
                ok, line = value >= bound, f"{metric} {value:.4f} >= {bound}"
            elif kind == "max":
                ok, line = value <= bound, f"{metric} {value:.4f} <= {bound}"
            elif kind == "min_gain":
                ok, line = value - ref >= bound, f"{metric} gain {value - ref:+.4f} over {ref:.4f} >= {bound:+}"
            else:
                ok, line = ref - value <= bound, f"{metric} drop {ref - value:+.4f} from {ref:.4f} <= {bound}"
            reasons.append(("pass: " if ok else "FAIL: ") + line)
            passed = passed and ok
    return passed, reasons
