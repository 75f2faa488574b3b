"""Placements: Ray placement groups of one bundle per worker, which one or more worker groups share.

    connect_ray()                                                        # the job's, the stack's or a new local cluster
    placement = Placement.create(num_nodes=1, gpus_per_node=2, name="actor")   # 2 bundles, or a one-line error
    placement.node_ids()                                                 # the Ray node of each bundle
    placement.remove()

A bundle is one GPU and one CPU on a GPU cluster and one CPU on a CPU-only one, plus any custom
resources the stage asks for (`Placement.create(..., resources={"node_a": 1})`: Ray then puts the
bundles only on nodes that advertise them, which is how a group is pinned to a kind of node). A
placement the cluster could never hold is a ConfigError; one it could hold but others hold now is
ResourcesBusy, which a retry may get past. What changes here is how bundles are asked for and refused;
the groups placed on them are tasks.common.nn.workers.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from tasks.common.config import ConfigError

PLACEMENT_TIMEOUT_S = float(os.environ.get("RLHF_PLACEMENT_TIMEOUT_S", "60"))


class ResourcesBusy(RuntimeError):
    """A placement group that waited in vain for resources the cluster has but others hold: worth a retry
    (the stage exits 75, tasks.common.stage), unlike one the cluster could never hold (a ConfigError)."""

    transient = True


def busy_resources(bundle: dict[str, float], count: int, total: dict[str, float], free: dict[str, float]) -> str:
    """What `count` bundles of `bundle` lack now, as 'CPU 1 (needs 2, 1 free of 2)', comma-separated; '' when the
    cluster could never hold them (it has less of a resource in all than they need) or they fit what is free
    (a placement that still failed: no one node can hold its bundles)."""
    need = {key: amount * count for key, amount in bundle.items()}
    if any(total.get(key, 0) < amount for key, amount in need.items()):
        return ""
    short = [
        f"{key} {amount - free.get(key, 0):g} (needs {amount:g}, {free.get(key, 0):g} free of {total[key]:g})"
        for key, amount in sorted(need.items())
        if free.get(key, 0) < amount
    ]
    return ", ".join(short)


def connect_ray() -> None:
    """Join the Ray cluster this process belongs to: the job's (RAY_ADDRESS, which Ray sets for a
    job's driver), the local stack's (RLHF_RAY_PORT, from `python -m tools.stack env`), or a new local one."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "")
    if not address or address.startswith(("http://", "https://")):  # a dashboard URL is for job submission
        port = os.environ.get("RLHF_RAY_PORT")
        address = f"127.0.0.1:{port}" if port else None
    ray.init(address=address, log_to_driver=True, logging_level="WARNING")


def cluster_has_gpus() -> bool:
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
    def create(
        cls,
        num_nodes: int,
        gpus_per_node: int,
        name: str,
        use_gpu: bool | None = None,
        resources: dict[str, float] | None = None,
    ) -> "Placement":
        """`resources`: custom resources each bundle also asks for (e.g. {"node_a": 1}), so the bundles
        land only on nodes that advertise them."""
        from ray.util.placement_group import placement_group

        connect_ray()
        use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        bundle.update(resources or {})
        missing = sorted(set(resources or {}) - set(ray.cluster_resources()))
        if missing:  # Ray would wait for such a node forever
            raise ConfigError(
                f"{name}_resources: no node of this Ray cluster advertises {', '.join(missing)}; start nodes with `ray start --resources`, or drop the flag"
            )
        # PACK keeps one node's ranks together (and on one node when they fit); STRICT_PACK would
        # refuse a group larger than a node.
        pg = placement_group(
            [dict(bundle) for _ in range(num_nodes * gpus_per_node)],
            strategy="PACK",
            name=f"rlhf-{name}-{uuid.uuid4().hex[:6]}",
        )
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(pg)
            free = ray.available_resources()
            need = num_nodes * gpus_per_node
            kind = "GPU" if use_gpu else "CPU"
            busy = busy_resources(bundle, need, ray.cluster_resources(), free)
            if busy:  # the cluster can hold the group, but other work holds what it needs now
                raise ResourcesBusy(
                    f"{name}_num_gpus_per_node: the {name} workers need {need} bundle(s) of {bundle} and found no room after "
                    f"{PLACEMENT_TIMEOUT_S:g} s: missing {busy}, held by other jobs; a retry may succeed once they finish "
                    "(or use fewer workers, colocate groups with --colocate_all_models, or raise RLHF_PLACEMENT_TIMEOUT_S)"
                )
            if resources:
                raise ConfigError(
                    f"{name}_resources: the {name} workers need {need} bundle(s) of {bundle}, which no node(s) could hold "
                    f"after {PLACEMENT_TIMEOUT_S:g} s (free: {free}); ask for custom resources the nodes advertise "
                    "(`ray start --resources`), or drop the flag"
                )
            raise ConfigError(
                f"{name}_num_gpus_per_node: the {name} workers need {need} bundle(s) of {bundle} but the cluster has "
                f"{free.get(kind, 0):g} {kind} free after {PLACEMENT_TIMEOUT_S:g} s; use fewer workers or colocate groups "
                f"(--colocate_all_models)"
            )
        return cls(name, num_nodes, gpus_per_node, use_gpu, pg)

    def node_ids(self) -> list[str]:
        """The Ray node id of each bundle, known as soon as the placement group is ready."""
        nodes = ray.util.placement_group_table(self.group)["bundles_to_node_id"]
        return [nodes[i] for i in range(self.size)]

    def remove(self) -> None:
        ray.util.remove_placement_group(self.group)
