"""The fields of generating responses and playing episodes, which RL and eval share (the same flags, limits and
defaults in both), so an eval measures the policy as RL sampled it.

    @dataclass
    class EvalConfig(EpisodeConfig, StageConfig): ...
"""

from dataclasses import dataclass, field


@dataclass
class GenerationConfig:
    """How a response is sampled."""

    generate_max_len: int = field(default=16, metadata={"help": "new tokens per response", "min": 1, "max": 65_536})
    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature (RL's rollouts; eval's sampled metrics)", "exclusive_min": 0},
    )


@dataclass
class EpisodeConfig(GenerationConfig):
    """Multi-turn episodes in an environment (tasks.common.nn.environment): the RL stage trains on them, eval scores them."""

    env_path: str = field(
        default="",
        metadata={
            "help": "environment of multi-turn episodes: 'calculator', 'guess', or a .py file (local or s3://) defining class Environment with reset(row) and step(action); in RL its rewards replace the reward model's",
            "aliases": ["agent_func_path"],
        },
    )
    max_turns: int = field(
        default=4, metadata={"help": "model turns per episode at most (with --env_path)", "min": 1, "max": 1000}
    )
    max_episode_tokens: int = field(
        default=64,
        metadata={
            "help": "model and observation tokens per episode after the prompt, at most (with --env_path); each turn is at most generate_max_len",
            "min": 1,
            "max": 1_000_000,
        },
    )
    env_step_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds an environment's reset or step may take before its episode ends with reward 0 (with --env_path)",
            "exclusive_min": 0,
        },
    )


@dataclass
class ImageConfig:
    """A vision-language model's images (issue 54): where the rows hold them, and how many a prompt may carry. RL and
    eval take the same flags as SFT (its --image_key), so every stage reads one column."""

    image_key: str = field(
        default="images",
        metadata={
            "help": "dataset column holding each row's images, for a vision-language model (prepare_data's); a text model ignores it"
        },
    )
    max_images_per_prompt: int = field(
        default=0,
        metadata={
            "help": "images a prompt may carry at most, a vision-language model's vLLM engine sized to it (its limit_mm_per_prompt; OpenRLHF's --data.max_images_per_prompt); 0: the data's most",
            "min": 0,
            "max": 1024,
        },
    )
