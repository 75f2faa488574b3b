"""The rlhf_pipeline and rlhf_nightly DAGs: parse cleanly, are wired as designed, validate their run
form; and rlhf_pipeline runs end to end down each branch."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import REPO, ray_headers

DAGS = REPO / "dags"
ORDER = [
    "validate",
    "prepare_data",
    "sft",
    "choose_method",
    "reward_model",
    "rl",
    "dpo",
    "kto",
    "eval",
    "promote",
    "champion",
]
BRANCHES = {"rl": ["reward_model", "rl"], "dpo": ["dpo"], "kto": ["kto"]}


REGISTRY = "s3://{{ params.bucket or conn.rlhf_s3.extra_dejson.get('bucket') or 'rlhf-flow' }}/{{ params.prefix }}/models/{{ params.model_name }}"
FAULT = "{{ fail_after('%s', params.fault_injection) }}"
# What each stage gets by hand, beside its flags from the form (plugins.form.form_flags, checked below): flag ->
# upstream task whose manifest URI it receives, or the template or constant it is.
WIRING = {
    "prepare_data": {
        "source": "params.dataset",
        "base_model": "params.base_model",
        "datasets_root": REGISTRY.replace("/models/{{ params.model_name }}", "/datasets"),
    },
    "sft": {"pretrain": "prepare_data", "dataset": "prepare_data", "fail_after_step": FAULT % "sft"},
    "reward_model": {"pretrain": "sft", "dataset": "prepare_data", "fail_after_step": FAULT % "reward_model"},
    "rl": {
        "pretrain": "sft",
        "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",
        "prompt_data": "prepare_data",
        "pretrain_data": "{{ ti.xcom_pull(task_ids='prepare_data') if params.ptx_coef else '' }}",  # PPO-ptx's SFT rows
        "fail_after_step": FAULT % "rl",
    },
    **{
        method: {
            "method": method,
            "pretrain": "sft",
            "dataset": "prepare_data",
            "fail_after_step": FAULT % method,
            **extra,
        }
        for method, extra in (
            ("dpo", {"dataset_split": "style_pairs", "nll_loss_coef": 0.5}),
            ("kto", {"dataset_split": "unpaired", "undesirable_weight": 0.3}),
        )
    },
    "eval": {
        "baseline": "sft",
        "dataset": "prepare_data",
        # whichever branch ran: a template over both branches' XComs
        "policy": "{{ ti.xcom_pull(task_ids='rl') or ti.xcom_pull(task_ids='dpo') or ti.xcom_pull(task_ids='kto') }}",
        "reward_pretrain": "{{ ti.xcom_pull(task_ids='reward_model') or '' }}",
        "registry": REGISTRY,
        # the demo's own metrics for the demo's data: overrides the form's flag
        "metric_func": "params.eval_metric_func or ('tasks/data/demo_metrics.py' if params.dataset == 'demo' else '')",
    },
    "promote": {
        "evaluation": "eval",
        "registry": REGISTRY,
        "gate": "{{ params.promotion_gate | tojson }}",
        "allow_promotion": "params.allow_promotion",
        "promoted_by": "{{ dag.dag_id }} run {{ run_id }}",
    },
}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["rlhf_pipeline"]


@pytest.fixture
def pipeline_to_test(airflow_db):
    """The pipeline DAG from a DagBag of its own, synced to the DB, for one dag.test() run: dag.test() in this
    process leaves its run_conf in the DAG's params, so a shared DAG handed one run's Params to the next (seen
    2026-12-03: the refused form's rloo with 1 sample failed the agentic run's validate task)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    dagbag = DagBag(dag_folder=str(DAGS))
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(dagbag, "dags-folder", None)
    return dagbag.dags["rlhf_pipeline"]


def test_dag_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"rlhf_pipeline", "rlhf_nightly"} <= set(dagbag.dags)


def test_dag_parses_without_torch():
    """The DAG processor side installs no torch: parsing the DAG must not need it. It reads the stage configs
    (standard library and yaml), which its form is made from."""
    code = (
        "import sys; from airflow.dag_processing.dagbag import DagBag; "
        f"bag = DagBag(dag_folder={str(DAGS)!r}); assert not bag.import_errors, bag.import_errors; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed', 'ray', 'vllm', 'peft')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_dag_settings(dag, dagbag):
    assert dag.schedule is None
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert {"rlhf", "ray"} <= set(dag.tags)
    nightly = dagbag.dags["rlhf_nightly"]
    assert type(nightly.timetable).__name__ == "CronTriggerTimetable"
    assert nightly.timetable.expression == "0 2 * * *" and str(nightly.timetable.timezone) == "UTC"
    assert nightly.catchup is False and nightly.max_active_runs == 1
    # The same pipeline; only who may promote differs.
    assert nightly.task_ids == dag.task_ids
    assert nightly.params["allow_promotion"] is True and dag.params["allow_promotion"] is False


def test_stage_tasks_share_the_gpu_pool_cache_deadline_and_lineage(dag):
    from tasks.common.names import GPU_POOL  # the pool tools/stack creates
    from tasks.common.stages import PIPELINE_TASKS, STAGES

    ray_tasks = {t.task_id for t in dag.tasks if type(t).__name__ == "RayJobOperator"}
    assert ray_tasks == set(PIPELINE_TASKS)  # the registry names every stage task, and nothing else
    for task_id, name in PIPELINE_TASKS.items():
        task = dag.get_task(task_id)
        assert task.module == STAGES[name].package
        assert task.pool == GPU_POOL and task.pool_slots == max(1, STAGES[name].gpus), task_id
        assert task.deadline_minutes == "{{ params.stage_deadline_minutes }}"
        # prepare_data reuses an output only when the data cannot have changed under the same flags.
        assert task.cache == {
            "eval": False,
            "promote": False,
            "prepare_data": "{{ params.use_cache and fixed_data(params.dataset) }}",
        }.get(task_id, "{{ params.use_cache }}"), task_id
    lineage = {
        t: ([a.name for a in dag.get_task(t).inlets], [a.name for a in dag.get_task(t).outlets])
        for t in ("prepare_data", "sft", "reward_model", "rl", "dpo", "eval", "champion")
    }
    assert lineage == {
        "prepare_data": ([], ["rlhf_flow.prepared_data"]),
        "sft": (["rlhf_flow.prepared_data"], ["rlhf_flow.sft_model"]),
        "reward_model": (["rlhf_flow.sft_model", "rlhf_flow.prepared_data"], ["rlhf_flow.reward_model"]),
        "rl": (["rlhf_flow.sft_model", "rlhf_flow.reward_model"], ["rlhf_flow.policy"]),
        "dpo": (["rlhf_flow.sft_model", "rlhf_flow.prepared_data"], ["rlhf_flow.policy"]),
        "eval": (["rlhf_flow.policy"], ["rlhf_flow.eval_report"]),
        "champion": ([], ["rlhf_flow.champion"]),
    }


def test_task_order(dag):
    assert [t.task_id for t in dag.topological_sort()] == ORDER
    upstream = {t: dag.get_task(t).upstream_task_ids for t in ORDER}
    assert (
        upstream["validate"] == set()
        and upstream["prepare_data"] == {"validate"}
        and upstream["choose_method"] == {"sft"}
    )
    assert upstream["reward_model"] >= {"choose_method", "sft"} and upstream["rl"] >= {
        "reward_model",
        "sft",
        "choose_method",
    }
    assert (
        dag.get_task("rl").trigger_rule == "none_failed_min_one_success"
    )  # runs with reward_model skipped (an environment)
    assert upstream["dpo"] >= {"choose_method", "sft"} and upstream["kto"] >= {"choose_method", "sft"}
    assert upstream["eval"] >= {"rl", "dpo", "kto"}
    assert dag.get_task("eval").trigger_rule == "none_failed_min_one_success"
    assert upstream["promote"] == {"eval"} and upstream["champion"] == {"promote"}


def test_stage_inputs_are_upstream_manifests_and_params(dag):
    """Each stage task's flags: its hand wiring (WIRING: upstream manifests, templates, constants) and, for the rest,
    exactly the form's fields that feed it, each rendering its Param under the stage field's name."""
    from airflow.sdk.definitions.xcom_arg import XComArg

    from plugins.form import FEEDS, PARAMS, STAGE_PARAMS, tasks_running

    for task_id, wiring in WIRING.items():
        task = dag.get_task(task_id)
        assert type(task).__name__ == "RayJobOperator"
        for flag, source in wiring.items():
            value = task.args[flag]
            if (
                not isinstance(source, str)
                or source.startswith(("{{", "s3://"))
                or source in ("dpo", "kto", "style_pairs", "unpaired")
            ):
                assert value == source, (task_id, flag, value)
            elif source.startswith("params."):
                assert value == "{{ %s }}" % source, (task_id, flag, value)
            else:
                assert isinstance(value, XComArg), (task_id, flag, value)
                assert value.operator.task_id == source and value.key == "return_value", (task_id, flag)
        from_form = {
            field_name: name
            for name, (module, field_name, _) in STAGE_PARAMS.items()
            if task_id in FEEDS.get(name, tasks_running(module)) and field_name not in wiring
        }
        assert set(task.args) == set(wiring) | set(from_form), task_id
        for field_name, name in from_form.items():
            empty_as = " or ''" if PARAMS[name].value is None else ""  # an emptied field arrives as its default
            assert task.args[field_name] == "{{ params.%s%s }}" % (name, empty_as), (task_id, field_name)
        assert task.output_root == REGISTRY.removesuffix("/models/{{ params.model_name }}")
    # A few by name: a Param whose field is named otherwise, the two betas, what every training stage shares.
    assert dag.get_task("rl").args["lambd"] == "{{ params.gae_lambda }}"
    assert dag.get_task("rl").args["env_path"] == dag.get_task("eval").args["env_path"] == "{{ params.environment }}"
    assert (dag.get_task("dpo").args["beta"], dag.get_task("kto").args["beta"]) == (
        "{{ params.dpo_beta }}",
        "{{ params.kto_beta }}",
    )
    for task_id in ("sft", "reward_model", "rl", "dpo", "kto"):
        assert dag.get_task(task_id).args["num_checkpoints"] == "{{ params.checkpoints_per_stage }}"
        assert dag.get_task(task_id).args["seed"] == "{{ params.seed }}"
    assert (
        "num_checkpoints" not in dag.get_task("eval").args and dag.get_task("eval").args["seed"] == "{{ params.seed }}"
    )
    # A vision-language model's fields: the image column is the user's file's, read by prepare_data alone (the splits
    # keep the images under `images`, every later stage's default); the frozen tower reaches each stage that trains one.
    assert [t for t in ORDER if "image_key" in getattr(dag.get_task(t), "args", {})] == ["prepare_data"]
    frozen = [t for t in ORDER if "freeze_visual_encoder" in getattr(dag.get_task(t), "args", {})]
    assert {"sft", "reward_model", "dpo", "kto"} <= set(frozen) and "prepare_data" not in frozen
    assert dag.get_task("dpo").args["freeze_visual_encoder"] == "{{ params.freeze_visual_encoder }}"
    # Every stage-backed field of the form reaches a stage.
    assert all(FEEDS.get(name, tasks_running(module)) for name, (module, _, _) in STAGE_PARAMS.items())


def test_params_form(dag):
    import dags.rlhf_pipeline as pipeline

    params = dag.params
    assert params.validate() == pipeline.DEFAULTS  # the defaults are valid, and are the one dict's
    expected = {
        "bucket",
        "prefix",
        "dataset",
        "base_model",
        "seed",
        "sft_steps",
        "sft_learning_rate",
        "rm_steps",
        "rm_learning_rate",
        "rl_steps",
        "actor_learning_rate",
        "critic_learning_rate",
        "init_kl_coef",
        "gae_lambda",
        "ptx_coef",
        "advantage_estimator",
        "n_samples_per_prompt",
        "colocate_all_models",
        "rollout_engine",
        "zero_stage",
        "eval_max_samples",
        "method",
        "preference_steps",
        "preference_learning_rate",
        "dpo_beta",
        "kto_beta",
        "checkpoints_per_stage",
        "use_cache",
        "stage_deadline_minutes",
        "model_name",
        "allow_promotion",
        "promotion_gate",
        "fault_injection",
        "input_key",
        "output_key",
        "chosen_key",
        "rejected_key",
        "label_key",
        "messages_key",
        "image_key",
        "eval_fraction",
        "max_bad_fraction",
        "apply_chat_template",
        "lora_rank",
        "freeze_visual_encoder",
        "eval_metrics",
        "eval_metric_func",
        "eval_samples_per_prompt",
        "eval_slice_key",
        "eval_judge_url",
        "eval_judge_model",
        "generate_max_len",
        "environment",
        "max_turns",
        "max_episode_tokens",
        "eval_lm_eval_tasks",
        "eval_lm_eval_include_path",
        "eval_lm_eval_limit",
    }
    assert set(params) == expected
    for name in expected:
        p = params.get_param(name)
        assert p.schema.get("title") and p.description, name  # the UI form shows a title and a help text
        # Flat fields, but the gate and the test-only fault injection, which the form edits as JSON. Every field
        # but the four a run starts from takes null: the form sends an emptied field as null (its default).
        kinds = p.schema["type"] if isinstance(p.schema["type"], list) else [p.schema["type"]]
        assert ("null" in kinds) == (name not in ("prefix", "dataset", "base_model", "method")), name
        (kind,) = [k for k in kinds if k != "null"]
        assert (
            kind == "object"
            if name in ("promotion_gate", "fault_injection")
            else kind in ("string", "integer", "number", "boolean")
        ), name
    assert params.get_param("zero_stage").schema["enum"] == [0, 1, 2, 3, None]
    assert pipeline.DEFAULTS["dataset"] == "demo" and pipeline.DEFAULTS["base_model"] == "demo"


@pytest.mark.parametrize(
    "name,value",
    [
        ("zero_stage", 4),
        ("sft_steps", 0),
        ("sft_steps", "30"),
        ("rl_steps", -1),
        ("sft_learning_rate", 0),
        ("actor_learning_rate", 2.0),
        ("seed", -5),
        ("bucket", "Not_A_Bucket"),
        ("prefix", "bad prefix with spaces"),
        ("dataset", ""),
        ("advantage_estimator", "ppo"),
        ("method", "ppo"),
        ("dpo_beta", 0),
        ("stage_deadline_minutes", -1),
        ("model_name", "../escape"),
        ("promotion_gate", {"accuracy": {"at_least": 0.5}}),
        ("promotion_gate", {"accuracy": {}}),
        ("fault_injection", {"stage": "eval", "after_step": 2}),
        ("use_cache", "yes"),
        ("eval_fraction", 0),
        ("eval_fraction", 1),
        ("max_bad_fraction", 1.5),
        ("lora_rank", -1),
        ("ptx_coef", -0.5),
        ("apply_chat_template", "true"),
        ("environment", "calculator; rm -rf /"),
        ("environment", "my_env"),
        ("max_turns", 0),
        ("generate_max_len", 0),
    ],
)
def test_params_refuse_bad_values(dag, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError):
        params[name] = value


def test_the_form_refuses_what_its_stage_would_and_starts_where_the_stage_does_unless_said_why():
    """Every Param made from a stage field (plugins/form.py STAGE_PARAMS) carries that field's limits, so a
    value just past one is refused by the form and by the stage alike; its default is the stage's, but where
    PIPELINE_DEFAULTS gives the pipeline's own with a reason."""
    import dataclasses

    from airflow.sdk.exceptions import ParamValidationError

    from plugins import form as pipeline
    from tasks.common.config import ConfigError, make_config
    from tasks.common.stages import config_class

    checked = 0
    for name, (module, field_name, _) in pipeline.STAGE_PARAMS.items():
        cls = config_class(module)
        field = next(f for f in dataclasses.fields(cls) if f.name == field_name)
        meta, param = field.metadata, pipeline.PARAMS[name]
        outside = [
            meta["min"] - 1 if "min" in meta else None,
            meta["max"] * 2 if "max" in meta else None,
            meta.get("exclusive_min"),
            meta.get("exclusive_max"),
            "no such choice" if "choices" in meta else None,
        ]
        for value in [v for v in outside if v is not None]:
            with pytest.raises(ParamValidationError):
                param.resolve(value)
            with pytest.raises(ConfigError, match=f"^{field_name}: "):
                make_config(cls, {field_name: value})
            checked += 1
        reason = pipeline.PIPELINE_DEFAULTS.get(name)
        assert param.value == (reason[0] if reason else field.default), name
    assert checked > 40


def test_params_accept_good_overrides(dag):
    params = copy.deepcopy(dag.params)
    for name, value in {
        "sft_steps": 30,
        "rm_steps": 20,
        "rl_steps": 2,
        "eval_max_samples": 50,
        "zero_stage": 3,
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 4,
        "colocate_all_models": False,
        "dataset": "s3://bucket/data/v1",
        "bucket": "rlhf-test",
        "prefix": "",
        "messages_key": "messages",
        "input_key": "",
        "label_key": "answer",
        "output_key": None,
        "eval_fraction": 0.2,
        "max_bad_fraction": 0,
        "apply_chat_template": True,
        "lora_rank": 8,
        "environment": "s3://bucket/envs/my_env.py",
        "max_turns": 3,
        "generate_max_len": 24,
        "image_key": "pictures",
        "freeze_visual_encoder": True,
    }.items():
        params[name] = value
    params.validate()


def test_plugins_folder_loads_only_the_plugin_file():
    """Airflow imports every non-ignored .py of the plugins folder as a top-level module: only ours."""
    code = f"""
import sys
from airflow._shared.module_loading import find_path_from_directory
from airflow._shared.plugins_manager.plugins_manager import _load_plugins_from_plugin_directory
files = sorted(find_path_from_directory({str(REPO / "plugins")!r}, ".airflowignore", "glob"))
plugins, errors = _load_plugins_from_plugin_directory({str(REPO / "plugins")!r})
stray = [m for m in ("hooks", "operators", "triggers") if m in sys.modules]
print({{"files": files, "plugins": [p.name for p in plugins], "errors": errors, "stray": stray}})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-3000:]
    result = eval(r.stdout.strip().splitlines()[-1])
    assert result == {
        "files": [str(REPO / "plugins" / "rlhf_flow_plugin.py")],
        "plugins": ["rlhf_flow"],
        "errors": {},
        "stray": [],
    }


# ----------------------------------------------------------------------------- validation first


def test_the_first_task_checks_every_stage_on_the_runs_path_with_the_stages_own_configs(dag, monkeypatch):
    """The flags each stage operator would submit, rendered from the Params with upstream outputs as
    placeholders, through tasks.common.stages: the defaults pass; what a stage would refuse after the others spent
    their compute is named now, one line per stage; a stage off the run's path is not checked."""
    from airflow.sdk.execution_time.context import ConnectionAccessor

    from plugins.pipeline import planned_problems
    from tools.stack.config import conn_s3

    monkeypatch.setenv(
        "AIRFLOW_CONN_RLHF_S3", conn_s3("http://127.0.0.1:9")
    )  # the templates read its bucket; nothing connects
    defaults = dag.params.dump()
    context = {"run_id": "manual__2026-01-01T00:00:00+00:00", "dag": dag, "conn": ConnectionAccessor()}
    assert planned_problems(dag, defaults, context) == []
    bad = {
        **defaults,
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 1,
        "eval_metrics": "bleu",
        "promotion_gate": {"accuracy": {"most": 0.5}},
    }
    problems = planned_problems(dag, bad, context)
    assert [p.split(": ")[:2] for p in problems] == [
        ["rl", "n_samples_per_prompt"],
        ["eval", "metrics"],
        ["promote", "gate"],
    ], problems
    # The dpo branch does not run rl, so rl's estimator is nobody's problem there.
    assert [p.split(":")[0] for p in planned_problems(dag, {**bad, "method": "dpo"}, context)] == ["eval", "promote"]
    # A layout the Ray cluster could never place: every RL model on a worker of its own needs 4 devices at once.
    apart = {**defaults, "colocate_all_models": False}
    assert planned_problems(dag, apart, context, {"CPU": 2.0}) == [
        "rl: its worker groups need 4 CPUs at once and the Ray cluster has 2; colocate them (colocate_all_models) or use fewer workers"
    ]
    assert planned_problems(dag, apart, context, {"CPU": 64.0, "GPU": 4.0}) == []
    assert planned_problems(dag, defaults, context, {"CPU": 2.0}) == []  # colocated: one device


def test_the_hook_reads_the_ray_clusters_total_resources(ray_head):
    from plugins.hooks import RayJobHook, RayUnreachableError

    assert RayJobHook(address=ray_head).cluster_resources()["CPU"] >= 1
    with pytest.raises(RayUnreachableError, match="^Ray Jobs API at http://127.0.0.1:9 is unreachable"):
        RayJobHook(address="http://127.0.0.1:9", http_timeout=5).cluster_resources()


def test_the_first_task_names_the_runs_s3_inputs_that_are_not_there(dag, s3_server, monkeypatch):
    from airflow.sdk.execution_time.context import ConnectionAccessor

    from plugins.pipeline import missing_inputs
    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint))
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="inputs/data.jsonl", Body=b'{"prompt": "1+1="}\n')
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="p/datasets/chats/v1/manifest.json", Body=b"{}")
    context = {"run_id": "manual__2026-01-01T00:00:00+00:00", "dag": dag, "conn": ConnectionAccessor()}
    params = {**dag.params.dump(), "bucket": s3_server.bucket, "prefix": "p"}
    context["params"] = params
    render = lambda template: dag.get_task("prepare_data").render_template(template, context)  # noqa: E731
    there = {"dataset": f"s3://{s3_server.bucket}/inputs/data.jsonl", "base_model": "demo", "environment": "calculator"}
    assert missing_inputs({**params, **there}, render) == []
    assert missing_inputs({**params, "dataset": "dataset:chats"}, render) == []
    gone = {
        "dataset": "dataset:chatz",
        "base_model": f"s3://{s3_server.bucket}/models/none/",
        "eval_metric_func": f"s3://{s3_server.bucket}/m.py",
    }
    problems = missing_inputs({**params, **gone}, render)
    assert problems == [
        f"dataset: s3://{s3_server.bucket}/p/datasets/chatz/ does not exist; upload it or fix the URI",
        f"base_model: s3://{s3_server.bucket}/models/none/ does not exist; upload it or fix the URI",
        f"eval_metric_func: s3://{s3_server.bucket}/m.py does not exist; upload it or fix the URI",
    ], problems


@pytest.mark.e2e
def test_a_refused_form_fails_the_validate_task_and_submits_no_ray_job(
    airflow_db, s3_server, ray_head, pipeline_to_test
):
    from plugins.stage_cli import submission_id_for

    dr = pipeline_to_test.test(
        run_conf={
            "bucket": s3_server.bucket,
            "prefix": "validate",
            "advantage_estimator": "rloo",
            "n_samples_per_prompt": 1,
        }
    )
    states = {ti.task_id: str(getattr(ti.state, "value", ti.state)) for ti in dr.get_task_instances()}
    assert states["validate"] == "failed" and states["prepare_data"] == "upstream_failed", states
    with urllib.request.urlopen(
        urllib.request.Request(f"{ray_head}/api/jobs/", headers=ray_headers()), timeout=30
    ) as response:
        jobs = [j.get("submission_id") or "" for j in json.load(response)]
    assert not {submission_id_for("rlhf_pipeline", dr.run_id, t) for t in ORDER} & set(jobs), jobs


# ----------------------------------------------------------------------------- end to end


#: Runs of the rl branch beside the demo's: their own Params, on top of the tiny step counts below.
RUNS = {
    # rl with the calculator environment on its dataset: no reward model is trained, RL and eval play the environment.
    "agentic": {
        "method": "rl",
        "dataset": "calculator",
        "environment": "calculator",
        "generate_max_len": 24,
        "max_turns": 3,
    },
    # The vision-language demo (docs/vision.md), as its form is filled in: the built-in images and the tiny Qwen2-VL
    # prepare_data builds for base_model demo, the tower frozen in every training stage. The fewest steps that run
    # each stage on images: SFT, the reward model (a VLM with a value head), RL (the form's PPO with KL and PPO-ptx:
    # the reward and the critic's start from that reward model), eval with its reward_mean; the responses are one
    # letter and <|im_end|>.
    "vlm": {
        "method": "rl",
        "dataset": "demo_vlm",
        "base_model": "demo",
        "apply_chat_template": True,
        "freeze_visual_encoder": True,
        "generate_max_len": 2,
        "sft_steps": 2,
        "rm_steps": 2,
        "rl_steps": 1,
        "eval_max_samples": 8,
    },
}


@pytest.mark.e2e
# The preference branches run under `make test-all`: their stages are covered by test_stages and
# test_learning, and the branch wiring by the tests above; `make test` keeps its time for the live stack.
# The rl branch runs end to end through the live stack (tests/e2e/test_e2e.py, make test) and through dag.test()
# down to promote (tests/e2e/test_byo_e2e.py, make test-all); here in `make test` on the vision-language demo only,
# whose stages take another path at every step (docs/vision.md).
@pytest.mark.parametrize(
    "method", [*(pytest.param(m, marks=pytest.mark.slow) for m in ("dpo", "kto", "agentic")), "vlm"]
)
def test_pipeline_end_to_end(method, airflow_db, s3_server, ray_head, pipeline_to_test):
    """The whole DAG with dag.test() against the local Ray head and the S3 emulator, with tiny step counts,
    down each branch: the other branch's tasks are skipped, not failed. `agentic` is rl with the calculator
    environment on its dataset: no reward model is trained, RL and eval play the environment. `vlm` is rl on the
    vision-language demo: every stage runs on the images, RL is scored by the VLM reward model, the report shows them."""
    from plugins.stage_cli import key_safe

    dag = pipeline_to_test
    conf = {
        "bucket": s3_server.bucket,
        "prefix": f"e2e-{method}",
        "method": method,
        "sft_steps": 30,
        "rm_steps": 20,
        "rl_steps": 2,
        "preference_steps": 3,
        "eval_max_samples": 50,
        **RUNS.get(method, {}),
    }
    branch = conf["method"]
    dr = dag.test(run_conf=conf)
    states = {ti.task_id: str(getattr(ti.state, "value", ti.state)) for ti in dr.get_task_instances()}
    skipped = {t for name, tasks in BRANCHES.items() if name != branch for t in tasks}
    if method == "agentic":  # an environment's rewards: no reward model
        skipped.add("reward_model")
    # A manual run judges its policy but may not promote it: the champion task is skipped.
    assert states == {t: "skipped" if t in skipped | {"champion"} else "success" for t in ORDER}, states

    base = f"e2e-{method}/runs/rlhf_pipeline/{key_safe(dr.run_id)}"
    s3 = s3_server.client()

    def read(key: str) -> bytes:
        return s3.get_object(Bucket=s3_server.bucket, Key=f"{base}/{key}")["Body"].read()

    ran = [t for t in ORDER if t not in skipped and t not in ("validate", "choose_method", "champion")]  # no output
    manifests = {task_id: json.loads(read(f"{task_id}/manifest.json")) for task_id in ran}
    assert all(manifests.values()), manifests
    evaluated = manifests["eval"]
    assert evaluated["inputs"]["policy"].endswith(f"/{branch}/manifest.json")
    assert ("reward_pretrain" in evaluated["inputs"]) == (branch == "rl" and method != "agentic")
    if method == "agentic":
        report = json.loads(read("eval/report.json"))
        assert {"env_success", "env_turns", "env_tool_calls"} <= set(report["metrics"]["policy"])
        assert evaluated["inputs"]["env_path"] == "calculator"
    if method == "vlm":
        check_vlm_run(manifests, read)


def check_vlm_run(manifests: dict, read) -> None:
    """What the vision-language demo's DAG run shows of its images: the split's rows carry them; every stage's model is
    a VLM with its processor, whose vision tower is prepare_data's (the form's freeze_visual_encoder reached SFT, the
    reward model and RL) and whose language model trained; the reward model is one with a value head, the one RL and
    eval scored with (RL's VLM path: its prompts_dropped metric); the report's samples carry their images, inline."""
    import torch
    from safetensors.torch import load as load_safetensors

    def weights(
        task_id: str, tower: bool
    ) -> dict:  # by name after "visual." (the reward model's backbone has no "model.")
        state = load_safetensors(read(f"{task_id}/model/model.safetensors"))
        return {k.split("visual.", 1)[-1]: v for k, v in state.items() if ("visual." in k) == tower}

    assert json.loads(read("prepare_data/data/sft.jsonl").splitlines()[0])["images"]
    for task_id in ("prepare_data", "sft", "reward_model", "rl"):
        assert json.loads(read(f"{task_id}/model/config.json")).get("vision_config"), task_id
        assert "model/processor_config.json" in manifests[task_id]["files"], (
            task_id,
            sorted(manifests[task_id]["files"]),
        )
    assert "model/value_head.safetensors" in manifests["reward_model"]["files"]
    start = weights("prepare_data", tower=True)
    for task_id in ("sft", "reward_model", "rl"):
        tower = weights(task_id, tower=True)
        assert tower.keys() == start.keys() and all(torch.equal(tower[k], start[k]) for k in start), task_id
    for before, after in (("prepare_data", "sft"), ("sft", "rl")):
        old, new = weights(before, tower=False), weights(after, tower=False)
        assert any(not torch.equal(old[k], new[k]) for k in old), f"{after}'s language model did not train"
    rm = manifests["reward_model"]["uri"].rstrip("/") + "/manifest.json"
    assert manifests["rl"]["inputs"]["reward_pretrain"] == manifests["eval"]["inputs"]["reward_pretrain"] == rm
    assert manifests["rl"]["metrics"]["prompts_dropped"] == 0 and manifests["rl"]["metrics"]["steps"] == 1
    report = json.loads(read("eval/report.json"))
    assert report["samples"] and all(len(s["images"]) == 1 for s in report["samples"]), report["samples"][:1]
    assert "policy_reward_mean" in manifests["eval"]["metrics"], sorted(manifests["eval"]["metrics"])
    assert read("eval/report.html").decode().count('<img src="data:image/png;base64,') == len(report["samples"])


def test_nightly_dataset_comes_from_the_environment():
    """A scheduled run has no form: RLHF_NIGHTLY_DATASET (e.g. dataset:<name>, its newest version) is the
    nightly DAG's default dataset; the manual DAG keeps 'demo'."""
    code = (
        "from airflow.dag_processing.dagbag import DagBag; "
        f"bag = DagBag(dag_folder={str(DAGS)!r}); assert not bag.import_errors, bag.import_errors; "
        "p = bag.dags['rlhf_nightly'].params.get_param('dataset'); "
        "print('RESULT', p.value, bag.dags['rlhf_pipeline'].params['dataset'], bool(p.description))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "RLHF_NIGHTLY_DATASET": "dataset:support-chats"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert result.split()[1:] == ["dataset:support-chats", "demo", "True"]


def test_the_form_is_grouped_by_stage():
    """Airflow's trigger form folds every section but the first: a run starts from the five fields left open."""
    from plugins.form import PARAMS, SECTIONS

    named = [n for names in SECTIONS.values() for n in names]
    assert len(named) == len(set(named)) and set(named) <= set(PARAMS), "each Param in one section"
    assert [n for n in PARAMS if "section" not in PARAMS[n].schema] == [
        "bucket",
        "prefix",
        "dataset",
        "base_model",
        "method",
    ]
    assert list(SECTIONS)[-1] == "Advanced" and "fault_injection" in SECTIONS["Advanced"]
    assert {PARAMS[n].schema["section"] for n in SECTIONS["RL"]} == {"RL"}


def test_only_what_a_run_starts_from_is_required_and_an_emptied_field_is_its_default():
    """Airflow's form marks a field required unless its type takes null, and sends an emptied one as null: the
    four a run cannot start without stay required; any other, emptied, renders as its default in every stage."""
    import copy

    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.definitions.param import process_params

    from plugins.form import DEFAULTS, PARAMS, REQUIRED
    from plugins.operators import fill_empty

    kinds = {
        n: p.schema["type"] if isinstance(p.schema["type"], list) else [p.schema["type"]] for n, p in PARAMS.items()
    }
    assert (
        [n for n, k in kinds.items() if "null" not in k]
        == list(REQUIRED)
        == ["prefix", "dataset", "base_model", "method"]
    )
    dag = DagBag(dag_folder=str(DAGS)).dags["rlhf_pipeline"]  # its own: rendering changes a task in place
    emptied = {"rl_steps": None, "gae_lambda": None, "advantage_estimator": None, "ptx_coef": None, "use_cache": None}
    conf = {**emptied, "sft_steps": 7, "stage_deadline_minutes": None}
    params = process_params(dag, dag.get_task("rl"), conf, suppress_exception=False)  # the form accepts it
    assert params["rl_steps"] is None and fill_empty(params, DEFAULTS)["rl_steps"] == DEFAULTS["rl_steps"]
    rl = copy.copy(dag.get_task("rl"))
    rl.output_root = "s3://b/p"  # its template reads the S3 connection, which this test has not

    class Upstream:  # `ti` for the templates: every upstream's output
        def xcom_pull(self, task_ids=None, **_):
            return f"s3://b/{task_ids}/manifest.json"

    rl.render_template_fields({"params": params, "ti": Upstream(), "dag": dag, "run_id": "r"})
    assert rl.args["max_steps"] == str(DEFAULTS["rl_steps"]) and rl.args["lambd"] == str(DEFAULTS["gae_lambda"])
    assert rl.args["advantage_estimator"] == DEFAULTS["advantage_estimator"]
    assert float(rl.deadline_minutes) == DEFAULTS["stage_deadline_minutes"] and rl.cache == "True"
    # Still refused: what the stage would refuse (a value out of its bounds, a choice it does not know).
    for bad in ({"rl_steps": 0}, {"advantage_estimator": "ppo2"}):
        with pytest.raises(Exception, match="Invalid input for param"):
            process_params(dag, dag.get_task("rl"), bad, suppress_exception=False)
