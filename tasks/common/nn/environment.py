"""Multi-turn episodes: the policy acting in an environment (a tool, a game), token in, token out.

    make_env = load_environment("calculator")        # a built-in's name, a .py path or an s3:// URI
    runner = EpisodeRunner(engine, tokenizer, make_env, EpisodeLimits(max_turns=4, max_episode_tokens=64))
    episodes = runner.run(rows, temperature=1.0)     # rows: the dataset's rows, as dicts
    episodes.rollout      # Rollout: the first observation as prompt | every later token; response_mask = the model's own
    episodes.rewards      # [B]: each episode's step rewards, summed
    episodes.stats        # episodes/s, turns, tool calls, tool errors, failures by reason, time waiting on environments

This module schedules episodes: model turns on the engine, environment steps on an event loop. Its parts
have their own modules, whose names are importable from here too: the environment file's contract and
loader (tasks.common.env_loader), what an episode records and counts (tasks.common.nn.episodes), and how
an observation is tokenized (tasks.common.nn.observations). An environment that raises, runs past the step
timeout or returns something malformed ends that episode with reward 0 and a counted reason; the run goes on.

Token in, token out: the trajectory is the token ids the engine produced, never re-tokenized text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from tasks.common.env_loader import BUILT_IN, EnvError, EnvironmentFile, check_environment, load_environment
from tasks.common.generation import EpisodeConfig
from tasks.common.nn import data
from tasks.common.nn.engines.rollout import BatchedRequests, Completion, Rollout
from tasks.common.nn.episodes import FAILURES, Episode, Episodes, episode_stats, episode_summary, failure_reason
from tasks.common.nn.observations import observation_ids

# The episode layer's names, its parts' included: callers write `from tasks.common.nn.environment import EnvError`.
__all__ = [
    "BUILT_IN",
    "FAILURES",
    "EnvError",
    "EnvironmentFile",
    "Episode",
    "EpisodeLimits",
    "EpisodeRunner",
    "Episodes",
    "check_environment",
    "episode_runner",
    "episode_stats",
    "episode_summary",
    "failure_reason",
    "load_environment",
    "observation_ids",
]

#: EpisodeConfig's defaults, which a runner made without a stage config (tests, benchmarks) starts from.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(EpisodeConfig)}


@dataclass
class EpisodeLimits:
    max_turns: int = _DEFAULT["max_turns"]
    max_episode_tokens: int = _DEFAULT["max_episode_tokens"]  # model and observation tokens after the prompt
    max_turn_tokens: int = _DEFAULT["generate_max_len"]  # new tokens per model turn
    step_timeout: float = _DEFAULT["env_step_timeout"]  # seconds an environment's reset or step may take
    max_prompt_tokens: int = 0  # a longer first observation keeps its last tokens (RL's prompt_max_len; 0: all)


def episode_runner(cfg, engine, tokenizer, policy_version=None) -> "EpisodeRunner":
    """The runner of a stage config's episodes (tasks.common.generation.EpisodeConfig's fields, with generate_max_len,
    apply_chat_template, input_key and, in RL, prompt_max_len): its environment, its limits, on `engine`."""
    limits = EpisodeLimits(
        cfg.max_turns,
        cfg.max_episode_tokens,
        cfg.generate_max_len,
        cfg.env_step_timeout,
        getattr(cfg, "prompt_max_len", 0),
    )
    return EpisodeRunner(
        engine,
        tokenizer,
        load_environment(cfg.env_path),
        limits,
        cfg.apply_chat_template,
        cfg.input_key,
        policy_version,
    )


class EpisodeRunner:
    """Runs a batch of episodes. Each model turn is a request to the engine (tasks.common.nn.engines: `submit`,
    then `step` until it finishes); the environments step on an event loop of the runner's own (async steps
    awaited, sync ones in threads), each as soon as its episode's turn is generated.

    In lock-step (the transformers engine: the same batches, so the same samples, whatever the timing) every
    turn of a round is one batched `generate`, and the engine waits for every step in flight before the next
    round. Overlapped (`engine.overlap_turns`, vLLM) an episode's next turn is submitted as soon as its step
    returns, and the engine keeps decoding the others meanwhile; vLLM takes each turn into its running batch
    at the next decode step, so a slow tool holds back its own episode only and a finished one never waits
    for a batch to drain.

    `policy_version`, when given, is called whenever turns are submitted to an engine with none in flight: it
    may load newer weights (--partial_rollouts) and says which version the turns generate with; each token is
    tagged with it."""

    def __init__(
        self,
        engine,
        tokenizer,
        make_env,
        limits: EpisodeLimits,
        chat_template: bool = False,
        input_key: str = "prompt",
        policy_version=None,
    ):
        self.engine, self.tokenizer, self.make_env, self.limits = engine, tokenizer, make_env, limits
        self.chat_template, self.input_key, self.policy_version = chat_template, input_key, policy_version
        self.overlap = bool(getattr(engine, "overlap_turns", False))
        self.requests = engine if hasattr(engine, "submit") else BatchedRequests(engine)
        self.stop_ids = set(data.stop_token_ids(tokenizer))
        self.pool = ThreadPoolExecutor(
            max_workers=32, thread_name_prefix="env"
        )  # a hung sync step holds a thread, not the run
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="env-loop", daemon=True).start()

    # ------------------------------------------------------------------ environment calls

    async def _call(self, fn, arg):
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(arg), self.limits.step_timeout)
        return await asyncio.wait_for(self.loop.run_in_executor(self.pool, fn, arg), self.limits.step_timeout)

    def _submit(self, fn, arg) -> Future:
        """`fn(arg)` started on the environments' loop, under the step timeout."""
        return asyncio.run_coroutine_threadsafe(self._call(fn, arg), self.loop)

    @staticmethod
    def _outcome(future: Future):
        """A finished call's value, or the exception it raised."""
        return future.exception() or future.result()

    def _fail(self, episode: Episode, reason: str) -> None:
        episode.failure, episode.reward, episode.done = reason, 0.0, True

    # ------------------------------------------------------------------ one batch

    def start(self, rows: list[dict]) -> list[Episode]:
        """An environment per row, reset; the prompt is the first observation (or the row's own). An environment
        that cannot be built or reset starts an episode that is already over, with reward 0."""
        envs = []
        for _ in rows:
            try:
                envs.append(self.make_env())
            except Exception as e:
                envs.append(e)
        resets = [None if isinstance(env, Exception) else self._submit(env.reset, row) for env, row in zip(envs, rows)]
        episodes = []
        for env, row, reset in zip(envs, rows, resets):
            first = env if reset is None else self._outcome(reset)
            failure = (
                failure_reason(first)
                if isinstance(first, BaseException)
                else None
                if first is None or isinstance(first, (str, list))
                else "malformed"
            )
            prompt = row.get(self.input_key, "") if failure or first is None else first
            ids = data.encode_prompt(
                self.tokenizer, prompt, self.chat_template, tools=getattr(self.make_env, "tools", None)
            )
            episode = Episode(
                ids[-self.limits.max_prompt_tokens :] if self.limits.max_prompt_tokens else ids,
                None if isinstance(env, Exception) else env,
            )
            if failure:
                self._fail(episode, failure)
            episodes.append(episode)
        return episodes

    def run(self, rows: list[dict], temperature: float = 1.0, greedy: bool = False) -> Episodes:
        t0 = time.monotonic()
        episodes = self.start(rows)
        waited = time.monotonic() - t0  # the engine idle, waiting on environments
        behaviour_logprobs = True  # until the engine returns a turn without them
        version = 0  # the weights the engine generates with
        ready = [i for i, e in enumerate(episodes) if not e.done]  # episodes waiting for their next model turn
        generating: dict[int, int] = {}  # an episode's turn in the engine: the version it generates with
        stepping: dict[Future, tuple[int, int]] = {}  # an environment step in flight: (episode, version of its turn)
        while ready or generating or stepping:
            if stepping and not (self.overlap and (ready or generating)):  # nothing for the engine to do meanwhile
                t1 = time.monotonic()
                finished, _ = wait(stepping, return_when=FIRST_COMPLETED if self.overlap else ALL_COMPLETED)
                waited += time.monotonic() - t1
            else:
                finished = [future for future in stepping if future.done()]
            for future in finished:
                i, turn_version = stepping.pop(future)
                self._apply(
                    episodes[i], self._outcome(future), episodes[i].turns == self.limits.max_turns, turn_version
                )
                if not episodes[i].done:
                    ready.append(i)
            if ready and not generating and self.policy_version:
                # Newer weights load only with no turn in the engine, so each token's version is the weights that made it.
                version = self.policy_version()
            for i in sorted(ready):
                self.requests.submit(
                    i, episodes[i].prompt + episodes[i].tokens, self.limits.max_turn_tokens, temperature, greedy
                )
                generating[i] = version
            ready = []
            turns = self.requests.step() if generating else []
            for completion in turns:
                i = completion.key
                behaviour_logprobs &= completion.logprobs is not None
                self._take_turn(episodes[i], completion, generating[i])
                stepping[self._submit(episodes[i].env.step, episodes[i].action)] = (i, generating.pop(i))
        return self._collect(episodes, time.monotonic() - t0, waited, behaviour_logprobs)

    def _take_turn(self, episode: Episode, completion: Completion, version: int) -> None:
        """A model turn's tokens appended to its episode (up to the episode's room) and decoded into its `action`."""
        room = self.limits.max_episode_tokens - len(episode.tokens)
        ids = completion.token_ids[:room]
        episode.add(
            ids,
            by_model=True,
            logprobs=None if completion.logprobs is None else completion.logprobs[:room],
            version=version,
        )
        episode.turns += 1
        episode.action = self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def _apply(self, episode: Episode, result, last_turn: bool, version: int) -> None:
        if isinstance(result, BaseException):
            return self._fail(episode, failure_reason(result))
        if not (isinstance(result, tuple) and len(result) == 4):
            return self._fail(episode, "malformed")
        observation, reward, done, info = result
        if (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or not math.isfinite(reward)
            or not (observation is None or isinstance(observation, str))
            or not (info is None or isinstance(info, dict))
        ):
            return self._fail(episode, "malformed")
        info = info or {}
        episode.reward += float(reward)
        episode.tool_calls += bool(info.get("tool_call"))
        episode.tool_errors += bool(info.get("tool_error"))
        if "success" in info:
            episode.success = bool(info["success"])
        if done or observation is None or last_turn:
            episode.done = True
            return
        ids = observation_ids(self.tokenizer, observation, self.chat_template)
        if len(episode.tokens) + len(ids) >= self.limits.max_episode_tokens:  # no room left for the model to answer
            episode.done = True
            return
        episode.add(ids, by_model=False, version=version)

    def _collect(self, episodes: list[Episode], seconds: float, waited: float, behaviour_logprobs: bool) -> Episodes:
        pad_id = self.tokenizer.pad_token_id
        prompts, p_mask = data.pad([e.prompt for e in episodes], pad_id, side="left")
        width = max(1, max(len(e.tokens) for e in episodes))
        responses = torch.full((len(episodes), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(episodes), width), dtype=torch.long)
        model_mask = torch.zeros((len(episodes), width), dtype=torch.long)
        logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)
        versions = torch.zeros((len(episodes), width), dtype=torch.long)
        for i, e in enumerate(episodes):
            n = len(e.tokens)
            responses[i, :n] = torch.tensor(e.tokens, dtype=torch.long)
            attention[i, :n] = 1
            model_mask[i, :n] = torch.tensor(e.model_mask, dtype=torch.long)
            logprobs[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(e.versions, dtype=torch.long)
        rollout = Rollout(
            torch.cat([prompts, responses], 1),
            torch.cat([p_mask, attention], 1),
            model_mask,
            prompts.size(1),
            logprobs if behaviour_logprobs else None,
            versions if self.policy_version else None,
        )
        summaries = [episode_summary(e) for e in episodes]
        return Episodes(
            rollout,
            torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            summaries,
            episode_stats(summaries, seconds, waited),
            episodes,
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)
