"""Sequence packing for SFT and the reward model: rows packed into one sequence give the same
log-probabilities, scores, losses and gradients as the same rows padded, because no token attends across
rows (CPU, tiny model, no Ray)."""

import torch

from tasks.common.config import make_config
from tasks.common.nn import data
from tasks.common.nn.losses import bradley_terry_loss
from tasks.common.nn.models import load_scalar_model
from tasks.common.nn.supervised import micro_batch_loss
from tasks.data import demo
from tasks.reward_model.config import RewardModelConfig
from tasks.reward_model.trainer import pair_scores
from tasks.sft.config import SFTConfig


def test_pack_restarts_positions_for_each_row():
    ids, positions, index = data.pack([[1, 5, 6], [1, 7], [1, 8, 9, 10]])
    assert ids.tolist() == [[1, 5, 6, 1, 7, 1, 8, 9, 10]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert index.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_packed_and_padded_sft_losses_and_gradients_match():
    tokenizer = demo.build_tokenizer()
    model = demo.build_base_model(tokenizer)  # SDPA: the block-diagonal mask path
    rows = [("12+34=", "046"), ("05+05=", "010 is the sum"), ("99+01=", "100")]
    ids, masks = [], []
    for prompt, response in rows:
        p, r = data.encode_prompt(tokenizer, prompt), data.encode_response(tokenizer, response)
        ids.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    tokens = sum(map(sum, masks))

    def loss_and_grad(packed: bool):
        model.zero_grad()
        loss = micro_batch_loss(model, ids, masks, tokenizer.pad_token_id, packed, torch.device("cpu"), tokens)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    padded_loss, padded_grad = loss_and_grad(False)
    packed_loss, packed_grad = loss_and_grad(True)
    assert abs(packed_loss - padded_loss) < 1e-5
    # Without a global token count (PPO-ptx's use) the loss is this micro-batch's token mean: here the same.
    assert (
        abs(
            micro_batch_loss(model, ids, masks, tokenizer.pad_token_id, False, torch.device("cpu")).item() - padded_loss
        )
        < 1e-6
    )
    assert torch.allclose(packed_grad, padded_grad, atol=1e-5)


def test_packed_and_padded_reward_scores_and_gradients_match(tmp_path):
    tokenizer = demo.build_tokenizer()
    demo.build_base_model(tokenizer).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    model = load_scalar_model(str(tmp_path / "m"))  # SDPA: the block-diagonal mask path
    prompts = [data.encode_prompt(tokenizer, p) for p in ("12+34=", "05+05=")]
    chosen = [p + data.encode_response(tokenizer, r) for p, r in zip(prompts, ("046", "010"))]
    rejected = [p + data.encode_response(tokenizer, r) for p, r in zip(prompts, ("046 is the sum", "010 is the sum"))]

    def scores_and_grad(packed: bool):
        model.zero_grad()
        c, r = pair_scores(model, chosen, rejected, tokenizer.pad_token_id, torch.device("cpu"), packed)
        bradley_terry_loss(c, r).backward()
        return torch.cat([c, r]).detach(), torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        )

    padded_scores, padded_grad = scores_and_grad(False)
    packed_scores, packed_grad = scores_and_grad(True)
    assert torch.allclose(packed_scores, padded_scores, atol=1e-5)
    assert torch.allclose(packed_grad, padded_grad, atol=1e-5)


def test_packing_is_a_flag():
    for config in (SFTConfig, RewardModelConfig):
        assert make_config(
            config, {"output": "/tmp/x", "pretrain": "m", "dataset": "d", "packing_samples": True}
        ).packing_samples
