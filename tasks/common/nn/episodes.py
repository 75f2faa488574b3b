"""Episodes as data: each one's tokens, masks and counts, a batch of them as a Rollout, and their statistics.

    e = Episode(prompt=[1, 5, 9], env=None)
    e.add([7, 8], by_model=True, logprobs=[-0.1, -0.3])    # a model turn: trained on
    e.add([4], by_model=False)                             # an observation: masked out
    episode_stats([episode_summary(e)], seconds=2.0, waited=0.5)   # {"episodes_per_s": 0.5, "turns_per_episode": ...}

An environment that raises, runs past the step timeout or returns something malformed ends its episode
with reward 0 and a counted reason (FAILURES). What changes here is what an episode records and counts;
tasks.common.nn.environment fills them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from tasks.common.nn.engines.rollout import Rollout

FAILURES = ("error", "timeout", "malformed")  # why an environment ended an episode early


def failure_reason(error: BaseException) -> str:
    return "timeout" if isinstance(error, TimeoutError) else "error"


@dataclass
class Episode:
    prompt: list[int]
    env: object | None
    tokens: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # 1: the model's token (trained on), 0: an observation's
    logprobs: list[float] = field(
        default_factory=list
    )  # the engine's log-probability of each model token (0 elsewhere)
    versions: list[int] = field(default_factory=list)  # the weight version each token was generated under
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    success: bool | None = None
    failure: str | None = None
    done: bool = False
    action: str = ""  # the last model turn's text, the environment's next step

    def add(self, ids: list[int], by_model: bool, logprobs: list[float] | None = None, version: int = 0) -> None:
        self.tokens += ids
        self.model_mask += [int(by_model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)


@dataclass
class Episodes:
    rollout: Rollout
    rewards: torch.Tensor
    summaries: list[dict]  # episode_summary of each: what episode_stats counts, small enough to ship between workers
    stats: dict[str, float]  # episode_stats of this batch
    episodes: list[Episode]


def episode_summary(e: Episode) -> dict:
    return {
        "turns": e.turns,
        "tool_calls": e.tool_calls,
        "tool_errors": e.tool_errors,
        "failure": e.failure,
        "success": e.success if e.success is not None else e.reward > 0,
    }


def episode_stats(summaries: list[dict], seconds: float, waited: float) -> dict[str, float]:
    """Per-episode means, failures counted by reason, episodes/s over `seconds` and the time spent waiting on environments."""
    n = max(1, len(summaries))
    failures = Counter(s["failure"] for s in summaries if s["failure"])
    return {
        "episodes_per_s": len(summaries) / max(seconds, 1e-9),
        "turns_per_episode": sum(s["turns"] for s in summaries) / n,
        "tool_calls_per_episode": sum(s["tool_calls"] for s in summaries) / n,
        "tool_errors_per_episode": sum(s["tool_errors"] for s in summaries) / n,
        "success_rate": sum(bool(s["success"]) for s in summaries) / n,
        "time_env_s": waited,
        **{f"env_{reason}s": failures[reason] for reason in FAILURES},
    }
