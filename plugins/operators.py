"""RayJobOperator: run one pipeline stage (``python -m tasks.<stage>``) as a Ray job, deferrably.

The operator never imports the stages (nor torch): it ships the project's code to Ray as the job's
``working_dir`` and passes every input as a flag. What it returns (and pushes to XCom) is the stage's
manifest URI, never data. Here is the job's lifecycle; the contract with the stage process (ids, flags,
error line) is plugins/stage_cli.py, which earlier job an attempt follows plugins/job_attempts.py, what the
job takes along plugins/job_env.py, what a success publishes plugins/job_results.py, a run's Params
plugins/run_params.py, the cache plugins/stage_cache.py, S3 access plugins/s3.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from plugins.hooks import TERMINAL_STATUSES, RayJobHook
from plugins.job_attempts import cleared_by_user, find_job, job_status
from plugins.job_env import default_working_dir, job_runtime_env, refuse_secret_env
from plugins.job_results import asset_extra, index_result, store_driver_log, wandb_url
from plugins.links import RAY_JOB_URL_KEY, WANDB_URL_KEY, RayJobLink, WandbRunLink

# plugins/pipeline.py imports OUTPUT_ROOT and fill_empty from here.
from plugins.run_params import OUTPUT_ROOT, as_bool, fill_empty
from plugins.s3 import S3Store
from plugins.stage_cache import StageCache
from plugins.stage_cli import build_entrypoint, failure_message, output_uri_for, submission_id_for, unknown_conf
from plugins.triggers import RayJobTrigger, job_event
from tasks.common import names
from tasks.common.stages import INPUT_ERROR_EXIT

if TYPE_CHECKING:
    from airflow.sdk import Context


#: The task state store key holding the Ray submission id of the task's latest job (kept across attempts).
SUBMISSION_ID_KEY = "ray_submission_id"
#: ... and the cache key of the work that job was submitted for (the code may change before it ends).
CACHE_KEY_KEY = "cache_key"

#: How long the trigger holds back a job's end event after the task deferred: the scheduler learns of the
#: deferral when the worker process exits, and an event that arrives first gets the task marked for retry
#: (see RayJobTrigger's not_before).
DEFER_SETTLE_S = 10.0


class RayJobOperator(BaseOperator):
    """Run ``python -m <module>`` as a Ray job; return the URI of the ``manifest.json`` it writes.

    :param module: the stage module, e.g. ``tasks.sft`` (templated).
    :param args: ``{flag: value}``; each becomes ``--flag value`` (templated; None dropped; bools as
        true/false). XComArgs (``other_task.output``) are resolved and make the dependency.
    :param output_root: where runs are stored, e.g. ``s3://bucket/prefix`` (templated; default: OUTPUT_ROOT).
        The job writes to ``{output_root}/runs/{dag_id}/{run_id}/{task_id}``, ``manifest.json`` last.
    :param ray_conn_id: connection of the Ray dashboard (Jobs API).
    :param aws_conn_id: connection used to check the manifest exists.
    :param entrypoint_num_cpus: CPUs reserved for the driver.
    :param entrypoint_num_gpus: GPUs reserved for the driver (0 when it only launches GPU actors).
    :param working_dir: local folder shipped as the job's working_dir; default: the project root.
    :param env_vars: extra non-secret environment for the job (names that look like secrets are refused).
    :param poll_interval: seconds between polls of the job's status.
    :param follow_before_defer: seconds the worker follows the job before deferring to the triggerer. A job
        that ends sooner (promotion, a short evaluation, a job found already ending) completes the task
        without a trigger round trip, and a trigger's event never races the deferral.
    :param python: the interpreter the entrypoint runs on the Ray node.
    :param deadline_minutes: stop the job and fail the task once the job has run this long (templated;
        enforced by the trigger, as ``execution_timeout`` does not run while the task is deferred).
    :param cache: skip the stage when a completed run of the same work exists (templated bool); see
        :mod:`plugins.stage_cache` for the key. Every success is indexed, whether or not it may reuse.
        Off for stages whose result depends on more than their flags and inputs (evaluation against the
        registry's champion, promotion).
    :param param_defaults: the DAG's Param defaults: a Param the run left empty (null, as Airflow's form sends
        an emptied optional field) renders as its default.

    Every outlet Asset of the task gets an event whose extra holds the manifest URI, the stage's
    numeric metrics and whether it was a cache hit.

    Idempotency: the job's submission id is derived from (dag_id, run_id, task_id[, map_index]) — see
    :func:`submission_id_for` — so any attempt can find what earlier attempts started. ``execute``
    looks up that base id: unknown -> submit under it; PENDING/RUNNING -> reattach (defer to it, submit
    nothing); SUCCEEDED with its manifest in S3 -> return the manifest URI at once; ended otherwise ->
    look at the ``{base}-try<n>`` jobs of earlier attempts the same way, and submit a new job under
    ``{base}-try{ti.try_number}`` only if none is live or succeeded.
    """

    template_fields = ("module", "args", "output_root", "deadline_minutes", "cache")
    template_fields_renderers = {"args": "json"}
    ui_color = "#d8e9ff"
    operator_extra_links = (RayJobLink(), WandbRunLink())

    def __init__(
        self,
        *,
        module: str,
        args: dict[str, Any] | None = None,
        output_root: str = OUTPUT_ROOT,
        ray_conn_id: str = names.RAY_CONN,
        aws_conn_id: str | None = names.S3_CONN,
        entrypoint_num_cpus: float = 1,
        entrypoint_num_gpus: float = 0,
        working_dir: str | None = None,
        env_vars: dict[str, str] | None = None,
        poll_interval: float = 2.0,
        follow_before_defer: float = 15.0,
        python: str = "python",
        deadline_minutes: float | str | None = None,
        cache: bool | str = False,
        param_defaults: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.param_defaults = dict(param_defaults or {})
        self.module = module
        self.args = dict(args or {})
        self.output_root = output_root
        self.ray_conn_id = ray_conn_id
        self.aws_conn_id = aws_conn_id
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_num_gpus = entrypoint_num_gpus
        self.working_dir = working_dir
        self.env_vars = dict(env_vars or {})
        refuse_secret_env(self.env_vars)
        self.poll_interval = poll_interval
        self.follow_before_defer = follow_before_defer
        self.python = python
        self.deadline_minutes = deadline_minutes
        self.cache = cache
        self.submission_id: str | None = None

    def render_template_fields(self, context: Context, jinja_env=None) -> None:
        if self.param_defaults and context.get("params"):
            context["params"] = fill_empty(context["params"], self.param_defaults)
        super().render_template_fields(context, jinja_env)

    # ------------------------------------------------------------------ pieces

    def _ids(self, context: Context) -> tuple[str, str, str, int]:
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        return ti.dag_id, context["run_id"], ti.task_id, -1 if map_index is None else map_index

    def output_uri(self, context: Context) -> str:
        dag_id, run_id, task_id, map_index = self._ids(context)
        return output_uri_for(self.output_root, dag_id, run_id, task_id, map_index)

    def manifest_uri(self, context: Context) -> str:
        return f"{self.output_uri(context)}/manifest.json"

    def base_submission_id(self, context: Context) -> str:
        return submission_id_for(*self._ids(context))

    def entrypoint(self, context: Context) -> str:
        return build_entrypoint(self.module, self.output_uri(context), context["run_id"], self.args, self.python)

    def code_dir(self) -> str | None:
        """The folder shipped to Ray as the job's working_dir (its code is part of the cache key)."""
        return self.working_dir or default_working_dir()

    def runtime_env(self) -> dict[str, Any]:
        return job_runtime_env(self.env_vars, self.code_dir())

    # ------------------------------------------------------------------ S3 and the cache

    @property
    def s3(self) -> S3Store:
        """A store on this task's S3 connection, made per use (a new S3Hook each time, as the connection is
        the one of the process the task runs in)."""
        return S3Store(self.aws_conn_id)

    def stage_cache(self) -> StageCache:
        return StageCache(self.s3, self.output_root, self.log)

    # ------------------------------------------------------------------ results

    def finish(self, context: Context, manifest: str, submission_id: str | None, cache_hit: bool = False) -> str:
        """What every successful end does: index the result, emit the outlet events, push the links."""
        record = self.s3.read_json(manifest)
        if not cache_hit:  # indexed even with the cache off: a later run that allows reuse finds it
            state = context.get("task_state_store")
            cache = self.stage_cache()
            key = (state.get(CACHE_KEY_KEY) if state else None) or cache.key(self.module, self.args, self.code_dir())
            index_result(cache, key, manifest, self._ids(context), self.module, submission_id)
            self.log.info("Cached as %s", key)
        for outlet in self.outlets or []:
            context["outlet_events"][outlet].extra = asset_extra(manifest, record, cache_hit)
        url = wandb_url(self.s3, manifest, record)
        if url:
            context["ti"].xcom_push(key=WANDB_URL_KEY, value=url)
        return manifest

    def deadline_s(self) -> float | None:
        if self.deadline_minutes in (None, "", "None"):
            return None
        minutes = float(self.deadline_minutes)
        return minutes * 60 if minutes > 0 else None

    # ------------------------------------------------------------------ execution

    def _whole_result(self, manifest: str) -> bool | None:
        """True when this task's own output is committed and whole; None when it has no manifest; False
        when its files changed since (then it is computed again, the stage's commit moving the old aside)."""
        if not self.s3.exists(manifest):
            return None
        problems = self.stage_cache().output_problems(manifest)
        if problems:
            self.log.warning(
                "The committed output at %s changed since it was written (%s): computing it again",
                manifest,
                "; ".join(problems[:3]),
            )
        return not problems

    def check_conf(self, context: Context) -> None:
        """Refuse a run whose conf names a key that is not a Param of the DAG, before any job."""
        dag_run, dag = context.get("dag_run"), context.get("dag")
        conf = getattr(dag_run, "conf", None) or {}
        if conf and dag is not None:
            refusal = unknown_conf(conf, dag.params.keys())
            if refusal:
                raise AirflowFailException(refusal)

    def execute(self, context: Context) -> str:
        self.check_conf(context)
        dag_id, run_id, task_id, _ = self._ids(context)
        ti = context["ti"]
        try_number = int(getattr(ti, "try_number", 1) or 1)
        recompute = cleared_by_user(try_number, int(getattr(ti, "max_tries", 0) or 0), int(self.retries or 0))
        output = self.output_uri(context)
        manifest = f"{output}/manifest.json"
        base = self.base_submission_id(context)
        hook = RayJobHook(self.ray_conn_id)

        cache = self.stage_cache()
        key = cache.key(self.module, self.args, self.code_dir())
        if recompute:
            self.log.info(
                "Cleared by a user (try %s starts a new budget): computing the stage again, neither the cache nor an earlier result is reused",
                try_number,
            )
        elif as_bool(self.cache):
            hit = cache.lookup(key)
            if hit:
                self.log.info("Cache hit: key %s was computed by %s; not running the stage", key, hit)
                return self.finish(context, hit, None, cache_hit=True)
            self.log.info("Cache miss: key %s", key)

        state = context.get("task_state_store")
        action, sid = find_job(
            hook,
            base,
            try_number,
            lambda: self._whole_result(manifest),
            self.log,
            state.get(SUBMISSION_ID_KEY) if state else None,
            recompute=recompute,
        )
        self.submission_id = sid
        context["ti"].xcom_push(key=RAY_JOB_URL_KEY, value=hook.dashboard_url(sid))
        if action == "done":
            self.log.info(
                "Ray job %s already SUCCEEDED and its manifest exists: not rerunning. Manifest: %s; dashboard: %s",
                sid,
                manifest,
                hook.dashboard_url(sid),
            )
            return self.finish(context, manifest, sid)
        if action == "reattach":
            self.log.info(
                "Ray job %s is still running: reattaching, not submitting. Dashboard: %s", sid, hook.dashboard_url(sid)
            )
        else:
            entrypoint = self.entrypoint(context)
            runtime_env = self.runtime_env()
            metadata = {
                "airflow_dag_id": dag_id,
                "airflow_run_id": run_id,
                "airflow_task_id": task_id,
                "airflow_try_number": str(try_number),
                "output": output,
            }
            self.log.info("Submitting Ray job %s: %s", sid, entrypoint)
            self.log.info("working_dir: %s", runtime_env.get("working_dir", "(none: code installed on the Ray nodes)"))
            try:
                hook.submit(
                    entrypoint=entrypoint,
                    submission_id=sid,
                    runtime_env=runtime_env,
                    entrypoint_num_cpus=self.entrypoint_num_cpus,
                    entrypoint_num_gpus=self.entrypoint_num_gpus,
                    metadata=metadata,
                )
            except RuntimeError as exc:
                if "already exists" not in str(exc):
                    raise
                # Someone (a concurrent attempt) submitted it between our lookup and now: follow that one.
                self.log.warning("Ray job %s was submitted concurrently: reattaching to it", sid)
                action = "reattach"
            else:
                self.log.info("Submitted Ray job %s. Dashboard: %s", sid, hook.dashboard_url(sid))
            if state is not None:
                # Kept across attempts and restarts: the next attempt looks at this job first.
                state.set(SUBMISSION_ID_KEY, sid)
                state.set(CACHE_KEY_KEY, key)

        ended = self._follow(hook, sid)
        if ended is not None:
            return self.execute_complete(context, ended)
        self.defer(
            trigger=RayJobTrigger(
                address=hook.address,
                submission_id=sid,
                ray_conn_id=self.ray_conn_id,  # its name only: the triggerer reads the token from the connection
                poll_interval=self.poll_interval,
                deadline_s=self.deadline_s(),
                not_before=time.time() + DEFER_SETTLE_S,
            ),
            method_name="execute_complete",
            timeout=self.execution_timeout if isinstance(self.execution_timeout, timedelta) else None,
        )

    def _follow(self, hook: RayJobHook, sid: str) -> dict[str, Any] | None:
        """Follow the job in this worker for up to ``follow_before_defer`` seconds (never past the stage
        deadline, which the trigger enforces); its end event (as the trigger's) if it ended, else None."""
        window = min(self.follow_before_defer, self.deadline_s() or float("inf"))
        until = time.monotonic() + window
        while time.monotonic() < until:
            info = hook.get_job_info(sid)
            if info is None:
                return None  # the trigger reports a job Ray does not know
            status = job_status(info)
            if status in TERMINAL_STATUSES:
                logs = hook.get_job_logs(sid)
                for line in logs.splitlines():
                    self.log.info("[ray %s] %s", sid, line)
                return job_event(
                    sid, status, str(getattr(info, "message", "") or ""), logs, getattr(info, "driver_exit_code", None)
                )
            time.sleep(min(self.poll_interval, max(0.0, until - time.monotonic())))
        return None

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> str:
        if not event:
            raise AirflowException("The Ray job trigger ended without an event")
        sid = event.get("submission_id") or self.submission_id
        self.submission_id = sid
        status = event.get("status")
        manifest = self.manifest_uri(context)
        if status not in ("MISSING", "UNREACHABLE"):
            store_driver_log(self.s3, RayJobHook(self.ray_conn_id), sid, self.output_uri(context), self.log)
        if status == "SUCCEEDED":
            if not self.s3.exists(manifest):
                raise AirflowException(f"Ray job {sid} succeeded but wrote no manifest at {manifest}")
            self.log.info("Ray job %s SUCCEEDED; manifest: %s", sid, manifest)
            return self.finish(context, manifest, sid)
        if status == "DEADLINE":
            # Not retried: a retry would only run into the same deadline again.
            raise AirflowFailException(
                f"Ray job {sid} ran past the stage deadline of {self.deadline_minutes} minutes and was stopped: "
                f"{event.get('message')} (raise the deadline Param to allow longer stages)"
            )
        if status == "FAILED" and event.get("exit_code") == INPUT_ERROR_EXIT:
            # The stage refused its input (config, data, verification): a retry would fail the same way.
            raise AirflowFailException(failure_message(event, sid))
        raise AirflowException(failure_message(event, sid))

    def on_kill(self) -> None:
        if not self.submission_id:
            return
        try:
            stopped = RayJobHook(self.ray_conn_id).stop_job(self.submission_id)
            self.log.info("Stop requested for Ray job %s (was live: %s)", self.submission_id, stopped)
        except Exception as exc:
            self.log.warning("Could not stop Ray job %s: %s", self.submission_id, exc)
