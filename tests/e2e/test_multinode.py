"""Two Ray nodes on this machine that share no folder: the RL stage with its actor (and reference) on
one node and its critic and reward model on the other, checkpointed and resumed through S3.

Each node is its own `ray start` on 127.0.0.1 with its own --temp-dir, its own custom resource
(node_a / node_b, which --actor_resources / --critic_resources ask for) and its own scratch folder
(RLHF_NODE_SCRATCH, where its workers write and cache). The driver is a plain process with yet
another TMPDIR. Nothing but URIs and file listings may cross between them: every rank uploads the
checkpoint files it wrote, the driver commits the manifest, and a resumed run's workers fetch them
back from S3 into their own node's folder.
"""

import json
import os
import shutil
import sys
import time

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage
from tasks.common.config import ConfigError, make_config
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig
from tasks.rl.config import RLConfig
from tools.stack.config import Config, process_env
from tools.stack.health import http_get, wait_healthy
from tools.stack.processes import launch, live_pids, log_file, ray_command, remove_scratch, stop_process, tail

from tests.conftest import REPO, SCRATCH, _stack_port, head_config, ray_headers
from tests.e2e.test_stack import LOOPBACK_IPS, _listening
from tests.e2e.test_stages import flags, metrics_of, run_cli

# `ray start` for a joining node, except that it keeps 127.0.0.1 as given: stock `ray start` turns a
# loopback --address / --node-ip-address into the machine's outward address (a real second machine
# needs that; here the head listens on 127.0.0.1 only, and so must this node: checked in two_nodes).
JOIN_ON_LOOPBACK = (
    "import sys; import ray._private.services as services; services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)


def _nodes(dashboard: str) -> list[dict]:
    status, body = http_get(f"{dashboard}/api/v0/nodes?detail=1", timeout=5, headers=ray_headers())
    assert status == 200, body[:300]
    return [n for n in json.loads(body)["data"]["result"]["result"] if n.get("state") == "ALIVE"]


def _temp_dir(cfg) -> None:
    """Ray's --temp-dir for a node, linked from its scratch folder when it had to move to /tmp (as tools.stack.processes.start_ray does)."""
    cfg.ray_temp_dir.mkdir(parents=True, exist_ok=True)
    cfg.scratch.mkdir(parents=True, exist_ok=True)
    if cfg.ray_temp_dir != cfg.scratch / "ray":
        (cfg.scratch / "ray").symlink_to(cfg.ray_temp_dir)


@pytest.fixture(scope="module")
def two_nodes(s3_server):
    """A Ray head (custom resource node_a) and a second node (node_b) joined to it, both on loopback.
    Yields {"address": GCS address, "node_a"/"node_b": {"id", "scratch"}, "driver_tmp": folder}."""
    parent = SCRATCH / "multinode"
    root = parent / str(os.getpid())
    for d in parent.iterdir() if parent.is_dir() else []:  # earlier sessions' folders, once their Ray is gone
        if d != root and not live_pids(d / "head"):
            for sub in ("head", "ray_b"):
                remove_scratch(d / sub)
            shutil.rmtree(d, ignore_errors=True)
    head = head_config(root / "head", s3_server)
    scratch = {name: root / name for name in ("node_a", "node_b", "driver_tmp")}
    for folder in scratch.values():
        folder.mkdir(parents=True, exist_ok=True)

    def node_env(name: str) -> dict:
        env = process_env(head)  # S3 endpoint and keys, offline flags, loopback-only Ray
        for key in ("HF_HOME", "WANDB_DIR", "WANDB_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
            env[key] = os.environ[key]
        env.update(RLHF_NODE_SCRATCH=str(scratch[name]), TMPDIR=str(scratch[name]))
        if name == "node_b":
            # `ray start --address` refuses to join while this is 0 (Ray's one-machine mode); see JOIN_ON_LOOPBACK.
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        return env

    _temp_dir(head)
    procs = {
        "ray-head": launch(
            head, "ray-head", ray_command(head) + ["--resources", json.dumps({"node_a": 100})], node_env("node_a")
        )
    }
    second = Config(scratch=root / "ray_b")  # only for its own short --temp-dir
    _temp_dir(second)
    address = f"127.0.0.1:{head.ray_port}"
    try:
        wait_healthy(head, "ray", {"ray": procs["ray-head"]}, timeout=120)
        procs["ray-node-b"] = launch(
            head,
            "ray-node-b",
            [
                sys.executable,
                "-c",
                JOIN_ON_LOOPBACK,
                "start",
                "--block",
                "--address",
                address,
                "--node-ip-address",
                "127.0.0.1",
                "--temp-dir",
                str(second.ray_temp_dir),
                "--num-cpus",
                "2",
                "--resources",
                json.dumps({"node_b": 100}),
                "--dashboard-agent-listen-port",
                str(_stack_port()),
                "--disable-usage-stats",
            ],
            node_env("node_b"),
        )
        deadline = time.monotonic() + 60
        while len(nodes := _nodes(head.dashboard_url)) < 2:
            assert procs["ray-node-b"].poll() is None, f"second node exited:\n{tail(log_file(head, 'ray-node-b'), 30)}"
            assert time.monotonic() < deadline, f"second node did not join:\n{tail(log_file(head, 'ray-node-b'), 30)}"
            time.sleep(1)
        exposed = [s for proc in procs.values() for s in _listening(proc.pid) if s[0] not in LOOPBACK_IPS]
        assert not exposed, f"listening beyond 127.0.0.1: {exposed}"
        ids = {
            name: next(n["node_id"] for n in nodes if name in n.get("resources_total", {}))
            for name in ("node_a", "node_b")
        }
        assert ids["node_a"] != ids["node_b"]
        yield {
            "address": address,
            "driver_tmp": scratch["driver_tmp"],
            **{name: {"id": ids[name], "scratch": scratch[name]} for name in ids},
        }
    finally:
        for name in ("ray-node-b", "ray-head"):  # only the processes started here, by pid
            if name in procs:
                stop_process(procs[name].pid)
        for sub in ("head", "ray_b"):
            remove_scratch(root / sub)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def inputs(two_nodes, s3_server):
    """The demo's data and tiny model (prepare_data, in this process) and a reward model trained on the two-node cluster."""
    root = s3_server.uri("multinode/run1")
    out = {name: f"{root}/{name}" for name in ("prepare_data", "reward_model")}
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": out["prepare_data"]}), prepare)
    done = run_cli(
        "tasks.reward_model",
        *flags(
            {
                "output": out["reward_model"],
                "pretrain": out["prepare_data"],
                "dataset": out["prepare_data"],
                "max_steps": 2,
                "train_batch_size": 16,
            }
        ),
        ray=two_nodes["address"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow  # 85 s: make test-all (the refusals below stay in make test)
def test_rl_stage_spans_two_nodes_checkpoints_through_s3_and_resumes(
    two_nodes, inputs, s3_server, tmp_path, monkeypatch
):
    # The driver's own temp and cache folders are neither node's.
    monkeypatch.setenv("TMPDIR", str(two_nodes["driver_tmp"]))
    monkeypatch.setenv("RLHF_CACHE_DIR", str(two_nodes["driver_tmp"] / "cache"))
    monkeypatch.setenv("RLHF_NODE_SCRATCH", str(two_nodes["driver_tmp"] / "must-not-reach-a-worker"))
    a, b = two_nodes["node_a"], two_nodes["node_b"]
    out = s3_server.uri("multinode/run1/rl")
    args = {
        "output": out,
        "pretrain": inputs["prepare_data"],
        "reward_pretrain": inputs["reward_model"],
        "prompt_data": inputs["prepare_data"],
        "max_samples": 64,
        "rollout_batch_size": 8,
        "train_batch_size": 8,
        "colocate_actor_ref": True,
        "colocate_critic_reward": True,
        "save_value_network": True,
        "save_steps": 2,
        "actor_resources": json.dumps({"node_a": 1}),
        "critic_resources": json.dumps({"node_b": 1}),
    }

    done = run_cli("tasks.rl", *flags({**args, "max_steps": 4}), ray=two_nodes["address"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    # Each group on the node its resources name; a group off the driver's node joins its world over TCP.
    driver_node = (
        next(line for line in log.splitlines() if line.startswith("rl: driver on node")).split()[4].rstrip(";")
    )
    for role, node in (("actor", a), ("ref", a), ("critic", b), ("reward", b)):
        rendezvous = "file" if node["id"][:8] == driver_node else "tcp"
        assert f"{role} on node(s) ['{node['id'][:8]}'] via {rendezvous}" in log, log[-3000:]
    assert "via tcp" in log  # one of the two nodes is not the driver's
    # Every rank wrote its checkpoint files in its own node's scratch and uploaded them itself.
    assert (
        f"ActorWorker rank 0 on node {a['id'][:8]}: wrote" in log
        and f"in {a['scratch']}, uploaded them to {out}/checkpoints/step_2/actor" in log
    )
    assert (
        f"CriticWorker rank 0 on node {b['id'][:8]}: wrote" in log
        and f"in {b['scratch']}, uploaded them to {out}/checkpoints/step_2/critic" in log
    )
    # The committed checkpoint holds both nodes' ranks' DeepSpeed files (model states, ZeRO-2 shard, RNG)
    # and the driver's controller state, listed by one manifest written after all of them.
    for step in (2, 4):
        files = manifests.read_manifest(f"{out}/checkpoints/step_{step}")["files"]
        for role in ("actor", "critic"):
            mine = [f for f in files if f.startswith(f"{role}/")]
            assert (
                f"{role}/rng_rank0.pt" in mine
                and any("zero_pp_rank_0" in f for f in mine)
                and any("model_states" in f for f in mine)
            ), files
        assert "controller/controller.pt" in files
    committed = manifests.read_manifest(out)["files"]
    assert "model/model.safetensors" in committed and "critic/model.safetensors" in committed
    # Workers read their inputs into their own node's cache: the reward model only where the critic
    # and reward groups run, and nothing into the driver's cache but what the driver itself reads.
    cached = {
        name: " ".join(p.name for p in (node["scratch"] / "cache").iterdir()) for name, node in (("a", a), ("b", b))
    }
    assert "reward_model" in cached["b"] and "reward_model" not in cached["a"], cached
    assert "prepare_data" in cached["a"]
    assert not (two_nodes["driver_tmp"] / "must-not-reach-a-worker").exists()
    assert not any(two_nodes["driver_tmp"].glob("rlhf-state-*")) and not any(
        two_nodes["driver_tmp"].glob("rlhf-model-*")
    )

    # A rerun resumes from the newest checkpoint: each rank fetches it from S3 into its own node's folder.
    done = run_cli("tasks.rl", *flags({**args, "max_steps": 6}), ray=two_nodes["address"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rl: resumed from {out}/checkpoints/step_4" in done.stdout
    assert [r["step"] for r in metrics_of(out, tmp_path / "resumed")] == [5, 6]
    assert manifests.read_manifest(out)["metrics"]["steps"] == 6


@pytest.mark.slow  # make test-all: a second Ray node (60 s to start)
def test_a_local_output_is_refused_when_workers_sit_on_other_nodes(two_nodes, inputs, tmp_path):
    # Actor on one node, reference on the other: whichever node the driver shares, one group is elsewhere.
    done = run_cli(
        "tasks.rl",
        *flags(
            {
                "output": str(tmp_path / "rl"),
                "pretrain": inputs["prepare_data"],
                "prompt_data": inputs["prepare_data"],
                "remote_rm_url": str(REPO / "tests" / "rewards" / "parity_reward.py"),
                "label_key": "label",
                "advantage_estimator": "reinforce",
                "max_steps": 1,
                "rollout_batch_size": 8,
                "train_batch_size": 8,
                "actor_resources": json.dumps({"node_a": 1}),
                "ref_resources": json.dumps({"node_b": 1}),
            }
        ),
        ray=two_nodes["address"],
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line == (
        f"error: output: {tmp_path / 'rl'} is a folder on the driver's node, which workers on other nodes cannot write to; pass an s3:// URI"
    ), line


@pytest.mark.slow  # make test-all: a second Ray node (60 s to start)
def test_resources_no_node_advertises_are_refused_at_once(two_nodes, inputs, tmp_path):
    done = run_cli(
        "tasks.rl",
        *flags(
            {
                "output": str(tmp_path / "rl"),
                "pretrain": inputs["prepare_data"],
                "reward_pretrain": inputs["reward_model"],
                "prompt_data": inputs["prepare_data"],
                "colocate_all_models": True,
                "actor_resources": json.dumps({"a100": 1}),
            }
        ),
        ray=two_nodes["address"],
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: actor_resources: no node of this Ray cluster advertises a100; start nodes with `ray start --resources`, or drop the flag"
    )


RL = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}


@pytest.mark.parametrize(
    "value,message",
    [
        (
            "node_a",
            r"^actor_resources: 'node_a' is not JSON; pass a JSON object of custom resources, e\.g\. --actor_resources '\{\"node_a\": 1\}'$",
        ),
        ("[1]", r"^actor_resources: '\[1\]' is not a non-empty JSON object"),
        ('{"CPU": 2}', r"^actor_resources: CPU comes from --actor_num_gpus_per_node, not from custom resources"),
        ('{"node_a": 0}', r"^actor_resources: 'node_a' needs a positive number, got 0"),
    ],
)
def test_resources_flags_are_validated_in_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        make_config(RLConfig, {**RL, "actor_resources": value})


def test_a_colocated_group_cannot_ask_for_resources_of_its_own():
    with pytest.raises(
        ConfigError,
        match=r"^reward_resources: with --colocate_critic_reward the reward group sits on the critic's bundles",
    ):
        make_config(RLConfig, {**RL, "colocate_critic_reward": True, "reward_resources": '{"node_b": 1}'})
    cfg = make_config(RLConfig, {**RL, "colocate_critic_reward": True, "critic_resources": '{"node_b": 1}'})
    assert cfg.resources("critic") == {"node_b": 1.0} and cfg.resources("reward") == {}
