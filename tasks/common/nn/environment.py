"""Multi-turn episodes: the policy acting in an environment (a tool, a game), token in, token out.

    make_env = load_environment("calculator")        # a built-in's name, a .py path or an s3:// URI
    runner = EpisodeRunner(engine, tokenizer, make_env, EpisodeLimits(max_turns=4, max_episode_tokens=64))
    episodes = runner.run(rows, temperature=1.0)     # rows: the dataset's rows, as dicts
    episodes.rollout      # Rollout: the first observation as prompt | every later token; response_mask = the model's own
    episodes.rewards      # [B]: each episode's step rewards, summed
    episodes.stats        # episodes/s, turns, tool calls, tool errors, failures by reason, time waiting on environments

The contract, one Python file (`--env_path`, OpenRLHF's `--agent_func_path`):

    TOOLS = [...]                    # optional: tool schemas for the chat template's `tools` argument
    class Environment:               # a fresh instance per episode
        def reset(self, row: dict) -> str | list[dict] | None     # the first observation; None: the row's prompt
        def step(self, action: str) -> tuple[str | None, float, bool, dict]   # observation, reward, done, info

Either method may be `async def` (a tool may await an HTTP service). `info` may say {"tool_call": True},
{"tool_error": True} and, on the last step, {"success": bool}; they are counted. An environment that
raises, runs past the step timeout or returns something malformed ends that episode with reward 0 and
a counted reason; the run goes on.

Token in, token out: the trajectory is the token ids the engine produced, never re-tokenized text. An
observation is tokenized once and appended the way the chat template formats a tool (or user) turn,
found by rendering one (`observation_ids`), or as plain text without a template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from collections import Counter
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from tasks.common import user_code
from tasks.common.config import ConfigError
from tasks.common.generation import EpisodeConfig
from tasks.common.nn import data
from tasks.common.nn.engines.rollout import BatchedRequests, Completion, Rollout

BUILT_IN = {"calculator": "tasks.common.envs.calculator", "guess": "tasks.common.envs.guess"}
FAILURES = ("error", "timeout", "malformed")  # why an environment ended an episode early


class EnvError(ConfigError):
    """An environment that cannot be used; one line naming it and the fix."""


@dataclass
class EnvironmentFile:
    """An environment as loaded: calling it builds a fresh episode's environment."""

    spec: str  # as messages name it: the file's URI, without its pin (#sha256=…)
    cls: type
    tools: list | None = None

    def __call__(self):
        return self.cls()


def load_environment(spec: str) -> EnvironmentFile:
    """The Environment class of a built-in (calculator, guess) or of a file (a local path or an s3:// URI)."""
    import importlib

    if spec in BUILT_IN:
        module = importlib.import_module(BUILT_IN[spec])
    else:
        module = user_code.load_module(spec, "env_path", EnvError, purpose="env")
    env = getattr(module, "Environment", None)
    if not isinstance(env, type) or not all(callable(getattr(env, m, None)) for m in ("reset", "step")):
        raise EnvError(
            f"env_path: {user_code.split_pin(spec)[0]} defines no class Environment with reset(row) and step(action); define both (see docs/agentic-rl.md)"
        )
    return EnvironmentFile(user_code.split_pin(spec)[0], env, getattr(module, "TOOLS", None))


def failure_reason(error: BaseException) -> str:
    return "timeout" if isinstance(error, TimeoutError) else "error"


def check_environment(env: EnvironmentFile, row: dict, timeout: float) -> None:
    """Build one episode's environment and reset it on a row, before any training: a file whose class
    cannot be built or whose reset fails or hangs past `timeout` stops the stage here, in one line."""
    outcome: dict = {}

    def reset():  # on a daemon thread: a reset that never returns is left there, not waited for
        try:
            value = env().reset(row)
            outcome["first"] = asyncio.run(asyncio.wait_for(value, timeout)) if inspect.isawaitable(value) else value
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=reset, name="env-check", daemon=True)
    thread.start()
    thread.join(timeout)
    try:
        if thread.is_alive():
            raise TimeoutError(f"no answer in {timeout:g} s (--env_step_timeout)")
        if "error" in outcome:
            raise outcome["error"]
        first = outcome["first"]
    except Exception as e:
        raise EnvError(
            f"env_path: {env.spec}: reset failed on the first prompt row ({type(e).__name__}: {e}); fix Environment.reset for rows like it"
        ) from None
    if not (first is None or isinstance(first, (str, list))):
        raise EnvError(
            f"env_path: {env.spec}: reset returned {type(first).__name__}; return the first observation "
            "(a string or chat messages) or None for the row's prompt"
        )


#: EpisodeConfig's defaults, which a runner made without a stage config (tests, benchmarks) starts from.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(EpisodeConfig)}


@dataclass
class EpisodeLimits:
    max_turns: int = _DEFAULT["max_turns"]
    max_episode_tokens: int = _DEFAULT["max_episode_tokens"]  # model and observation tokens after the prompt
    max_turn_tokens: int = _DEFAULT["generate_max_len"]  # new tokens per model turn
    step_timeout: float = _DEFAULT["env_step_timeout"]  # seconds an environment's reset or step may take
    max_prompt_tokens: int = 0  # a longer first observation keeps its last tokens (RL's prompt_max_len; 0: all)


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


def observation_ids(tokenizer, text: str, chat_template: bool, role: str = "tool") -> list[int]:
    """The ids appended after a model turn for an observation: without a template the text's own tokens;
    with one, what the template writes between the end of an assistant turn (its closing token, which the
    model generated) and the next assistant turn's opening, with the observation inside."""
    if not chat_template:
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(_observation_frame(tokenizer, role).replace(_OBS_PROBE, text), add_special_tokens=False)


_OBS_PROBE = "@@observation-probe@@"
_FRAMES: dict[tuple, str] = {}


def _observation_frame(tokenizer, role: str) -> str:
    key = (str(tokenizer.chat_template), role)
    if key not in _FRAMES:
        answer = "@@answer-probe@@"
        messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": answer}]
        for who in (role, "user"):  # a template that knows no tool role gets the observation as a user turn
            try:
                text = tokenizer.apply_chat_template(
                    messages + [{"role": who, "content": _OBS_PROBE}], add_generation_prompt=True, tokenize=False
                )
            except Exception:
                continue
            if _OBS_PROBE in text:
                break
        else:
            raise EnvError(
                f"env_path: the chat template of {tokenizer.name_or_path} renders no tool or user turn "
                "after an assistant turn; use a model whose template can, or drop --apply_chat_template"
            )
        after = text[text.index(answer) + len(answer) :]
        closing = tokenizer.decode(data.turn_end_ids(tokenizer))  # generated by the model, not part of the observation
        _FRAMES[key] = after[len(closing) :] if after.startswith(closing) else after
    return _FRAMES[key]


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
