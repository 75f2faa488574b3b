from dataclasses import dataclass, field

from tasks.common.config import ConfigError, StageConfig


@dataclass
class EvalConfig(StageConfig):
    """Compare a baseline policy (the SFT model, also the KL reference) with a trained policy on held-out prompts."""

    baseline: str = field(default="", metadata={"help": "the starting policy (SFT output URI); also the reference for KL"})
    policy: str = field(default="", metadata={"help": "the trained policy (RL output URI)"})
    reward_pretrain: str = field(default="", metadata={"help": "reward model (output URI) whose mean score is reported; without one (DPO, KTO) reward_mean is left out"})
    registry: str = field(default="", metadata={"help": "a model registry folder (s3://…/models/<name>): its champion, when there is one, is evaluated on the same prompts for the promotion gate"})
    dataset: str = field(default="", metadata={"help": "held-out prompts, with labels when there are reference answers: a stage output URI or a file"})
    dataset_split: str = field(default="eval", metadata={"help": "split of a stage output's datasets to evaluate on"})
    input_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt: a string or a list of chat messages"})
    label_key: str = field(default="label", metadata={"help": "dataset column holding the reference answer; without it (or empty) the accuracy metrics are left out"})
    apply_chat_template: bool = field(default=False, metadata={"help": "render each prompt with the tokenizer's chat template, as the trained stages did (needed for chat-message prompts)"})
    max_samples: int = field(default=500, metadata={"help": "evaluate on the first this many prompts"})
    generate_max_len: int = field(default=16, metadata={"help": "new tokens per response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature for the sampled metrics"})
    num_shown_samples: int = field(default=8, metadata={"help": "generations shown side by side in the report"})

    def validate(self) -> None:
        super().validate()
        for name in ("baseline", "policy", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        if self.max_samples < 1 or self.generate_max_len < 1:
            raise ConfigError("max_samples and generate_max_len: must be at least 1")
        if not self.temperature > 0:
            raise ConfigError(f"temperature: must be positive, got {self.temperature}")
