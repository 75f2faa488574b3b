"""The rollout engines as the RL controller drives them: `start(method, items)`, `finish(handle)` -> Generated, and
`sync_weights(version)` after each update. ActorGroupEngine: the engines inside the actor workers (transformers on
the trained module, or one vLLM engine per rank colocated); EngineGroup: engines on devices of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tasks.common.nn.engines.rollout import Rollout, concat_rollouts
from tasks.common.nn.environment import episode_stats
from tasks.common.nn.workers import WorkerGroup, gather, shard


@dataclass
class Generated:
    """What a rollout engine slot gives back: the rollout (its `versions` set by engines of their own), the
    environment's rewards with episodes (None: the reward source scores it) and episode statistics."""

    rollout: Rollout
    rewards: torch.Tensor | None = None
    stats: dict[str, float] | None = None


def merge_generated(parts: list, pad_token_id: int, seconds: float) -> Generated:
    """One Generated from the workers' shares: Rollouts, or Episodes (None for a worker without rows)."""
    parts = [p for p in parts if p is not None]
    if isinstance(parts[0], Rollout):
        return Generated(concat_rollouts([p for p in parts if p.sequences.size(0)], pad_token_id))
    stats = episode_stats([s for p in parts for s in p.summaries], seconds, max(p.stats["time_env_s"] for p in parts))
    return Generated(
        concat_rollouts([p.rollout for p in parts], pad_token_id), torch.cat([p.rewards for p in parts]), stats
    )


class ActorGroupEngine:
    """The rollout engine slot as the controller sees it: `start(method, items)` then `finish(handle)`, and
    `sync_weights()` after each update; method is "generate" (prompt ids) or "run_episodes" (dataset rows,
    --env_path). The engines live in the actor workers (items sharded over its ranks): transformers `generate`
    on the trained module itself, nothing to sync; or one vLLM engine per rank on the rank's GPU
    (tasks.common.nn.engines.vllm_engine), loaded with the new weights in place."""

    def __init__(self, actor: WorkerGroup, pad_token_id: int, vllm: bool = False):
        self.actor, self.pad_token_id, self.vllm = actor, pad_token_id, vllm

    def start(self, method: str, items: list):
        return time.time(), self.actor.scatter_async(method, shard(items, self.actor.world_size))

    def finish(self, handle) -> Generated:
        started, futures = handle
        return merge_generated(gather(futures), self.pad_token_id, time.time() - started)

    def sync_weights(self, version: int) -> None:
        """The actor's weights after `version` updates to the engines."""
        if self.vllm:
            self.actor.run("sync_weights")


class EngineGroup(ActorGroupEngine):
    """Rollout engines on devices of their own (RolloutEngineWorker): vLLM engines on GPUs (--vllm_num_engines),
    fed after each update by the actor's rank 0 over NCCL, or one transformers engine (--async_train without
    vLLM), fed the weights through Ray's object store (with --lora_rank, vLLM engines are fed the adapter alone
    that way). Calls on an engine run in order, so an update sent
    while rollouts are queued reaches only the rollouts started after it: with --async_train the controller
    keeps up to --max_staleness rollouts in flight, each token tagged with the weight version it used. With
    `partial` (--partial_rollouts) an update goes beside the queue and reaches running episodes at their next turn."""

    def __init__(
        self,
        engines: WorkerGroup,
        actor: WorkerGroup,
        pad_token_id: int,
        vllm: bool,
        partial: bool = False,
        adapter: bool = False,
    ):
        super().__init__(actor, pad_token_id, vllm)
        self.engines, self.adapter = engines, adapter
        self.send = engines.run_beside_async if partial else engines.run_async
        if vllm and not adapter:
            host, port = actor.run("weight_channel_address")[0]
            world = 1 + engines.world_size
            gather(
                [
                    actor.run_async("open_weight_channel", host, port, world),
                    engines.run_async("open_weight_channel", host, port, world),
                ]
            )
            self.shapes = actor.run("weight_shapes")[0]

    def start(self, method: str, items: list):
        return time.time(), self.engines.scatter_async(method, shard(items, self.engines.world_size))

    def sync_weights(self, version: int) -> None:
        if self.adapter:  # LoRA: the adapter alone (a few MB) through Ray's object store
            adapter = self.actor.run_async("adapter_weights")  # every rank (ZeRO-3 gathers); rank 0's holds it
            gather([*adapter, self.send("load_adapter", adapter[0], version)])
            return
        if self.vllm:
            gather([self.actor.run_async("send_weights"), self.send("receive_weights", self.shapes, version)])
            return
        state = self.actor.run_async("engine_state")  # every rank (ZeRO-3 gathers); rank 0's holds the weights
        gather([*state, self.send("load_state", state[0], version)])
