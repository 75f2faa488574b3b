"""Extra links of every stage task: its Ray dashboard job page and its wandb run.

Contract with RayJobOperator: once the job is submitted or reattached to it pushes XCom ``ray_job_url``
(the dashboard's job page, a full URL); after success it pushes ``wandb_url`` when the stage recorded
one (``wandb.json`` in the stage's output, url null in offline mode, so offline runs get no link).

How Airflow 3.3 shows them: on the worker, after each run of the task (including the one that ends in
deferral, so the Ray link appears while the job runs) the task runner calls ``get_link`` and stores the
result under the link's own XCom key (``_link_RayJobLink``); the API server then reads that XCom back
(its deserialized operator carries only name -> XCom key). ``get_link`` therefore runs where the SDK's
``XCom.get_value`` works, and returns "" (a greyed-out button) when the operator pushed nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend, as the task runner uses it

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

RAY_JOB_URL_KEY = "ray_job_url"
WANDB_URL_KEY = "wandb_url"


def _http_url(value) -> str:
    """The value when it is an http(s) URL, else "": an XCom is data, and a javascript: link is not a link."""
    return value if isinstance(value, str) and value.startswith(("http://", "https://")) else ""


class _XComUrlLink(BaseOperatorLink):
    key = ""

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        try:
            return _http_url(XCom.get_value(ti_key=ti_key, key=self.key))
        except Exception:  # noqa: BLE001 - a link must never fail the task's finalisation
            return ""


class RayJobLink(_XComUrlLink):
    name = "Ray job"
    key = RAY_JOB_URL_KEY


class WandbRunLink(_XComUrlLink):
    name = "wandb run"
    key = WANDB_URL_KEY
