"""Where an RL run's models go: each role's worker group (nodes × workers per node, custom Ray resources per
bundle) and which groups share one placement group (--colocate_actor_ref, --colocate_critic_reward,
--colocate_all_models). RLConfig takes these fields from here; it says which roles a run has (RLConfig.roles).

    cfg.placement_plan()     # [["actor", "ref"], ["critic", "reward"]]: the roles sharing each placement group
    cfg.group_size("actor")  # actor_num_nodes × actor_num_gpus_per_node
    cfg.resources("ref")     # --ref_resources as {"node_a": 1.0}, or {}
"""

import json
from dataclasses import dataclass, field

from tasks.common.config import ConfigError


@dataclass
class WorkerLayoutConfig:
    # Where the models run: one worker group each, or colocated groups sharing one placement group.
    actor_num_nodes: int = field(default=1, metadata={"help": "nodes of the actor (policy) group", "min": 1})
    actor_num_gpus_per_node: int = field(
        default=1, metadata={"help": "actor workers per node, one GPU each (one CPU on a CPU-only cluster)", "min": 1}
    )
    critic_num_nodes: int = field(default=1, metadata={"help": "nodes of the critic group (gae only)", "min": 1})
    critic_num_gpus_per_node: int = field(default=1, metadata={"help": "critic workers per node", "min": 1})
    ref_num_nodes: int = field(default=1, metadata={"help": "nodes of the reference-model group", "min": 1})
    ref_num_gpus_per_node: int = field(default=1, metadata={"help": "reference workers per node", "min": 1})
    reward_num_nodes: int = field(
        default=1, metadata={"help": "nodes of the reward-model group (with --reward_pretrain)", "min": 1}
    )
    reward_num_gpus_per_node: int = field(default=1, metadata={"help": "reward-model workers per node", "min": 1})
    actor_resources: str = field(
        default="",
        metadata={
            "help": "custom Ray resources each actor bundle also asks for, a JSON object such as '{\"node_a\": 1}': the group goes only on nodes that advertise them (`ray start --resources`)"
        },
    )
    critic_resources: str = field(
        default="", metadata={"help": "custom Ray resources of each critic bundle (JSON object)"}
    )
    ref_resources: str = field(
        default="", metadata={"help": "custom Ray resources of each reference bundle (JSON object)"}
    )
    reward_resources: str = field(
        default="", metadata={"help": "custom Ray resources of each reward-model bundle (JSON object)"}
    )
    colocate_actor_ref: bool = field(
        default=False, metadata={"help": "actor and reference share GPUs (one placement group, half a GPU each)"}
    )
    colocate_critic_reward: bool = field(default=False, metadata={"help": "critic and reward models share GPUs"})
    colocate_all_models: bool = field(
        default=False, metadata={"help": "every model shares the actor's GPUs (fractions of one placement group)"}
    )

    def roles(self) -> list[str]:  # RLConfig's: the groups the run places
        raise NotImplementedError

    def placement_plan(self) -> list[list[str]]:
        """Which of roles() share a placement group: [[actor, ref], [critic, reward]] etc., each list one group."""
        roles = self.roles()
        if self.colocate_all_models:
            return [roles]
        together = [
            mates
            for flag, mates in (
                (self.colocate_actor_ref, {"actor", "ref"}),
                (self.colocate_critic_reward, {"critic", "reward"}),
            )
            if flag
        ]
        plan, placed = [], set()
        for role in roles:
            if role in placed:
                continue
            mates = next((s for s in together if role in s), {role})
            plan.append([r for r in roles if r in mates])
            placed.update(mates)
        return plan

    def group_size(self, role: str) -> int:
        return getattr(self, f"{role}_num_nodes") * getattr(self, f"{role}_num_gpus_per_node")

    def resources(self, role: str) -> dict[str, float]:
        """--<role>_resources as a dict of custom resource -> amount per bundle ({} when unset)."""
        name = f"{role}_resources"
        text = getattr(self, name).strip()
        if not text:
            return {}
        hint = f"pass a JSON object of custom resources, e.g. --{name} '{{\"node_a\": 1}}'"
        try:
            value = json.loads(text)
        except ValueError:
            raise ConfigError(f"{name}: {text!r} is not JSON; {hint}") from None
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"{name}: {text!r} is not a non-empty JSON object; {hint}")
        for key, amount in value.items():
            if key in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ConfigError(
                    f"{name}: {key} comes from --{role}_num_gpus_per_node, not from custom resources; {hint}"
                )
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ConfigError(f"{name}: {key!r} needs a positive number, got {amount!r}; {hint}")
        return {key: float(amount) for key, amount in value.items()}

    def check_layout(self) -> None:
        """Each role's resources parse, and colocated groups agree on their size and bundles (one line each)."""
        for role in ("actor", "critic", "ref", "reward"):
            self.resources(role)
        # A colocated group sits on the first member's bundles: its own resources would be ignored.
        shared = (
            [("colocate_all_models", "actor", role) for role in ("critic", "ref", "reward")]
            if self.colocate_all_models
            else [
                (flag, a, b)
                for flag, a, b in (
                    ("colocate_actor_ref", "actor", "ref"),
                    ("colocate_critic_reward", "critic", "reward"),
                )
                if getattr(self, flag)
            ]
        )
        for flag, a, b in shared:
            if b in self.roles() and a in self.roles() and self.resources(b) and self.resources(b) != self.resources(a):
                raise ConfigError(
                    f"{b}_resources: with --{flag} the {b} group sits on the {a}'s bundles; set --{a}_resources instead, or drop --{b}_resources"
                )
        if self.colocate_all_models:
            for role in self.roles()[1:]:
                if self.group_size(role) != self.group_size("actor"):
                    raise ConfigError(
                        f"{role}_num_gpus_per_node: colocate_all_models needs every group the actor's size "
                        f"({self.group_size('actor')}), got {self.group_size(role)}"
                    )
        for flag, a, b in (("colocate_actor_ref", "actor", "ref"), ("colocate_critic_reward", "critic", "reward")):
            if getattr(self, flag) and {a, b} <= set(self.roles()) and self.group_size(a) != self.group_size(b):
                raise ConfigError(
                    f"{b}_num_gpus_per_node: {flag} needs the {b} group the {a}'s size ({self.group_size(a)}), got {self.group_size(b)}"
                )
