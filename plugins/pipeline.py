"""The RLHF pipeline as Airflow tasks, built once for every DAG that runs it.

    build_pipeline(dag_id="rlhf_pipeline", schedule=None, allow_promotion=False)

validate -> prepare_data -> sft -> choose_method -> (reward_model -> rl | dpo | kto) -> eval -> promote -> champion

`validate` builds every stage's config from the flags its task would submit (tasks/common/stages.py: the stage
configs need only the standard library and yaml), so a form the stages would refuse fails before any Ray job; it
also refuses a text base model with a dataset that has images (plugins/modality.py: read from config.json's
vision_config and the data's columns, no torch).

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
manifest URI and metrics. The run form (the Params) is plugins/form.py. No torch is imported here: the
stage configs (tasks/<stage>/config.py, standard library and yaml) are, by the form and by `validate`.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Asset, Param, chain, task

from plugins.form import PARAMS, form_flags, optional, promotion_param
from plugins.hooks import RayJobHook, RayUnreachableError
from plugins.modality import run_problems
from plugins.notifiers import WebhookNotifier
from plugins.operators import OUTPUT_ROOT, RayJobOperator, fill_empty
from plugins.s3 import S3Error, S3Store, split_uri
from tasks.common import names
from tasks.common.stages import PIPELINE_TASKS, STAGES

#: A model's registry folder (champion.json, history/, candidates/), templated like the stages' output.
REGISTRY = OUTPUT_ROOT + "/models/{{ params.model_name }}"

#: Where prepare_data registers dataset versions: <root>/<name>/<version>/ (tasks/data/versions.py).
DATASETS_ROOT = OUTPUT_ROOT + "/datasets"

#: Lineage in the Assets view: base model and data -> SFT -> reward model -> policy -> report -> champion.
ASSETS = {
    name: Asset(name=f"rlhf_flow.{name}", uri=f"rlhf-flow://assets/{name}")
    for name in ("prepared_data", "sft_model", "reward_model", "policy", "eval_report", "champion")
}


def fail_after(stage: str, fault: dict) -> int:
    """The step after which the fault_injection Param fails `stage` (0: it does not)."""
    return int(fault.get("after_step", 0)) if fault and fault.get("stage") == stage else 0


def fixed_data(dataset: str) -> bool:
    """Whether the dataset Param names the same data every time: a built-in task, or a pinned dataset:<name>@<version>."""
    return dataset in ("demo", "calculator", "guess", "demo_vlm") or (dataset.startswith("dataset:") and "@" in dataset)


def branch_for(params) -> list[str]:
    """The tasks of the branch the `method` Param picks: RL's reward model is left out with an environment,
    whose rewards RL trains on (rl then runs with reward_model skipped: its trigger rule)."""
    if params["method"] == "rl":
        return ["rl"] if params.get("environment") else ["reward_model", "rl"]
    return [params["method"]]


def planned_problems(dag, params, context, cluster: dict[str, float] | None = None) -> list[str]:
    """Each stage on this run's path with the flags its operator would submit (an upstream stage's output as a
    placeholder URI), checked by the stage's own config (tasks.common.stages: standard library and yaml, no model
    loaded): one line per stage that would refuse them, and, given the Ray cluster's total resources, per
    stage whose worker groups it could never place."""
    from airflow.sdk.definitions.xcom_arg import XComArg

    from tasks.common.config import ConfigError
    from tasks.common.stages import oversized, stage_config

    running = {"prepare_data", "sft", *branch_for(params), "eval", "promote"}

    def placeholder(task_id: str) -> str:  # what an upstream stage's output URI stands for here
        return f"s3://validate/{task_id}/manifest.json"

    class PlannedXComs:
        """`ti` for the templates: an upstream that will run gives its output's placeholder; a skipped one, nothing."""

        def xcom_pull(self, task_ids=None, **_):
            return placeholder(task_ids) if task_ids in running else None

    problems, configs = [], {}
    for op in dag.tasks:
        if not isinstance(op, RayJobOperator) or op.task_id not in running:
            continue
        args = {k: placeholder(v.operator.task_id) if isinstance(v, XComArg) else v for k, v in op.args.items()}
        flags = op.render_template(args, {**context, "params": params, "ti": PlannedXComs()})
        try:
            configs[op.task_id] = stage_config(
                op.module, {"output": "s3://validate/output", "run_id": context["run_id"], **flags}
            )
        except ConfigError as e:
            problems.append(f"{op.task_id}: {e}")
    return problems + (oversized(configs, cluster) if cluster is not None else [])


def missing_inputs(params, render) -> list[str]:
    """The run's own inputs on S3 that are not there: a dataset, base model, environment or metric file given as an
    s3:// URI, and a registered dataset (dataset:<name>) with no version under the datasets root (`render` turns
    a template into this run's value). Local paths and hub ids live on the Ray nodes: their stage checks them."""
    store = S3Store(names.S3_CONN)
    wanted = {name: params.get(name) or "" for name in ("dataset", "base_model", "environment", "eval_metric_func")}
    if wanted["dataset"].startswith("dataset:"):
        name = wanted["dataset"].removeprefix("dataset:").split("@")[0]
        wanted["dataset"] = f"{render(DATASETS_ROOT)}/{name}/"
    problems = []
    for name, uri in wanted.items():
        if not uri.startswith("s3://"):
            continue
        bucket, key = split_uri(uri)
        try:
            found = (
                store.exists(uri)
                if key and not key.endswith("/") and "." in key.rsplit("/", 1)[-1]
                else bool(store.objects(f"s3://{bucket}/" + (key.rstrip("/") + "/" if key else ""), limit=1))
            )
        except S3Error as exc:  # a missing bucket, no access: the same answer, with botocore's cause
            found, uri = False, f"{uri} ({' '.join(str(exc.__cause__).split())[:200]})"
        if not found:
            problems.append(f"{name}: {uri} does not exist; upload it or fix the URI")
    return problems


def stage(task_id: str, args: dict, inlets: list[str] = (), outlet: str | None = None, **kwargs) -> RayJobOperator:
    """The stage task `task_id`: its flags from the form (plugins.form.form_flags), then `args`, what is wired by
    hand (upstream outputs, the stage's constants; one may override a form flag). A training stage's fault
    injection comes from the fault_injection Param."""
    name = PIPELINE_TASKS[task_id]
    fault = (
        {"fail_after_step": "{{ fail_after('%s', params.fault_injection) }}" % task_id} if STAGES[name].trains else {}
    )
    return RayJobOperator(
        task_id=task_id,
        module=STAGES[name].package,
        args={**form_flags(task_id), **fault, **args},
        pool=names.GPU_POOL,
        pool_slots=max(1, STAGES[PIPELINE_TASKS[task_id]].gpus),  # the GPUs it asks Ray for
        inlets=[ASSETS[name] for name in inlets],
        outlets=[ASSETS[outlet]] if outlet else [],
        **kwargs,
    )


def build_pipeline(
    dag_id: str,
    schedule,
    description: str,
    allow_promotion: bool,
    doc_md: str | None = None,
    tags: tuple[str, ...] = (),
    dataset: str | None = None,
) -> DAG:
    """The pipeline DAG; `allow_promotion` is the default of the Param of that name, `dataset` (when given)
    the default of the dataset Param: a scheduled run takes no form, so its data comes from here."""
    params = {**PARAMS, "allow_promotion": optional(promotion_param(allow_promotion))}
    if dataset:
        base = PARAMS["dataset"]
        params["dataset"] = Param(
            dataset, description=base.description, **{k: v for k, v in base.schema.items() if k != "default"}
        )
    defaults = {name: param.value for name, param in params.items()}  # what a field left empty means (fill_empty)
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
        user_defined_macros={"fail_after": fail_after, "fixed_data": fixed_data},
        default_args={
            "retries": 1,
            "retry_delay": timedelta(seconds=30),
            "deadline_minutes": "{{ params.stage_deadline_minutes }}",
            "cache": "{{ params.use_cache }}",
            "param_defaults": defaults,  # the stage operators' (RayJobOperator): a field left empty is its default
        },
    ) as dag:

        @task(task_id="validate", retries=0)
        def validate(params=None, dag=None, **context) -> None:
            """The whole run's flags, checked by each stage's own config before any Ray job: a form the stages
            would refuse fails here, one line per stage, and nothing downstream runs."""
            from airflow.sdk.exceptions import AirflowFailException

            params = fill_empty(params, defaults)
            context = {**context, "dag": dag, "params": params}
            render = lambda template: dag.get_task("prepare_data").render_template(template, context)  # noqa: E731
            problems = missing_inputs(params, render)
            # A text model with an image dataset would never see the images (plugins/modality.py).
            problems += run_problems(params, S3Store(names.S3_CONN), render(DATASETS_ROOT))
            try:
                cluster = RayJobHook().cluster_resources()
            except RayUnreachableError as e:  # every stage would fail to submit: say so now
                cluster, problems = None, problems + [f"ray: {e}"]
            problems += planned_problems(dag, params, context, cluster)
            if problems:
                raise AirflowFailException(
                    "this run's Params would fail its stages; fix them and trigger again:\n" + "\n".join(problems)
                )

        prepare_data = stage(
            "prepare_data",
            {"source": "{{ params.dataset }}", "base_model": "{{ params.base_model }}", "datasets_root": DATASETS_ROOT},
            outlet="prepared_data",
            # A file's content or dataset:<name>'s newest version may change under the same flags: only the demo
            # and a pinned version are the same data whenever the flags are.
            cache="{{ params.use_cache and fixed_data(params.dataset) }}",
        )
        sft = stage(
            "sft",
            {"pretrain": prepare_data.output, "dataset": prepare_data.output},
            inlets=["prepared_data"],
            outlet="sft_model",
        )

        @task.branch(task_id="choose_method")
        def choose_method(params=None) -> list[str]:
            return branch_for(fill_empty(params, defaults))

        method = choose_method()
        reward_model = stage(
            "reward_model",
            {"pretrain": sft.output, "dataset": prepare_data.output},
            inlets=["sft_model", "prepared_data"],
            outlet="reward_model",
        )
        # With an environment, RL's episodes and eval's play the same one, within the same limits (form.FEEDS).
        rl = stage(
            "rl",
            {
                "pretrain": sft.output,
                "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",  # none with an environment
                "prompt_data": prepare_data.output,
                # PPO-ptx on the run's own SFT split: the demo's accuracy held on every seed only with it (docs/design-notes.md).
                "pretrain_data": "{{ ti.xcom_pull(task_ids='prepare_data') if params.ptx_coef else '' }}",
            },
            inlets=["sft_model", "reward_model"],
            outlet="policy",
            trigger_rule="none_failed_min_one_success",
        )
        # DPO on the demo's style pairs (right answers both sides) with an NLL term on the chosen side, which
        # keeps the answers' likelihood from sliding (without it, accuracy fell 25 points for 27 of style);
        # KTO on the unpaired thumbs-up/down split.
        preference_args = {"pretrain": sft.output, "dataset": prepare_data.output}
        dpo = stage(
            "dpo",
            {**preference_args, "method": "dpo", "dataset_split": "style_pairs", "nll_loss_coef": 0.5},
            inlets=["sft_model", "prepared_data"],
            outlet="policy",
        )
        # Thumbs-down examples weigh less: pushing their (right) answers down costs accuracy (measured: weight 1
        # lost 29 points of accuracy for 39 of style; 0.3 gained 14 and 38).
        kto = stage(
            "kto",
            {**preference_args, "method": "kto", "dataset_split": "unpaired", "undesirable_weight": 0.3},
            inlets=["sft_model", "prepared_data"],
            outlet="policy",
        )
        eval_ = stage(
            "eval",
            {
                "baseline": sft.output,
                "policy": "{{ ti.xcom_pull(task_ids='rl') or ti.xcom_pull(task_ids='dpo') or ti.xcom_pull(task_ids='kto') }}",
                "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",
                "dataset": prepare_data.output,
                "registry": REGISTRY,
                # The demo's own metrics (answer and style) when the data is the demo's; else the form's file.
                "metric_func": "{{ params.eval_metric_func or ('tasks/data/demo_metrics.py' if params.dataset == 'demo' else '') }}",
            },
            inlets=["policy"],
            outlet="eval_report",
            # Runs after whichever branch ran (the skipped branch's XComs are empty). Never cached: it also
            # scores the registry's current champion.
            trigger_rule="none_failed_min_one_success",
            cache=False,
        )
        promote = stage(
            "promote",
            {
                "evaluation": eval_.output,
                "registry": REGISTRY,
                "gate": "{{ params.promotion_gate | tojson }}",
                "allow_promotion": "{{ params.allow_promotion }}",
                "promoted_by": "{{ dag.dag_id }} run {{ run_id }}",
            },
            inlets=["eval_report"],
            cache=False,
            on_success_callback=WebhookNotifier("decision"),
        )  # promotion or rejection, with the gate's metrics

        @task(task_id="champion", outlets=[ASSETS["champion"]])
        def champion(decision_manifest: str, outlet_events=None) -> str:
            """Emit the champion Asset's event when `promote` promoted; skipped otherwise."""
            from airflow.sdk.exceptions import AirflowSkipException

            record = S3Store(names.S3_CONN).read_json(decision_manifest)
            if not record["metrics"].get("promoted"):
                raise AirflowSkipException(record.get("decision", "not promoted"))
            outlet_events[ASSETS["champion"]].extra = {
                "champion": record["champion"],
                "decision": record["decision"],
                "promotion": decision_manifest,
            }
            return record["champion"]

        chain(validate(), prepare_data, sft, method, [reward_model, dpo, kto])
        chain(reward_model, rl, eval_)
        method >> rl  # a branch of its own with an environment (choose_method)
        chain([dpo, kto], eval_)
        chain(eval_, promote, champion(promote.output))
    return dag
