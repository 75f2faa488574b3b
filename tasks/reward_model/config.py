from dataclasses import dataclass, field

from tasks.common.config import SingleGroupTrainingConfig as Base
from tasks.common.config import restate


@dataclass
class RewardModelConfig(Base):
    """Pairwise (Bradley-Terry) reward model: a scalar head on the SFT model, trained on chosen/rejected pairs."""

    pretrain: str = restate(
        Base, "pretrain", help="model to start from (the SFT output URI); the scalar head starts fresh"
    )
    dataset: str = restate(Base, "dataset", help="preference pairs: a stage output URI or a JSONL/Parquet/CSV file")
    dataset_split: str = restate(Base, "dataset_split", "preference")
    eval_split: str = field(
        default="preference_eval", metadata={"help": "held-out pairs for pairwise accuracy and reward statistics"}
    )
    prompt_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    chosen_key: str = field(default="chosen", metadata={"help": "dataset column holding the preferred response"})
    rejected_key: str = field(default="rejected", metadata={"help": "dataset column holding the other response"})
    max_steps: int = restate(Base, "max_steps", 300)
    train_batch_size: int = restate(Base, "train_batch_size", help="pairs per optimizer step")
    learning_rate: float = restate(Base, "learning_rate", 3e-4)
    lr_warmup_steps: int = restate(Base, "lr_warmup_steps", 50)
    image_key: str = field(
        default="images",
        metadata={
            "help": "dataset column holding each pair's prompt images, for a vision-language model (prepare_data's)"
        },
    )
    freeze_visual_encoder: bool = field(
        default=False,
        metadata={
            "help": "a vision-language model trains its language model and value head only: the vision tower and its projector stay as they are"
        },
    )
    packing_samples: bool = field(
        default=False,
        metadata={
            "help": "pack each micro-batch's sequences into one: no padding, and no token attends across sequences"
        },
    )
