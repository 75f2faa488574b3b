"""Worker groups: N Ray actors that form one torch.distributed (DeepSpeed data-parallel) world.

    placement = Placement.create(num_nodes=1, gpus_per_node=2, name="actor")   # 2 bundles
    actor = WorkerGroup(ActorWorker, placement, name="actor", fraction=1.0)    # 2 ranks, world of 2
    actor.run("setup", cfg, total_updates)         # every rank, same arguments
    actor.scatter("generate", [shard0, shard1])     # rank r gets shards[r]
    files = actor.run("upload_model", [uri])[0]   # every rank saves (a ZeRO-3 gather needs them all), rank 0 uploads

Every stage that trains builds its workers this way: SFT and reward-model training put one group
on their placement; RL puts actor, critic, reference and reward groups on one placement each, or
several groups on one placement ("colocated") with a fraction of each bundle's GPU (CPU here).

The group's rank r always runs in bundle r of its placement (tasks.common.nn.placement). The world joins
through a file in a folder every rank sees when the group sits on the driver's own Ray node (torch's TCP
store would listen on every interface), and through TCP on rank 0's node address otherwise. A worker's
environment and scratch folder are tasks.common.worker_env. Names of both are importable from here too.

Worker subclasses implement their role's methods; `Worker.__init__` joins the world, so by the
time a method runs, `torch.distributed` and DeepSpeed are ready.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from contextlib import contextmanager
from typing import Sequence

import ray

from tasks.common.nn.placement import (
    PLACEMENT_TIMEOUT_S,
    Placement,
    ResourcesBusy,
    busy_resources,
    cluster_has_gpus,
    connect_ray,
)
from tasks.common.worker_env import (
    FORWARDED_ENV_PREFIXES,
    NODE_SCRATCH_ENV,
    NOT_FORWARDED,
    SECRET_ENV,
    forwarded_env,
    use_node_scratch,
)

# The worker layer's names, its parts' included: callers write `from tasks.common.nn.workers import Placement`.
__all__ = [
    "FORWARDED_ENV_PREFIXES",
    "NODE_SCRATCH_ENV",
    "NOT_FORWARDED",
    "PLACEMENT_TIMEOUT_S",
    "SECRET_ENV",
    "Placement",
    "ResourcesBusy",
    "TrainingWorker",
    "Worker",
    "WorkerGroup",
    "busy_resources",
    "cluster_has_gpus",
    "connect_ray",
    "forwarded_env",
    "gather",
    "merge_uploads",
    "placed_group",
    "shard",
    "use_node_scratch",
]


def merge_uploads(results: Sequence[dict], prefix: str = "") -> dict:
    """The ranks' `upload_files` listings as one, under `prefix/`; two ranks writing one path differently is a bug."""
    merged: dict = {}
    for files in results:
        for rel, entry in (files or {}).items():
            key = f"{prefix.strip('/')}/{rel}" if prefix else rel
            if merged.setdefault(key, entry) != entry:
                raise RuntimeError(
                    f"{key}: two ranks wrote different files under one name; give each rank its own file names"
                )
    return merged


class Worker:
    """Base of every worker: joins the group's torch.distributed world, then serves its role's methods."""

    def __init__(self, rank: int, world_size: int, init_method: str, num_threads: int):
        import torch

        from tasks.common.nn.strategy import init_distributed

        self.rank, self.world_size = rank, world_size
        self.scratch = use_node_scratch()
        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        init_distributed(rank, world_size, init_method)

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args, **kwargs):
        """Run one of this worker's methods by name (the group's fan-out goes through here)."""
        return getattr(self, method)(*args, **kwargs)

    def gpu_peak_gb(self) -> float | None:
        """The most GPU memory this worker's tensors have held so far (torch's allocator), None without CUDA."""
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None

    @ray.method(concurrency_group="beside")
    def call_beside(self, method: str, *args, **kwargs):
        """`call` on a thread of its own, while the main queue runs something else: a weight update that must
        reach a rollout already running (--partial_rollouts). The method must be safe beside the others."""
        return self.call(method, *args, **kwargs)


class TrainingWorker(Worker):
    """A worker that trains one DeepSpeed engine and can save and restore its whole state.

    Subclasses set `cfg`, `strategy`, `engine`, `tokenizer` (and `processor` for a vision-language model) and,
    when the worker draws its own batches, `sampler`.
    """

    strategy = None
    engine = None
    sampler = None
    processor = None  # a vision-language model's processor; None for a text model

    def save_model(self, out_dir: str) -> None:
        """The trained model as an HF folder (LoRA merged or as an adapter over --pretrain, as cfg says), with its
        tokenizer, or a VLM's processor: its tokenizer, image processor and chat template, which later stages need."""
        self.strategy.save_hf(
            self.engine,
            self.processor or self.tokenizer,
            out_dir,
            merge_lora=self.cfg.merge_lora,
            base_uri=self.cfg.pretrain,
        )

    def save_state(self, uri: str) -> dict:
        """Save this rank's part of the state (DeepSpeed writes rank 0's model states and each rank's ZeRO
        shard and RNG) in this node's scratch, upload it under `uri`, and return what was uploaded."""
        from tasks.common import manifest as manifests

        sampler = self.sampler.state_dict() if self.sampler is not None else None
        local = tempfile.mkdtemp(prefix="rlhf-state-", dir=self.scratch)
        try:
            self.strategy.save_state(self.engine, local, {"sampler": sampler})
            files = manifests.upload_files(local, uri)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        print(
            f"{type(self).__name__} rank {self.rank} on node {self.node_id()[:8]}: wrote {len(files)} files in {self.scratch}, uploaded them to {uri}",
            flush=True,
        )
        return files

    def load_state(self, uri: str, subdir: str | None = None) -> None:
        """Fetch a committed checkpoint (only `subdir` of it, if given) into this node's scratch, every
        rank's files (ZeRO-2 reads them all), and restore from it."""
        from tasks.common import manifest as manifests

        local = tempfile.mkdtemp(prefix="rlhf-resume-", dir=self.scratch)
        try:
            path, _ = manifests.fetch(uri, local, subdir=subdir)
            state = self.strategy.load_state(self.engine, path)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])

    def upload_model(self, uris: Sequence[str], *args) -> dict:
        """`save_model(folder, *args)` on every rank (a ZeRO-3 gather needs them all) into this node's
        scratch; rank 0 uploads the HF model to each of `uris` and returns the first upload's files."""
        from tasks.common import manifest as manifests
        from tasks.common import storage

        local = tempfile.mkdtemp(prefix="rlhf-model-", dir=self.scratch)
        try:
            self.save_model(local, *args)
            if self.rank != 0:
                return {}
            files = manifests.upload_files(local, uris[0])
            for uri in uris[1:]:
                storage.upload_dir(local, uri)
            return files
        finally:
            shutil.rmtree(local, ignore_errors=True)


class _Probe:
    """A bare actor placed like a group's rank, to learn its node before the world forms."""

    def address(self) -> tuple[str, str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port


class WorkerGroup:
    """`placement.size` actors of `worker_cls`, rank r in bundle r, each taking `fraction` of its bundle."""

    def __init__(self, worker_cls: type, placement: Placement, name: str, fraction: float = 1.0):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.placement, self.world_size = name, placement, placement.size
        resources = {"num_cpus": fraction, "num_gpus": fraction if placement.use_gpu else 0}
        # vLLM runs in its worker's process (tasks.common.nn.engines.vllm_engine): set when the process starts, as the
        # environment must not change once NCCL's threads read it (init_distributed).
        env = {**forwarded_env(os.environ), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        options = [
            dict(
                resources,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=r),
            )
            for r in range(self.world_size)
        ]

        probes = [ray.remote(_Probe).options(**o).remote() for o in options]
        addresses = ray.get([p.address.remote() for p in probes])
        for p in probes:
            ray.kill(p)
        # Ray node ids, not addresses: two nodes may share an address (and a file rendezvous would
        # then assume a filesystem they do not share).
        nodes = [node for node, _, _ in addresses]
        self.nodes, self.driver_node = nodes, ray.get_runtime_context().get_node_id()
        if set(nodes) == {self.driver_node}:
            # One node, the driver's: a file rendezvous in a folder every rank sees.
            folder = os.environ.get("RLHF_RENDEZVOUS_DIR") or tempfile.gettempdir()
            init_method = f"file://{folder}/rlhf-{name}-{uuid.uuid4().hex}"
        else:
            init_method = f"tcp://{addresses[0][1]}:{addresses[0][2]}"
        self.rendezvous = init_method.split(":", 1)[0]
        self._rendezvous_file = init_method.removeprefix("file://") if self.rendezvous == "file" else None
        per_node = max(nodes.count(n) for n in nodes)
        threads = max(1, (os.cpu_count() or 1) // per_node)

        remote_cls = ray.remote(concurrency_groups={"beside": 1})(worker_cls)
        self.workers = [
            remote_cls.options(**o).remote(r, self.world_size, init_method, threads) for r, o in enumerate(options)
        ]
        ray.get([w.node_address.remote() for w in self.workers])  # all joined (or the error surfaces here)

    def run_async(self, method: str, *args, **kwargs) -> list:
        """Start `method(*args)` on every rank; returns the futures (ray.get them, or pass to `gather`)."""
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def run(self, method: str, *args, **kwargs) -> list:
        """`method(*args)` on every rank; the ranks' results in rank order."""
        return ray.get(self.run_async(method, *args, **kwargs))

    def run_beside_async(self, method: str, *args, **kwargs) -> list:
        """`run_async` through each rank's `call_beside`: not queued behind the calls still running there."""
        return [w.call_beside.remote(method, *args, **kwargs) for w in self.workers]

    def scatter_async(self, method: str, shards: Sequence, *args, **kwargs) -> list:
        if len(shards) != self.world_size:
            raise ValueError(f"{self.name}: {len(shards)} shards for {self.world_size} workers")
        return [w.call.remote(method, shard, *args, **kwargs) for w, shard in zip(self.workers, shards)]

    def scatter(self, method: str, shards: Sequence, *args, **kwargs) -> list:
        """Rank r runs `method(shards[r], *args)`; the results in rank order."""
        return ray.get(self.scatter_async(method, shards, *args, **kwargs))

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        if self._rendezvous_file:  # torch's file store leaves it behind
            with contextlib.suppress(OSError):
                os.unlink(self._rendezvous_file)


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


def shard(items: Sequence, parts: int) -> list:
    """`items` cut into `parts` contiguous, nearly equal pieces (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for r in range(parts):
        end = start + size + (r < extra)
        out.append(items[start:end])
        start = end
    return out


def gather(futures: list) -> list:
    """ray.get over futures and lists of futures, flattened, in order."""
    import ray

    return ray.get([f for item in futures for f in (item if isinstance(item, list) else [item])])
