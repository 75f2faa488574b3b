"""The RLHF pipeline as Airflow tasks, built once for every DAG that runs it.

    build_pipeline(dag_id="rlhf_pipeline", schedule=None, allow_promotion=False)

validate -> prepare_data -> sft -> choose_method -> (reward_model -> rl | dpo | kto) -> eval -> promote -> champion

`validate` builds every stage's config from the flags its task would submit (tasks/validate.py: the stage
configs need only the standard library and yaml), so a form the stages would refuse fails before any Ray job.

Every stage is a RayJobOperator running ``python -m tasks.<stage>`` on the Ray cluster; it returns the URI
of the stage's ``manifest.json`` and downstream stages take those URIs as inputs (XCom holds URIs, never
data). Artifacts land in ``s3://<bucket>/<prefix>/runs/<dag_id>/<run_id>/<stage>/``; the registry at
``s3://<bucket>/<prefix>/models/<model_name>/``. The `method` Param picks the branch after SFT (the others
show as skipped). `eval` scores the policy beside the SFT model and the registry's champion on the same
held-out prompts; `promote` judges it with the gate and, when allowed, makes it champion by
compare-and-swap; `champion` emits the champion Asset's event, and is skipped when nothing was promoted.

Each stage task: is cached (Param use_cache; see plugins.stage_cache), has a deadline (Param
stage_deadline_minutes), takes pool_slots of the GPU pool equal to the GPUs it asks Ray for (at least
one), writes resumable checkpoints (Param checkpoints_per_stage), and emits an Asset event carrying its
manifest URI and metrics. Only the Airflow side is imported here (no torch; tasks' configs only inside `validate`).
"""
from __future__ import annotations

import json
from datetime import timedelta

from airflow.sdk import DAG, Asset, Param, chain, task

from plugins.notifiers import WebhookNotifier
from plugins.operators import OUTPUT_ROOT, RayJobOperator

#: A model's registry folder (champion.json, history/, candidates/), templated like the stages' output.
REGISTRY = OUTPUT_ROOT + "/models/{{ params.model_name }}"

#: Where prepare_data registers dataset versions: <root>/<name>/<version>/ (tasks/data/versions.py).
DATASETS_ROOT = OUTPUT_ROOT + "/datasets"
#: prepare_data's flags that come from the Params of the same name (the column mapping and the checks).
DATASET_FLAGS = ("input_key", "output_key", "chosen_key", "rejected_key", "label_key", "messages_key", "eval_fraction",
                 "max_bad_fraction")

#: The Airflow pool of GPUs (created by `make up` with --include-deferred: deferred stages hold their GPUs).
GPU_POOL = "rlhf_gpus"
#: GPUs each stage asks Ray for with the DAG's layout (the RL models colocated on the actor's GPU).
STAGE_GPUS = {"prepare_data": 0, "sft": 1, "reward_model": 1, "rl": 1, "dpo": 1, "kto": 1, "eval": 1, "promote": 0}
TRAINING_STAGES = ("sft", "reward_model", "rl", "dpo", "kto")
#: Lineage in the Assets view: base model and data -> SFT -> reward model -> policy -> report -> champion.
ASSETS = {name: Asset(name=f"rlhf_flow.{name}", uri=f"rlhf-flow://assets/{name}")
          for name in ("prepared_data", "sft_model", "reward_model", "policy", "eval_report", "champion")}
# Same values as tasks.promote.config.DEFAULT_GATE (kept apart: the Airflow side does not import tasks).
DEFAULT_GATE: dict = {}  # the default gate: made from the metrics the run declares


def promotion_param(default: bool) -> Param:
    """The allow_promotion Param: its default differs between the manual and the nightly DAG."""
    return Param(default, type="boolean", title="Allow promotion",
                 description="Promote the policy to champion when it passes the gate. Off: the gate judges and records it only.")


def save_steps(steps: int, checkpoints: int) -> int:
    """Checkpoint interval giving `checkpoints` evenly spaced checkpoints over `steps` (0: none)."""
    return -(-int(steps) // int(checkpoints)) if int(checkpoints) > 0 else 0


def fail_after(stage: str, fault: dict) -> int:
    """The step after which the fault_injection Param fails `stage` (0: it does not)."""
    return int(fault.get("after_step", 0)) if fault and fault.get("stage") == stage else 0


def fixed_data(dataset: str) -> bool:
    """Whether the dataset Param names the same data every time: a built-in task, or a pinned dataset:<name>@<version>."""
    return dataset in ("demo", "calculator", "guess") or (dataset.startswith("dataset:") and "@" in dataset)


# The run form's defaults, in one place.
DEFAULTS = {
    "bucket": None,
    "prefix": "rlhf-flow",
    "dataset": "demo",
    "input_key": "prompt",
    "output_key": "",
    "chosen_key": "chosen",
    "rejected_key": "rejected",
    "label_key": "",
    "messages_key": "",
    "eval_fraction": 0.1,
    "max_bad_fraction": 0.05,
    "base_model": "demo",
    "apply_chat_template": False,
    "lora_rank": 0,
    "seed": 0,
    "method": "rl",
    "sft_steps": 500,
    "sft_learning_rate": 1e-3,
    "rm_steps": 100,
    "rm_learning_rate": 3e-4,
    "rl_steps": 30,
    "actor_learning_rate": 3e-5,
    "critic_learning_rate": 1e-4,
    "init_kl_coef": 0.05,
    "gae_lambda": 0.8,
    "ptx_coef": 0.5,
    "advantage_estimator": "gae",
    "n_samples_per_prompt": 1,
    "generate_max_len": 16,
    "environment": "",
    "max_turns": 4,
    "max_episode_tokens": 64,
    "colocate_all_models": True,
    "preference_steps": 100,
    "preference_learning_rate": 2e-5,
    "dpo_beta": 0.5,
    "kto_beta": 0.1,
    "zero_stage": 2,
    "eval_max_samples": 500,
    "eval_metrics": "",
    "eval_metric_func": "",
    "eval_samples_per_prompt": 1,
    "eval_slice_key": "",
    "eval_lm_eval_tasks": "",
    "eval_lm_eval_include_path": "",
    "eval_lm_eval_limit": 0,
    "eval_judge_url": "",
    "eval_judge_model": "judge",
    "checkpoints_per_stage": 5,
    "use_cache": True,
    "stage_deadline_minutes": 240,
    "model_name": "demo-policy",
    "allow_promotion": False,
    "promotion_gate": DEFAULT_GATE,
    "fault_injection": {},
}

PARAMS = {
    # null allowed: the UI's form sends an emptied field as null (Airflow's docs: optional = "null" in type).
    "bucket": Param(
        DEFAULTS["bucket"], type=["null", "string"], title="Bucket",
        description="S3 bucket that receives every artifact of the run. Empty: the bucket named in the rlhf_s3 "
                    "connection's extra (`bucket`), else rlhf-flow.",
        pattern=r"^$|^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$",
    ),
    "prefix": Param(
        DEFAULTS["prefix"], type="string", title="Key prefix",
        description="Key prefix inside the bucket; runs go under <prefix>/runs/<dag_id>/<run_id>/.",
        pattern=r"^[A-Za-z0-9._\-/]*$", maxLength=200,
    ),
    "dataset": Param(
        DEFAULTS["dataset"], type="string", title="Dataset", minLength=1,
        description="'demo' for the built-in synthetic preference dataset; a JSONL, Parquet or CSV file URI (s3://..., local "
                    "path), validated, split and registered as a version under <prefix>/datasets/<file name>/; or "
                    "dataset:<name> (its newest registered version) or dataset:<name>@<version>.",
    ),
    # The column mapping of a user's dataset (ignored for 'demo'): a column name, or empty for none. null
    # allowed: the UI's form sends an emptied field as null (as for bucket above).
    **{name: Param(
        DEFAULTS[name], type=["null", "string"], title=title, maxLength=200, description=description,
    ) for name, title, description in (
        ("input_key", "Prompt column", "Column holding the prompt (not read when a messages column is set)."),
        ("output_key", "SFT response column", "Column holding the SFT response. Empty: the final assistant turn of the "
                                              "messages column, else the chosen column."),
        ("chosen_key", "Chosen column", "Column holding the preferred response of a pair. Empty, with the rejected "
                                        "column: SFT-only data (no reward model, DPO or KTO data)."),
        ("rejected_key", "Rejected column", "Column holding the other response of a pair (empty: no pairs)."),
        ("label_key", "Label column", "Column holding a reference answer for exact-match evaluation (empty: none)."),
        ("messages_key", "Messages column", "Column holding chat messages [{role, content}]: the turns before the final "
                                            "assistant turn are the prompt, that turn the SFT response (empty: none)."),
    )},
    "eval_fraction": Param(
        DEFAULTS["eval_fraction"], type="number", title="Held-out fraction", exclusiveMinimum=0, exclusiveMaximum=1,
        description="Fraction of a user dataset's prompts held out for evaluation, chosen by a hash of the prompt and "
                    "the seed (a prompt is never on both sides).",
    ),
    "max_bad_fraction": Param(
        DEFAULTS["max_bad_fraction"], type="number", title="Max bad rows", minimum=0, maximum=1,
        description="prepare_data fails when more than this fraction of a user dataset's rows fails validation "
                    "(missing or empty fields, too long, duplicates, train/held-out overlap); fewer are left out and reported.",
    ),
    "base_model": Param(
        DEFAULTS["base_model"], type="string", title="Base model", minLength=1,
        description="'demo' for a tiny model built offline, or a model URI / hub id.",
    ),
    "apply_chat_template": Param(
        DEFAULTS["apply_chat_template"], type="boolean", title="Apply chat template",
        description="Render prompts with the base model's chat template (a chat-messages prompt always needs it) in "
                    "every training stage and the evaluation.",
    ),
    "lora_rank": Param(
        DEFAULTS["lora_rank"], type="integer", title="LoRA rank", minimum=0, maximum=1024,
        description="Train LoRA adapters of this rank instead of every weight, in every training stage (0: full fine-tuning).",
    ),
    "seed": Param(
        DEFAULTS["seed"], type="integer", title="Seed", minimum=0, maximum=2**31 - 1,
        description="Random seed of every stage.",
    ),
    "method": Param(
        DEFAULTS["method"], type="string", title="Method", enum=["rl", "dpo", "kto"],
        description="After SFT: rl (reward model, then RL with the advantage estimator below), or dpo / kto "
                    "(direct preference optimisation on the preference data, no reward model).",
    ),
    "sft_steps": Param(
        DEFAULTS["sft_steps"], type="integer", title="SFT steps", minimum=1, maximum=1_000_000,
        description="Optimizer steps of supervised fine-tuning.",
    ),
    "sft_learning_rate": Param(
        DEFAULTS["sft_learning_rate"], type="number", title="SFT learning rate", exclusiveMinimum=0, maximum=1,
        description="Peak learning rate of supervised fine-tuning.",
    ),
    "rm_steps": Param(
        DEFAULTS["rm_steps"], type="integer", title="Reward model steps", minimum=1, maximum=1_000_000,
        description="Optimizer steps of reward model training.",
    ),
    "rm_learning_rate": Param(
        DEFAULTS["rm_learning_rate"], type="number", title="Reward model learning rate", exclusiveMinimum=0, maximum=1,
        description="Peak learning rate of reward model training.",
    ),
    "rl_steps": Param(
        DEFAULTS["rl_steps"], type="integer", title="RL steps", minimum=1, maximum=1_000_000,
        description="PPO iterations (rollout + update) of the RL stage.",
    ),
    "actor_learning_rate": Param(
        DEFAULTS["actor_learning_rate"], type="number", title="Actor learning rate", exclusiveMinimum=0, maximum=1,
        description="Learning rate of the policy (actor) in RL.",
    ),
    "critic_learning_rate": Param(
        DEFAULTS["critic_learning_rate"], type="number", title="Critic learning rate", exclusiveMinimum=0, maximum=1,
        description="Learning rate of the value model (critic) in RL.",
    ),
    "init_kl_coef": Param(
        DEFAULTS["init_kl_coef"], type="number", title="Initial KL coefficient", minimum=0, maximum=10,
        description="Weight of the KL penalty against the SFT reference policy at the start of RL.",
    ),
    "gae_lambda": Param(
        DEFAULTS["gae_lambda"], type="number", title="GAE lambda", minimum=0, maximum=1,
        description="λ of generalised advantage estimation in RL (lower: credit stays nearer the token that earned it).",
    ),
    "ptx_coef": Param(
        DEFAULTS["ptx_coef"], type="number", title="PPO-ptx coefficient", minimum=0, maximum=100,
        description="Weight of the SFT data's likelihood in the RL policy's loss (InstructGPT's PPO-ptx), which keeps what "
                    "SFT taught while RL moves the style; 0 turns it off.",
    ),
    "advantage_estimator": Param(
        DEFAULTS["advantage_estimator"], type="string", title="Advantage estimator",
        enum=["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"],
        description="gae: PPO with a critic; reinforce (REINFORCE++), reinforce_baseline, rloo, group_norm (GRPO), "
                    "dr_grpo: critic-free. The group estimators need 2 or more samples per prompt.",
    ),
    "n_samples_per_prompt": Param(
        DEFAULTS["n_samples_per_prompt"], type="integer", title="Samples per prompt", minimum=1, maximum=64,
        description="Responses sampled per prompt in RL (a group, for the group estimators).",
    ),
    "generate_max_len": Param(
        DEFAULTS["generate_max_len"], type="integer", title="New tokens per response", minimum=1, maximum=65_536,
        description="Tokens a response may have in RL and eval; with an environment, tokens per model turn.",
    ),
    "environment": Param(
        DEFAULTS["environment"], type=["null", "string"], title="Environment",
        description="Agentic RL: empty for single responses scored by the reward model; 'calculator' or 'guess' (the built-in "
                    "environments, with the datasets of those names), or a .py file URI (s3://...) defining class Environment "
                    "with reset(row) and step(action). With one, RL trains on multi-turn episodes with the environment's "
                    "rewards (no reward model is trained) and eval plays the same environment.",
        pattern=r"^$|^(calculator|guess|s3://\S+\.py|/\S+\.py|tasks/\S+\.py)$",
    ),
    "max_turns": Param(
        DEFAULTS["max_turns"], type="integer", title="Turns per episode", minimum=1, maximum=1000,
        description="Model turns an episode may take (with an environment).",
    ),
    "max_episode_tokens": Param(
        DEFAULTS["max_episode_tokens"], type="integer", title="Tokens per episode", minimum=1, maximum=1_000_000,
        description="Model and observation tokens an episode may hold after its prompt (with an environment).",
    ),
    "colocate_all_models": Param(
        DEFAULTS["colocate_all_models"], type="boolean", title="Colocate all RL models",
        description="Actor, reference, critic and reward models share the actor's GPUs (one placement group). "
                    "Off: each model group gets GPUs of its own (4 on the default sizes).",
    ),
    "preference_steps": Param(
        DEFAULTS["preference_steps"], type="integer", title="DPO/KTO steps", minimum=1, maximum=1_000_000,
        description="Optimizer steps of the dpo or kto stage.",
    ),
    "preference_learning_rate": Param(
        DEFAULTS["preference_learning_rate"], type="number", title="DPO/KTO learning rate", exclusiveMinimum=0, maximum=1,
        description="Learning rate of the dpo or kto stage.",
    ),
    "dpo_beta": Param(
        DEFAULTS["dpo_beta"], type="number", title="DPO beta", exclusiveMinimum=0, maximum=100,
        description="Strength of DPO's implicit KL constraint to the SFT reference.",
    ),
    "kto_beta": Param(
        DEFAULTS["kto_beta"], type="number", title="KTO beta", exclusiveMinimum=0, maximum=100,
        description="Strength of KTO's implicit KL constraint to the SFT reference.",
    ),
    "zero_stage": Param(
        DEFAULTS["zero_stage"], type="integer", title="DeepSpeed ZeRO stage", enum=[0, 2, 3],
        description="DeepSpeed ZeRO stage of every training stage (0: off, 2: shard optimizer + gradients, 3: also parameters).",
    ),
    "eval_max_samples": Param(
        DEFAULTS["eval_max_samples"], type="integer", title="Eval samples", minimum=1, maximum=1_000_000,
        description="Prompts scored by the evaluation (baseline SFT vs RL policy).",
    ),
    "eval_metrics": Param(
        DEFAULTS["eval_metrics"], type=["null", "string"], title="Eval metrics", maxLength=500,
        description="Built-in metrics, comma-separated: exact_match, math_verify, regex:<pattern> (last), json_valid, "
                    "length. Empty: exact_match when the data has labels and no metric file is given.",
    ),
    "eval_metric_func": Param(
        DEFAULTS["eval_metric_func"], type=["null", "string"], title="Eval metric file", maxLength=1000,
        description="A .py file (s3:// URI, or a path in the project) defining metrics(prompts, responses, labels, rows) "
                    "-> {name: [score per response]}. Empty: the demo's own metrics for the demo dataset, none otherwise.",
    ),
    "eval_samples_per_prompt": Param(
        DEFAULTS["eval_samples_per_prompt"], type="integer", title="Eval samples per prompt", minimum=1, maximum=256,
        description="Sampled responses per prompt for the sampled_* metrics; above 1, pass@1 and pass@n of every 0/1 metric.",
    ),
    "eval_judge_url": Param(
        DEFAULTS["eval_judge_url"], type=["null", "string"], title="Eval LLM judge URL", maxLength=500,
        pattern=r"^$|^https?://\S+$",
        description="An OpenAI-compatible API (http://host:port/v1, e.g. vLLM's server) whose chat model judges the policy "
                    "against the SFT model and the champion, both orders asked. Its key, if any: RLHF_JUDGE_API_KEY in the "
                    "Ray nodes' environment. Empty: the reward model judges alone.",
    ),
    "eval_judge_model": Param(
        DEFAULTS["eval_judge_model"], type="string", title="Eval LLM judge model", minLength=1, maxLength=200,
        description="The model name the judge endpoint serves.",
    ),
    "eval_slice_key": Param(
        DEFAULTS["eval_slice_key"], type=["null", "string"], title="Eval slice column", maxLength=200,
        description="A dataset column: every metric is also reported per value of it, with intervals. Empty: none.",
    ),
    "eval_lm_eval_tasks": Param(
        DEFAULTS["eval_lm_eval_tasks"], type=["null", "string"], title="Eval lm-eval tasks", maxLength=1000,
        description="lm-eval tasks, comma-separated (arc_easy,gsm8k: their data from the Hugging Face hub, so Ray nodes that "
                    "reach it; or the team's own from the task folder below), run on the SFT model, the policy and the "
                    "champion; each per-document metric is reported as lm_eval/<task>/<metric> and can be gated on. Empty: none.",
    ),
    "eval_lm_eval_include_path": Param(
        DEFAULTS["eval_lm_eval_include_path"], type=["null", "string"], title="Eval lm-eval task folder", maxLength=1000,
        description="A folder of lm-eval task YAMLs (s3:// prefix, or a path on the Ray nodes): the team's own tasks. Empty: "
                    "lm-eval's tasks only.",
    ),
    "eval_lm_eval_limit": Param(
        DEFAULTS["eval_lm_eval_limit"], type="integer", title="Eval lm-eval documents", minimum=0, maximum=1_000_000,
        description="The first this many documents of each lm-eval task (0: all of them).",
    ),
    "checkpoints_per_stage": Param(
        DEFAULTS["checkpoints_per_stage"], type="integer", title="Checkpoints per stage", minimum=0, maximum=1000,
        description="Resumable checkpoints each training stage writes, evenly spaced (0: none). A rerun of a failed "
                    "stage resumes from its newest one.",
    ),
    "use_cache": Param(
        DEFAULTS["use_cache"], type="boolean", title="Reuse cached stages",
        description="Skip a stage whose flags, input manifests and code match a completed stage under this prefix, "
                    "and use that stage's output (off: every stage runs).",
    ),
    "stage_deadline_minutes": Param(
        DEFAULTS["stage_deadline_minutes"], type="number", title="Stage deadline (minutes)", minimum=0, maximum=100_000,
        description="A stage's Ray job still running after this long is stopped and the task fails (0: no deadline).",
    ),
    "model_name": Param(
        DEFAULTS["model_name"], type="string", title="Model name", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="Registry name: the champion lives at <prefix>/models/<name>/champion.json.",
    ),
    "allow_promotion": promotion_param(DEFAULTS["allow_promotion"]),
    "promotion_gate": Param(
        DEFAULTS["promotion_gate"], type="object", title="Promotion gate",
        description="Per metric: min / max (absolute), min_gain / max_drop (against the champion, or the SFT model "
                    "before the first champion), min_gain_lower (the 95% interval of the gain starts at or above it). "
                    "Must include a metric the reward model does not produce (not only reward_mean). Empty ({}): no "
                    "declared 0/1 metric drops more than 2 points, KL to the SFT model stays under 2, and one of them "
                    "gains beyond noise. A report whose reward-hacking alarm went off never passes.",
        additionalProperties={"type": "object", "minProperties": 1, "additionalProperties": False,
                              "properties": {k: {"type": "number"} for k in ("min", "max", "min_gain", "max_drop", "min_gain_lower")}},
    ),
    "fault_injection": Param(
        DEFAULTS["fault_injection"], type="object", title="Fault injection (testing)",
        description='Testing only: {"stage": "rl", "after_step": 12} fails that stage once, right after its checkpoint '
                    "of that step (a multiple of its checkpoint interval); its rerun resumes from there.",
        properties={"stage": {"type": "string", "enum": list(TRAINING_STAGES)}, "after_step": {"type": "integer", "minimum": 1}},
        additionalProperties=False,
    ),
}



def branch_for(params) -> list[str]:
    """The tasks of the branch the `method` Param picks: RL's reward model is left out with an environment,
    whose rewards RL trains on (rl then runs with reward_model skipped: its trigger rule)."""
    if params["method"] == "rl":
        return ["rl"] if params.get("environment") else ["reward_model", "rl"]
    return [params["method"]]


def planned_problems(dag, params, context) -> list[str]:
    """Each stage on this run's path with the flags its operator would submit (an upstream stage's output as a
    placeholder URI), checked by the stage's own config (tasks.validate: standard library and yaml, no model
    loaded): one line per stage that would refuse them."""
    from airflow.sdk.definitions.xcom_arg import XComArg

    from tasks.validate import check_stage

    running = {"prepare_data", "sft", *branch_for(params), "eval", "promote"}

    def placeholder(task_id: str) -> str:  # what an upstream stage's output URI stands for here
        return f"s3://validate/{task_id}/manifest.json"

    class PlannedXComs:
        """`ti` for the templates: an upstream that will run gives its output's placeholder; a skipped one, nothing."""

        def xcom_pull(self, task_ids=None, **_):
            return placeholder(task_ids) if task_ids in running else None

    problems = []
    for op in dag.tasks:
        if not isinstance(op, RayJobOperator) or op.task_id not in running:
            continue
        args = {k: placeholder(v.operator.task_id) if isinstance(v, XComArg) else v for k, v in op.args.items()}
        flags = op.render_template(args, {**context, "params": params, "ti": PlannedXComs()})
        why = check_stage(op.module, {"output": "s3://validate/output", "run_id": context["run_id"], **flags})
        if why:
            problems.append(f"{op.task_id}: {why}")
    return problems


def missing_inputs(params, render) -> list[str]:
    """The run's own inputs on S3 that are not there: a dataset, base model, environment or metric file given as an
    s3:// URI, and a registered dataset (dataset:<name>) with no version under the datasets root (`render` turns
    a template into this run's value). Local paths and hub ids live on the Ray nodes: their stage checks them."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    hook = S3Hook(aws_conn_id="rlhf_s3")
    wanted = {name: params.get(name) or "" for name in ("dataset", "base_model", "environment", "eval_metric_func")}
    if wanted["dataset"].startswith("dataset:"):
        name = wanted["dataset"].removeprefix("dataset:").split("@")[0]
        wanted["dataset"] = f"{render(DATASETS_ROOT)}/{name}/"
    problems = []
    for name, uri in wanted.items():
        if not uri.startswith("s3://"):
            continue
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        try:
            found = hook.check_for_key(key, bucket) if key and not key.endswith("/") and "." in key.rsplit("/", 1)[-1] \
                else bool(hook.list_keys(bucket, prefix=key.rstrip("/") + "/" if key else "", max_items=1))
        except Exception as exc:  # a missing bucket, no access: the same answer, with botocore's cause
            found, uri = False, f"{uri} ({' '.join(str(exc).split())[:200]})"
        if not found:
            problems.append(f"{name}: {uri} does not exist; upload it or fix the URI")
    return problems


def training_args(stage: str, steps_param: str) -> dict:
    """The flags every training stage gets from the run form, beside its own."""
    return {
        "seed": "{{ params.seed }}",
        "zero_stage": "{{ params.zero_stage }}",
        "save_steps": "{{ save_steps(params.%s, params.checkpoints_per_stage) }}" % steps_param,
        "fail_after_step": "{{ fail_after('%s', params.fault_injection) }}" % stage,
        "apply_chat_template": "{{ params.apply_chat_template }}",
        "lora_rank": "{{ params.lora_rank }}",
    }


def stage(task_id: str, module: str, args: dict, inlets: list[str] = (), outlet: str | None = None, **kwargs) -> RayJobOperator:
    return RayJobOperator(
        task_id=task_id,
        module=module,
        args=args,
        pool=GPU_POOL,
        pool_slots=max(1, STAGE_GPUS[task_id]),
        inlets=[ASSETS[name] for name in inlets],
        outlets=[ASSETS[outlet]] if outlet else [],
        **kwargs,
    )


def build_pipeline(dag_id: str, schedule, description: str, allow_promotion: bool, doc_md: str | None = None,
                   tags: tuple[str, ...] = (), dataset: str | None = None) -> DAG:
    """The pipeline DAG; `allow_promotion` is the default of the Param of that name, `dataset` (when given)
    the default of the dataset Param: a scheduled run takes no form, so its data comes from here."""
    params = {**PARAMS, "allow_promotion": promotion_param(allow_promotion)}
    if dataset:
        base = PARAMS["dataset"]
        params["dataset"] = Param(dataset, description=base.description, **{k: v for k, v in base.schema.items() if k != "default"})
    with DAG(
        dag_id=dag_id,
        description=description,
        doc_md=doc_md or __doc__,
        schedule=schedule,
        catchup=False,
        max_active_runs=1,
        tags=["rlhf", "ray", "s3", *tags],
        params=params,
        # A scheduled run fails with nobody watching: post it to the webhook (plugins/notifiers.py).
        on_failure_callback=WebhookNotifier("nightly_failure") if schedule is not None else None,
        user_defined_macros={"save_steps": save_steps, "fail_after": fail_after, "fixed_data": fixed_data},
        default_args={
            "retries": 1,
            "retry_delay": timedelta(seconds=30),
            "deadline_minutes": "{{ params.stage_deadline_minutes }}",
            "cache": "{{ params.use_cache }}",
        },
    ) as dag:
        @task(task_id="validate", retries=0)
        def validate(params=None, dag=None, **context) -> None:
            """The whole run's flags, checked by each stage's own config before any Ray job: a form the stages
            would refuse fails here, one line per stage, and nothing downstream runs."""
            from airflow.sdk.exceptions import AirflowFailException

            context = {**context, "dag": dag, "params": params}
            problems = missing_inputs(params, lambda template: dag.get_task("prepare_data").render_template(template, context))
            problems += planned_problems(dag, params, context)
            if problems:
                raise AirflowFailException("this run's Params would fail its stages; fix them and trigger again:\n" + "\n".join(problems))

        prepare_data = stage("prepare_data", "tasks.data", {
            "source": "{{ params.dataset }}",
            "base_model": "{{ params.base_model }}",
            "seed": "{{ params.seed }}",
            "datasets_root": DATASETS_ROOT,
            **{name: ("{{ params.%s or '' }}" if name.endswith("_key") else "{{ params.%s }}") % name for name in DATASET_FLAGS},
        }, outlet="prepared_data",
            # A file's content or dataset:<name>'s newest version may change under the same flags: only the demo
            # and a pinned version are the same data whenever the flags are.
            cache="{{ params.use_cache and fixed_data(params.dataset) }}")
        sft = stage("sft", "tasks.sft", {
            "pretrain": prepare_data.output,
            "dataset": prepare_data.output,
            "max_steps": "{{ params.sft_steps }}",
            "learning_rate": "{{ params.sft_learning_rate }}",
            **training_args("sft", "sft_steps"),
        }, inlets=["prepared_data"], outlet="sft_model")

        @task.branch(task_id="choose_method")
        def choose_method(params=None) -> list[str]:
            return branch_for(params)

        method = choose_method()
        reward_model = stage("reward_model", "tasks.reward_model", {
            "pretrain": sft.output,
            "dataset": prepare_data.output,
            "max_steps": "{{ params.rm_steps }}",
            "learning_rate": "{{ params.rm_learning_rate }}",
            **training_args("reward_model", "rm_steps"),
        }, inlets=["sft_model", "prepared_data"], outlet="reward_model")
        # With an environment: RL's episodes and eval's play the same one, within the same limits.
        episode_args = {
            "env_path": "{{ params.environment or '' }}",
            "max_turns": "{{ params.max_turns }}",
            "max_episode_tokens": "{{ params.max_episode_tokens }}",
        }
        rl = stage("rl", "tasks.rl", {
            "pretrain": sft.output,
            "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",  # none with an environment
            "prompt_data": prepare_data.output,
            "generate_max_len": "{{ params.generate_max_len }}",
            **episode_args,
            "max_steps": "{{ params.rl_steps }}",
            "actor_learning_rate": "{{ params.actor_learning_rate }}",
            "critic_learning_rate": "{{ params.critic_learning_rate }}",
            "init_kl_coef": "{{ params.init_kl_coef }}",
            "lambd": "{{ params.gae_lambda }}",
            # PPO-ptx on the run's own SFT split: the demo's accuracy held on every seed only with it (README's design notes).
            "ptx_coef": "{{ params.ptx_coef }}",
            "pretrain_data": "{{ ti.xcom_pull(task_ids='prepare_data') if params.ptx_coef else '' }}",
            "advantage_estimator": "{{ params.advantage_estimator }}",
            "n_samples_per_prompt": "{{ params.n_samples_per_prompt }}",
            "colocate_all_models": "{{ params.colocate_all_models }}",
            **training_args("rl", "rl_steps"),
        }, inlets=["sft_model", "reward_model"], outlet="policy", trigger_rule="none_failed_min_one_success")
        # DPO on the demo's style pairs (right answers both sides) with an NLL term on the chosen side, which
        # keeps the answers' likelihood from sliding (without it, accuracy fell 25 points for 27 of style);
        # KTO on the unpaired thumbs-up/down split.
        preference_args = {
            "pretrain": sft.output,
            "dataset": prepare_data.output,
            "max_steps": "{{ params.preference_steps }}",
            "learning_rate": "{{ params.preference_learning_rate }}",
        }
        dpo = stage("dpo", "tasks.preference", {
            **preference_args, **training_args("dpo", "preference_steps"),
            "method": "dpo", "dataset_split": "style_pairs", "beta": "{{ params.dpo_beta }}", "nll_loss_coef": 0.5,
        }, inlets=["sft_model", "prepared_data"], outlet="policy")
        # Thumbs-down examples weigh less: pushing their (right) answers down costs accuracy (measured: weight 1
        # lost 29 points of accuracy for 39 of style; 0.3 gained 14 and 38).
        kto = stage("kto", "tasks.preference", {
            **preference_args, **training_args("kto", "preference_steps"),
            "method": "kto", "dataset_split": "unpaired", "beta": "{{ params.kto_beta }}", "undesirable_weight": 0.3,
        }, inlets=["sft_model", "prepared_data"], outlet="policy")
        eval_ = stage("eval", "tasks.eval", {
            "baseline": sft.output,
            "policy": "{{ ti.xcom_pull(task_ids='rl') or ti.xcom_pull(task_ids='dpo') or ti.xcom_pull(task_ids='kto') }}",
            "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",
            "dataset": prepare_data.output,
            "registry": REGISTRY,
            "max_samples": "{{ params.eval_max_samples }}",
            "generate_max_len": "{{ params.generate_max_len }}",
            **episode_args,
            # The demo's own metrics (answer and style) when the data is the demo's; else what the form declares.
            "metrics": "{{ params.eval_metrics or '' }}",
            "metric_func": "{{ params.eval_metric_func or ('tasks/data/demo_metrics.py' if params.dataset == 'demo' else '') }}",
            "n_samples_per_prompt": "{{ params.eval_samples_per_prompt }}",
            "slice_key": "{{ params.eval_slice_key or '' }}",
            "judge_url": "{{ params.eval_judge_url or '' }}",
            "judge_model": "{{ params.eval_judge_model }}",
            "lm_eval_tasks": "{{ params.eval_lm_eval_tasks or '' }}",
            "lm_eval_include_path": "{{ params.eval_lm_eval_include_path or '' }}",
            "lm_eval_limit": "{{ params.eval_lm_eval_limit }}",
            "seed": "{{ params.seed }}",
            "apply_chat_template": "{{ params.apply_chat_template }}",
        }, inlets=["policy"], outlet="eval_report",
            # Runs after whichever branch ran (the skipped branch's XComs are empty). Never cached: it also
            # scores the registry's current champion.
            trigger_rule="none_failed_min_one_success", cache=False)
        promote = stage("promote", "tasks.promote", {
            "evaluation": eval_.output,
            "registry": REGISTRY,
            "gate": "{{ params.promotion_gate | tojson }}",
            "allow_promotion": "{{ params.allow_promotion }}",
            "promoted_by": "{{ dag.dag_id }} run {{ run_id }}",
        }, inlets=["eval_report"], cache=False,
            on_success_callback=WebhookNotifier("decision"))  # promotion or rejection, with the gate's metrics

        @task(task_id="champion", outlets=[ASSETS["champion"]])
        def champion(decision_manifest: str, outlet_events=None) -> str:
            """Emit the champion Asset's event when `promote` promoted; skipped otherwise."""
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook
            from airflow.sdk.exceptions import AirflowSkipException

            record = json.loads(S3Hook(aws_conn_id="rlhf_s3").read_key(decision_manifest))
            if not record["metrics"].get("promoted"):
                raise AirflowSkipException(record.get("decision", "not promoted"))
            outlet_events[ASSETS["champion"]].extra = {"champion": record["champion"], "decision": record["decision"],
                                                       "promotion": decision_manifest}
            return record["champion"]

        chain(validate(), prepare_data, sft, method, [reward_model, dpo, kto])
        chain(reward_model, rl, eval_)
        method >> rl  # a branch of its own with an environment (choose_method)
        chain([dpo, kto], eval_)
        chain(eval_, promote, champion(promote.output))
    return dag
