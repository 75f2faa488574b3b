from dataclasses import dataclass, field

from tasks.common.config import LR_SCHEDULERS, ConfigError, TrainingConfig, check_batch


@dataclass
class SFTConfig(TrainingConfig):
    """Supervised fine-tuning: causal-LM loss on the response tokens of prompt/response pairs."""

    pretrain: str = field(default="", metadata={"help": "model to start from: a stage output URI, a local folder or a hub id"})
    dataset: str = field(default="", metadata={"help": "a stage output URI (its 'sft' split) or a JSONL/Parquet/CSV file"})
    dataset_split: str = field(default="sft", metadata={"help": "which split of a stage output's datasets to train on"})
    input_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    output_key: str = field(default="response", metadata={"help": "dataset column holding the response"})
    max_steps: int = field(default=500, metadata={"help": "optimizer steps", "min": 1, "max": 1_000_000})
    train_batch_size: int = field(default=128, metadata={"help": "sequences per optimizer step", "min": 1})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW)", "exclusive_min": 0, "max": 1})
    lr_warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    lr_scheduler: str = field(default="constant", metadata={"help": "after warmup: constant, or cosine down to 0.1 of the peak", "choices": LR_SCHEDULERS})
    max_len: int = field(
        default=512,
        metadata={
            "help": "longest prompt+response in tokens; longer rows lose the start of their prompt (then the end of the response) and are counted",
            "min": 1,
        },
    )
    logging_steps: int = field(default=25, metadata={"help": "log metrics every this many steps", "min": 1})
    packing_samples: bool = field(
        default=False, metadata={"help": "pack each micro-batch's rows into one sequence: no padding, and no token attends across rows"}
    )
    num_nodes: int = field(default=1, metadata={"help": "nodes of the data-parallel worker group", "min": 1})
    num_gpus_per_node: int = field(default=1, metadata={"help": "workers per node, one GPU each (one CPU on a CPU-only cluster)", "min": 1})

    def validate(self) -> None:
        super().validate()
        for name in ("pretrain", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        check_batch(
            "train_batch_size", self.train_batch_size, self.micro_train_batch_size, self.num_nodes * self.num_gpus_per_node, "num_nodes × num_gpus_per_node"
        )
