"""The promotion gate: does a candidate policy beat the reference (the champion, or the SFT baseline when
there is no champion yet) by the margins asked, on metrics measured on the same held-out prompts?

    rules = {"sampled_preferred_style_rate": {"min_gain_lower": 0.0}, "accuracy": {"max_drop": 0.02}, "kl_to_ref": {"max": 2.0}}
    passed, reasons = judge(candidate_metrics, reference_metrics, rules, comparison)

Per metric, any of: ``min`` / ``max`` (absolute bounds on the candidate), ``min_gain`` (candidate -
reference >= min_gain), ``max_drop`` (reference - candidate <= max_drop) and ``min_gain_lower`` (the lower
end of the 95% interval of candidate - reference >= the bound: a gain that is not noise). ``comparison``
is the eval report's {metric: {"delta", "interval"}} against that reference. A gate must hold at least one
metric the reward model does not produce, so a policy that games its reward model cannot pass on reward
alone; and a report whose reward-hacking alarm went off fails the gate (tasks/eval/stats.py).

An empty gate ({}, the default) is made from the metrics the run declared (the eval report's
``verifiable_metrics``, its 0/1 metrics): none may drop more than 2 points (``default_rules``), KL to the
SFT model stays under 2 nats, and at least one of them must gain beyond noise (``real_gain``).
"""

from __future__ import annotations

from tasks.common.config import ConfigError

RULE_KINDS = ("min", "max", "min_gain", "max_drop", "min_gain_lower")
#: What the reward model itself produces: no gate may rest on these alone.
REWARD_METRICS = ("reward_mean",)


#: The default gate's bounds: what a declared metric may lose, and the KL to the SFT model it may spend.
DEFAULT_MAX_DROP = 0.02
DEFAULT_MAX_KL = 2.0


def check_rules(rules: dict) -> None:
    """Refuse a malformed gate with one line naming the fault ({} is the default gate)."""
    if not isinstance(rules, dict):
        raise ConfigError('gate: must be a JSON object such as {"accuracy": {"max_drop": 0.02}}, or {} for the default')
    if not rules:
        return
    for metric, rule in rules.items():
        if not isinstance(rule, dict) or not rule or set(rule) - set(RULE_KINDS):
            raise ConfigError(
                f"gate: rule for {metric!r} must be an object with keys from {list(RULE_KINDS)}, got {rule!r}"
            )
        for kind, value in rule.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"gate: {metric}.{kind} must be a number, got {value!r}")
    if not set(rules) - set(REWARD_METRICS):
        raise ConfigError(
            f"gate: needs at least one metric the reward model does not produce (not only {list(REWARD_METRICS)}), such as accuracy or kl_to_ref"
        )


def judge(
    candidate: dict, reference: dict, rules: dict, comparison: dict | None = None, alarms: list[str] | tuple = ()
) -> tuple[bool, list[str]]:
    """(passed, one line per rule saying how it went). A metric missing on either side fails its rule, as
    does an interval rule without the interval; every alarm fails the gate."""
    reasons, passed = [], True
    for metric, rule in rules.items():
        value, ref = candidate.get(metric), reference.get(metric)
        interval = ((comparison or {}).get(metric) or {}).get("interval")
        for kind, bound in rule.items():
            if value is None or (kind in ("min_gain", "max_drop") and ref is None):
                ok, line = False, f"{metric}: missing from the evaluation report"
            elif kind == "min":
                ok, line = value >= bound, f"{metric} {value:.4f} >= {bound}"
            elif kind == "max":
                ok, line = value <= bound, f"{metric} {value:.4f} <= {bound}"
            elif kind == "min_gain":
                ok, line = value - ref >= bound, f"{metric} gain {value - ref:+.4f} over {ref:.4f} >= {bound:+}"
            elif kind == "max_drop":
                ok, line = ref - value <= bound, f"{metric} drop {ref - value:+.4f} from {ref:.4f} <= {bound}"
            elif not interval:
                ok, line = False, f"{metric}: no interval of its change in the evaluation report"
            else:
                ok, line = (
                    interval[0] >= bound,
                    f"{metric} gain's 95% interval [{interval[0]:+.4f}, {interval[1]:+.4f}] starts >= {bound:+}",
                )
            reasons.append(("pass: " if ok else "FAIL: ") + line)
            passed = passed and ok
    for alarm in alarms:
        reasons.append(f"FAIL: {alarm}")
        passed = False
    return passed, reasons


def default_rules(report: dict) -> dict:
    """The default gate for an eval report: no declared 0/1 metric (greedy) drops more than DEFAULT_MAX_DROP,
    and the KL to the SFT model stays under DEFAULT_MAX_KL."""
    greedy = [m for m in report.get("verifiable_metrics", []) if not m.startswith("sampled_")]
    return {**{m: {"max_drop": DEFAULT_MAX_DROP} for m in greedy}, "kl_to_ref": {"max": DEFAULT_MAX_KL}}


def real_gain(report: dict, side: str) -> tuple[bool, str]:
    """Whether some declared 0/1 metric (greedy or sampled) gained beyond noise against `side`: the 95% interval
    of its change lies above 0. The default gate asks for one, so a candidate no better than the reference stays out."""
    comparison = report.get("comparisons", {}).get(side, {})
    gains = [
        (m, c)
        for m in report.get("verifiable_metrics", [])
        if (c := comparison.get(m)) and c.get("interval") and c["interval"][0] > 0
    ]
    if not gains:
        return (
            False,
            f"FAIL: no declared metric gained beyond noise against the {side} (of {report.get('verifiable_metrics', [])})",
        )
    metric, change = max(gains, key=lambda g: g[1]["interval"][0])
    lo, hi = change["interval"]
    return (
        True,
        f"pass: {metric} gained {change['delta']:+.4f} (95% interval [{lo:+.4f}, {hi:+.4f}]) against the {side}",
    )
