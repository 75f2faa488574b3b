from dataclasses import dataclass, field

from tasks.common.config import LR_SCHEDULERS, ConfigError, TrainingConfig, check_batch


@dataclass
class RewardModelConfig(TrainingConfig):
    """Pairwise (Bradley-Terry) reward model: a scalar head on the SFT model, trained on chosen/rejected pairs."""

    pretrain: str = field(default="", metadata={"help": "model to start from (the SFT output URI); the scalar head starts fresh"})
    dataset: str = field(default="", metadata={"help": "preference pairs: a stage output URI or a JSONL/Parquet/CSV file"})
    dataset_split: str = field(default="preference", metadata={"help": "split of a stage output's datasets to train on"})
    eval_split: str = field(default="preference_eval", metadata={"help": "held-out pairs for pairwise accuracy and reward statistics"})
    prompt_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    chosen_key: str = field(default="chosen", metadata={"help": "dataset column holding the preferred response"})
    rejected_key: str = field(default="rejected", metadata={"help": "dataset column holding the other response"})
    max_steps: int = field(default=300, metadata={"help": "optimizer steps"})
    train_batch_size: int = field(default=128, metadata={"help": "pairs per optimizer step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "peak learning rate (AdamW)"})
    lr_warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    lr_scheduler: str = field(default="constant", metadata={"help": "after warmup: constant, or cosine down to 0.1 of the peak"})
    max_len: int = field(default=512, metadata={"help": "longest prompt+response in tokens; longer ones lose the start of their prompt (then the end of the response) and are counted"})
    packing_samples: bool = field(default=False, metadata={"help": "pack each micro-batch's sequences into one: no padding, and no token attends across sequences"})
    logging_steps: int = field(default=25, metadata={"help": "log metrics every this many steps"})
    num_nodes: int = field(default=1, metadata={"help": "nodes of the data-parallel worker group"})
    num_gpus_per_node: int = field(default=1, metadata={"help": "workers per node, one GPU each (one CPU on a CPU-only cluster)"})

    def validate(self) -> None:
        super().validate()
        for name in ("pretrain", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        for name in ("max_steps", "train_batch_size", "max_len", "logging_steps", "num_nodes", "num_gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ConfigError(f"lr_scheduler: {self.lr_scheduler!r} is unknown; use {' or '.join(LR_SCHEDULERS)}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate: must be positive, got {self.learning_rate}")
        check_batch("train_batch_size", self.train_batch_size, self.micro_train_batch_size, self.num_nodes * self.num_gpus_per_node,
                    "num_nodes × num_gpus_per_node")
