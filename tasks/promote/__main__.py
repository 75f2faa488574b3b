import json

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.registry import Registry
from tasks.common.stage import StageRun, main
from tasks.promote.config import PromoteConfig
from tasks.promote.gate import default_rules, judge, real_gain


def promote(cfg: PromoteConfig, run: StageRun) -> None:
    evaluation = manifests.read_manifest(run.input("evaluation", cfg.evaluation))
    report = storage.read_json(manifests.resolve(evaluation, "report"))
    champion = report.get("champion")  # what the eval stage compared against: {"version", "policy"} or None
    side = "champion" if champion else "baseline"
    rules = cfg.rules() or default_rules(report)
    passed, reasons = judge(
        report["metrics"]["policy"],
        report["metrics"][side],
        rules,
        comparison=report.get("comparisons", {}).get(side),
        alarms=report.get("alarms", []),
    )
    if not cfg.rules():  # the default gate also asks for a gain beyond noise
        gained, line = real_gain(report, side)
        passed, reasons = passed and gained, [*reasons, line]
    against = f"champion v{champion['version']}" if champion else "the SFT baseline (no champion yet)"
    print(f"gate against {against}:\n  " + "\n  ".join(reasons), flush=True)

    registry = Registry(cfg.registry)
    entry = {
        "policy": evaluation["inputs"]["policy"],
        "evaluation": cfg.evaluation,
        "run_id": cfg.run_id,
        "metrics": report["metrics"]["policy"],
        "gate": rules,
        "reasons": reasons,
    }
    promoted = None
    if not passed:
        decision = "rejected: the gate failed"
    elif not cfg.allow_promotion:
        decision = "passed, not promoted: promotion is off for this run (allow_promotion false)"
    else:
        promoted = registry.promote(
            entry,
            expected_version=champion["version"] if champion else 0,
            promoted_by=cfg.promoted_by or f"run {cfg.run_id}",
        )
        decision = f"promoted: champion v{promoted['version']}"
    print(f"decision: {decision}", flush=True)
    candidate = registry.record_candidate(
        cfg.run_id,
        {**entry, "decision": decision, "passed": passed, "against": champion, "promoted": promoted is not None},
    )
    (run.workdir / "decision.json").write_text(json.dumps({"decision": decision, "reasons": reasons}, indent=2))
    run.commit(
        metrics={
            "passed": int(passed),
            "promoted": int(promoted is not None),
            "champion_version": promoted["version"] if promoted else (champion or {}).get("version", 0),
        },
        decision=decision,
        candidate=candidate,
        champion=registry.champion_uri if promoted else None,
    )


if __name__ == "__main__":
    main("promote", PromoteConfig, promote)
