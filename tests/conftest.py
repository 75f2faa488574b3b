"""Shared fixtures: real services on 127.0.0.1, nothing mocked.

The environment is fixed here, at import time, because Airflow reads AIRFLOW_HOME on its first
import and transformers reads HF_HUB_OFFLINE on its first import.
"""
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRATCH = Path(os.environ.get("RLHF_TEST_SCRATCH", REPO / ".scratch" / "test"))
SCRATCH.mkdir(parents=True, exist_ok=True)

os.environ.setdefault("AIRFLOW_HOME", str(SCRATCH / "airflow-inproc"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(SCRATCH / "hf")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_DIR"] = str(SCRATCH / "wandb")
os.environ["WANDB_CACHE_DIR"] = str(SCRATCH / "wandb-cache")
# One JIT cache for DeepSpeed's ops across tests and the local stack: each op builds once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".scratch" / "torch_extensions"))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, endpoint: str, bucket: str):
        self.endpoint = endpoint
        self.bucket = bucket

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server over real HTTP on 127.0.0.1, with the environment boto3 reads pointing at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_S3=endpoint,
    )
    s3 = S3Server(endpoint, "rlhf-test")
    s3.client().create_bucket(Bucket=s3.bucket)
    yield s3
    server.stop()
