from dataclasses import dataclass, field

from tasks.common.allowlist import check_reach
from tasks.common.config import ConfigError, TrainingConfig, check_batch
from tasks.common.generation import EpisodeConfig, ImageConfig
from tasks.rl.engine_config import HF_ENGINE_MAX_TOKENS, ROLLOUT_ENGINES, RolloutEngineConfig  # noqa: F401
from tasks.rl.layout_config import WorkerLayoutConfig

#: By default responses over this many tokens train in micro-batches by token budget (RLConfig.token_budget); at
#: and below it rows by count, as the demo and the 256-token bench were measured. Its own bound, not the engine's.
TOKEN_BUDGET_ABOVE_TOKENS = 256
IS_CORRECTIONS = ("tis", "mis", "reject", "none")  # tasks.common.nn.losses.importance_weights

ADVANTAGE_ESTIMATORS = (
    "gae",
    "reinforce",
    "reinforce_baseline",
    "rloo",
    "group_norm",
    "dr_grpo",
)  # tasks.rl.advantages
GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def uses_critic(estimator: str) -> bool:
    """Whether the estimator needs a value model: only gae; the others are critic-free."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator: unknown {estimator!r}; use {', '.join(ADVANTAGE_ESTIMATORS)}")
    return estimator == "gae"


@dataclass
class RLConfig(ImageConfig, EpisodeConfig, RolloutEngineConfig, WorkerLayoutConfig, TrainingConfig):
    """PPO-family RL: rollouts from the policy, rewards from reward models, a function or an endpoint,
    KL to the frozen reference; advantages by GAE with a critic or by a critic-free estimator.

    Flag names follow OpenRLHF's (--pretrain, --reward_pretrain, --actor_learning_rate, --init_kl_coef …).
    """

    pretrain: str = field(
        default="", metadata={"help": "policy to start from (SFT output URI); also the frozen reference"}
    )
    reward_pretrain: str = field(
        default="",
        metadata={
            "help": "reward model URI, or several comma-separated (scores summed); the critic starts from the first"
        },
    )
    remote_rm_url: str = field(
        default="",
        metadata={
            "help": "reward function file (.py defining reward_func(queries, prompts, labels)) or an http(s):// reward endpoint; wins over --reward_pretrain"
        },
    )
    critic_pretrain: str = field(
        default="", metadata={"help": "critic to start from; default: the first reward model, else the policy"}
    )
    prompt_data: str = field(
        default="", metadata={"help": "prompts: a stage output URI (its 'prompts' split) or a file"}
    )
    prompt_split: str = field(
        default="prompts", metadata={"help": "split of a stage output's datasets holding the prompts"}
    )
    input_key: str = field(default="prompt", metadata={"help": "dataset column holding the prompt"})
    label_key: str = field(
        default="", metadata={"help": "dataset column passed to a reward function or endpoint as labels"}
    )
    pretrain_data: str = field(
        default="",
        metadata={
            "help": "PPO-ptx (InstructGPT): supervised data whose likelihood the actor keeps while RL trains, a stage output URI (its pretrain_split) or a file; needs --ptx_coef"
        },
    )
    pretrain_split: str = field(
        default="sft", metadata={"help": "split of a stage output's datasets holding the PPO-ptx data"}
    )
    output_key: str = field(
        default="response", metadata={"help": "PPO-ptx data column holding the response (the prompt is input_key)"}
    )
    freeze_visual_encoder: bool = field(
        default=False,
        metadata={
            "help": "a vision-language policy trains its language model only: the vision tower and its projector stay as they are, and only the trained weights are synced to the rollout engines"
        },
    )
    ptx_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the PPO-ptx loss (the response tokens' mean NLL on --pretrain_data) beside the policy loss; 0 = off",
            "min": 0,
            "max": 100,
        },
    )
    max_steps: int = field(default=40, metadata={"help": "rollout + update iterations", "min": 1, "max": 1_000_000})
    rollout_batch_size: int = field(default=128, metadata={"help": "prompts per rollout", "min": 1})
    n_samples_per_prompt: int = field(
        default=1,
        metadata={"help": "responses sampled per prompt (a group, for the group estimators)", "min": 1, "max": 1024},
    )
    train_batch_size: int = field(
        default=64, metadata={"help": "sequences per optimizer step (a minibatch of the rollout)", "min": 1}
    )
    max_epochs: int = field(default=2, metadata={"help": "passes over each rollout", "min": 1})
    prompt_max_len: int = field(
        default=256,
        metadata={"help": "longest prompt in tokens; longer prompts are cut from the left and counted", "min": 1},
    )
    actor_learning_rate: float = field(
        default=3e-5, metadata={"help": "policy learning rate (AdamW)", "exclusive_min": 0, "max": 1}
    )
    critic_learning_rate: float = field(
        default=1e-4, metadata={"help": "critic learning rate (AdamW)", "exclusive_min": 0, "max": 1}
    )
    lr_warmup_steps: int = field(default=5, metadata={"help": "linear warmup in optimizer steps, then constant"})
    advantage_estimator: str = field(
        default="gae",
        metadata={
            "help": "gae (with a critic), reinforce, reinforce_baseline, rloo, group_norm or dr_grpo",
            "choices": ADVANTAGE_ESTIMATORS,
        },
    )
    gamma: float = field(default=1.0, metadata={"help": "discount factor", "min": 0, "max": 1})
    lambd: float = field(default=0.95, metadata={"help": "GAE λ", "min": 0, "max": 1})
    eps_clip: float = field(default=0.2, metadata={"help": "PPO policy ratio clip ε", "exclusive_min": 0})
    eps_clip_low: float = field(
        default=0.0,
        metadata={"help": "lower ratio clip ε (DAPO's clip-higher uses a larger upper one); 0 = eps_clip", "min": 0},
    )
    eps_clip_high: float = field(default=0.0, metadata={"help": "upper ratio clip ε; 0 = eps_clip", "min": 0})
    dual_clip: float = field(
        default=0.0, metadata={"help": "dual-clip bound c > 1 on the loss of negative advantages; 0 = off"}
    )
    entropy_coef: float = field(
        default=0.0, metadata={"help": "weight of the entropy bonus in the policy loss", "min": 0}
    )
    use_kl_loss: bool = field(
        default=False,
        metadata={
            "help": "put the KL to the reference in the loss (init_kl_coef × KL, estimator kl_estimator) instead of the reward"
        },
    )
    value_clip: float = field(default=0.2, metadata={"help": "critic value clip (relative to the rollout's values)"})
    init_kl_coef: float = field(
        default=0.05, metadata={"help": "β of the KL penalty to the reference, in the reward", "min": 0, "max": 10}
    )
    kl_target: float = field(
        default=0.0,
        metadata={"help": "adaptive KL controller's target (summed KL per response); 0 keeps init_kl_coef fixed"},
    )
    kl_horizon: int = field(default=10000, metadata={"help": "adaptive KL controller's horizon, in samples", "min": 1})
    kl_estimator: str = field(
        default="k1",
        metadata={
            "help": "per-token KL estimator: k1, k2 or k3; each token's estimate is clamped to ±10 (reward and loss)",
            "choices": KL_ESTIMATORS,
        },
    )
    save_value_network: bool = field(
        default=False, metadata={"help": "also save the critic (HF format) under critic/ in the output"}
    )
    normalize_reward: bool = field(
        default=True, metadata={"help": "standardise reward-model scores with the mean/std stored by its stage"}
    )
    logging_steps: int = field(default=1, metadata={"help": "log metrics every this many steps", "min": 1})
    num_episodes: int = field(
        default=0,
        metadata={
            "help": "passes over the prompts; when set, the stage runs num_episodes × ⌊prompts / rollout_batch_size⌋ steps instead of max_steps"
        },
    )
    micro_rollout_batch_size: int = field(
        default=0,
        metadata={"help": "sequences per generate / inference call on one worker (0: its whole share at once)"},
    )
    max_tokens_per_gpu: int = field(
        default=0,
        metadata={
            "help": "actor and critic updates in micro-batches by token budget, not by count (slime's name; verl's ppo_max_token_len_per_gpu): rows of similar length, at most this many tokens padded to the longest in each (a longer row alone), each cut to its rows; the loss is normalised over the whole minibatch, so the split changes nothing; 0: auto, for responses over 256 tokens the tokens of a micro-batch of the longest rows (RLConfig.token_budget), else micro_train_batch_size rows each",
            "min": 0,
        },
    )
    over_sampling_batch_size: int = field(
        default=0,
        metadata={
            "help": "prompts drawn a rollout, more than rollout_batch_size: the step trains on the first rollout_batch_size prompt groups whose samples have all finished, and the engines abort the rest then (slime's name; logged as rollout_dropped_groups). The long tail's stragglers stop holding the step, at the price of a bias towards short responses. 0: off",
            "min": 0,
        },
    )
    packing_samples: bool | None = field(
        default=None,
        metadata={
            "help": "actor, reference and critic passes with each micro-batch's rows packed into one sequence (varlen FlashAttention-2 with --flash_attn, else a block-diagonal mask of tokens x tokens): no compute on padding, the same losses; by token budget a micro-batch then holds up to max_tokens_per_gpu real tokens. Unset: packed for a text policy's responses over 256 tokens where FlashAttention-2 runs (--flash_attn, a GPU cluster, the flash-attn package), as measured faster there (RLConfig.choose_packing); padded otherwise"
        },
    )
    dynamic_filtering: bool = field(
        default=False,
        metadata={
            "help": "drop prompt groups whose rewards are all equal or whose mean is outside dynamic_filtering_reward_range, and refill from the prompts (DAPO)"
        },
    )
    dynamic_filtering_reward_range: str = field(
        default="0 1", metadata={"help": "open interval (low high) a kept group's mean reward must lie in"}
    )
    reward_clip_range: str = field(
        default="", metadata={"help": "clip shaped rewards to this range, 'low high' (empty: no clipping)"}
    )
    is_correction: str = field(
        default="auto",
        metadata={
            "help": "off-policy correction of the policy loss by the engine's log-probabilities of the sampled tokens, w = π_old/μ per token: tis (weight min(w, is_cap)), mis (IcePop: weight w inside [1/is_cap, is_cap], 0 outside; the dropped tokens still count in the token-mean denominator), reject (weight 1 inside the band; tokens outside leave the loss, its denominator included) or none; auto: tis with --async_train, else none"
        },
    )
    is_cap: float = field(
        default=2.0, metadata={"help": "the importance weight's cap (tis) or band [1/is_cap, is_cap] (mis, reject)"}
    )
    ignore_eos: bool = field(
        default=False, metadata={"help": "benchmarks: every response is generate_max_len tokens, EOS or not"}
    )

    def prompts_per_rollout(self) -> int:
        """Prompts drawn a rollout: --over_sampling_batch_size when over-sampling, else rollout_batch_size."""
        return self.over_sampling_batch_size or self.rollout_batch_size

    def choose_packing(self, flash_attention: bool, vision: bool) -> tuple[bool, str]:
        """(pack, why) for this run: --packing_samples, or unset, the rule the measurements give. FlashAttention-2
        finds packed sequences in the position ids; any other kernel needs a tokens x tokens mask. On one H100 at the
        Qwen2.5-1.5B shape, 128 long-tailed responses of up to 4,096 tokens, packed updates took 4.3 s against 7.9 s
        padded (bench/RESULTS.md). At and below TOKEN_BUDGET_ABOVE_TOKENS, the short shape measured padded, rows stay
        padded. The caller knows whether FlashAttention-2 runs: --flash_attn, GPUs and the package (the driver's)."""
        if self.packing_samples is not None:
            return self.packing_samples, "--packing_samples"
        if vision:
            return False, "auto: a vision-language policy's rows are laid out one by one"
        if not flash_attention:
            return False, "auto: packing needs FlashAttention-2 (--flash_attn on a GPU with the flash-attn package)"
        if self.longest_response() <= TOKEN_BUDGET_ABOVE_TOKENS:
            return False, f"auto: responses of at most {TOKEN_BUDGET_ABOVE_TOKENS} tokens"
        return True, f"auto: FlashAttention-2 and responses over {TOKEN_BUDGET_ABOVE_TOKENS} tokens"

    def longest_response(self) -> int:
        """The most tokens a sample's response holds: generate_max_len, or with an environment the episode's."""
        return max(self.generate_max_len, self.max_episode_tokens if self.env_path else 0)

    def token_budget(self) -> int:
        """Tokens per actor and critic micro-batch, 0 for micro_train_batch_size rows each: --max_tokens_per_gpu, or by
        default, for responses over TOKEN_BUDGET_ABOVE_TOKENS, as many tokens as a micro-batch of the longest rows holds.
        Never more memory than counting rows at their worst, and less padding: at the Qwen2.5-1.5B shape, 128
        long-tailed responses of up to 4,096 tokens (mean about 1,000) on one H100, the update took 8.2 s against
        25.9 s by count (bench/RESULTS.md). Off where it cannot run: --is_correction reject without old log-probs."""
        if self.max_tokens_per_gpu:
            return self.max_tokens_per_gpu
        longest = self.longest_response()
        if longest <= TOKEN_BUDGET_ABOVE_TOKENS or (self.correction() == "reject" and not self.needs_old_logprobs()):
            return 0
        rows = self.micro_train_batch_size or max(1, self.train_batch_size // self.group_size("actor"))
        return rows * (self.prompt_max_len + longest)

    def correction(self) -> str:
        """--is_correction with auto resolved: on (tis) when rollouts are a step behind the trainer (--async_train)."""
        if self.is_correction == "auto":
            return "tis" if self.async_train else "none"
        return self.is_correction

    def uses_kl(self) -> bool:
        """Whether the KL to the reference enters reward or loss; without it no reference model is needed."""
        return self.init_kl_coef > 0 or self.kl_target > 0

    def needs_old_logprobs(self) -> bool:
        """Whether the actor scores a rollout before training on it. Only the KL (against the reference) and
        a rollout feeding several optimizer updates need that pass: with one update, the log-probabilities
        before it are the update's own forward, detached (ratio 1), so the pass is skipped, as TRL does."""
        one_update = (
            self.max_epochs == 1 and self.train_batch_size == self.rollout_batch_size * self.n_samples_per_prompt
        )
        return self.uses_kl() or not one_update

    def roles(self) -> list[str]:
        """The worker groups this run places: a reference only when KL is on and the actor cannot be its own
        (with LoRA it is: its base with the adapters off), a critic only for gae, reward models unless a
        function, an endpoint or an environment scores."""
        ref = self.uses_kl() and not self.lora_rank
        return (
            ["actor"]
            + (["ref"] if ref else [])
            + (["critic"] if uses_critic(self.advantage_estimator) else [])
            + ([] if self.remote_rm_url or self.env_path else ["reward"])
        )

    def devices_needed(self) -> int:
        """Devices (GPUs, or CPUs on a CPU-only cluster) the run holds at once: a bundle per worker of each placement
        group, and the rollout engines of their own."""
        return sum(self.group_size(members[0]) for members in self.placement_plan()) + (
            self.rollout_engines() if self.separate_engines() else 0
        )

    def interval(self, name: str) -> tuple[float, float] | None:
        """A 'low high' field as two floats (None when empty)."""
        text = getattr(self, name).replace(",", " ").split()
        if not text:
            return None
        try:
            low, high = (float(x) for x in text)
        except ValueError:
            raise ConfigError(
                f"{name}: {getattr(self, name)!r} is not two numbers; pass 'low high', e.g. '0 1'"
            ) from None
        if not low < high:
            raise ConfigError(f"{name}: low {low} must be below high {high}")
        return low, high

    def validate(self) -> None:
        super().validate()
        self.check_layout()
        for role in [r for r in ("actor", "critic") if r in self.roles()]:
            check_batch(
                "train_batch_size",
                self.train_batch_size,
                self.micro_train_batch_size,
                self.group_size(role),
                f"{role}_num_nodes × {role}_num_gpus_per_node",
            )
        if self.vllm_num_engines < 0 or self.micro_rollout_batch_size < 0 or self.num_episodes < 0:
            raise ConfigError("vllm_num_engines, micro_rollout_batch_size and num_episodes must not be negative")
        self.check_engines()
        if self.over_sampling_batch_size:
            actors = self.group_size("actor")
            if self.over_sampling_batch_size <= self.rollout_batch_size:
                raise ConfigError(
                    f"over_sampling_batch_size: {self.over_sampling_batch_size} prompts must be more than rollout_batch_size {self.rollout_batch_size}; raise it, or 0 for off"
                )
            if self.env_path or self.dynamic_filtering or self.separate_engines():
                raise ConfigError(
                    "over_sampling_batch_size: cuts one-turn rollouts of engines inside the actor workers; drop --env_path, --dynamic_filtering and --async_train, colocate vLLM (--colocate_all_models), or drop --over_sampling_batch_size"
                )
            if self.over_sampling_batch_size % actors or self.rollout_batch_size % actors:
                raise ConfigError(
                    f"over_sampling_batch_size: it and rollout_batch_size must split evenly over the {actors} actor workers; got {self.over_sampling_batch_size} and {self.rollout_batch_size}"
                )
        if self.partial_rollouts and not self.async_train:
            raise ConfigError(
                "partial_rollouts: weights change under running rollouts only with --async_train; add it, or drop --partial_rollouts"
            )
        dynamic_range = self.interval("dynamic_filtering_reward_range")
        if self.dynamic_filtering and (dynamic_range is None or self.n_samples_per_prompt < 2):
            raise ConfigError(
                "dynamic_filtering: needs n_samples_per_prompt of 2 or more and a dynamic_filtering_reward_range 'low high'"
            )
        self.interval("reward_clip_range")
        for name in ("pretrain", "prompt_data"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        if self.is_correction not in ("auto", *IS_CORRECTIONS) or not self.is_cap > 1:
            raise ConfigError(
                f"is_correction: use auto, {', '.join(IS_CORRECTIONS)} with an is_cap above 1; got {self.is_correction!r} and {self.is_cap}"
            )
        if self.max_tokens_per_gpu and self.correction() == "reject" and not self.needs_old_logprobs():
            # The kept tokens are the denominator, known before the update only from the rollout's old log-probs.
            raise ConfigError(
                "max_tokens_per_gpu: with --is_correction reject it needs the rollout's old log-probs (KL or more than one update); use tis or mis, or drop --max_tokens_per_gpu"
            )
        for name in ("remote_rm_url", "env_path"):  # before any Ray job: only what the operator allows
            check_reach(getattr(self, name), name, ConfigError)
        if not (self.reward_pretrain or self.remote_rm_url or self.env_path):
            raise ConfigError(
                "reward_pretrain: missing; pass --reward_pretrain <URI>, --remote_rm_url <file.py or URL> or --env_path <environment>"
            )
        if self.advantage_estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            raise ConfigError(
                f"n_samples_per_prompt: {self.advantage_estimator} compares samples of one prompt; use 2 or more"
            )
        if (self.rollout_batch_size * self.n_samples_per_prompt) % self.train_batch_size:
            raise ConfigError(
                f"train_batch_size: {self.train_batch_size} must divide rollout_batch_size × n_samples_per_prompt "
                f"= {self.rollout_batch_size * self.n_samples_per_prompt}"
            )
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip: {self.dual_clip} must be greater than 1 (or 0 for off)")
        if bool(self.ptx_coef) != bool(self.pretrain_data):
            raise ConfigError(
                "ptx_coef: PPO-ptx needs both --pretrain_data <URI> and a positive --ptx_coef; set both, or neither"
            )
