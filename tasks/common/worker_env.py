"""What a worker process takes from the driver's environment, and where on its node it writes.

    runtime_env = {"env_vars": forwarded_env(os.environ)}   # caches, S3 endpoint, offline flags: never a secret
    scratch = use_node_scratch()                            # in a worker: its node's RLHF_NODE_SCRATCH, else temp

Nodes share no filesystem. A worker writes what it saves (checkpoint shards, a final model) under its
node's scratch folder, `RLHF_NODE_SCRATCH` from that node's `ray start` environment (else the system temp
folder), and uploads it itself; only URIs and file listings travel to the driver. Standard library only.
"""

from __future__ import annotations

import os
import re
import tempfile

# Environment a worker process needs from the driver: the raylet started it with its own, which
# lacks what a test or a job set for the driver (caches, S3 endpoint, offline flags).
FORWARDED_ENV_PREFIXES = (
    "RLHF_",
    "AWS_",
    "HF_",
    "WANDB_",
    "TRANSFORMERS_",
    "TORCH_EXTENSIONS_DIR",
    "PYTHONPATH",
    "TOKENIZERS_PARALLELISM",
    "DS_",
)
# Never forwarded, whatever the prefix: a runtime_env is readable by anyone who reaches Ray's dashboard
# (its actor API shows it) and is written to Ray's logs. Workers inherit credentials from their node.
SECRET_ENV = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|SESSION_KEY|API_KEY", re.I)
# Set per node on its `ray start`, never copied from the driver: where that node's workers write.
NODE_SCRATCH_ENV = "RLHF_NODE_SCRATCH"
NOT_FORWARDED = (NODE_SCRATCH_ENV,)


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    """What a worker actor's runtime_env carries from the driver's environment: no secret."""
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(FORWARDED_ENV_PREFIXES) and k not in NOT_FORWARDED and not SECRET_ENV.search(k)
    }


def use_node_scratch() -> str:
    """Point this process's temporary files and fetch cache at its node's scratch folder
    ($RLHF_NODE_SCRATCH, when that node's `ray start` set it); returns the folder it writes in."""
    scratch = os.environ.get(NODE_SCRATCH_ENV)
    if not scratch:
        return tempfile.gettempdir()
    os.makedirs(scratch, exist_ok=True)
    tempfile.tempdir = scratch
    # Models and checkpoints this worker fetches are cached on its own node, not where the driver caches.
    os.environ["RLHF_CACHE_DIR"] = os.path.join(scratch, "cache")
    return scratch
