"""One config system for every stage: a dataclass, filled from a YAML file, then from flags.

    @dataclass
    class SFTConfig(StageConfig):
        learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate"})

    cfg = parse_config(SFTConfig, ["--config", "sft.yaml", "--learning_rate", "5e-4"])

Every dataclass field is a flag of the same name (`--learning_rate 5e-4`; a bool also takes the
bare form `--bf16`), and a key of the YAML file. Unknown keys, wrong types and values that
`validate()` refuses raise ConfigError with one line naming the field and the fix, before any
work starts. This module imports neither torch nor airflow: the DAG side may use it.

A field's metadata is the one place its limits are written: `min`, `max`, `exclusive_min` and
`exclusive_max` (bounds the value must be strictly inside), `choices`, `max_length`, `pattern` (a regex
the value must contain a match of, as JSON schema's), and `fix` (advice added to a refusal). `validate()`
enforces them before the stage's own cross-field checks, and `param_schema` turns them into the JSON
schema of the run form's Param (plugins/form.py), so the form refuses what the stage would.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LR_SCHEDULERS = ("constant", "cosine")  # what tasks.common.nn.strategy.lr_multiplier implements


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the field and the fix."""


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


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_declared(f: dataclasses.Field, value: Any) -> None:
    """Refuse `value` for field `f` when it breaks a limit the field's metadata declares (one line)."""
    meta, name = f.metadata, f.name
    fix = f"; {meta['fix']}" if "fix" in meta else ""
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        choices = [str(c) for c in meta["choices"]]
        raise ConfigError(f"{name}: {value!r} is not a choice; use {', '.join(choices[:-1])} or {choices[-1]}{fix}")
    if "min" in meta and value < meta["min"]:
        bound = "must not be negative" if meta["min"] == 0 else f"must be at least {_number(meta['min'])}"
        raise ConfigError(f"{name}: {bound}, got {value}{fix}")
    if "exclusive_min" in meta and not value > meta["exclusive_min"]:
        bound = "must be positive" if meta["exclusive_min"] == 0 else f"must be above {_number(meta['exclusive_min'])}"
        raise ConfigError(f"{name}: {bound}, got {value}{fix}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{name}: must be at most {_number(meta['max'])}, got {value}{fix}")
    if "exclusive_max" in meta and not value < meta["exclusive_max"]:
        raise ConfigError(f"{name}: must be below {_number(meta['exclusive_max'])}, got {value}{fix}")
    if "max_length" in meta and len(value) > meta["max_length"]:
        raise ConfigError(f"{name}: {len(value)} characters, more than {meta['max_length']}{fix}")
    if "pattern" in meta and not re.search(meta["pattern"], value):
        raise ConfigError(f"{name}: {value!r} is not of the form {meta['pattern']}{fix}")


#: JSON schema's keyword for each limit a field's metadata may declare.
SCHEMA_KEYWORDS = {
    "min": "minimum",
    "max": "maximum",
    "exclusive_min": "exclusiveMinimum",
    "exclusive_max": "exclusiveMaximum",
    "choices": "enum",
    "max_length": "maxLength",
    "pattern": "pattern",
}


def param_schema(cls: type, name: str) -> dict[str, Any]:
    """Field `name` of config class `cls` as a JSON schema (what an Airflow Param takes): its default, type,
    declared limits and its help as the description. A string that may be empty also takes null, which the
    UI's form sends for an emptied field (the DAG renders it as '')."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    kind = _field_type(cls, f)
    json_type: Any = {bool: "boolean", int: "integer", float: "number", str: "string"}[kind]
    if kind is str and "choices" not in f.metadata and re.search(f.metadata.get("pattern", ""), ""):
        json_type = ["null", "string"]
    schema = {"default": f.default, "type": json_type, "description": f.metadata.get("help", "")}
    for key, keyword in SCHEMA_KEYWORDS.items():
        if key in f.metadata:
            schema[keyword] = list(f.metadata[key]) if key == "choices" else f.metadata[key]
    return schema


def split_list(value: str) -> list[str]:
    """The parts of a comma-separated flag value (several reward models, endpoints or input URIs)."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


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


def _field_type(cls: type, f: dataclasses.Field) -> type:
    """The concrete type of a field: int, float, str or bool (Optional[X] gives X)."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _convert(name: str, kind: type, value: Any) -> Any:
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: {value!r} is not a boolean; use true or false")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {kind.__name__}") from None


def parse_config(cls: type, argv: list[str] | None = None, prog: str | None = None):
    """Build `cls` from `--config file.yaml` (optional) and `--field value` flags; validate it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip(), allow_abbrev=False)
    parser.add_argument("--config", help="YAML file of field: value pairs; flags override it")
    for name, f in fields.items():
        kind = _field_type(cls, f)
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help: "95%" would crash --help
        names = [f"--{name}"] + [
            f"--{alias}" for alias in f.metadata.get("aliases", ())
        ]  # a peer's flag name for the same thing
        if kind is bool:
            parser.add_argument(
                *names, dest=name, nargs="?", const="true", default=None, metavar="BOOL", help=help_text
            )
        else:
            parser.add_argument(*names, dest=name, default=None, metavar=kind.__name__.upper(), help=help_text)
    # argparse's own errors are already one line; exit code 2 like every usage error.
    args = parser.parse_args(argv)

    values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config: file {args.config} not found; pass an existing YAML file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {args.config} must hold a mapping of field: value")
        unknown = sorted(set(loaded) - set(fields))
        if unknown:
            raise ConfigError(
                f"config: unknown field {unknown[0]!r} in {args.config}; known fields: {', '.join(fields)}"
            )
        values.update(loaded)
    for name in fields:
        flag = getattr(args, name)
        if flag is not None:
            values[name] = flag
    return make_config(cls, values)


def make_config(cls: type, values: dict[str, Any]):
    """Build `cls` from a mapping, each value converted to its field's type (used by tests and in-process callers
    too); constructing it validates it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field for {cls.__name__}; known fields: {', '.join(fields)}")
    converted = {name: _convert(name, _field_type(cls, fields[name]), v) for name, v in values.items()}
    return cls(**converted)
