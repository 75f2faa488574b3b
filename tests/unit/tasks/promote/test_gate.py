"""The promotion gate (hand-computed cases), the registry's compare-and-swap on the S3 emulator and on a
local folder, and the promote stage judging evaluation reports committed like the eval stage's."""

import json
import threading

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage, storage
from tasks.common.config import ConfigError, make_config
from tasks.common.registry import Registry, StaleChampion
from tasks.promote.__main__ import promote
from tasks.promote.config import PromoteConfig
from tasks.promote.gate import check_rules, judge

RULES = {"preferred_style_rate": {"min_gain": 0.1}, "accuracy": {"max_drop": 0.02}, "kl_to_ref": {"max": 2.0}}


def test_gate_hand_computed():
    reference = {"preferred_style_rate": 0.50, "accuracy": 0.80, "kl_to_ref": 0.0}
    ok, reasons = judge({"preferred_style_rate": 0.65, "accuracy": 0.79, "kl_to_ref": 1.5}, reference, RULES)
    assert ok, reasons
    assert reasons == [
        "pass: preferred_style_rate gain +0.1500 over 0.5000 >= +0.1",
        "pass: accuracy drop +0.0100 from 0.8000 <= 0.02",
        "pass: kl_to_ref 1.5000 <= 2.0",
    ]
    # Each rule failing alone fails the gate: too little gain, too much accuracy lost, too far from the SFT policy.
    for worse in ({"preferred_style_rate": 0.55}, {"accuracy": 0.77}, {"kl_to_ref": 2.5}):
        ok, reasons = judge(
            {"preferred_style_rate": 0.65, "accuracy": 0.79, "kl_to_ref": 1.5, **worse}, reference, RULES
        )
        assert not ok and sum(r.startswith("FAIL") for r in reasons) == 1, reasons
    ok, reasons = judge({"preferred_style_rate": 0.9}, reference, {"accuracy": {"min": 0.5}})
    assert not ok and reasons == ["FAIL: accuracy: missing from the evaluation report"]


def test_gate_refuses_rules_a_reward_hacked_policy_could_pass():
    with pytest.raises(ConfigError, match="does not produce"):
        check_rules({"reward_mean": {"min_gain": 0.5}})
    with pytest.raises(ConfigError, match="accuracy"):
        check_rules({"accuracy": {"at_least": 0.5}})
    with pytest.raises(ConfigError, match="must be a number"):
        check_rules({"accuracy": {"min": "high"}})
    check_rules(RULES)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_registry_promotion_is_a_compare_and_swap(where, s3_server, tmp_path):
    root = s3_server.uri(f"registry-{tmp_path.name}/models/m") if where == "s3" else str(tmp_path / "models" / "m")
    reg = Registry(root)
    assert reg.champion() == (None, None)
    first = reg.promote({"policy": "s3://b/run1/rl/manifest.json"}, expected_version=0, promoted_by="test")
    assert first["version"] == 1 and first["previous"] is None

    # Two promoters judged against v1 race: exactly one wins, the other is told its view is stale.
    results = []

    def contender(n: int) -> None:
        try:
            results.append(
                reg.promote({"policy": f"s3://b/run{n}/rl/manifest.json"}, expected_version=1, promoted_by=f"p{n}")
            )
        except StaleChampion as e:
            results.append(e)

    threads = [threading.Thread(target=contender, args=(n,)) for n in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, dict)]
    assert len(won) == 1 and len(results) == 2, results
    champion, _ = reg.champion()
    assert champion["version"] == 2 and champion["policy"] == won[0]["policy"]
    assert champion["previous"] == "s3://b/run1/rl/manifest.json"
    assert [h["version"] for h in reg.history()] == [1, 2]
    with pytest.raises(StaleChampion, match="version 2, not the version 1"):
        reg.promote({"policy": "s3://b/late/rl/manifest.json"}, expected_version=1, promoted_by="late")


def evaluation(
    root: str, name: str, policy: dict, baseline: dict, champion: dict | None = None, version: int = 0, **extra
) -> str:
    """An eval stage output as the eval stage commits it: report.json (plus `extra` keys) + manifest.json."""
    out = f"{root}/{name}/eval"
    metrics = {"baseline": baseline, "policy": policy, **({"champion": champion} if champion else {})}
    report = {"metrics": metrics, "champion": {"version": version, "policy": "x"} if champion else None, **extra}
    local = storage.local_path(f"{root}-local/{name}")
    local.mkdir(parents=True)
    (local / "report.json").write_text(json.dumps(report))
    manifests.commit(
        local,
        out,
        manifests.build_manifest(
            "eval", name, {}, {"policy": f"{root}/{name}/rl/manifest.json"}, {}, report="report.json"
        ),
    )
    return out


def run_promote(evaluation_uri: str, registry: str, tmp_path, allow: bool = True, rules: dict = RULES) -> dict:
    out = str(tmp_path / f"promote-{evaluation_uri.rsplit('/', 2)[-2]}")
    cfg = make_config(
        PromoteConfig,
        {
            "output": out,
            "evaluation": evaluation_uri,
            "registry": registry,
            "gate": json.dumps(rules),
            "allow_promotion": allow,
            "run_id": evaluation_uri,
        },
    )
    stage.run("promote", cfg, promote)
    return manifests.read_manifest(out)


def test_promote_stage_promotes_a_better_policy_and_keeps_a_worse_one_out(tmp_path):
    root, registry = str(tmp_path / "runs"), str(tmp_path / "models" / "demo")
    sft = {"preferred_style_rate": 0.5, "accuracy": 0.84, "kl_to_ref": 0.0}
    good = {"preferred_style_rate": 0.99, "accuracy": 0.85, "kl_to_ref": 0.7}

    # A manual run may not promote: judged, recorded, not promoted.
    manual = run_promote(evaluation(root, "manual", good, sft), registry, tmp_path, allow=False)
    assert manual["metrics"]["passed"] == 1 and manual["metrics"]["promoted"] == 0
    assert "not promoted" in manual["decision"]
    assert Registry(registry).champion() == (None, None)

    night1 = run_promote(evaluation(root, "night1", good, sft), registry, tmp_path)
    assert night1["metrics"] == {**night1["metrics"], "passed": 1, "promoted": 1, "champion_version": 1}
    champion, _ = Registry(registry).champion()
    assert champion["policy"] == f"{root}/night1/rl/manifest.json"

    # Fewer RL steps: better than the SFT model, but far below the champion it is judged against.
    weaker = {"preferred_style_rate": 0.6, "accuracy": 0.84, "kl_to_ref": 0.1}
    night2 = run_promote(evaluation(root, "night2", weaker, sft, champion=good, version=1), registry, tmp_path)
    assert night2["metrics"]["passed"] == 0 and night2["metrics"]["promoted"] == 0
    assert night2["decision"].startswith("rejected")
    assert Registry(registry).champion()[0]["version"] == 1
    record = storage.read_json(night2["candidate"])
    assert record["promoted"] is False and any(r.startswith("FAIL: preferred_style_rate") for r in record["reasons"])

    # A candidate judged against a champion that has since been replaced is refused, not promoted.
    stale = evaluation(root, "stale", good, sft)  # evaluated when there was no champion
    with pytest.raises(StaleChampion, match="version 1, not the version 0"):
        run_promote(stale, registry, tmp_path)


def test_promote_refuses_a_candidate_whose_reward_model_was_gamed(tmp_path):
    """The eval report's reward-hacking alarm went off (reward up, exact match down, both beyond noise): the gate
    fails whatever its rules say, and the candidate is recorded as rejected with the alarm as the reason."""
    from tasks.eval import stats

    root, registry = str(tmp_path / "runs"), str(tmp_path / "models" / "gamed")
    comparison = {
        "reward_mean": {"delta": 1.2, "interval": [0.9, 1.5]},
        "exact_match": {"delta": -0.2, "interval": [-0.3, -0.1]},
    }
    alarms = [f"against the baseline: {line}" for line in stats.hacking_alarms(comparison, ["exact_match"])]
    uri = evaluation(
        root,
        "gamed",
        {"exact_match": 0.4, "reward_mean": 1.3},
        {"exact_match": 0.6, "reward_mean": 0.1},
        comparisons={"baseline": comparison},
        alarms=alarms,
    )
    decided = run_promote(uri, registry, tmp_path, rules={"exact_match": {"min": 0.0}})
    assert decided["metrics"]["passed"] == 0 and decided["metrics"]["promoted"] == 0
    record = storage.read_json(Registry(registry).candidate_uri(uri))
    assert record["decision"] == "rejected: the gate failed"
    assert record["reasons"][0] == "pass: exact_match 0.4000 >= 0.0"
    assert record["reasons"][1].startswith(
        "FAIL: against the baseline: reward hacking suspected: reward_mean rose +1.2000"
    )
