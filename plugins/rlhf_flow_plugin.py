"""The project's AirflowPlugin.

Airflow's plugin loader imports every non-ignored .py in the plugins folder as a top-level module;
``plugins/.airflowignore`` limits that to this file. The operator, hook and trigger are imported from
the installed ``plugins`` package (``from plugins.operators import RayJobOperator``), not from here.
Nothing heavy is registered yet: extra links and a report view come later.
"""
from __future__ import annotations

from airflow.sdk.plugins_manager import AirflowPlugin


class RlhfFlowPlugin(AirflowPlugin):
    name = "rlhf_flow"
