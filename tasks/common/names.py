"""The names both sides of the pipeline agree on: the Airflow connections and pool the stack creates and the
DAGs use, and the DAG ids the registry and retention act on. Standard library only.

    from tasks.common import names
    S3Hook(aws_conn_id=names.S3_CONN)
"""

S3_CONN = "rlhf_s3"  # the S3 the Airflow side reads manifests and reports from (extra: bucket, buckets)
RAY_CONN = "rlhf_ray"  # the Ray dashboard, where stage jobs are submitted
WEBHOOK_CONN = "rlhf_webhook"  # where notifications go
GPU_POOL = "rlhf_gpus"  # the Airflow pool every stage takes GPU slots from

PIPELINE_DAG, NIGHTLY_DAG, REGISTRY_DAG = "rlhf_pipeline", "rlhf_nightly", "rlhf_registry"
PIPELINE_DAGS = (PIPELINE_DAG, NIGHTLY_DAG)  # the DAGs whose runs write stage outputs


def conn_env(conn_id: str) -> str:
    """The environment variable Airflow reads connection `conn_id` from."""
    return f"AIRFLOW_CONN_{conn_id.upper()}"


# What a bucket and a registered name (a model's registry entry, a dataset) may be: the run form's Params,
# the views and the stages check these same patterns.
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$"  # S3's bucket naming rules, lower case
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # letters, digits, '.', '_' and '-'; no '/' or '..'
