"""The run form of the pipeline DAGs: their Params, what a person fills in when triggering a run.

    from plugins.form import PARAMS, DEFAULTS      # {name: Param}, {name: default}

Most fields are stage flags, each made from that flag's field in the stage's config (STAGE_PARAMS:
tasks/<stage>/config.py gives its type, limits, help and default), so the form refuses what the stage would;
PIPELINE_DEFAULTS holds where the run starts elsewhere than the stage, with the reason. The rest are the
pipeline's own: where the run goes, which data and model, which branch, the cache, deadline, checkpoints,
registry and gate. The graph that uses them is plugins/pipeline.py.
"""

from __future__ import annotations

from airflow.sdk import Param

from tasks.common import names
from tasks.common.config import param_schema
from tasks.common.stages import PIPELINE_TASKS, STAGES, config_class
from tasks.promote.config import DEFAULT_GATE  # {}: the gate made from the metrics the run declares
from tasks.promote.gate import RULE_KINDS

#: The pipeline's tasks whose stage trains, and so checkpoints (the fault_injection Param names one).
TRAINING_TASKS = tuple(task for task, name in PIPELINE_TASKS.items() if STAGES[name].trains)


def promotion_param(default: bool) -> Param:
    """The allow_promotion Param: its default differs between the manual and the nightly DAG."""
    return Param(
        default,
        type="boolean",
        title="Allow promotion",
        description="Promote the policy to champion when it passes the gate. Off: the gate judges and records it only.",
        section="Promotion",  # SECTIONS: made here too, since the nightly DAG makes its own
    )


#: The form's fields that are stage flags: Param -> (stage, the stage config's field, title). The field
#: (tasks/<stage>/config.py) is the one source of the Param's type, limits, description and (unless
#: PIPELINE_DEFAULTS says otherwise) default, so the form refuses what the stage would.
STAGE_PARAMS = {
    "input_key": ("tasks.data", "input_key", "Prompt column"),
    "output_key": ("tasks.data", "output_key", "SFT response column"),
    "chosen_key": ("tasks.data", "chosen_key", "Chosen column"),
    "rejected_key": ("tasks.data", "rejected_key", "Rejected column"),
    "label_key": ("tasks.data", "label_key", "Label column"),
    "messages_key": ("tasks.data", "messages_key", "Messages column"),
    "image_key": ("tasks.data", "image_key", "Image column"),
    "eval_fraction": ("tasks.data", "eval_fraction", "Held-out fraction"),
    "max_bad_fraction": ("tasks.data", "max_bad_fraction", "Max bad rows"),
    # every training stage's (training_args below); seed and apply_chat_template eval's too
    "apply_chat_template": ("tasks.sft", "apply_chat_template", "Apply chat template"),
    "lora_rank": ("tasks.sft", "lora_rank", "LoRA rank"),
    "freeze_visual_encoder": ("tasks.sft", "freeze_visual_encoder", "Freeze the vision tower"),
    "checkpoints_per_stage": ("tasks.sft", "num_checkpoints", "Checkpoints per stage"),
    "seed": ("tasks.sft", "seed", "Seed"),
    "zero_stage": ("tasks.sft", "zero_stage", "DeepSpeed ZeRO stage"),
    "sft_steps": ("tasks.sft", "max_steps", "SFT steps"),
    "sft_learning_rate": ("tasks.sft", "learning_rate", "SFT learning rate"),
    "rm_steps": ("tasks.reward_model", "max_steps", "Reward model steps"),
    "rm_learning_rate": ("tasks.reward_model", "learning_rate", "Reward model learning rate"),
    "rl_steps": ("tasks.rl", "max_steps", "RL steps"),
    "actor_learning_rate": ("tasks.rl", "actor_learning_rate", "Actor learning rate"),
    "critic_learning_rate": ("tasks.rl", "critic_learning_rate", "Critic learning rate"),
    "init_kl_coef": ("tasks.rl", "init_kl_coef", "Initial KL coefficient"),
    "gae_lambda": ("tasks.rl", "lambd", "GAE lambda"),
    "ptx_coef": ("tasks.rl", "ptx_coef", "PPO-ptx coefficient"),
    "advantage_estimator": ("tasks.rl", "advantage_estimator", "Advantage estimator"),
    "n_samples_per_prompt": ("tasks.rl", "n_samples_per_prompt", "Samples per prompt"),
    "generate_max_len": ("tasks.rl", "generate_max_len", "New tokens per response"),  # eval's too
    "environment": ("tasks.rl", "env_path", "Environment"),
    "max_turns": ("tasks.rl", "max_turns", "Turns per episode"),
    "max_episode_tokens": ("tasks.rl", "max_episode_tokens", "Tokens per episode"),
    "colocate_all_models": ("tasks.rl", "colocate_all_models", "Colocate all RL models"),
    "rollout_engine": ("tasks.rl", "rollout_engine", "Rollout engine"),
    "preference_steps": ("tasks.preference", "max_steps", "DPO/KTO steps"),
    "preference_learning_rate": ("tasks.preference", "learning_rate", "DPO/KTO learning rate"),
    "dpo_beta": ("tasks.preference", "beta", "DPO beta"),
    "kto_beta": ("tasks.preference", "beta", "KTO beta"),
    "eval_max_samples": ("tasks.eval", "max_samples", "Eval samples"),
    "eval_metrics": ("tasks.eval", "metrics", "Eval metrics"),
    "eval_metric_func": ("tasks.eval", "metric_func", "Eval metric file"),
    "eval_samples_per_prompt": ("tasks.eval", "n_samples_per_prompt", "Eval samples per prompt"),
    "eval_slice_key": ("tasks.eval", "slice_key", "Eval slice column"),
    "eval_judge_url": ("tasks.eval", "judge_url", "Eval LLM judge URL"),
    "eval_judge_model": ("tasks.eval", "judge_model", "Eval LLM judge model"),
    "eval_lm_eval_tasks": ("tasks.eval", "lm_eval_tasks", "Eval lm-eval tasks"),
    "eval_lm_eval_include_path": ("tasks.eval", "lm_eval_include_path", "Eval lm-eval task folder"),
    "eval_lm_eval_limit": ("tasks.eval", "lm_eval_limit", "Eval lm-eval documents"),
}


def tasks_with_field(field_name: str, tasks: tuple[str, ...] = TRAINING_TASKS) -> tuple[str, ...]:
    """The pipeline tasks among `tasks` whose stage config has the field `field_name`: those its flag can reach."""
    import dataclasses

    return tuple(
        t for t in tasks if field_name in {f.name for f in dataclasses.fields(config_class(PIPELINE_TASKS[t]))}
    )


#: The pipeline tasks a stage-backed Param feeds, where that is not every task that runs its stage's module. In
#: each the flag is the field's name (STAGE_PARAMS); the DAG takes its flags from here (form_flags).
FEEDS = {
    # The image column of the run's own file: prepare_data stores each row's images in an `images` column of every
    # split, which the later stages read by their --image_key default; the user's column name would miss it there.
    "image_key": ("prepare_data",),
    # Every training stage that trains a vision-language model (its config has the flag).
    "freeze_visual_encoder": tasks_with_field("freeze_visual_encoder"),
    "seed": ("prepare_data", *TRAINING_TASKS, "eval"),
    "apply_chat_template": (*TRAINING_TASKS, "eval"),
    "lora_rank": TRAINING_TASKS,
    "zero_stage": TRAINING_TASKS,
    "checkpoints_per_stage": TRAINING_TASKS,
    **{name: ("rl", "eval") for name in ("generate_max_len", "environment", "max_turns", "max_episode_tokens")},
    "dpo_beta": ("dpo",),
    "kto_beta": ("kto",),
}


def tasks_running(module: str) -> tuple[str, ...]:
    return tuple(task for task, name in PIPELINE_TASKS.items() if STAGES[name].package == module)


def form_flags(task_id: str) -> dict[str, str]:
    """The flags the pipeline task `task_id` takes from the form: {stage field: its Param's template}. A field left
    empty renders as its default (the stage operators fill the Params first); one whose default is null as ''."""
    flags = {}
    for name, (module, field_name, _) in STAGE_PARAMS.items():
        if task_id in FEEDS.get(name, tasks_running(module)):
            flags[field_name] = ("{{ params.%s or '' }}" if PARAMS[name].value is None else "{{ params.%s }}") % name
    return flags


#: Where the run starts from another default than the stage's own, and why. The stages keep the peers'
#: defaults (OpenRLHF's λ 0.95, no PPO-ptx) for a team's own data; the form's are the demo's measured recipe.
PIPELINE_DEFAULTS = {
    "rm_steps": (
        100,
        "the demo's reward model: its run's claim (tests/e2e/test_e2e.py) holds with 100 steps on 2 cores",
    ),
    "rl_steps": (30, "the demo's RL recipe as measured on seeds 0, 1 and 2 (docs/design-notes.md)"),
    "gae_lambda": (
        0.8,
        "the demo's style comes after the digits: with 0.95 the digit tokens carried much of its advantage noise",
    ),
    "ptx_coef": (0.5, "PPO-ptx on the run's SFT split: without it the demo's accuracy held on one seed of three"),
    "colocate_all_models": (
        True,
        "one GPU per stage, as the pool slots count them (tasks.common.stages); the local Ray head has 2 CPUs",
    ),
    "preference_learning_rate": (2e-5, "the DPO and KTO learning checks' rate (tests/e2e/test_learning.py)"),
    "dpo_beta": (0.5, "the DPO learning check's β, with the NLL term below"),
    "checkpoints_per_stage": (5, "a rerun of a failed stage loses at most a fifth of its steps"),
}

#: The pipeline's own narrowing of a stage field's schema, and why.
NARROWED = {
    # The Ray nodes reach the built-in environments, S3, absolute paths and the shipped tasks/ folder only.
    # A file may carry its pin, #sha256=<hex> (tasks/common/user_code.py).
    "environment": {"pattern": r"^$|^(calculator|guess|(s3://\S+|/\S+|tasks/\S+)\.py(#sha256=[0-9a-f]{64})?)$"},
}


def stage_param(name: str) -> Param:
    """The Param `name` of the run form, made from its stage config's field (STAGE_PARAMS)."""
    module, field_name, title = STAGE_PARAMS[name]
    schema = {**param_schema(config_class(module), field_name), **NARROWED.get(name, {})}
    default = PIPELINE_DEFAULTS[name][0] if name in PIPELINE_DEFAULTS else schema["default"]
    schema.pop("default")
    return Param(default, title=title, **schema)


# The form's fields that are the pipeline's own (where the run goes, which data and model, which branch, the
# cache, deadline, checkpoints, registry and gate). The stage-backed ones come from their configs above.
PARAMS = {
    # null allowed: the UI's form sends an emptied field as null (Airflow's docs: optional = "null" in type).
    "bucket": Param(
        None,
        type=["null", "string"],
        title="Bucket",
        description="S3 bucket that receives every artifact of the run. Empty: the bucket named in the rlhf_s3 connection's extra (`bucket`), else rlhf-flow.",
        pattern="^$|" + names.BUCKET_PATTERN,
    ),
    "prefix": Param(
        "rlhf-flow",
        type="string",
        title="Key prefix",
        description="Key prefix inside the bucket; runs go under <prefix>/runs/<dag_id>/<run_id>/.",
        pattern=r"^[A-Za-z0-9._\-/]*$",
        maxLength=200,
    ),
    "dataset": Param(
        "demo",
        type="string",
        title="Dataset",
        minLength=1,
        description="'demo' for the built-in synthetic preference dataset; a JSONL, Parquet or CSV file URI (s3://..., local "
        "path), validated, split and registered as a version under <prefix>/datasets/<file name>/; or "
        "dataset:<name> (its newest registered version) or dataset:<name>@<version>.",
    ),
    "base_model": Param(
        "demo",
        type="string",
        title="Base model",
        minLength=1,
        description="'demo' for a tiny model built offline, or a model URI / hub id.",
    ),
    "method": Param(
        "rl",
        type="string",
        title="Method",
        enum=["rl", "dpo", "kto"],
        description="After SFT: rl (reward model, then RL with the advantage estimator below), or dpo / kto "
        "(direct preference optimisation on the preference data, no reward model).",
    ),
    **{name: stage_param(name) for name in STAGE_PARAMS},
    "use_cache": Param(
        True,
        type="boolean",
        title="Reuse cached stages",
        description="Skip a stage whose flags, input manifests and code match a completed stage under this prefix, "
        "and use that stage's output (off: every stage runs).",
    ),
    "stage_deadline_minutes": Param(
        240,
        type="number",
        title="Stage deadline (minutes)",
        minimum=0,
        maximum=100_000,
        description="A stage's Ray job still running after this long is stopped and the task fails (0: no deadline).",
    ),
    "model_name": Param(
        "demo-policy",
        type="string",
        title="Model name",
        pattern=names.NAME_PATTERN,
        description="Registry name: the champion lives at <prefix>/models/<name>/champion.json.",
    ),
    "allow_promotion": promotion_param(False),
    "promotion_gate": Param(
        DEFAULT_GATE,
        type="object",
        title="Promotion gate",
        description="Per metric: min / max (absolute), min_gain / max_drop (against the champion, or the SFT model "
        "before the first champion), min_gain_lower (the 95% interval of the gain starts at or above it). "
        "Must include a metric the reward model does not produce (not only reward_mean). Empty ({}): no "
        "declared 0/1 metric drops more than 2 points, KL to the SFT model stays under 2, and one of them "
        "gains beyond noise. A report whose reward-hacking alarm went off never passes.",
        additionalProperties={
            "type": "object",
            "minProperties": 1,
            "additionalProperties": False,
            "properties": {k: {"type": "number"} for k in RULE_KINDS},
        },
    ),
    "fault_injection": Param(
        {},
        type="object",
        title="Fault injection (testing)",
        description='Testing only: {"stage": "rl", "after_step": 12} fails that stage once, right after its checkpoint '
        "of that step (a multiple of its checkpoint interval); its rerun resumes from there.",
        properties={
            "stage": {"type": "string", "enum": list(TRAINING_TASKS)},
            "after_step": {"type": "integer", "minimum": 1},
        },
        additionalProperties=False,
    ),
}

#: The form's sections, in order (Airflow's trigger form groups a Param by its `section`). What a run needs to start
#: stays in the first, "Run Parameters" (no section, open); every other starts folded, Advanced last.
SECTIONS = {
    "Data": [
        "input_key",
        "output_key",
        "chosen_key",
        "rejected_key",
        "label_key",
        "messages_key",
        "image_key",
        "eval_fraction",
        "max_bad_fraction",
    ],
    "Training, every stage": ["seed", "lora_rank", "zero_stage", "apply_chat_template", "freeze_visual_encoder"],
    "SFT": ["sft_steps", "sft_learning_rate"],
    "Reward model": ["rm_steps", "rm_learning_rate"],
    "RL": [
        "rl_steps",
        "actor_learning_rate",
        "critic_learning_rate",
        "init_kl_coef",
        "gae_lambda",
        "ptx_coef",
        "advantage_estimator",
        "n_samples_per_prompt",
        "generate_max_len",
        "environment",
        "max_turns",
        "max_episode_tokens",
        "colocate_all_models",
        "rollout_engine",
    ],
    "Preference (DPO/KTO)": ["preference_steps", "preference_learning_rate", "dpo_beta", "kto_beta"],
    "Eval": [name for name in STAGE_PARAMS if STAGE_PARAMS[name][0] == "tasks.eval"],
    "Promotion": ["model_name", "allow_promotion", "promotion_gate"],
    "Advanced": ["checkpoints_per_stage", "use_cache", "stage_deadline_minutes", "fault_injection"],
}
for _section, _names in SECTIONS.items():
    for _name in _names:
        PARAMS[_name].schema["section"] = _section


def optional(param: Param) -> Param:
    """`param` as a field the form does not mark required: null joins its type (and its choices). Airflow's form
    marks a field required unless its type takes null, and sends a field emptied as null: the DAG's tasks read
    that as the field's default (plugins.operators.fill_empty)."""
    schema = dict(param.schema)
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    schema["type"] = kinds if "null" in kinds else [*kinds, "null"]
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
        schema["values_display"] = {"null": f"(default: {param.value})"}
    return Param(param.value, description=param.description, schema=schema)


#: What a run cannot start without, the only fields the form marks required: where it goes, from which data and
#: model, by which method. Every other field left empty means its default.
REQUIRED = ("prefix", "dataset", "base_model", "method")
PARAMS = {name: param if name in REQUIRED else optional(param) for name, param in PARAMS.items()}
PARAMS = {
    name: PARAMS[name]
    for name in [n for n in PARAMS if "section" not in PARAMS[n].schema] + [n for ns in SECTIONS.values() for n in ns]
}

#: The run form's defaults by Param name.
DEFAULTS = {name: param.value for name, param in PARAMS.items()}
