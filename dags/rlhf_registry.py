"""rlhf_registry: promote a judged candidate or roll back to an earlier champion, by hand, from the trigger form.

The `action` Param picks one task: `promote` (the candidate run id), `rollback` (an earlier version), or
`list`. Each runs ``python -m tasks.registry <action>`` as a Ray job (RayJobOperator: the same
compare-and-swap code the promote stage uses, the result committed as a manifest under this run's folder).
`expected_version` is the champion version you saw (the registry view or `list` shows it): if the champion
moved since, the task fails with one line and nothing changes. Who acted is recorded as this DAG and run.
"""

from airflow.sdk import DAG, Param, task

from plugins.operators import RayJobOperator
from plugins.pipeline import REGISTRY
from tasks.common import names

MOVE = {
    "registry": REGISTRY,
    "expected_version": "{{ params.expected_version }}",
    "by": "{{ params.requested_by or 'rlhf_registry' }} via {{ dag.dag_id }} run {{ run_id }}",
    "reason": "{{ params.reason }}",
}

with DAG(
    dag_id="rlhf_registry",
    description="Manual promotion and rollback of the model registry (compare-and-swap)",
    doc_md=__doc__,
    schedule=None,
    catchup=False,
    max_active_runs=1,
    tags=["rlhf", "registry"],
    params={
        "action": Param("list", type="string", enum=["list", "promote", "rollback"], title="Action"),
        "bucket": Param(
            None,
            type=["null", "string"],
            title="Bucket",
            pattern="^$|" + names.BUCKET_PATTERN,
            description="Empty: the bucket of the rlhf_s3 connection (extra.bucket).",
        ),
        "prefix": Param("rlhf-flow", type="string", title="Key prefix", pattern=r"^[A-Za-z0-9._\-/]*$", maxLength=200),
        "model_name": Param("demo-policy", type="string", title="Model name", pattern=names.NAME_PATTERN),
        "expected_version": Param(
            0,
            type="integer",
            minimum=0,
            title="Champion version you saw",
            description="The move is refused if the champion is no longer at this version (0: none yet).",
        ),
        "candidate": Param(
            "",
            type="string",
            title="Candidate run id (promote)",
            description="The run id of a judged candidate (the registry view lists them).",
        ),
        "override_gate": Param(
            False,
            type="boolean",
            title="Override the gate (promote)",
            description="Promote a candidate that failed its gate; say why in the reason.",
        ),
        "to_version": Param(1, type="integer", minimum=1, title="Version to roll back to (rollback)"),
        "requested_by": Param("", type="string", title="Your name", description="Recorded in the history."),
        "reason": Param("", type="string", title="Reason", description="Recorded in the history."),
    },
) as dag:

    @task.branch(task_id="choose_action")
    def choose_action(params=None) -> str:
        return params["action"]

    # Small driver-only jobs: no GPU pool, never cached (they act on the registry's current state).
    list_ = RayJobOperator(task_id="list", module="tasks.registry", args={"action": "list", "registry": REGISTRY})
    promote = RayJobOperator(
        task_id="promote",
        module="tasks.registry",
        args={
            "action": "promote",
            **MOVE,
            "candidate": "{{ params.candidate }}",
            "override_gate": "{{ params.override_gate }}",
        },
    )
    rollback = RayJobOperator(
        task_id="rollback",
        module="tasks.registry",
        args={"action": "rollback", **MOVE, "to_version": "{{ params.to_version }}"},
    )
    choose_action() >> [list_, promote, rollback]
