"""Multi-turn episodes (tasks/common/nn/environment.py): the environment contract, the built-in environments,
token in / token out, failures counted and never fatal, observation tokens out of the loss.

Episodes run on a real tiny Llama (random weights) through the HF rollout engine, with real environments
written as files the way a team writes them.
"""

import asyncio
import math
import textwrap
import time

import pytest
import torch

from tasks.common.config import ConfigError, parse_config
from tasks.common.envs import calculator, guess
from tasks.common.nn import data
from tasks.common.nn.engines.hf_engine import HFRolloutEngine
from tasks.common.nn.engines.rollout import Completion, Rollout
from tasks.common.nn.environment import (
    EnvError,
    EpisodeLimits,
    EpisodeRunner,
    check_environment,
    load_environment,
    observation_ids,
)
from tasks.common.nn.losses import importance_weights, logprob_mismatch, policy_loss
from tasks.data import agentic
from tasks.data.demo import build_base_model
from tasks.rl.advantages import discounted_returns, gae
from tasks.rl.config import RLConfig
from tasks.rl.experience import fresh_groups, response_logprobs

from tests.tiny_chat import build_tokenizer as build_chat_tokenizer


@pytest.fixture(scope="module")
def tiny():
    tokenizer = agentic.build_tokenizer()
    model = build_base_model(tokenizer, hidden_size=32, num_layers=1, max_positions=128)
    return model, tokenizer


class RecordingEngine(HFRolloutEngine):
    """The real HF engine, keeping what each generate call returned (the ids the model produced)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False, batch_size=256):
        rollout = super().generate(prompt_ids, max_new_tokens, temperature, greedy, batch_size)
        self.calls.append(
            [
                [t for t, m in zip(ids, mask) if m]
                for ids, mask in zip(rollout.responses.tolist(), rollout.response_mask.tolist())
            ]
        )
        return rollout


def env_file(tmp_path, body: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


ECHO = """
    class Environment:
        def reset(self, row):
            self.turns = 0
            return row["prompt"]

        def step(self, action):
            self.turns += 1
            return f"ok{self.turns}", 0.5, False, {"tool_call": True}
"""


# ---------------------------------------------------------------------------------------------- built-ins


def test_calculator_evaluates_arithmetic_and_refuses_the_rest():
    assert calculator.evaluate("347*8") == "2776"
    assert calculator.evaluate("(2+3)*4-1") == "19"
    assert calculator.evaluate("7/2") == "3.5"
    for bad in ("2**10", "__import__('os')", "1/0", "9*" * 40 + "9"):
        with pytest.raises(ValueError):
            calculator.evaluate(bad)


def test_calculator_answers_a_call_and_scores_the_answer():
    env = calculator.Environment()
    assert env.reset({"prompt": "347*8=", "label": "2776"}) is None
    assert env.step("<calc>347*8</calc>") == ("<result>2776</result>", 0.0, False, {"tool_call": True})
    assert env.step("<calc>347**8</calc>") == (
        "<result>error</result>",
        0.0,
        False,
        {"tool_call": True, "tool_error": True},
    )
    assert env.step(" 2776") == (None, 1.0, True, {"success": True})
    assert env.step("2775")[1:3] == (0.0, True)


def test_guess_says_higher_or_lower_and_pays_less_for_more_guesses():
    env = guess.Environment()
    env.reset({"prompt": "guess 1-16:", "target": 11})
    assert env.step("8")[:3] == ("higher", 0.0, False)
    assert env.step("x")[3] == {"tool_error": True}
    assert env.step("12")[0] == "lower"
    observation, reward, done, info = env.step("11")
    assert (observation, done, info) == (None, True, {"success": True})
    assert reward == pytest.approx(1.0 - 0.2 * 3)


# ---------------------------------------------------------------------------------------------- the contract


def test_a_bad_environment_file_is_refused_in_one_line_naming_it(tmp_path):
    cases = {
        "broken.py": ("import nowhere_to_be_found\n", "failed to import: ModuleNotFoundError"),
        "empty.py": ("X = 1\n", "defines no class Environment with reset(row) and step(action)"),
        "half.py": (
            "class Environment:\n    def reset(self, row):\n        return None\n",
            "defines no class Environment",
        ),
    }
    for name, (body, words) in cases.items():
        path = env_file(tmp_path, body, name)
        with pytest.raises(EnvError) as caught:
            load_environment(path)
        assert (
            str(caught.value).startswith(f"env_path: {path}")
            and words in str(caught.value)
            and "\n" not in str(caught.value)
        )
    with pytest.raises(EnvError, match="not found"):
        load_environment(str(tmp_path / "missing.py"))


def test_an_environment_whose_reset_raises_stops_before_training(tmp_path):
    path = env_file(
        tmp_path,
        """
        class Environment:
            def reset(self, row):
                raise KeyError("target")
            def step(self, action):
                return None, 0.0, True, {}
    """,
    )
    with pytest.raises(
        EnvError, match=r"reset failed on the first prompt row \(KeyError: 'target'\); fix Environment.reset"
    ):
        check_environment(load_environment(path), {"prompt": "1"}, timeout=5)
    check_environment(load_environment("calculator"), {"prompt": "1*2=", "label": "2"}, timeout=5)


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_an_environment_whose_reset_hangs_stops_before_training(kind, tmp_path):
    path = env_file(
        tmp_path,
        f"""
        import asyncio, time
        class Environment:
            {kind} reset(self, row):
                {"await asyncio.sleep(30)" if kind == "async def" else "time.sleep(30)"}
            def step(self, action):
                return None, 0.0, True, {{}}
    """,
    )
    started = time.monotonic()
    with pytest.raises(EnvError, match=r"reset failed on the first prompt row \(TimeoutError"):
        check_environment(load_environment(path), {"prompt": "1"}, timeout=0.5)
    assert time.monotonic() - started < 5


def test_rl_config_takes_the_environment_flags_and_openrlhfs_name(tmp_path):
    base = ["--pretrain", "m", "--prompt_data", "d", "--output", str(tmp_path / "o")]
    cfg = parse_config(RLConfig, base + ["--agent_func_path", "calculator", "--max_turns", "3"])
    assert (cfg.env_path, cfg.max_turns) == ("calculator", 3)
    assert "reward" not in cfg.roles()  # the environment gives the rewards
    assert parse_config(
        RLConfig, base + ["--env_path", "guess", "--async_train"]
    ).separate_engines()  # episodes on the engine
    with pytest.raises(ConfigError, match="max_turns"):
        parse_config(RLConfig, base + ["--env_path", "guess", "--max_turns", "0"])
    with pytest.raises(ConfigError, match="^partial_rollouts: .*--async_train"):
        parse_config(RLConfig, base + ["--env_path", "guess", "--partial_rollouts"])


# ---------------------------------------------------------------------------------------------- episodes


def test_episodes_keep_the_engines_tokens_and_mask_the_observations(tiny, tmp_path):
    model, tokenizer = tiny
    torch.manual_seed(0)
    engine = RecordingEngine(model, tokenizer)
    runner = EpisodeRunner(
        engine,
        tokenizer,
        load_environment(env_file(tmp_path, ECHO)),
        EpisodeLimits(max_turns=3, max_episode_tokens=60, max_turn_tokens=6),
    )
    rows = [{"prompt": f"{a}*{b}="} for a, b in ((123, 4), (56, 7), (9, 9))]
    result = runner.run(rows)
    rollout = result.rollout
    for i, episode in enumerate(result.episodes):
        # The sequence the trainer reads: the prompt's ids, then model and observation ids, as produced.
        kept = [t for t, m in zip(rollout.sequences[i].tolist(), rollout.attention_mask[i].tolist()) if m]
        assert kept == episode.prompt + episode.tokens
        model_ids = [t for t, m in zip(rollout.responses[i].tolist(), rollout.response_mask[i].tolist()) if m]
        generated = [tok for call in engine.calls for tok in call[i]]  # every episode is live for all 3 turns
        assert model_ids == generated, "the model's tokens are exactly what the engine generated, never re-tokenized"
        observations = [
            t
            for t, m, a in zip(
                rollout.responses[i].tolist(),
                rollout.response_mask[i].tolist(),
                rollout.attention_mask[i, rollout.prompt_width :].tolist(),
            )
            if a and not m
        ]
        expected = [
            tok for k in range(1, episode.turns) for tok in tokenizer.encode(f"ok{k}", add_special_tokens=False)
        ]
        assert observations == expected
        assert episode.turns == 3 and episode.reward == pytest.approx(1.5) and episode.tool_calls == 3
    assert result.rewards.tolist() == pytest.approx([1.5, 1.5, 1.5])
    assert result.stats["turns_per_episode"] == 3 and result.stats["tool_calls_per_episode"] == 3
    assert result.stats["episodes_per_s"] > 0
    runner.close()


def test_a_long_first_observation_keeps_its_last_tokens(tiny, tmp_path):
    model, tokenizer = tiny
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(env_file(tmp_path, ECHO)),
        EpisodeLimits(max_turns=1, max_episode_tokens=8, max_turn_tokens=2, max_prompt_tokens=5),
    )
    episode = runner.run([{"prompt": "123456789*2="}]).episodes[0]
    assert episode.prompt == data.encode_prompt(tokenizer, "123456789*2=")[-5:]  # the end, which the answer follows
    runner.close()


def test_failing_hanging_and_malformed_environments_end_only_their_episode(tiny, tmp_path):
    model, tokenizer = tiny
    path = env_file(
        tmp_path,
        """
        import asyncio
        import itertools

        COUNTER = itertools.count()

        class Environment:
            def reset(self, row):
                self.kind = row["kind"]
                return None

            async def step(self, action):
                if self.kind == "flaky" and next(COUNTER) % 5 == 0:   # every fifth step raises: 20%
                    raise RuntimeError("tool down")
                if self.kind == "hang":
                    await asyncio.sleep(60)
                if self.kind == "malformed":
                    return "obs", "one", False, {}
                return None, 1.0, True, {"success": True}
    """,
    )
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(path),
        EpisodeLimits(max_turns=2, max_episode_tokens=40, max_turn_tokens=4, step_timeout=0.5),
    )
    kinds = ["flaky"] * 10 + ["hang", "malformed", "fine"]
    result = runner.run([{"prompt": "1*2=", "kind": kind} for kind in kinds])
    failures = {e.failure for e in result.episodes}
    assert {"error", "timeout", "malformed"} <= failures
    assert result.stats["env_errors"] == 2 and result.stats["env_timeouts"] == 1 and result.stats["env_malformeds"] == 1
    rewards = dict(zip(range(len(kinds)), result.rewards.tolist()))
    assert all(rewards[i] == 0.0 for i, e in enumerate(result.episodes) if e.failure)
    assert sum(r == 1.0 for r in rewards.values()) == 10 - 2 + 1
    assert result.stats["time_env_s"] < 5, "a hung step costs its timeout, not the run"
    runner.close()


def test_observation_tokens_get_no_gradient(tiny, tmp_path):
    model, tokenizer = tiny
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(env_file(tmp_path, ECHO)),
        EpisodeLimits(max_turns=2, max_episode_tokens=40, max_turn_tokens=4),
    )
    rollout = runner.run([{"prompt": "12*3="}, {"prompt": "45*6="}]).rollout
    logprobs = response_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_width)
    logprobs.retain_grad()
    mask = rollout.response_mask
    loss, _ = policy_loss(logprobs, logprobs.detach() - 0.1, torch.ones_like(logprobs), mask, 0.2)
    loss.backward()
    observation = (rollout.attention_mask[:, rollout.prompt_width :] == 1) & (mask == 0)
    assert observation.any() and (mask == 1).any()
    assert torch.all(logprobs.grad[observation] == 0)
    assert torch.any(logprobs.grad[mask == 1] != 0)
    runner.close()


def test_observations_are_framed_as_the_chat_template_frames_a_tool_turn():
    tokenizer = build_chat_tokenizer()
    ids = observation_ids(tokenizer, "<result>6</result>", chat_template=True)
    # The model's turn ended with <|end|> (generated); then the tool turn and the next assistant opening.
    assert tokenizer.decode(ids) == "<|tool|><result>6</result><|end|><|assistant|>"
    assert observation_ids(tokenizer, "6", chat_template=False) == tokenizer.encode("6", add_special_tokens=False)


def test_async_steps_run_concurrently(tiny, tmp_path):
    model, tokenizer = tiny
    path = env_file(
        tmp_path,
        """
        import asyncio

        class Environment:
            def reset(self, row):
                return None

            async def step(self, action):
                await asyncio.sleep(0.3)   # a slow tool: 16 of them at once take 0.3 s, not 4.8 s
                return None, 1.0, True, {}
    """,
    )
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(path),
        EpisodeLimits(max_turns=1, max_episode_tokens=8, max_turn_tokens=4),
    )
    result = runner.run([{"prompt": "1*1="}] * 16)
    assert result.stats["time_env_s"] < 2.0
    runner.close()
    assert asyncio.iscoroutinefunction(load_environment(path).cls.step)


class OverlappedEngine(RecordingEngine):
    overlap_turns = True  # as the vLLM engine declares


SLOW_TOOL = """
    import asyncio, time

    class Environment:
        LOG = []  # (episode, turn, time the step returned)

        def reset(self, row):
            self.row, self.turns = row, 0
            return row["prompt"]

        async def step(self, action):
            self.turns += 1
            await asyncio.sleep(self.row["delay"])
            Environment.LOG.append((self.row["prompt"], self.turns, time.monotonic()))
            return "ok", 1.0, False, {}
"""


@pytest.mark.parametrize("overlap", [False, True])
def test_a_slow_tool_holds_back_only_its_own_episode_when_turns_overlap(overlap, tiny, tmp_path):
    """One episode's tool takes 2 s a step (room for a loaded machine), three others' return at once; three turns
    each. Overlapped (the vLLM engine), the three finish all their turns while the slow one waits on its first
    step; in lock-step (the transformers engine) every turn waits for the slow step. The episodes are the same
    either way."""
    model, tokenizer = tiny
    env = load_environment(env_file(tmp_path, SLOW_TOOL))
    engine = (OverlappedEngine if overlap else RecordingEngine)(model, tokenizer)
    runner = EpisodeRunner(engine, tokenizer, env, EpisodeLimits(max_turns=3, max_episode_tokens=60, max_turn_tokens=3))
    rows = [{"prompt": "9*9=", "delay": 2.0}] + [{"prompt": f"{k}*2=", "delay": 0.0} for k in range(3)]
    result = runner.run(rows)
    runner.close()
    assert [e.turns for e in result.episodes] == [3, 3, 3, 3] and result.rewards.tolist() == [3.0] * 4
    finished = {prompt: t for prompt, turn, t in env.cls.LOG if turn == 3}
    slow_first = next(t for prompt, turn, t in env.cls.LOG if prompt == "9*9=" and turn == 1)
    fast_done = max(t for prompt, t in finished.items() if prompt != "9*9=")
    assert (fast_done < slow_first) == overlap
    if overlap:
        assert any(len(call) < 4 for call in engine.calls)  # turns generated without the slow episode's
    else:
        assert [len(call) for call in engine.calls] == [4, 4, 4]
        # three 2 s steps; each starts just before the engine begins to wait on it, hence the slack
        assert result.stats["time_env_s"] >= 5.5


class StepwiseEngine:
    """vLLM's request-level loop on the CPU, on the real tiny model: each `step` decodes one token of every
    request in flight (greedy, to max_new_tokens as vLLM does with ignore_eos), so a request submitted between
    steps joins the running batch at the next one. It records, at each submit, how many requests in flight
    were already part-way through their tokens, and what each request produced."""

    overlap_turns = True

    def __init__(self, model, tokenizer, step_s: float = 0.02):
        self.model, self.step_s = model, step_s
        self.live, self.joined, self.produced = {}, [], {}

    def submit(self, key, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        self.joined.append(sum(1 for request in self.live.values() if request["out"]))
        self.live[key] = {"ids": list(prompt_ids), "out": [], "logprobs": [], "max": max_new_tokens}

    @torch.no_grad()
    def step(self):
        time.sleep(self.step_s)  # a decode step's time on the GPU
        finished = []
        for key, request in list(self.live.items()):
            logprobs = torch.log_softmax(
                self.model(torch.tensor([request["ids"] + request["out"]])).logits[0, -1].float(), -1
            )
            token = int(logprobs.argmax())
            request["out"].append(token)
            request["logprobs"].append(float(logprobs[token]))
            if len(request["out"]) == request["max"]:
                del self.live[key]
                self.produced.setdefault(key, []).append(request["out"])
                finished.append(Completion(key, request["out"], request["logprobs"]))
        return finished


def test_a_request_level_engine_takes_each_turn_into_its_running_batch(tiny, tmp_path):
    """vLLM's way: an episode whose step returns while others' turns are decoding is submitted at once and
    decodes beside them, rather than waiting for a batch to drain. Two episodes: the first's tool answers at
    once, the second's after 0.1 s, turns of 8 tokens at 0.02 s a step, so the second's next turn starts while
    the first's is part-way. The episodes keep exactly the tokens the engine produced, with its log-probs;
    newer weights load only with no turn in the engine (each token's version is the weights that made it)."""
    model, tokenizer = tiny
    env = load_environment(env_file(tmp_path, SLOW_TOOL))
    engine = StepwiseEngine(model, tokenizer)
    in_flight_at_load = []

    def policy_version():
        in_flight_at_load.append(len(engine.live))
        return len(in_flight_at_load)

    runner = EpisodeRunner(
        engine,
        tokenizer,
        env,
        EpisodeLimits(max_turns=3, max_episode_tokens=60, max_turn_tokens=8),
        policy_version=policy_version,
    )
    result = runner.run([{"prompt": "3*4=", "delay": 0.0}, {"prompt": "9*9=", "delay": 0.1}])
    runner.close()
    assert [e.turns for e in result.episodes] == [3, 3] and result.rewards.tolist() == [3.0, 3.0]
    assert max(engine.joined) >= 1, "a turn joined a batch already decoding"
    assert set(in_flight_at_load) == {0}
    for key, episode in enumerate(result.episodes):
        model_tokens = [t for t, m in zip(episode.tokens, episode.model_mask) if m]
        assert model_tokens == [t for turn in engine.produced[key] for t in turn]
        assert all(lp < 0 for lp, m in zip(episode.logprobs, episode.model_mask) if m)
        assert len(set(episode.versions)) >= 1 and episode.versions == sorted(episode.versions)
    assert result.rollout.logprobs is not None


# ---------------------------------------------------------------------------------------------- advantages over episodes


def test_gae_runs_over_the_models_tokens_only():
    # Tokens: model, observation, model (mask 1 0 1). Over the model's two tokens, γ = 1, λ = 0.5, V = (0.2, 0.6),
    # reward 1 on the last: δ2 = 1 - 0.6 = 0.4, A2 = 0.4; δ1 = 0 + 0.6 - 0.2 = 0.4, A1 = 0.4 + 0.5·0.4 = 0.6.
    # The observation's value (9.0) must not enter: it is not a state the model acted in.
    rewards, values, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 9.0, 0.6]]), torch.tensor([[1, 0, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambd=0.5)
    assert advantages.tolist()[0] == pytest.approx([0.6, 0.0, 0.4])
    assert returns.tolist()[0] == pytest.approx([0.8, 0.0, 1.0])
    # γ = 0.5: the observation is not a step. G = (0.5·1, 0, 1) = (0.5, 0, 1), not (0.25, 0.5, 1).
    assert discounted_returns(rewards, mask, gamma=0.5).tolist()[0] == pytest.approx([0.5, 0.0, 1.0])
    # A prefix mask (one turn) is unchanged by the compaction.
    a, _ = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.tensor([[1, 1, 0]]), 1.0, 0.9)
    assert a.tolist()[0] == pytest.approx([0.6 - 0.5 + 0.9 * 0.4, 0.4, 0.0])  # δ0 = 0.6 - 0.5


def test_sft_traces_are_the_tokens_of_an_episode():
    """A calculator trace's second row holds the first turn and the observation exactly as an episode does."""
    tokenizer = agentic.build_tokenizer()
    first, second = agentic.calculator_trace(347, 8, use_tool=True)
    episode = (
        data.encode_prompt(tokenizer, first["prompt"])
        + data.encode_response(tokenizer, first["response"])
        + observation_ids(tokenizer, "<result>2776</result>", chat_template=False)
    )
    assert data.encode_prompt(tokenizer, second["prompt"]) == episode
    assert second["response"] == "2776"


# ---------------------------------------------------------------------------------------------- off-policy correction


def test_importance_weights_truncate_or_mask_by_the_ratio_to_the_behaviour_policy():
    # log w = old - behaviour = (log 3, log 0.25, 0, log 10 (masked)); cap 2.
    old = torch.log(torch.tensor([[0.3, 0.1, 0.5, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.4, 0.5, 0.09]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    assert importance_weights(old, behaviour, mask, "tis", cap=2.0).tolist()[0] == pytest.approx([2.0, 0.25, 1.0, 0.0])
    # mis is IcePop's w inside [1/2, 2], 0 outside: the one token inside has w = 1 (test_losses.py has w ≠ 1).
    assert importance_weights(old, behaviour, mask, "mis", cap=2.0).tolist()[0] == pytest.approx([0.0, 0.0, 1.0, 0.0])
    assert importance_weights(old, behaviour, mask, "reject", cap=2.0).tolist()[0] == [False, False, True, False]
    assert importance_weights(old, behaviour, mask, "none") is None
    with pytest.raises(ValueError, match="is_correction"):
        importance_weights(old, behaviour, mask, "vtrace")


def test_policy_loss_weighs_each_token_by_its_importance_weight():
    # ρ = 1 (π = π_old), A = (1, 2): token losses -1 and -2; weights (0.5, 2) give (-0.5 - 4) / 2 = -2.25.
    logprobs = torch.zeros(1, 2)
    loss, _ = policy_loss(
        logprobs, logprobs, torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), 0.2, is_weights=torch.tensor([[0.5, 2.0]])
    )
    assert loss.item() == pytest.approx(-2.25)


def test_logprob_mismatch_reports_the_mean_the_largest_gap_and_the_kl():
    # log w = (0.5, -0.5, 3.0 masked): mean 0, max 0.5; k3 = mean(e^0.5 - 1.5, e^-0.5 - 0.5).
    old, behaviour, mask = (
        torch.tensor([[0.0, -1.0, 3.0]]),
        torch.tensor([[-0.5, -0.5, 0.0]]),
        torch.tensor([[1, 1, 0]]),
    )
    stats = logprob_mismatch(old, behaviour, mask)
    assert stats["mismatch_log_ratio_mean"] == pytest.approx(0.0)
    assert stats["engine_logprob_max_diff"] == pytest.approx(0.5)
    assert stats["mismatch_kl"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)) / 2)
    assert stats["corrected_mismatch_kl"] == pytest.approx(stats["mismatch_kl"])  # no correction: all of it is left


def test_the_corrected_mismatch_is_what_the_importance_weights_leave():
    # log w = (1.5, -0.5, 0.2); cap 2. tis: w = (e^1.5, e^-0.5, e^0.2) -> weights (2, e^-0.5, e^0.2), so
    # r = (e^1.5 / 2, 1, 1): only the first token's excess over the cap is left. The band is [1/2, 2]: the first
    # token is masked out. reject (what mis meant before IcePop) gives the others weight 1, so they keep all of
    # theirs (r = w); mis, IcePop's weight w, corrects them fully (r = 1), so nothing is left.
    old, behaviour, mask = (
        torch.tensor([[0.0, -1.0, -0.8]]),
        torch.tensor([[-1.5, -0.5, -1.0]]),
        torch.tensor([[1, 1, 1]]),
    )
    k3 = lambda log_r: math.exp(log_r) - 1 - log_r  # noqa: E731
    tis = logprob_mismatch(old, behaviour, mask, importance_weights(old, behaviour, mask, "tis", cap=2.0))
    assert tis["corrected_mismatch_kl"] == pytest.approx(k3(1.5 - math.log(2)) / 3, rel=1e-5)
    assert tis["mismatch_kl"] == pytest.approx((k3(1.5) + k3(-0.5) + k3(0.2)) / 3, rel=1e-5)
    reject = logprob_mismatch(old, behaviour, mask, importance_weights(old, behaviour, mask, "reject", cap=2.0))
    assert reject["corrected_mismatch_kl"] == pytest.approx((k3(-0.5) + k3(0.2)) / 2, rel=1e-5)
    mis = logprob_mismatch(old, behaviour, mask, importance_weights(old, behaviour, mask, "mis", cap=2.0))
    assert mis["corrected_mismatch_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_hf_engine_reports_the_behaviour_log_probabilities_the_trainer_computes(tiny, tmp_path, temperature):
    """The sampled tokens' log-probabilities under softmax(logits / T), as generated, equal the trainer's at T:
    episodes carry them for their model tokens (0 at observations)."""
    model, tokenizer = tiny
    torch.manual_seed(1)
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(env_file(tmp_path, ECHO)),
        EpisodeLimits(max_turns=2, max_episode_tokens=40, max_turn_tokens=5),
    )
    rollout = runner.run([{"prompt": "12*3="}, {"prompt": "4*5="}], temperature=temperature).rollout
    trainer = response_logprobs(
        model, rollout.sequences, rollout.attention_mask, rollout.prompt_width, temperature=temperature
    )
    mask = rollout.response_mask
    assert rollout.logprobs is not None and (rollout.logprobs * (1 - mask)).abs().max() == 0
    assert ((trainer - rollout.logprobs).abs() * mask).max() < 1e-4
    runner.close()


# ---------------------------------------------------------------------------------------------- partial rollouts


def test_each_token_is_tagged_with_the_weight_version_of_its_turn(tiny, tmp_path):
    """The runner asks `policy_version` before every turn (where --partial_rollouts loads newer weights): the
    tokens of turn k carry the version it said, and the rollout's oldest version per row is the first turn's."""
    model, tokenizer = tiny
    versions = iter([3, 4, 6])
    runner = EpisodeRunner(
        HFRolloutEngine(model, tokenizer),
        tokenizer,
        load_environment(env_file(tmp_path, ECHO)),
        EpisodeLimits(max_turns=3, max_episode_tokens=60, max_turn_tokens=4),
        policy_version=lambda: next(versions),
    )
    result = runner.run([{"prompt": "1*2="}, {"prompt": "3*4="}])
    for episode in result.episodes:
        turns = [v for v, m in zip(episode.versions, episode.model_mask) if m]
        assert sorted(set(turns)) == [3, 4, 6] and turns == sorted(turns)
    rollout = result.rollout
    assert rollout.oldest_versions().tolist() == [3, 3]
    assert rollout.select([1]).versions.tolist() == rollout.versions[1:].tolist()
    runner.close()


def test_fresh_groups_drop_whole_groups_past_the_staleness_bound():
    """Rows are groups of 2; the trainer has made 5 updates. Row 2's oldest token is version 1 (4 behind): with
    a bound of 2 its whole group (rows 2 and 3) goes; a row that spans two versions counts as partial."""
    versions = torch.tensor([[4, 4, 5], [3, 3, 3], [1, 5, 5], [4, 4, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])  # row 3's last token is padding: not counted
    rollout = Rollout(
        torch.zeros(4, 4, dtype=torch.long), torch.ones(4, 4, dtype=torch.long), mask, 1, versions=versions
    )
    keep, stats = fresh_groups(rollout, updates=5, n=2, max_staleness=2)
    assert keep.tolist() == [True, True, False, False]
    assert stats == {
        "staleness": 4,
        "staleness_mean": pytest.approx((1 + 2 + 4 + 1) / 4),
        "partial_fraction": 0.5,
        "dropped_stale": 2,
    }


SLOW_STEP = """
    import pathlib, time
    class Environment:
        def reset(self, row):
            return row["prompt"]
        def step(self, action):
            pathlib.Path({marker!r}).touch()  # the test sends new weights now, while this episode waits here
            time.sleep(1.5)
            return "ok", 0.0, False, {{}}
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "partial", [True, pytest.param(False, marks=pytest.mark.slow)]
)  # the queue's order: make test-all
def test_weights_sent_beside_a_running_rollout_reach_its_next_turn(partial, ray_driver, tiny, tmp_path):
    """A transformers rollout engine of its own (RolloutEngineWorker on the real Ray head) runs two-turn episodes
    whose environment waits 1.5 s a step. New weights sent while the first step waits: with --partial_rollouts
    (beside the engine's queue) the second turn generates with them (tagged version 1, the first turn 0);
    without, they wait in the queue and the whole episode is version 0, the next rollout version 1."""
    import ray

    from tasks.common.nn.workers import Placement, WorkerGroup
    from tasks.rl.workers import RolloutEngineWorker

    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    marker = tmp_path / "stepping"
    env = env_file(tmp_path, SLOW_STEP.format(marker=str(marker)))
    cfg = parse_config(
        RLConfig,
        [
            "--pretrain",
            str(tmp_path / "base"),
            "--prompt_data",
            "d",
            "--output",
            str(tmp_path / "o"),
            "--env_path",
            env,
            "--max_turns",
            "2",
            "--generate_max_len",
            "4",
            "--async_train",
            *(["--partial_rollouts"] if partial else []),
        ],
    )
    placement = Placement.create(1, 1, "rollout")  # joins the head (RAY_ADDRESS)
    try:
        engines = WorkerGroup(RolloutEngineWorker, placement, "rollout")
        engines.run("setup", cfg)
        running = engines.scatter_async("run_episodes", [[{"prompt": "1*2="}, {"prompt": "3*4="}]])
        while not marker.exists():
            time.sleep(0.05)
        state = {name: p.detach() + 0.01 for name, p in model.named_parameters()}  # what ActorWorker.engine_state sends
        send = engines.run_beside_async if partial else engines.run_async
        sent = send("load_state", state, 1)
        rollout = ray.get(running)[0].rollout
        ray.get(sent)
        turns = sorted(set(rollout.versions[rollout.response_mask.bool()].tolist()))
        assert turns == ([0, 1] if partial else [0])
        assert engines.scatter("generate", [[[5, 6]]])[0].versions.unique().tolist() == [1]
    finally:
        placement.remove()  # with the actors
