"""Rollout scheduling for the RL loop: which prompts a step draws, when their rollout starts (now, or up to
--max_staleness steps ahead with --async_train), and what comes back: the engines' samples with their rewards,
with --dynamic_filtering's informative groups only, --over_sampling_batch_size's first whole groups, and nothing
staler than the bound. The controller (tasks/rl/trainer.py) trains on what `rollout` returns.

    rollouts = RolloutScheduler(cfg, prompts, tokenizer, engine, reward, steps)
    rollout, scores, timing = rollouts.rollout(step)      # timing: time_generate_s, time_reward_s, the engines' stats
    state = rollouts.sampler.state_dict()                  # what a checkpoint keeps of it
"""

from __future__ import annotations

import time
from collections import deque

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import data
from tasks.common.nn.engines.rollout import Rollout, concat_rollouts
from tasks.common.nn.rewards import build_reward_batch
from tasks.rl.advantages import group_keep_mask
from tasks.rl.config import RLConfig
from tasks.rl.engine_slots import Generated
from tasks.rl.experience import fresh_groups, whole_groups

MAX_FILTER_ROUNDS = 8  # rollouts drawn per step before dynamic filtering gives up


class RolloutScheduler:
    """The prompts' sampler and the rollouts in flight, over the actor's engine slot and the reward source."""

    def __init__(self, cfg: RLConfig, prompts, tokenizer, engine, reward, steps: int):
        self.cfg, self.prompts, self.tokenizer, self.engine, self.reward, self.steps = (
            cfg,
            prompts,
            tokenizer,
            engine,
            reward,
            steps,
        )
        self.sampler = data.BatchSampler(len(prompts.ids), cfg.prompts_per_rollout(), cfg.seed)
        self.in_flight: deque = deque()  # --async_train: (prompt rows, engine handle) of rollouts already generating
        self.started = 0  # rollouts started so far (the run starts no more than its steps)

    def rollout(self, step: int) -> tuple[Rollout, torch.Tensor, dict]:
        """Sample prompts, generate, score; with --dynamic_filtering, keep only informative groups. With
        --async_train the rollout was started up to --max_staleness steps ago (`in_flight`)."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        kept: list[tuple[Rollout, torch.Tensor]] = []
        have, rounds, generated = 0, 0, 0
        timing = {"time_generate_s": 0.0, "time_reward_s": 0.0}
        while have < cfg.rollout_batch_size:
            rounds += 1
            if rounds > MAX_FILTER_ROUNDS:
                raise ConfigError(
                    f"dynamic_filtering: only {have} of {cfg.rollout_batch_size} prompt groups kept after "
                    f"{MAX_FILTER_ROUNDS} rollouts; widen --dynamic_filtering_reward_range or drop --dynamic_filtering"
                )
            index, handle = self._next_rollout()
            rollout, scores = self._finish_and_score(index, handle, step, timing)
            generated += len(index) // n
            if not cfg.dynamic_filtering:
                return rollout, scores, timing
            rows = group_keep_mask(scores, n, *cfg.interval("dynamic_filtering_reward_range")).nonzero().squeeze(-1)
            rows = rows[: (cfg.rollout_batch_size - have) * n]
            kept.append((rollout.select(rows), scores[rows]))
            have += rows.numel() // n
        timing["filter_kept_fraction"] = cfg.rollout_batch_size / generated
        return (
            concat_rollouts([r for r, _ in kept], self.tokenizer.pad_token_id),
            torch.cat([s for _, s in kept]),
            timing,
        )

    def _start_rollout(self):
        """Draw a rollout's prompt rows and start generating it: (rows, engine handle). The samples of one prompt
        are consecutive rows: the group estimators rely on it."""
        index = [i for i in self.sampler.next() for _ in range(self.cfg.n_samples_per_prompt)]
        self.started += 1
        if self.cfg.env_path:
            return index, self.engine.start("run_episodes", [self.prompts.rows[i] for i in index])
        if self.prompts.images is not None:  # each prompt with its images (refused beside over-sampling)
            return index, self.engine.start(
                "generate_vision", [(self.prompts.ids[i], self.prompts.images[i]) for i in index]
            )
        method = "generate_first_groups" if self.cfg.over_sampling_batch_size else "generate"
        return index, self.engine.start(method, [self.prompts.ids[i] for i in index])

    def _next_rollout(self):
        """The rollout this step trains on. With --async_train, the oldest in flight; then as many more are started
        as keep --max_staleness in flight (queued on the engines before this step's weight update, they use
        weights up to that many updates old), never more than the run's steps."""
        if not self.cfg.async_train:
            return self._start_rollout()
        current = self.in_flight.popleft() if self.in_flight else self._start_rollout()
        while len(self.in_flight) < self.cfg.max_staleness and self.started < self.steps:
            self.in_flight.append(self._start_rollout())
        return current

    def _finish_and_score(self, index: list[int], handle, step: int, timing: dict) -> tuple[Rollout, torch.Tensor]:
        """The rollout and its rewards: the environment's (--env_path), or the reward source's. Adds to `timing`."""
        t0 = time.time()
        out = self.engine.finish(handle)
        t1 = time.time()
        timing["time_generate_s"] += t1 - t0
        timing.update(out.stats or {})
        if out.rollout.versions is not None:
            out, index = self._drop_stale(out, index, step, timing)
        if self.cfg.over_sampling_batch_size:
            out, index = self._first_groups(out, index, timing)
        if out.rewards is not None:
            return out.rollout, out.rewards
        batch = build_reward_batch(
            out.rollout, self.tokenizer, [self.prompts.texts[i] for i in index], [self.prompts.labels[i] for i in index]
        )
        scores = self.reward.score(batch).float()
        timing["time_reward_s"] += time.time() - t1
        return out.rollout, scores

    def _drop_stale(self, out: Generated, index: list[int], step: int, timing: dict) -> tuple[Generated, list[int]]:
        """Drop the prompt groups with a sample more than --max_staleness updates behind the trainer (step - 1 so
        far). The engines' queue keeps every sample within it, so a drop means a rollout outlived its bound."""
        keep, stats = fresh_groups(out.rollout, step - 1, self.cfg.n_samples_per_prompt, self.cfg.max_staleness)
        timing.update(stats)
        if keep.all():
            return out, index
        if not keep.any():
            raise RuntimeError(
                f"rl: every sample of step {step}'s rollout is more than --max_staleness {self.cfg.max_staleness} "
                "updates old; the engines fell behind the trainer"
            )
        rows = keep.nonzero().squeeze(-1)
        return Generated(out.rollout.select(rows), None if out.rewards is None else out.rewards[rows], out.stats), [
            index[i] for i in rows.tolist()
        ]

    def _first_groups(self, out: Generated, index: list[int], timing: dict) -> tuple[Generated, list[int]]:
        """--over_sampling_batch_size: the prompt groups generated to the end; the engines left the rest empty."""
        rows, timing["rollout_dropped_groups"] = whole_groups(out.rollout, self.cfg.n_samples_per_prompt)
        return Generated(out.rollout.select(rows), None, out.stats), [index[i] for i in rows.tolist()]
