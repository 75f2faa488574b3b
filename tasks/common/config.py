"""The fields every stage's config shares, in three layers: every stage, every training stage, every stage that
trains one model in one worker group.

    @dataclass
    class SFTConfig(SingleGroupTrainingConfig):
        learning_rate: float = restate(SingleGroupTrainingConfig, "learning_rate", 1e-3)   # its limits kept
        input_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})

    cfg = parse_config(SFTConfig, ["--config", "sft.yaml", "--learning_rate", "5e-4"])

Every construction validates (`__post_init__` runs `validate()`): first each field's declared limits
(tasks.common.config_limits), then the checks that span fields, so a bad value raises ConfigError with one
line naming the field and the fix before any work starts. Filling a config from YAML and flags is
tasks.common.config_flags; its names (parse_config, make_config, split_list) and the limits' (ConfigError,
param_schema) are importable from here too. This module imports neither torch nor airflow: the DAG side
may use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tasks.common.config_flags import make_config, parse_config, split_list
from tasks.common.config_limits import SCHEMA_KEYWORDS, ConfigError, check_declared, field_type, param_schema

# The config layer's names, its parts' included: callers write `from tasks.common.config import ConfigError`.
__all__ = [
    "LR_SCHEDULERS",
    "SCHEMA_KEYWORDS",
    "ConfigError",
    "SingleGroupTrainingConfig",
    "StageConfig",
    "TrainingConfig",
    "check_batch",
    "check_declared",
    "field_type",
    "make_config",
    "micro_batches",
    "param_schema",
    "parse_config",
    "restate",
    "split_list",
]

LR_SCHEDULERS = ("constant", "cosine")  # what tasks.common.nn.strategy.lr_multiplier implements


@dataclass
class StageConfig:
    """Fields every stage shares."""

    output: str = field(
        default="", metadata={"help": "URI (s3://… or a local folder) the stage writes its output and manifest.json to"}
    )
    run_id: str = field(
        default="local", metadata={"help": "pipeline run this output belongs to (recorded in the manifest)"}
    )
    seed: int = field(
        default=0,
        metadata={"help": "random seed for data order, initialisation and sampling", "min": 0, "max": 2**31 - 1},
    )
    zero_stage: int = field(
        default=2,
        metadata={
            "help": "DeepSpeed ZeRO stage: 0 (off), 1 (optimizer state sharded), 2 (also gradients) or 3 (also parameters)",
            "choices": (0, 1, 2, 3),
        },
    )
    bf16: bool = field(default=False, metadata={"help": "train in bfloat16 (GPU); fp32 otherwise"})
    use_wandb: bool = field(default=False, metadata={"help": "log metrics to wandb as well (WANDB_MODE=offline works)"})
    wandb_project: str = field(default="rlhf-flow", metadata={"help": "wandb project name"})

    def __post_init__(self) -> None:
        # Every construction is checked: make_config's, dataclasses.replace's, a caller's own.
        self.validate()

    def validate(self) -> None:
        """Refuse values no stage can use: first every field's declared limits (its metadata), then the
        checks that span fields. Subclasses extend this and call super(); __post_init__ runs it."""
        for f in dataclasses.fields(self):
            check_declared(f, getattr(self, f.name))
        if not self.output:
            raise ConfigError("output: missing; pass --output s3://bucket/prefix/… or a local folder")

    def devices_needed(self) -> int:
        """Devices (GPUs, or CPUs on a CPU-only cluster) the stage's worker group holds at once: one per worker
        (num_nodes × num_gpus_per_node, where the stage has them); RL counts its groups (tasks.rl.config)."""
        return getattr(self, "num_nodes", 1) * getattr(self, "num_gpus_per_node", 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainingConfig(StageConfig):
    """Fields every training stage shares (SFT, reward model, RL), named as in OpenRLHF."""

    micro_train_batch_size: int = field(
        default=0,
        metadata={
            "help": "sequences per forward/backward on one worker; the rest of train_batch_size is gradient accumulation (0: the worker's whole share at once)",
            "min": 0,
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "recompute activations in backward: less memory, more compute"}
    )
    adam_offload: bool = field(
        default=False, metadata={"help": "keep Adam's state on the CPU (DeepSpeedCPUAdam; JIT-builds its op once)"}
    )
    flash_attn: bool = field(
        default=False,
        metadata={
            "help": "FlashAttention-2 kernels; PyTorch's SDPA kernels (logged) when the flash-attn package or a GPU is missing"
        },
    )
    torch_compile: bool = field(
        default=False,
        metadata={
            "help": "compile each transformer block with torch.compile: its norms, rotary and MLP elementwise ops fuse (GPU speed; the first steps pay the compile; not with ZeRO-3); RL's hf engine (--vllm_num_engines 0) compiles its decode forward too, on CUDA"
        },
    )
    use_liger_kernel: bool = field(
        default=True,
        metadata={
            "help": "Liger's Triton kernels (RMSNorm, SwiGLU, RoPE) and log-probs taken from the last hidden states a chunk of tokens at a time, never the full logits; on CUDA with liger-kernel (the gpu extra), eager kernels on CPU; --torch_compile takes its place"
        },
    )
    max_samples: int = field(
        default=0, metadata={"help": "use only the first this many rows of the training data (0: all)", "min": 0}
    )
    apply_chat_template: bool = field(
        default=False, metadata={"help": "wrap each prompt in the tokenizer's chat template as a user turn"}
    )
    save_steps: int = field(
        default=0, metadata={"help": "write a resumable checkpoint every this many steps (0: never)", "min": 0}
    )
    num_checkpoints: int = field(
        default=0,
        metadata={
            "help": "write this many resumable checkpoints, evenly spaced over the steps the stage runs (wins over --save_steps; 0: every --save_steps)",
            "min": 0,
            "max": 1000,
        },
    )
    ckpt_path: str = field(
        default="",
        metadata={"help": "where checkpoints go (default <output>/checkpoints); each step_<n>/ has its own manifest"},
    )
    load_checkpoint: bool = field(
        default=True, metadata={"help": "resume from the newest complete checkpoint under ckpt_path when one exists"}
    )
    max_ckpt_num: int = field(default=3, metadata={"help": "keep this many newest checkpoints (0: all)", "min": 0})
    fail_after_step: int = field(
        default=0,
        metadata={
            "help": "testing only: fail right after committing this step's checkpoint, unless the run resumed at or past it (fault injection for rerun tests)",
            "min": 0,
        },
    )
    save_path: str = field(
        default="",
        metadata={
            "help": "also write the final HF model here (a folder or s3:// URI); the stage output stays --output"
        },
    )
    # LoRA (tasks.common.nn.lora): low-rank adapters through peft; the base weights stay frozen.
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "LoRA rank: train low-rank adapters (peft) instead of every weight; 0 trains the full model",
            "min": 0,
            "max": 1024,
            "fix": "use 0 (full fine-tuning) or a rank such as 8",
        },
    )
    lora_alpha: int = field(
        default=16, metadata={"help": "LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_rank"}
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the adapters' input, in [0, 1)"})
    target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "modules LoRA adapts: all-linear (every linear layer but the output head) or comma-separated names such as q_proj,v_proj"
        },
    )
    merge_lora: bool = field(
        default=False,
        metadata={
            "help": "with LoRA, export model/ as the merged full checkpoint; otherwise the adapter alone, with the base's URI in the manifest (loading it merges)"
        },
    )

    def checkpoint_interval(self, steps: int) -> int:
        """Steps between resumable checkpoints in a run of `steps` steps (0: none)."""
        return -(-steps // self.num_checkpoints) if self.num_checkpoints else self.save_steps

    def check_fault_step(self, steps: int) -> None:
        """--fail_after_step must name a checkpoint step of a run of `steps` steps."""
        every = self.checkpoint_interval(steps)
        if self.fail_after_step and (not every or self.fail_after_step % every):
            how = (
                f"--num_checkpoints {self.num_checkpoints} over {steps} steps"
                if self.num_checkpoints
                else "--save_steps"
            )
            raise ConfigError(
                f"fail_after_step: {self.fail_after_step} is not a checkpoint step; use a multiple of {every} ({how})"
            )

    def validate(self) -> None:
        super().validate()
        self.check_fault_step(
            getattr(self, "max_steps", 0)
        )  # RL's num_episodes runs are checked again once their steps are known
        if self.torch_compile and self.zero_stage == 3:
            raise ConfigError(
                "torch_compile: ZeRO-3 gathers each block's weights through hooks a compiled block does not run; use --zero_stage 2 or drop --torch_compile"
            )
        self.validate_lora()

    def validate_lora(self) -> None:
        if not self.lora_rank:
            if self.merge_lora:
                raise ConfigError("merge_lora: only applies to LoRA training; set --lora_rank too, or drop it")
            return
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha: must be positive, got {self.lora_alpha}; use e.g. 16 (or 2 × lora_rank)")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        names = [n.strip() for n in self.target_modules.split(",")]
        if not all(names) or ("all-linear" in names and len(names) > 1):
            raise ConfigError(
                f"target_modules: {self.target_modules!r} is not a module list; use all-linear or comma-separated names such as q_proj,v_proj"
            )


@dataclass
class SingleGroupTrainingConfig(TrainingConfig):
    """A stage that trains one model in one data-parallel worker group on rows of a dataset: SFT, the reward model,
    DPO/KTO. A stage restates a field only for its own default or help (`restate`)."""

    pretrain: str = field(
        default="", metadata={"help": "model to start from: a stage output URI, a local folder or a hub id"}
    )
    dataset: str = field(default="", metadata={"help": "a stage output URI or a JSONL/Parquet/CSV file"})
    dataset_split: str = field(default="", metadata={"help": "which split of a stage output's datasets to train on"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps", "min": 1, "max": 1_000_000})
    train_batch_size: int = field(default=128, metadata={"help": "rows per optimizer step", "min": 1})
    learning_rate: float = field(
        default=1e-4, metadata={"help": "peak learning rate (AdamW)", "exclusive_min": 0, "max": 1}
    )
    lr_warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps"})
    lr_scheduler: str = field(
        default="constant",
        metadata={"help": "after warmup: constant, or cosine down to 0.1 of the peak", "choices": LR_SCHEDULERS},
    )
    max_len: int = field(
        default=512,
        metadata={
            "help": "longest prompt+response in tokens; longer rows lose the start of their prompt (then the end of the response) and are counted",
            "min": 1,
        },
    )
    logging_steps: int = field(default=25, metadata={"help": "log metrics every this many steps", "min": 1})
    num_nodes: int = field(default=1, metadata={"help": "nodes of the data-parallel worker group", "min": 1})
    num_gpus_per_node: int = field(
        default=1, metadata={"help": "workers per node, one GPU each (one CPU on a CPU-only cluster)", "min": 1}
    )

    def validate(self) -> None:
        super().validate()
        for name in ("pretrain", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        check_batch(
            "train_batch_size",
            self.train_batch_size,
            self.micro_train_batch_size,
            self.num_nodes * self.num_gpus_per_node,
            "num_nodes × num_gpus_per_node",
        )


def restate(base: type, name: str, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
    """`base`'s field `name` with another default and/or help, its limits kept: what a stage's config declares to
    change a shared field (e.g. `max_steps: int = restate(SingleGroupTrainingConfig, "max_steps", 500)`)."""
    f = next(f for f in dataclasses.fields(base) if f.name == name)
    metadata = {**f.metadata, **({"help": help} if help else {})}
    return field(default=f.default if default is dataclasses.MISSING else default, metadata=metadata)


def check_batch(name: str, batch: int, micro: int, world: int, world_flag: str) -> None:
    """Refuse a global batch that `world` workers cannot split evenly into micro-batches of `micro`."""
    if batch % world:
        raise ConfigError(
            f"{name}: {batch} does not split over {world} workers ({world_flag}); use a multiple of {world}"
        )
    if micro and (batch // world) % micro:
        raise ConfigError(
            f"micro_train_batch_size: {micro} must divide each worker's share of {name}, {batch // world}"
        )


def micro_batches(batch: int, micro: int, world: int) -> tuple[int, int]:
    """(sequences per forward/backward, accumulation steps) for one worker's share of `batch`."""
    share = batch // world
    micro = micro or share
    return micro, share // micro
