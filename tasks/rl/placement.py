"""Where the RL stage's worker groups go: one placement group per set of colocated roles (RLConfig.placement_plan),
a WorkerGroup per role on it, each set up, then the rollout engine slot and the reward source the controller
drives. Refused at once: a layout the whole cluster cannot hold, and local output folders workers on other nodes
cannot reach.

    placed = place(cfg, run, tokenizer.pad_token_id, updates)
    placed.groups["actor"].run("train", ...); placed.engine.start("generate", prompt_ids)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common import storage
from tasks.common.config import ConfigError, split_list
from tasks.common.nn.rewards import RewardBatch, RewardError, RewardSource, make_reward_source
from tasks.common.nn.workers import Placement, WorkerGroup, gather, shard
from tasks.common.stage import StageRun
from tasks.common.stages import oversized
from tasks.rl.actor import ActorWorker
from tasks.rl.config import RLConfig
from tasks.rl.engine_slots import ActorGroupEngine, EngineGroup
from tasks.rl.workers import CriticWorker, ReferenceWorker, RewardWorker, RolloutEngineWorker


@dataclass
class Placed:
    layout: list[list[str]]  # the roles of each placement group
    placements: list[Placement]
    groups: dict[str, WorkerGroup]  # by role: actor, ref, critic, reward, rollout
    engine: ActorGroupEngine
    reward: RewardSource | None  # None: the environment's rewards (--env_path)


def place(cfg: RLConfig, run: StageRun, pad_token_id: int, updates: int) -> Placed:
    """Place and set up every group of the run's layout (the inputs it loads recorded in `run`)."""
    roles = cfg.roles()
    critic_uri = ""
    if "critic" in roles:
        critic_uri = run.input(
            "critic_pretrain", cfg.critic_pretrain or (split_list(cfg.reward_pretrain) or [cfg.pretrain])[0]
        )
    if "reward" in roles:
        run.input("reward_pretrain", cfg.reward_pretrain)
    else:
        cfg.remote_rm_url = run.code_input("remote_rm_url", cfg.remote_rm_url, RewardError)
    layout = cfg.placement_plan()
    check_fits(cfg, layout)
    classes = {"actor": ActorWorker, "ref": ReferenceWorker, "critic": CriticWorker, "reward": RewardWorker}
    placements, groups = [], {}
    for members in layout:
        placements.append(
            Placement.create(
                getattr(cfg, f"{members[0]}_num_nodes"),
                getattr(cfg, f"{members[0]}_num_gpus_per_node"),
                members[0],
                resources=cfg.resources(members[0]),
            )
        )
    run.placements.extend(placements)  # what the stage held, for its cost
    check_outputs_reachable(cfg, placements, groups)
    for members, placement in zip(layout, placements):
        for role in members:
            groups[role] = WorkerGroup(classes[role], placement, role, fraction=1.0 / len(members))
    setup_args = {"actor": (cfg, updates), "ref": (cfg,), "critic": (cfg, critic_uri, updates), "reward": (cfg,)}
    if cfg.separate_engines():
        placement = Placement.create(1, cfg.rollout_engines(), "rollout")
        placements.append(placement)
        run.placements.append(placement)
        groups["rollout"] = WorkerGroup(RolloutEngineWorker, placement, "rollout")
        roles = roles + ["rollout"]
        setup_args["rollout"] = (cfg,)
    gather([groups[role].run_async("setup", *setup_args[role]) for role in roles])
    if cfg.separate_engines():
        engine = EngineGroup(
            groups["rollout"],
            groups["actor"],
            pad_token_id,
            vllm=cfg.vllm_num_engines > 0,
            partial=cfg.partial_rollouts,
            adapter=cfg.lora_rank > 0,
        )
    else:
        engine = ActorGroupEngine(groups["actor"], pad_token_id, vllm=cfg.vllm_num_engines > 0)
    reward: RewardSource | None = (
        RemoteRewardModels(groups["reward"])
        if "reward" in groups
        else None
        if cfg.env_path
        else make_reward_source("", cfg.remote_rm_url)
    )
    return Placed(layout, placements, groups, engine, reward)


def check_fits(cfg: RLConfig, layout: list[list[str]]) -> None:
    """Refuse at once a layout that needs more devices than the whole cluster has (Ray would wait): the validate
    task's check (tasks.common.stages.oversized), again here for a stage started from its CLI."""
    import ray

    for problem in oversized({"colocate_all_models": cfg}, ray.cluster_resources()):
        groups = ", ".join(f"[{' + '.join(m)}] × {cfg.group_size(m[0])}" for m in layout)
        raise ConfigError(f"{problem} (worker groups: {groups})")


def check_outputs_reachable(cfg: RLConfig, placements: list[Placement], groups: dict[str, WorkerGroup]) -> None:
    """Workers upload checkpoints and the final model themselves: a folder on the driver's node is out
    of reach of those on other nodes. Checked once the bundles have nodes, before any worker starts."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    if all(node == here for placement in placements for node in placement.node_ids()):
        return
    for name in ("output", "ckpt_path", "save_path"):
        value = getattr(cfg, name)
        if value and not storage.is_s3(value):
            for group in groups.values():
                group.shutdown()
            for placement in placements:
                placement.remove()
            raise ConfigError(
                f"{name}: {value} is a folder on the driver's node, which workers on other nodes cannot write to; pass an s3:// URI"
            )


class RemoteRewardModels(RewardSource):
    """Reward models served by a RewardWorker group, behind the RewardSource interface."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def score(self, batch: RewardBatch) -> torch.Tensor:
        parts = [select_batch(batch, rows) for rows in shard(list(range(len(batch))), self.group.world_size)]
        return torch.cat(self.group.scatter("score", parts))


def select_batch(batch: RewardBatch, rows: list[int]) -> RewardBatch:
    """The batch's `rows`, each with its images (a vision-language policy's)."""
    return RewardBatch(
        batch.sequences[rows],
        batch.attention_mask[rows],
        *([field[i] for i in rows] for field in (batch.queries, batch.prompts, batch.responses, batch.labels)),
        images=None if batch.images is None else [batch.images[i] for i in rows],
    )
