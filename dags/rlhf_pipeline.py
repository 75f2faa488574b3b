"""rlhf_pipeline: one RLHF run on demand (the Airflow UI's trigger form, or the REST API).

prepare_data -> sft -> (reward_model -> rl | dpo | kto) -> eval -> promote -> champion, each stage a Ray
job; see plugins/pipeline.py. A manual run judges its policy with the promotion gate but promotes it
only when the `allow_promotion` Param is set.
"""

from plugins.form import DEFAULTS, PARAMS  # noqa: F401  (the run form, for tests and docs)
from plugins.pipeline import build_pipeline

dag = build_pipeline(
    dag_id="rlhf_pipeline",
    schedule=None,
    description="RLHF: data -> SFT -> reward model -> RL -> eval -> gate, each stage a Ray job, artifacts in S3",
    allow_promotion=False,
)
