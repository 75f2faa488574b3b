"""Which Ray job an attempt of a stage task follows: an earlier attempt's, still live or succeeded, or a new one.

    action, sid = find_job(hook, base, try_number, whole_result=lambda: True, log=log, stored=state_id)
    # ("reattach", "airflow-…-try2"): follow a live job; ("done", base): its result stands; ("submit", sid): start one
    cleared_by_user(try_number=4, max_tries=5, retries=2)   # True: a user's clear, so recompute

A job's submission id is derived from (dag_id, run_id, task_id[, map_index]) (plugins/stage_cli.py), so any
attempt finds what earlier attempts started: the base id first, then the ``{base}-try<n>`` jobs of earlier
attempts. What changes here is that policy; the operator (plugins/operators.py) acts on its answer.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

from plugins.hooks import LIVE_STATUSES, RayJobHook


def cleared_by_user(try_number: int, max_tries: int, retries: int) -> bool:
    """Whether this try is the first after a clear (the UI's Clear, the REST API's clearTaskInstances,
    `airflow tasks clear`). A clear starts a new budget of tries: Airflow sets max_tries to the last try
    number plus the task's retries, so the new budget's first try is ``max_tries - retries + 1``, which
    a run's very first try (1) also is. An automatic retry, or the same try restarted, comes later."""
    return try_number > 1 and try_number == max_tries - retries + 1


def job_status(info: Any) -> str:
    """A Ray job's status as a string ("RUNNING", "SUCCEEDED", ...), from its JobDetails or JobInfo."""
    status = getattr(info, "status", None)
    return str(getattr(status, "value", status))


def find_job(
    hook: RayJobHook,
    base: str,
    try_number: int,
    whole_result: Callable[[], bool | None],
    log: Any,
    stored: str | None = None,
    recompute: bool = False,
) -> tuple[str, str]:
    """Decide what this attempt does. Returns (action, submission_id); action in submit/reattach/done.

    ``whole_result`` says whether the task's committed output is whole (None: there is none); ``stored`` is
    the id an earlier attempt kept in the task state store; it is looked at first. With ``recompute`` (a
    user's clear) a succeeded job is not taken as the result; a live one still is followed, so that one
    output never has two jobs writing it.
    """
    # Asked only once a succeeded job is found (it lists the output folder), then remembered.
    result = functools.cache(lambda: None if recompute else whole_result())
    if stored and stored != base:
        info = hook.get_job_info(stored)
        if info is not None and job_status(info) in LIVE_STATUSES:
            return "reattach", stored
        if info is not None and job_status(info) == "SUCCEEDED" and result():
            return "done", stored
    info = hook.get_job_info(base)
    if info is None:
        return "submit", base
    status = job_status(info)
    if status in LIVE_STATUSES:
        return "reattach", base
    if status == "SUCCEEDED" and result():
        return "done", base
    log.info(
        "Earlier job %s ended %s%s",
        base,
        status,
        ""
        if status != "SUCCEEDED"
        else " (its result is recomputed)"
        if recompute or result() is False
        else " without a manifest",
    )

    # The base job ended without a result: later attempts run under "{base}-try{n}". Look at those too,
    # so a retry after a worker crash finds the job an earlier retry left running.
    attempt_id = re.compile(re.escape(base) + r"-try\d+(-\d+)?")
    attempts = sorted(
        (j for j in hook.list_jobs() if attempt_id.fullmatch(j.submission_id or "")),
        key=lambda j: (j.start_time or 0, j.submission_id),
    )
    for job in reversed(attempts):
        if job_status(job) in LIVE_STATUSES:
            return "reattach", job.submission_id
    succeeded = [j for j in attempts if job_status(j) == "SUCCEEDED"]
    if succeeded and result():
        return "done", succeeded[-1].submission_id
    taken = {j.submission_id for j in attempts}
    sid = f"{base}-try{try_number}"
    n = 2
    while sid in taken:  # this very attempt number already ran a job that ended (rare): go on counting
        sid = f"{base}-try{try_number}-{n}"
        n += 1
    return "submit", sid
