from dataclasses import dataclass, field

from tasks.common.config import LR_SCHEDULERS, ConfigError, TrainingConfig, check_batch

METHODS = ("dpo", "kto")
DPO_LOSS_TYPES = ("sigmoid", "ipo")  # tasks.common.nn.losses.dpo_loss


@dataclass
class PreferenceConfig(TrainingConfig):
    """Direct preference optimisation of an SFT policy against its frozen copy: DPO (sigmoid), IPO,
    conservative DPO (label smoothing) on chosen/rejected pairs, or KTO on unpaired thumbs-up/down data.
    Flag names follow OpenRLHF's train_dpo / train_kto."""

    method: str = field(default="dpo", metadata={"help": "dpo (pairs: chosen/rejected) or kto (one completion with a desirable label)", "choices": METHODS})
    pretrain: str = field(default="", metadata={"help": "policy to start from (the SFT output URI); also the frozen reference"})
    ref_pretrain: str = field(default="", metadata={"help": "reference model; default: --pretrain"})
    dataset: str = field(default="", metadata={"help": "a stage output URI or a JSONL/Parquet/CSV file"})
    dataset_split: str = field(default="", metadata={"help": "split of a stage output's datasets; default: preference (dpo) or unpaired (kto)"})
    prompt_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    chosen_key: str = field(default="chosen", metadata={"help": "dpo: column holding the preferred response"})
    rejected_key: str = field(default="rejected", metadata={"help": "dpo: column holding the other response"})
    completion_key: str = field(default="completion", metadata={"help": "kto: column holding the response"})
    label_key: str = field(default="label", metadata={"help": "kto: column holding true (desirable) or false"})
    beta: float = field(default=0.1, metadata={"help": "strength of the implicit KL constraint to the reference", "exclusive_min": 0, "max": 100})
    loss_type: str = field(default="sigmoid", metadata={"help": "dpo: sigmoid (DPO) or ipo", "choices": DPO_LOSS_TYPES})
    label_smoothing: float = field(default=0.0, metadata={"help": "dpo: assumed label noise ε of conservative DPO, in [0, 0.5)"})
    nll_loss_coef: float = field(
        default=0.0,
        metadata={"help": "dpo: add this times the chosen responses' NLL (token mean) to the loss, which keeps their likelihood from sliding (RPO)", "min": 0},
    )
    reference_free: bool = field(default=False, metadata={"help": "dpo: no reference model (its log-probabilities are taken as 0)"})
    ref_offload: bool = field(
        default=False, metadata={"help": "compute the reference log-probabilities of the whole dataset once, then free the reference model"}
    )
    desirable_weight: float = field(default=1.0, metadata={"help": "kto: weight of desirable examples' loss", "exclusive_min": 0})
    undesirable_weight: float = field(default=1.0, metadata={"help": "kto: weight of undesirable examples' loss", "exclusive_min": 0})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps", "min": 1, "max": 1_000_000})
    train_batch_size: int = field(default=64, metadata={"help": "pairs (dpo) or examples (kto) per optimizer step", "min": 1})
    learning_rate: float = field(default=5e-5, metadata={"help": "peak learning rate (AdamW)", "exclusive_min": 0, "max": 1})
    lr_warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps"})
    lr_scheduler: str = field(default="constant", metadata={"help": "after warmup: constant, or cosine down to 0.1 of the peak", "choices": LR_SCHEDULERS})
    max_len: int = field(
        default=512,
        metadata={
            "help": "longest prompt+response in tokens; longer ones lose the start of their prompt (then the end of the response) and are counted",
            "min": 1,
        },
    )
    logging_steps: int = field(default=10, metadata={"help": "log metrics every this many steps", "min": 1})
    num_nodes: int = field(default=1, metadata={"help": "nodes of the data-parallel worker group", "min": 1})
    num_gpus_per_node: int = field(default=1, metadata={"help": "workers per node, one GPU each (one CPU on a CPU-only cluster)", "min": 1})

    @property
    def split(self) -> str:
        return self.dataset_split or ("preference" if self.method == "dpo" else "unpaired")

    def validate(self) -> None:
        super().validate()
        for name in ("pretrain", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        if self.method == "kto" and (self.loss_type != "sigmoid" or self.label_smoothing or self.reference_free or self.nll_loss_coef):
            raise ConfigError("loss_type: loss_type, label_smoothing, reference_free and nll_loss_coef are DPO's; drop them with --method kto")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("label_smoothing: conservative DPO smooths the sigmoid loss; use 0 with --loss_type ipo")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing: {self.label_smoothing} must be in [0, 0.5)")
        if self.reference_free and self.ref_offload:
            raise ConfigError("ref_offload: there is no reference to offload with --reference_free; drop one of them")
        check_batch(
            "train_batch_size", self.train_batch_size, self.micro_train_batch_size, self.num_nodes * self.num_gpus_per_node, "num_nodes × num_gpus_per_node"
        )
