from dataclasses import dataclass, field

from tasks.common.allowlist import check_reach
from tasks.common.config import ConfigError, StageConfig, split_list
from tasks.common.generation import EpisodeConfig, ImageConfig
from tasks.eval import metrics


@dataclass
class EvalConfig(ImageConfig, EpisodeConfig, StageConfig):
    """Compare a baseline policy (the SFT model, also the KL reference) with a trained policy on held-out prompts."""

    baseline: str = field(
        default="", metadata={"help": "the starting policy (SFT output URI); also the reference for KL"}
    )
    policy: str = field(default="", metadata={"help": "the trained policy (RL output URI)"})
    reward_pretrain: str = field(
        default="",
        metadata={
            "help": "reward model (output URI) whose mean score is reported; without one (DPO, KTO) reward_mean is left out"
        },
    )
    registry: str = field(
        default="",
        metadata={
            "help": "a model registry folder (s3://…/models/<name>): its champion, when there is one, is evaluated on the same prompts for the promotion gate"
        },
    )
    dataset: str = field(
        default="",
        metadata={
            "help": "held-out prompts, with labels when there are reference answers: a stage output URI or a file"
        },
    )
    dataset_split: str = field(default="eval", metadata={"help": "split of a stage output's datasets to evaluate on"})
    input_key: str = field(
        default="prompt", metadata={"help": "dataset column holding the prompt: a string or a list of chat messages"}
    )
    label_key: str = field(
        default="label",
        metadata={
            "help": "dataset column holding the reference answer; without it (or empty) the accuracy metrics are left out"
        },
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={
            "help": "render each prompt with the tokenizer's chat template, as the trained stages did (needed for chat-message prompts)"
        },
    )
    metrics: str = field(
        default="",
        metadata={
            "help": "built-in metrics, comma-separated: exact_match, math_verify, regex:<pattern>, json_valid, length (default: exact_match when the data has labels and no --metric_func is given)",
            "max_length": 500,
        },
    )
    metric_func: str = field(
        default="",
        metadata={
            "help": "a Python file (local path or s3:// URI) defining metrics(prompts, responses, labels, rows) -> {name: [score per response]}",
            "max_length": 1000,
        },
    )
    n_samples_per_prompt: int = field(
        default=1,
        metadata={
            "help": "sampled responses per prompt for the sampled_* metrics; with more than one, pass@k is reported for every 0/1 metric",
            "min": 1,
            "max": 256,
        },
    )
    pass_k: str = field(
        default="", metadata={"help": "the k of pass@k, comma-separated (default: 1 and n_samples_per_prompt)"}
    )
    slice_key: str = field(
        default="",
        metadata={
            "help": "a dataset column: every metric is also reported per value of it, with intervals",
            "max_length": 200,
        },
    )
    bootstrap_resamples: int = field(
        default=2000, metadata={"help": "resamples of the paired bootstrap behind every 95% interval", "min": 100}
    )
    win_margin: float = field(
        default=0.1,
        metadata={"help": "reward-model score difference within which a pairwise comparison is a tie", "min": 0},
    )
    judge_url: str = field(
        default="",
        metadata={
            "help": "an OpenAI-compatible API (http://host:port/v1) whose chat model judges the policy against the baseline and the champion, both orders asked; its key, if any, in $RLHF_JUDGE_API_KEY",
            "pattern": r"^$|^https?://\S+$",
            "max_length": 500,
        },
    )
    judge_model: str = field(
        default="judge",
        metadata={"help": "the model name the judge endpoint serves", "pattern": r"\S", "max_length": 200},
    )
    max_samples: int = field(
        default=500, metadata={"help": "evaluate on the first this many prompts", "min": 1, "max": 1_000_000}
    )
    num_shown_samples: int = field(default=8, metadata={"help": "generations shown side by side in the report"})
    lm_eval_tasks: str = field(
        default="",
        metadata={
            "help": "lm-eval tasks, comma-separated (arc_easy,gsm8k: data from the Hugging Face hub; or a team's own from --lm_eval_include_path), run on each compared model; every per-document metric is reported as lm_eval/<task>/<metric> with intervals and deltas",
            "max_length": 1000,
        },
    )
    lm_eval_include_path: str = field(
        default="",
        metadata={
            "help": "a folder (local or s3://) of lm-eval task YAMLs, a team's own tasks, added to lm-eval's",
            "max_length": 1000,
        },
    )
    lm_eval_limit: int = field(
        default=0,
        metadata={"help": "the first this many documents of each lm-eval task (0: all)", "min": 0, "max": 1_000_000},
    )
    lm_eval_num_fewshot: int = field(
        default=-1, metadata={"help": "few-shot examples per lm-eval prompt (-1: each task's own setting)", "min": -1}
    )
    lm_eval_batch_size: int = field(
        default=16, metadata={"help": "sequences per forward pass in the lm-eval tasks", "min": 1}
    )
    rollout_engine: str = field(
        default="auto",
        metadata={
            "help": "who generates on the eval worker: vllm (one engine on its GPU, loaded with each compared model in turn), transformers, or auto: vLLM where the worker has a GPU and the vllm package (at 1,000 prompts x 256 tokens on one H200: 35,804 tokens/s against the transformers engine's 5,553, measured a day apart, bench/results.json eval), else transformers",
            "choices": ("auto", "vllm", "transformers"),
        },
    )
    use_vllm: bool = field(default=False, metadata={"help": "the same as --rollout_engine vllm"})
    vllm_gpu_memory_utilization: float = field(
        default=0.5,
        metadata={
            "help": "with --use_vllm: the fraction of the GPU's memory vLLM may take (the compared models and reward model use the rest)",
            "exclusive_min": 0,
            "max": 0.99,
        },
    )

    def choose_rollout_engine(self, has_gpu: bool, has_vllm: bool) -> tuple[str, str]:
        """(engine, why) on a worker with or without a GPU and the vllm package: the flags, or for auto the faster one."""
        if self.use_vllm or self.rollout_engine == "vllm":
            return "vllm", "--rollout_engine vllm" if self.rollout_engine == "vllm" else "--use_vllm"
        if self.rollout_engine == "transformers":
            return "transformers", "--rollout_engine"
        if not has_gpu:
            return "transformers", "the eval worker has no GPU"
        if not has_vllm:
            return "transformers", "the vllm package is not installed (the gpu extra)"
        return "vllm", "measured faster on a GPU"

    def validate(self) -> None:
        super().validate()
        if self.use_vllm and self.rollout_engine == "transformers":
            raise ConfigError("use_vllm: it asks for vLLM and --rollout_engine for transformers; drop one of them")
        for name in ("baseline", "policy", "dataset"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: missing; pass --{name} <URI>")
        try:
            for name in self.metric_names():
                metrics.builtin(name)
        except metrics.MetricError as e:
            raise ConfigError(str(e)) from None
        for name in ("judge_url", "metric_func", "env_path"):  # before any Ray job: only what the operator allows
            check_reach(getattr(self, name), name, ConfigError)
        if self.lm_eval_include_path and not self.lm_eval_tasks:
            raise ConfigError(
                "lm_eval_include_path: names task files but --lm_eval_tasks names no task to run; add the tasks' names"
            )
        bad = [k for k in self.ks() if not 0 < k <= self.n_samples_per_prompt]
        if bad:
            raise ConfigError(
                f"pass_k: {bad[0]} is not between 1 and n_samples_per_prompt ({self.n_samples_per_prompt})"
            )

    def metric_names(self) -> list[str]:
        # A regex may hold commas: everything after "regex:" is its pattern when it comes last.
        names, rest = [], self.metrics
        while rest:
            if rest.startswith("regex:"):
                names.append(rest.strip())
                break
            head, _, rest = rest.partition(",")
            if head.strip():
                names.append(head.strip())
        return names

    def ks(self) -> list[int]:
        try:
            ks = [int(k) for k in split_list(self.pass_k)]
        except ValueError:
            raise ConfigError(f"pass_k: {self.pass_k!r} is not a comma-separated list of integers") from None
        n = self.n_samples_per_prompt
        return ks or (sorted({1, n}) if n > 1 else [])
