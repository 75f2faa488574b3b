from dataclasses import dataclass, field

from tasks.common.config import SingleGroupTrainingConfig as Base
from tasks.common.config import restate


@dataclass
class SFTConfig(Base):
    """Supervised fine-tuning: causal-LM loss on the response tokens of prompt/response pairs."""

    dataset: str = restate(Base, "dataset", help="a stage output URI (its 'sft' split) or a JSONL/Parquet/CSV file")
    dataset_split: str = restate(Base, "dataset_split", "sft")
    input_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    output_key: str = field(default="response", metadata={"help": "dataset column holding the response"})
    max_steps: int = restate(Base, "max_steps", 500)
    train_batch_size: int = restate(Base, "train_batch_size", help="sequences per optimizer step")
    learning_rate: float = restate(Base, "learning_rate", 1e-3)
    lr_warmup_steps: int = restate(Base, "lr_warmup_steps", 20)
    image_key: str = field(
        default="images",
        metadata={"help": "dataset column holding each row's images, for a vision-language model (prepare_data's)"},
    )
    freeze_visual_encoder: bool = field(
        default=False,
        metadata={
            "help": "a vision-language model trains its language model only: the vision tower and its projector stay as they are"
        },
    )
    packing_samples: bool = field(
        default=False,
        metadata={
            "help": "pack each micro-batch's rows into one sequence: no padding, and no token attends across rows"
        },
    )
