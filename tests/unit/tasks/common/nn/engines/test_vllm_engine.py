"""The vLLM rollout path: its pure parts on CPU, the engine itself on a GPU (marked gpu, skipped without
CUDA and vllm; run on the GPU machine with bench/gpu/, see bench/gpu/README.md)."""

import importlib.util

import pytest
import torch

from tasks.common.nn.engines.rollout import concat_rollouts, to_rollout
from tasks.common.nn.losses import logprob_mismatch

GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def test_engine_output_becomes_a_rollout_with_its_logprobs():
    rollout = to_rollout([[5, 6, 7], [8]], [[9, 2], [3, 4, 2]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], pad_id=0)
    assert rollout.sequences.tolist() == [[5, 6, 7, 9, 2, 0], [0, 0, 8, 3, 4, 2]]
    assert rollout.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert rollout.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(rollout.logprobs, torch.tensor([[-0.5, -1.0, 0.0], [-0.1, -0.2, -0.3]]))
    # Selecting and joining rows keeps the engine's log-probabilities aligned with their tokens.
    joined = concat_rollouts([rollout.select([1]), to_rollout([[1, 1, 1, 1]], [[7]], [[-2.0]], pad_id=0)], pad_id=0)
    assert torch.allclose(joined.logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-2.0, 0.0, 0.0]]))
    assert joined.prompt_width == 4


def test_engine_output_without_logprobs_becomes_a_rollout_without_them():
    # Eval asks the engine for no per-token log-probs: the rollout says so rather than holding zeros.
    rollout = to_rollout([[5, 6, 7], [8]], [[9, 2], [3, 4, 2]], None, pad_id=0)
    assert rollout.logprobs is None
    assert rollout.sequences.tolist() == [[5, 6, 7, 9, 2, 0], [0, 0, 8, 3, 4, 2]]
    assert concat_rollouts([rollout, rollout.select([0])], pad_id=0).logprobs is None


def test_sync_check_is_the_largest_gap_on_response_tokens():
    actor = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    engine = torch.tensor([[-1.1, -2.5, 0.0], [-0.5, -0.45, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert logprob_mismatch(actor, engine, mask)["engine_logprob_max_diff"] == pytest.approx(
        0.5
    )  # the masked 9.0 gap is not counted
    assert logprob_mismatch(actor, engine, torch.zeros_like(mask))["engine_logprob_max_diff"] == 0.0


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    """The demo's tiny model saved, loaded in bf16 on the GPU, and a vLLM engine on it (one per process)."""
    from tasks.common.nn.engines.vllm_engine import VLLMRolloutEngine
    from tasks.common.nn.models import load_causal_lm, load_tokenizer
    from tasks.common.nn.strategy import init_distributed
    from tasks.data import demo

    path = tmp_path_factory.mktemp("vllm") / "m"
    tokenizer = demo.build_tokenizer()
    demo.build_base_model(tokenizer, max_positions=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    init_distributed()
    tokenizer = load_tokenizer(str(path))
    model = load_causal_lm(str(path)).to("cuda", torch.bfloat16)
    # ignore_eos: every turn runs to its token limit, so the request-level test's timing does not hang on sampling.
    return (
        VLLMRolloutEngine(str(path), tokenizer, max_model_len=256, gpu_memory_utilization=0.2, seed=0, ignore_eos=True),
        model,
        tokenizer,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and vllm")
def test_vllm_engine_generates_and_follows_the_trained_weights(demo_engine):
    """The engine samples from the weights it is given: after loading perturbed weights its
    log-probabilities match the perturbed model's own (bf16 tolerance), not the original's."""
    from tasks.rl.experience import response_logprobs

    engine, model, tokenizer = demo_engine
    prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in ("12+34=", "56+07=")]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(model)
    rollout = engine.generate(prompts * 8, max_new_tokens=8)
    actor = (
        response_logprobs(model, rollout.sequences.cuda(), rollout.attention_mask.cuda(), rollout.prompt_width)
        .float()
        .cpu()
    )
    assert logprob_mismatch(actor, rollout.logprobs, rollout.response_mask)["engine_logprob_max_diff"] < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and vllm")
def test_vllm_engine_aborts_running_requests_and_keeps_the_first_whole_groups(demo_engine):
    """--over_sampling_batch_size on vLLM: a request aborted part-way never finishes and leaves nothing in flight,
    and first_groups keeps `keep` whole groups with the engine's log-probs, the cut groups' rows empty."""
    from tasks.common.nn.engines.rollout import first_groups

    engine, _, tokenizer = demo_engine
    prompt = [tokenizer.bos_token_id] + tokenizer.encode("12+34=", add_special_tokens=False)
    engine.submit(0, prompt, max_new_tokens=200)
    engine.submit(1, prompt, max_new_tokens=200)
    for _ in range(3):
        assert engine.step() == []
    engine.abort([1])
    finished = []
    while engine.in_flight:
        finished += engine.step()
    assert [c.key for c in finished] == [0] and len(finished[0].token_ids) == 200
    rollout, dropped = first_groups(
        engine, [prompt] * 8, group_size=2, keep=2, max_new_tokens=16, temperature=1.0, pad_id=0
    )
    assert dropped == 2 and not engine.in_flight
    lengths = rollout.response_lengths()
    assert int((lengths > 0).sum()) == 4 and (lengths.view(4, 2) > 0).all(1).sum() == 2
    assert rollout.logprobs is not None and (rollout.logprobs[lengths == 0] == 0).all()


SLOW_SECOND = """
import asyncio

class Environment:
    def reset(self, row):
        self.row = row
        return row["prompt"]

    async def step(self, action):
        await asyncio.sleep(self.row["delay"])
        return "ok", 1.0, False, {}
"""


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and vllm")
def test_vllm_engine_takes_each_episode_turn_into_its_running_batch(demo_engine, tmp_path):
    """Episodes on vLLM request by request: the second episode's tool answers 20 ms after the first's, and its
    next turn is submitted at once, joining the first's turn part-way through its 64 tokens, rather than
    waiting for it to finish. Each episode keeps the engine's tokens and log-probs."""
    from tasks.common.nn.environment import EpisodeLimits, EpisodeRunner, load_environment

    engine, _, tokenizer = demo_engine
    joined, decoding = [], set()  # at each submit: how many requests in flight have been through a decode step
    submit, step = engine.submit, engine.step

    def recording_submit(*args, **kwargs):
        joined.append(len(decoding & set(engine.in_flight)))
        submit(*args, **kwargs)

    def recording_step():
        decoding.update(engine.in_flight)
        return step()

    engine.submit, engine.step = recording_submit, recording_step
    (tmp_path / "env.py").write_text(SLOW_SECOND)
    runner = EpisodeRunner(
        engine,
        tokenizer,
        load_environment(str(tmp_path / "env.py")),
        EpisodeLimits(max_turns=3, max_episode_tokens=240, max_turn_tokens=64),
    )
    result = runner.run([{"prompt": "12+34=", "delay": 0.0}, {"prompt": "56+07=", "delay": 0.02}])
    runner.close()
    del engine.submit, engine.step
    assert [e.turns for e in result.episodes] == [3, 3] and not engine.in_flight
    assert max(joined) >= 1, "a turn was submitted while another was part-way through decoding"
    assert result.rollout.logprobs is not None
    for episode in result.episodes:
        assert sum(episode.model_mask) == 3 * 64 and all(lp <= 0 for lp in episode.logprobs)
