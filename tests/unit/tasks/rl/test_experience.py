"""tasks/rl/experience.py: what the RL stage logs about its responses' lengths each step (response_lengths), and the
actor's log-probs at the sampling temperature (response_logprobs).

pytest tests/unit/tasks/rl/test_experience.py
"""

import pytest
import torch

from tasks.rl.experience import response_lengths


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


def test_mean_max_and_the_share_cut_at_the_cap():
    stats = response_lengths(torch.tensor([3, 8, 8, 1]), cap=8)
    assert stats == {
        "response_length": pytest.approx(5.0),
        "response_length_max": 8,
        "response_truncated": pytest.approx(0.5),
    }


def test_episodes_have_no_single_cap():
    assert "response_truncated" not in response_lengths(torch.tensor([5, 40]), cap=None)


def test_actor_logprobs_at_the_temperature_are_those_generate_sampled_from():
    """HF generate's processed scores (logits / temperature) give the sampled tokens the log-probs that
    response_logprobs computes at that temperature; untempered ones differ."""
    from tasks.common.nn.data import encode_prompt
    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.data import demo
    from tasks.rl.experience import response_logprobs

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1).eval()
    prompts = [encode_prompt(tok, "3+4="), encode_prompt(tok, "37+45=")]
    rollout = HFRolloutEngine(model, tok).generate(prompts, max_new_tokens=4)
    width = rollout.prompt_width
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=rollout.sequences[:, :width],
            attention_mask=rollout.attention_mask[:, :width],
            max_new_tokens=4,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        sampled = sampled.gather(-1, out.sequences[:, width:].unsqueeze(-1)).squeeze(-1)
        seqs, attention = (
            out.sequences,
            torch.cat([rollout.attention_mask[:, :width], torch.ones_like(out.sequences[:, width:])], 1),
        )
        tempered = response_logprobs(model, seqs, attention, width, temperature=0.7)
        untempered = response_logprobs(model, seqs, attention, width)
    first = slice(0, 1)  # the first response token is never after an EOS, so always a response token
    assert torch.allclose(tempered[:, first], sampled[:, first], atol=1e-4)
    assert not torch.allclose(untempered[:, first], sampled[:, first], atol=1e-3)
