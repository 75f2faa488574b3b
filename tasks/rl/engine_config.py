"""Who generates an RL run's rollouts: the engine (vLLM or the transformers engine in the actor workers, or auto:
the one measured faster for the run's shape), vLLM's engines and their settings, and asynchronous training (engines
of their own, rollouts up to --max_staleness updates old). RLConfig takes these fields from here.

    engine, why = cfg.choose_rollout_engine(has_gpus=True, has_vllm=True)   # ("vllm", "auto: responses over 256 …")
    cfg = cfg.with_rollout_engine(engine)                                  # vLLM colocated: one engine per actor rank
    cfg.separate_engines(), cfg.rollout_engines()                          # engines on GPUs of their own, how many
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Self

from tasks.common.config import ConfigError

ROLLOUT_ENGINES = ("auto", "vllm", "transformers")
#: --rollout_engine auto picks transformers up to this many new tokens a response: at the Qwen2.5-1.5B shape, 64
#: responses of exactly 256 tokens (EOS ignored), on one H100 (2026-12-06) it stepped in 1.254 s against vLLM's 1.679 s; at 2,048 tokens vLLM generated 5.6× faster (bench/RESULTS.md).
HF_ENGINE_MAX_TOKENS = 256


@dataclass
class RolloutEngineConfig:
    rollout_engine: str = field(
        default="auto",
        metadata={
            "help": "who generates the rollouts: vllm, transformers (in the actor workers), or auto: the one measured faster for the run's shape (RLConfig.choose_rollout_engine, bench/RESULTS.md): vLLM on a GPU cluster with the vllm package for responses over 256 tokens, else transformers",
            "choices": ROLLOUT_ENGINES,
        },
    )
    vllm_num_engines: int = field(
        default=0,
        metadata={
            "help": "vLLM rollout engines (GPU only); 0 with the vllm engine: one per actor GPU, inside the actor workers (--colocate_all_models)"
        },
    )
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM engine"})
    vllm_gpu_memory_utilization: float = field(
        default=0.4,
        metadata={"help": "fraction of its GPU's memory a vLLM engine may take; the rest is the colocated trainer's"},
    )
    enable_prefix_caching: bool = field(
        default=False, metadata={"help": "vLLM's prefix cache (shared prompt prefixes computed once)"}
    )
    vllm_enable_sleep: bool = field(
        default=False,
        metadata={
            "help": "vLLM gives its weights and KV cache back while the actor trains (sleep level 1), and takes them again for the next rollout"
        },
    )
    async_train: bool = field(
        default=False,
        metadata={
            "help": "rollout engines of their own generate the next rollouts while the actor trains: the vLLM engines on GPUs of their own, or without vLLM one transformers engine on a device of its own; see --max_staleness"
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "with --async_train: rollouts kept generating ahead of the trainer, so a trained sample's weights are at most this many updates old (1: one step off-policy)"
        },
    )
    partial_rollouts: bool = field(
        default=False,
        metadata={
            "help": "with --async_train: an update reaches the episodes already running at their next turn (each token tagged with the weight version that generated it), instead of the rollouts started after it"
        },
    )

    def choose_rollout_engine(self, has_gpus: bool, has_vllm: bool) -> tuple[str, str]:
        """(engine, why) for this run on a cluster with or without GPUs and the vllm package: --rollout_engine, or for
        auto the rule the measurements give. vLLM is chosen only where it needs no GPU the run did not ask for: an
        explicit --vllm_num_engines, or engines inside the actor workers (--colocate_all_models)."""
        if self.rollout_engine != "auto":
            return self.rollout_engine, "--rollout_engine"
        if self.vllm_num_engines:
            return "vllm", "--vllm_num_engines"
        if not has_gpus:
            return "transformers", "the cluster has no GPU"
        if not has_vllm:
            return "transformers", "the vllm package is not installed (the gpu extra)"
        longest = self.longest_response()
        if longest <= HF_ENGINE_MAX_TOKENS:
            return (
                "transformers",
                f"responses of at most {longest} tokens: measured faster up to {HF_ENGINE_MAX_TOKENS}",
            )
        if not self.colocate_all_models:
            return "transformers", "vLLM would need GPUs of its own: set --vllm_num_engines, or --colocate_all_models"
        return "vllm", f"responses of up to {longest} tokens: vLLM measured faster above {HF_ENGINE_MAX_TOKENS}"

    def with_rollout_engine(self, engine: str) -> Self:
        """This config with the chosen engine spelled out: vLLM gets one engine per actor GPU when none was asked for."""
        if engine == "vllm" and not self.vllm_num_engines:
            return dataclasses.replace(self, rollout_engine="vllm", vllm_num_engines=self.group_size("actor"))
        return dataclasses.replace(self, rollout_engine=engine)

    def separate_engines(self) -> bool:
        """Rollout engines on devices of their own (RolloutEngineWorker), rather than inside the actor workers: vLLM
        engines unless colocated, or with --async_train one transformers engine."""
        return (self.vllm_num_engines > 0 and not self.colocate_all_models) or (
            self.async_train and not self.vllm_num_engines
        )

    def rollout_engines(self) -> int:
        """How many RolloutEngineWorkers a run with separate engines places."""
        return self.vllm_num_engines or 1

    def check_engines(self) -> None:
        """The engine flags agree with each other and with the layout (one line each, naming the fix)."""
        if self.rollout_engine == "transformers" and self.vllm_num_engines:
            raise ConfigError(
                f"rollout_engine: transformers generates in the actor workers, yet --vllm_num_engines is {self.vllm_num_engines}; drop one of them"
            )
        if self.vllm_num_engines:
            if self.vllm_tensor_parallel_size != 1:
                raise ConfigError("vllm_tensor_parallel_size: engines of one GPU each only, so far; use 1")
            # Colocated, the engines live inside the actor workers, one per rank, on its GPU.
            if self.colocate_all_models and self.vllm_num_engines != self.group_size("actor"):
                raise ConfigError(
                    f"vllm_num_engines: with --colocate_all_models each actor worker hosts one vLLM engine on its "
                    f"GPU; use --vllm_num_engines {self.group_size('actor')} (the actor's size)"
                )
            if self.async_train and self.colocate_all_models:
                raise ConfigError(
                    "async_train: needs vLLM engines on GPUs of their own; drop --colocate_all_models, or drop --async_train"
                )
            if self.lora_rank > 512:
                raise ConfigError(
                    f"lora_rank: vLLM's LoRA layers hold ranks up to 512, got {self.lora_rank}; use 512 or less, or --vllm_num_engines 0"
                )
            if not 0 < self.vllm_gpu_memory_utilization < 1:
                raise ConfigError(
                    f"vllm_gpu_memory_utilization: {self.vllm_gpu_memory_utilization} leaves the colocated trainer no memory; use a fraction such as 0.3"
                )
        else:
            for name, default in (
                ("vllm_tensor_parallel_size", 1),
                ("vllm_gpu_memory_utilization", 0.4),
                ("enable_prefix_caching", False),
                ("vllm_enable_sleep", False),
            ):
                if getattr(self, name) != default:
                    raise ConfigError(f"{name}: only applies to vLLM engines; set --vllm_num_engines too, or drop it")
        # The transformers engine of --async_train without vLLM loads full weights; vLLM engines take adapters.
        if self.async_train and (
            self.dynamic_filtering or (self.lora_rank and not self.vllm_num_engines) or self.max_staleness < 1
        ):
            raise ConfigError(
                "async_train: needs a fixed rollout, --max_staleness of 1 or more, and vLLM engines with LoRA; "
                "drop --dynamic_filtering, set --vllm_num_engines with --lora_rank, or drop --async_train"
            )
