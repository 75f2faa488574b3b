"""Worker groups: N Ray actors that form one torch.distributed (DeepSpeed data-parallel) world.

    placement = Placement.create(num_nodes=1, gpus_per_node=2, name="actor")   # 2 bundles
    actor = WorkerGroup(ActorWorker, placement, name="actor", fraction=1.0)    # 2 ranks, world of 2
    actor.run("setup", cfg, total_updates)         # every rank, same arguments
    actor.scatter("generate", [shard0, shard1])     # rank r gets shards[r]
    actor.run("save_model", out_dir)              # every rank: a ZeRO-3 gather needs them all

Every stage that trains builds its workers this way: SFT and reward-model training put one group
on their placement; RL puts actor, critic, reference and reward groups on one placement each, or
several groups on one placement ("colocated") with a fraction of each bundle's GPU (CPU here).

A bundle is one GPU and one CPU on a GPU cluster and one CPU on a CPU-only one, so the group's
rank r always runs in bundle r. The world joins through a file in a folder every rank sees when
the group sits on one node (torch's TCP store would listen on every interface), and through
TCP on rank 0's node address otherwise.

Worker subclasses implement their role's methods; `Worker.__init__` joins the world, so by the
time a method runs, `torch.distributed` and DeepSpeed are ready.
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

from tasks.common.config import ConfigError

# Environment a worker process needs from the driver: the raylet started it with its own, which
# lacks what a test or a job set for the driver (caches, S3 endpoint and keys, offline flags).
FORWARDED_ENV_PREFIXES = ("RLHF_", "AWS_", "HF_", "WANDB_", "TRANSFORMERS_", "TORCH_EXTENSIONS_DIR", "PYTHONPATH",
                          "TOKENIZERS_PARALLELISM", "DS_")
PLACEMENT_TIMEOUT_S = float(os.environ.get("RLHF_PLACEMENT_TIMEOUT_S", "60"))


def connect_ray() -> None:
    """Join the Ray cluster this process belongs to: the job's (RAY_ADDRESS, which Ray sets for a
    job's driver), the local stack's (RLHF_RAY_PORT, from `tools/stack.py env`), or a new local one."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "")
    if not address or address.startswith(("http://", "https://")):  # a dashboard URL is for job submission
        port = os.environ.get("RLHF_RAY_PORT")
        address = f"127.0.0.1:{port}" if port else None
    ray.init(address=address, log_to_driver=True, logging_level="WARNING")


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


@dataclass
class Placement:
    """A Ray placement group of `num_nodes × gpus_per_node` bundles that one or more worker groups share."""

    name: str
    num_nodes: int
    gpus_per_node: int
    use_gpu: bool
    group: Any  # ray.util.placement_group.PlacementGroup

    @property
    def size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @classmethod
    def create(cls, num_nodes: int, gpus_per_node: int, name: str, use_gpu: bool | None = None) -> "Placement":
        import ray
        from ray.util.placement_group import placement_group

        connect_ray()
        use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        # PACK keeps one node's ranks together (and on one node when they fit); STRICT_PACK would
        # refuse a group larger than a node.
        pg = placement_group([dict(bundle) for _ in range(num_nodes * gpus_per_node)], strategy="PACK", name=f"rlhf-{name}-{uuid.uuid4().hex[:6]}")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(pg)
            free = ray.available_resources()
            need = num_nodes * gpus_per_node
            kind = "GPU" if use_gpu else "CPU"
            raise ConfigError(
                f"{name}_num_gpus_per_node: the {name} workers need {need} bundle(s) of {bundle} but the cluster has "
                f"{free.get(kind, 0):g} {kind} free after {PLACEMENT_TIMEOUT_S:g} s; use fewer workers or colocate groups "
                f"(--colocate_all_models)")
        return cls(name, num_nodes, gpus_per_node, use_gpu, pg)

    def remove(self) -> None:
        import ray

        ray.util.remove_placement_group(self.group)


class Worker:
    """Base of every worker: joins the group's torch.distributed world, then serves its role's methods."""

    def __init__(self, rank: int, world_size: int, init_method: str, num_threads: int):
        import torch

        from tasks.common.strategy import init_distributed

        self.rank, self.world_size = rank, world_size
        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        init_distributed(rank, world_size, init_method)

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def call(self, method: str, *args, **kwargs):
        """Run one of this worker's methods by name (the group's fan-out goes through here)."""
        return getattr(self, method)(*args, **kwargs)


class TrainingWorker(Worker):
    """A worker that trains one DeepSpeed engine and can save and restore its whole state.

    Subclasses set `strategy`, `engine` and, when the worker draws its own batches, `sampler`.
    """

    strategy = None
    engine = None
    sampler = None

    def save_state(self, out_dir: str) -> None:
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        self.strategy.save_state(self.engine, out_dir, {"sampler": sampler})

    def load_state(self, in_dir: str) -> None:
        state = self.strategy.load_state(self.engine, in_dir)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])


class _Probe:
    """A bare actor placed like a group's rank 0, to learn its node before the world forms."""

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port


class WorkerGroup:
    """`placement.size` actors of `worker_cls`, rank r in bundle r, each taking `fraction` of its bundle."""

    def __init__(self, worker_cls: type, placement: Placement, name: str, fraction: float = 1.0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.placement, self.world_size = name, placement, placement.size
        resources = {"num_cpus": fraction, "num_gpus": fraction if placement.use_gpu else 0}
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        options = [dict(resources, runtime_env={"env_vars": env},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=r))
                   for r in range(self.world_size)]

        probes = [ray.remote(_Probe).options(**o).remote() for o in options]
        addresses = ray.get([p.address.remote() for p in probes])
        for p in probes:
            ray.kill(p)
        nodes = [a for a, _ in addresses]
        if len(set(nodes)) == 1 and nodes[0] == ray.util.get_node_ip_address():
            # One node, the driver's: a file rendezvous in a folder every rank sees.
            folder = os.environ.get("RLHF_RENDEZVOUS_DIR") or tempfile.gettempdir()
            init_method = f"file://{folder}/rlhf-{name}-{uuid.uuid4().hex}"
        else:
            init_method = f"tcp://{addresses[0][0]}:{addresses[0][1]}"
        per_node = max(nodes.count(n) for n in nodes)
        threads = max(1, (os.cpu_count() or 1) // per_node)

        remote_cls = ray.remote(worker_cls)
        self.workers = [remote_cls.options(**o).remote(r, self.world_size, init_method, threads) for r, o in enumerate(options)]
        ray.get([w.node_address.remote() for w in self.workers])  # all joined (or the error surfaces here)

    def run_async(self, method: str, *args, **kwargs) -> list:
        """Start `method(*args)` on every rank; returns the futures (ray.get them, or pass to `gather`)."""
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def run(self, method: str, *args, **kwargs) -> list:
        """`method(*args)` on every rank; the ranks' results in rank order."""
        import ray

        return ray.get(self.run_async(method, *args, **kwargs))

    def scatter_async(self, method: str, shards: Sequence, *args, **kwargs) -> list:
        if len(shards) != self.world_size:
            raise ValueError(f"{self.name}: {len(shards)} shards for {self.world_size} workers")
        return [w.call.remote(method, shard, *args, **kwargs) for w, shard in zip(self.workers, shards)]

    def scatter(self, method: str, shards: Sequence, *args, **kwargs) -> list:
        """Rank r runs `method(shards[r], *args)`; the results in rank order."""
        import ray

        return ray.get(self.scatter_async(method, shards, *args, **kwargs))

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


@contextmanager
def placed_group(worker_cls: type, num_nodes: int, gpus_per_node: int, name: str):
    """A WorkerGroup of `worker_cls` on a placement group of its own, removed (with the actors) on exit."""
    placement = Placement.create(num_nodes, gpus_per_node, name)
    try:
        group = WorkerGroup(worker_cls, placement, name)
        try:
            yield group
        finally:
            group.shutdown()
    finally:
        placement.remove()


def train_steps(run, group: WorkerGroup, max_steps: int, logging_steps: int) -> dict:
    """The driver's loop of a one-group training stage (SFT, reward model, preference): resume from the
    newest checkpoint, then `train_step` on every rank per step, logging rank 0's (global) statistics
    and checkpointing every --save_steps. Returns the last step's statistics ({} when none ran)."""
    start = run.resume(lambda local: group.run("load_state", str(local)))
    stats: dict = {}
    for step in range(start + 1, max_steps + 1):
        stats = group.run("train_step")[0]
        if step % logging_steps == 0 or step == max_steps:
            run.tracker.log(step, stats)
        run.checkpoint(step, lambda local: group.run("save_state", str(local)))
    return stats


def shard(items: Sequence, parts: int) -> list:
    """`items` cut into `parts` contiguous, nearly equal pieces (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for r in range(parts):
        end = start + size + (r < extra)
        out.append(items[start:end])
        start = end
    return out
