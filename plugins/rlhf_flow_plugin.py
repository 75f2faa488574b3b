"""The project's AirflowPlugin: the stage tasks' extra links and the report view.

Airflow's plugin loader imports every non-ignored .py in the plugins folder as a top-level module;
``plugins/.airflowignore`` limits that to this file. Everything it registers is imported from the
installed ``plugins`` package (``plugins.links``, ``plugins.reports``), like the operator, hook and trigger.

- Extra links "Ray job" and "wandb run": RayJobOperator lists them in ``operator_extra_links``; they are
  registered here too, as Airflow's docs ask. Their ``operators`` stay empty on purpose: a link matched to
  an operator here would replace, on the API server, the XCom the task runner stored (plugins/links.py).
- The registry view (plugins/registry_view.py): champions, promotion history and candidates, read-only,
  at /rlhf-registry, in the Browse menu ("RLHF registry").
- The report view: the FastAPI app at /rlhf-flow, in the UI's Browse menu ("RLHF reports") and as a
  "Report" tab on every DAG run (the UI fills in {DAG_ID} and {RUN_ID}).
"""

from __future__ import annotations

from airflow.sdk.plugins_manager import AirflowPlugin

from plugins.links import RayJobLink, WandbRunLink
from plugins.registry_view import app as registry_app
from plugins.reports import app as reports_app

URL_PREFIX = "/rlhf-flow"
REGISTRY_PREFIX = "/rlhf-registry"


class RlhfFlowPlugin(AirflowPlugin):
    name = "rlhf_flow"
    operator_extra_links = [RayJobLink(), WandbRunLink()]
    fastapi_apps = [
        {"app": reports_app, "url_prefix": URL_PREFIX, "name": "rlhf-flow reports"},
        {"app": registry_app, "url_prefix": REGISTRY_PREFIX, "name": "rlhf-flow registry"},
    ]
    external_views = [
        {
            "name": "RLHF reports",
            "href": f"{URL_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "rlhf-reports",
        },
        {
            "name": "RLHF registry",
            "href": f"{REGISTRY_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "rlhf-registry",
        },
        {
            "name": "Report",
            "href": f"{URL_PREFIX}/dags/{{DAG_ID}}/runs/{{RUN_ID}}/report.html",
            "destination": "dag_run",
            "url_route": "rlhf-report",
        },
    ]
