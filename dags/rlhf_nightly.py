"""rlhf_nightly: retrain every night at 02:00 UTC, promote the new policy only if the gate passes.

The same pipeline as rlhf_pipeline (plugins/pipeline.py) on a CronTriggerTimetable: no catch-up, one
active run. Unchanged stages (same data, flags and code) are cache hits, so a night with new RL settings
reruns only RL and eval. The candidate is evaluated beside the current champion on the same held-out
prompts; `promote` makes it champion by compare-and-swap on models/<name>/champion.json only when the
gate passes (`promotion_gate` Param); a rejected candidate is kept and recorded under candidates/.

Its data: RLHF_NIGHTLY_DATASET in the scheduler's and DAG processor's environment, typically
`dataset:<name>` so each night trains on the newest registered version of that dataset; 'demo' without it.
"""

import os
from datetime import timedelta

from airflow.sdk import CronTriggerTimetable

from plugins.pipeline import build_pipeline

dag = build_pipeline(
    dag_id="rlhf_nightly",
    # run_immediately=0: a stack started at 02:30 waits for tomorrow's 02:00. Airflow's default would run the
    # night just past at once (within 10% of a day of it), beside the run its user came to start.
    schedule=CronTriggerTimetable("0 2 * * *", timezone="UTC", run_immediately=timedelta(0)),
    description="Nightly RLHF retraining behind an evaluation gate",
    allow_promotion=True,
    doc_md=__doc__,
    tags=("nightly",),
    dataset=os.environ.get("RLHF_NIGHTLY_DATASET") or None,
)
