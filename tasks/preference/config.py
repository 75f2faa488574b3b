from dataclasses import dataclass, field

from tasks.common.config import ConfigError, restate
from tasks.common.config import SingleGroupTrainingConfig as Base

METHODS = ("dpo", "kto")
DPO_LOSS_TYPES = ("sigmoid", "ipo")  # tasks.preference.losses.dpo_loss


@dataclass
class PreferenceConfig(Base):
    """Direct preference optimisation of an SFT policy against its frozen copy: DPO (sigmoid), IPO,
    conservative DPO (label smoothing) on chosen/rejected pairs, or KTO on unpaired thumbs-up/down data.
    Flag names follow OpenRLHF's train_dpo / train_kto."""

    method: str = field(
        default="dpo",
        metadata={
            "help": "dpo (pairs: chosen/rejected) or kto (one completion with a desirable label)",
            "choices": METHODS,
        },
    )
    pretrain: str = restate(
        Base, "pretrain", help="policy to start from (the SFT output URI); also the frozen reference"
    )
    ref_pretrain: str = field(default="", metadata={"help": "reference model; default: --pretrain"})
    dataset_split: str = restate(
        Base, "dataset_split", help="split of a stage output's datasets; default: preference (dpo) or unpaired (kto)"
    )
    prompt_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    chosen_key: str = field(default="chosen", metadata={"help": "dpo: column holding the preferred response"})
    rejected_key: str = field(default="rejected", metadata={"help": "dpo: column holding the other response"})
    completion_key: str = field(default="completion", metadata={"help": "kto: column holding the response"})
    label_key: str = field(default="label", metadata={"help": "kto: column holding true (desirable) or false"})
    image_key: str = field(
        default="images",
        metadata={"help": "dataset column holding each prompt's images, for a vision-language model (prepare_data's)"},
    )
    freeze_visual_encoder: bool = field(
        default=False,
        metadata={
            "help": "a vision-language model trains its language model only: the vision tower and its projector stay as they are"
        },
    )
    beta: float = field(
        default=0.1,
        metadata={"help": "strength of the implicit KL constraint to the reference", "exclusive_min": 0, "max": 100},
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "dpo: sigmoid (DPO) or ipo", "choices": DPO_LOSS_TYPES})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "dpo: assumed label noise ε of conservative DPO, in [0, 0.5)"}
    )
    nll_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "dpo: add this times the chosen responses' NLL (token mean) to the loss, which keeps their likelihood from sliding (RPO)",
            "min": 0,
        },
    )
    reference_free: bool = field(
        default=False, metadata={"help": "dpo: no reference model (its log-probabilities are taken as 0)"}
    )
    ref_offload: bool = field(
        default=False,
        metadata={
            "help": "compute the reference log-probabilities of the whole dataset once, then free the reference model"
        },
    )
    desirable_weight: float = field(
        default=1.0, metadata={"help": "kto: weight of desirable examples' loss", "exclusive_min": 0}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "kto: weight of undesirable examples' loss", "exclusive_min": 0}
    )
    train_batch_size: int = restate(
        Base, "train_batch_size", 64, help="pairs (dpo) or examples (kto) per optimizer step"
    )
    learning_rate: float = restate(Base, "learning_rate", 5e-5)
    logging_steps: int = restate(Base, "logging_steps", 10)

    @property
    def split(self) -> str:
        return self.dataset_split or ("preference" if self.method == "dpo" else "unpaired")

    def validate(self) -> None:
        super().validate()
        if self.method == "kto" and (
            self.loss_type != "sigmoid" or self.label_smoothing or self.reference_free or self.nll_loss_coef
        ):
            raise ConfigError(
                "loss_type: loss_type, label_smoothing, reference_free and nll_loss_coef are DPO's; drop them with --method kto"
            )
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("label_smoothing: conservative DPO smooths the sigmoid loss; use 0 with --loss_type ipo")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing: {self.label_smoothing} must be in [0, 0.5)")
        if self.reference_free and self.ref_offload:
            raise ConfigError("ref_offload: there is no reference to offload with --reference_free; drop one of them")
