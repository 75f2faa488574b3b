"""Over-sampling with an early cut (--over_sampling_batch_size, issue 52 item 4): more prompt groups are started than
a step trains on; the first to finish all their samples are kept, the rest aborted and counted.

Here on the transformers engine, whose batched requests all finish in one step (so the first groups in row order are
kept), a tiny random Llama on the CPU; the vLLM engine's early abort runs in test_vllm_engine.py (GPU).
"""

import pytest
import torch

from tasks.common.nn.data import encode_prompt
from tasks.common.nn.engines.hf_engine import HFRolloutEngine
from tasks.common.nn.engines.rollout import BatchedRequests, Rollout, first_groups
from tasks.data import demo
from tasks.rl.experience import whole_groups


def test_the_first_groups_to_finish_are_kept_and_the_others_left_empty():
    tokenizer = demo.build_tokenizer()
    engine = HFRolloutEngine(demo.build_base_model(tokenizer), tokenizer)
    prompts = [encode_prompt(tokenizer, p) for p in ("12+34=", "05+05=", "99+01=") for _ in range(2)]  # 3 groups of 2
    torch.manual_seed(0)
    rollout, dropped = first_groups(
        BatchedRequests(engine), prompts, group_size=2, keep=2, max_new_tokens=5, temperature=1.0, pad_id=0
    )
    assert dropped == 1 and rollout.sequences.size(0) == 6
    lengths = rollout.response_lengths()
    assert (lengths[:4] > 0).all() and (lengths[4:] == 0).all()  # groups 0 and 1 whole, group 2 empty
    for row, prompt in enumerate(prompts):  # every row keeps its prompt, a cut group's too
        assert rollout.sequences[row, rollout.prompt_width - len(prompt) : rollout.prompt_width].tolist() == prompt
    rows, cut = whole_groups(rollout, 2)
    assert rows.tolist() == [0, 1, 2, 3] and cut == 1
    with pytest.raises(ValueError, match="^first_groups: keep 4 of 6 prompts in groups of 2"):
        first_groups(BatchedRequests(engine), prompts, 2, 4, 5, 1.0, 0)


def test_whole_groups_drops_a_group_with_any_empty_response():
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 0], [0, 0], [0, 0]])
    rollout = Rollout(torch.zeros(6, 3, dtype=torch.long), torch.ones(6, 3), mask, 1)
    rows, dropped = whole_groups(rollout, 2)
    assert rows.tolist() == [0, 1] and dropped == 2  # group 1 lost a sample: cut too
