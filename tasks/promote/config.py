import json
from dataclasses import dataclass, field

from tasks.common.config import ConfigError, StageConfig
from tasks.promote.gate import check_rules

#: {}: the default gate, made from the metrics the run declares (tasks/promote/gate.py: default_rules, real_gain).
DEFAULT_GATE: dict = {}


@dataclass
class PromoteConfig(StageConfig):
    """Judge an evaluated candidate against the gate; promote it to champion when it passes and promotion is allowed."""

    evaluation: str = field(
        default="",
        metadata={"help": "the eval stage's output URI (its report holds candidate, baseline and champion metrics)"},
    )
    registry: str = field(
        default="", metadata={"help": "the model's registry folder, e.g. s3://bucket/prefix/models/<name>"}
    )
    gate: str = field(
        default=json.dumps(DEFAULT_GATE),
        metadata={
            "help": 'JSON rules per metric: {"accuracy": {"max_drop": 0.02}, ...} (min, max, min_gain, max_drop, min_gain_lower); {}: no declared 0/1 metric drops over 2 points, KL under 2, and one gains beyond noise'
        },
    )
    allow_promotion: bool = field(
        default=True, metadata={"help": "false: judge and record the candidate, never promote (manual runs)"}
    )
    promoted_by: str = field(default="", metadata={"help": "who or what promotes (recorded in the history)"})

    def validate(self) -> None:
        super().validate()
        for name in ("evaluation", "registry"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        check_rules(self.rules())

    def rules(self) -> dict:
        try:
            return json.loads(self.gate)
        except ValueError as e:
            raise ConfigError(
                f'gate: not valid JSON ({e}); pass an object such as {{"accuracy": {{"max_drop": 0.02}}}}, or {{}}'
            ) from None
