"""Chat templates and chat-message prompts through every stage's encoding, on tests/tiny_chat.py's model.

tiny_chat renders a turn as `<|role|>content<|end|>` after `<bos>`, opens the assistant with
`<|assistant|>`, and its EOS is <|end|>. Expected ids below are written from that vocabulary (special
tokens first, then one id per character), not from the tokenizer under test.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import data
from tasks.common.nn.engines.hf_engine import HFRolloutEngine
from tasks.common.nn.engines.rollout import Rollout, response_mask
from tasks.data import demo

from tests.conftest import REPO
from tests.tiny_chat import CHARACTERS, SPECIAL_TOKENS, build_chat_model, build_tokenizer, chat_rows

BOS, USER, ASSISTANT, SYSTEM, END, EOS, PAD = 1, 4, 5, 6, 7, 2, 0
CONVERSATION = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "1+2"},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "3+4"},
]


def c(text: str) -> list[int]:
    """Ids of plain characters in tiny_chat's vocabulary."""
    return [len(SPECIAL_TOKENS) + CHARACTERS.index(ch) for ch in text]


# The conversation above, rendered up to the assistant's opening.
CONVERSATION_IDS = [
    BOS,
    SYSTEM,
    *c("Add."),
    END,
    USER,
    *c("1+2"),
    END,
    ASSISTANT,
    *c("3"),
    END,
    USER,
    *c("3+4"),
    END,
    ASSISTANT,
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stage_config(module: str, values: dict):
    """A validated stage config with the placeholders its validate() asks for."""
    import importlib

    cls = {"sft": "SFTConfig", "reward_model": "RewardModelConfig", "preference": "PreferenceConfig", "rl": "RLConfig"}[
        module
    ]
    required = {"output": "unused", "pretrain": "unused", "dataset": "unused"}
    if module == "rl":
        required = {"output": "unused", "pretrain": "unused", "prompt_data": "unused", "remote_rm_url": "unused.py"}
    return make_config(getattr(importlib.import_module(f"tasks.{module}.config"), cls), {**required, **values})


# ---------------------------------------------------------------------------------------------- encoding


def test_prompts_render_through_the_chat_template(tok):
    assert data.encode_prompt(tok, "3+4", chat_template=True) == [BOS, USER, *c("3+4"), END, ASSISTANT]
    assert data.encode_prompt(tok, CONVERSATION, chat_template=True) == CONVERSATION_IDS
    assert data.encode_prompt(tok, "3+4=") == [BOS, *c("3+4=")]  # plain text: BOS and the characters


def test_responses_close_the_turn_as_the_template_does(tok):
    assert data.encode_response(tok, "7", chat_template=True) == [*c("7"), END]
    # A chat model whose EOS is not its end of turn: the turn's closing token with the template, EOS without.
    other = build_tokenizer()
    other.eos_token = "<eos>"
    assert data.encode_response(other, "7", chat_template=True) == [*c("7"), END]
    assert data.encode_response(other, "7") == [*c("7"), EOS]
    assert data.stop_token_ids(other) == [EOS, END]
    assert data.stop_token_ids(tok) == [END]
    assert data.stop_token_ids(demo.build_tokenizer()) == [
        demo.build_tokenizer().eos_token_id
    ]  # no template: EOS alone


def test_a_turn_separator_after_the_end_token_is_left_to_the_next_turn(tok):
    """ChatML-like templates write '<|im_end|>\\n': generation stops at the token, so responses end there."""
    chatml = build_tokenizer()
    chatml.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    assert data.turn_end_text(chatml) == "<|end|>\n"
    assert data.encode_response(chatml, "7", chat_template=True) == [*c("7"), END]


def test_prompt_plus_response_is_the_rendered_conversation(tok):
    for row in chat_rows(12):
        messages = row["messages"]
        ids = data.encode_prompt(tok, messages[:-1], True) + data.encode_response(tok, messages[-1]["content"], True)
        assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    whole = CONVERSATION + [{"role": "assistant", "content": "7"}]
    assert data.encode_prompt(tok, CONVERSATION, True) + data.encode_response(tok, "7", True) == list(
        tok.apply_chat_template(whole, tokenize=True, return_dict=False)
    )


def test_chat_prompts_are_refused_in_one_line_without_the_template(tok):
    with pytest.raises(ConfigError) as e:
        data.encode_prompt(tok, CONVERSATION)
    assert str(e.value) == (
        "apply_chat_template: the prompt is a list of chat messages, which only the tokenizer's chat template can render; pass --apply_chat_template"
    )
    with pytest.raises(
        ConfigError, match=r"^apply_chat_template: the tokenizer of .* has no chat template; drop --apply_chat_template"
    ):
        data.encode_prompt(demo.build_tokenizer(), CONVERSATION, chat_template=True)
    with pytest.raises(
        ConfigError, match=r"^prompt: a chat message must be an object with string 'role' and 'content'"
    ):
        data.encode_prompt(tok, [{"role": "user"}], chat_template=True)


def test_fit_cuts_the_prompt_from_the_left_first():
    prompt, responses = [1, 2, 3, 4, 5], [[6, 7], [8, 9, 10]]
    assert data.fit(prompt, responses, 8) == (prompt, responses, 0)
    assert data.fit(prompt, responses, 6) == ([3, 4, 5], responses, 2)  # both sequences lose the prompt's start
    assert data.fit(prompt, responses, 4) == ([5], [[6, 7], [8, 9, 10]], 2)
    assert data.fit(prompt, responses, 3) == ([5], [[6, 7], [8, 9]], 2)  # the response alone does not fit: its end goes


# ---------------------------------------------------------------------------------------------- stages' encodings


def test_sft_learns_only_the_final_assistant_turn(tok):
    from tasks.sft.trainer import tokenize

    ids, masks, truncated = tokenize(
        {"prompt": [CONVERSATION], "response": ["7"]}, tok, stage_config("sft", {"apply_chat_template": True})
    )
    assert ids == [CONVERSATION_IDS + [*c("7"), END]] and truncated == 0
    assert masks == [[0] * len(CONVERSATION_IDS) + [1, 1]]  # system, user and the earlier answer: masked out


def test_reward_model_preference_and_rl_see_the_sft_rendering(tok, tmp_path):
    from tasks.preference.trainer import tokenize as preference_tokenize
    from tasks.reward_model.trainer import tokenize_pairs
    from tasks.rl.prompts import load_prompts
    from tasks.sft.trainer import tokenize as sft_tokenize

    rows = [
        {"prompt": r["messages"][:-1], "chosen": r["chosen"], "rejected": r["rejected"], "response": r["chosen"]}
        for r in chat_rows(6)
    ]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    sft_ids, _, _ = sft_tokenize(columns, tok, stage_config("sft", {"apply_chat_template": True}))
    rejected_ids, _, _ = sft_tokenize(
        {**columns, "response": columns["rejected"]}, tok, stage_config("sft", {"apply_chat_template": True})
    )
    chosen, rejected, _ = tokenize_pairs(columns, tok, stage_config("reward_model", {"apply_chat_template": True}))
    assert chosen == sft_ids and rejected == rejected_ids
    prompts, responses, _ = preference_tokenize(columns, tok, stage_config("preference", {"apply_chat_template": True}))
    assert [p + r[0] for p, r in zip(prompts, responses)] == sft_ids
    assert [p + r[1] for p, r in zip(prompts, responses)] == rejected_ids

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    run = SimpleNamespace(input=lambda name, uri: uri)
    loaded = load_prompts(stage_config("rl", {"prompt_data": str(path), "apply_chat_template": True}), run, tok)
    assert [p + data.encode_response(tok, r["chosen"], True) for p, r in zip(loaded.ids, rows)] == sft_ids
    assert loaded.texts[0] == rows[0]["prompt"] and loaded.truncated == 0


def test_truncation_keeps_the_answer_and_is_counted_in_every_stage(tok, tmp_path):
    from tasks.preference.trainer import tokenize as preference_tokenize
    from tasks.reward_model.trainer import tokenize_pairs
    from tasks.rl.prompts import load_prompts
    from tasks.sft.trainer import tokenize as sft_tokenize

    columns = {
        "prompt": [CONVERSATION, "1+1"],
        "response": ["7", "2"],
        "chosen": ["7", "2"],
        "rejected": ["7, I think", "2"],
    }
    ids, masks, truncated = sft_tokenize(columns, tok, stage_config("sft", {"apply_chat_template": True, "max_len": 8}))
    assert truncated == 2 and ids[0] == CONVERSATION_IDS[-6:] + [*c("7"), END] and masks[0][-2:] == [1, 1]
    assert ids[1] == [USER, *c("1+1"), END, ASSISTANT, *c("2"), END]  # 9 tokens with its BOS: over 8, so also cut
    chosen, rejected, truncated = tokenize_pairs(
        columns, tok, stage_config("reward_model", {"apply_chat_template": True, "max_len": 16})
    )
    assert truncated == 2 and all(len(s) <= 16 for s in chosen + rejected)
    assert chosen[0][-2:] == [*c("7"), END] and rejected[0][-len("7, I think") - 1 :] == [*c("7, I think"), END]
    assert chosen[0][:-2] == rejected[0][: -len("7, I think") - 1]  # one prompt for both sides
    _, _, truncated = preference_tokenize(
        columns, tok, stage_config("preference", {"apply_chat_template": True, "max_len": 16})
    )
    assert truncated == 2
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in columns["prompt"]))
    loaded = load_prompts(
        stage_config("rl", {"prompt_data": str(path), "apply_chat_template": True, "prompt_max_len": 8}),
        SimpleNamespace(input=lambda name, uri: uri),
        tok,
    )
    assert loaded.truncated == 1 and loaded.ids[0] == CONVERSATION_IDS[-8:] and loaded.ids[0][-1] == ASSISTANT


# ---------------------------------------------------------------------------------------------- generation


def test_generation_stops_at_the_end_of_turn_and_texts_strip_it(tok):
    other = build_tokenizer()
    other.eos_token = "<eos>"  # EOS and end of turn differ: both stop a response
    assert response_mask(
        torch.tensor([[9, END, 9, 9], [9, EOS, 9, 9], [9, 9, 9, 9]]), data.stop_token_ids(other)
    ).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
    ]
    prompt = data.encode_prompt(tok, "1+2", True)
    sequences = torch.tensor([prompt + [*c("3"), END, PAD]])
    responses = sequences[:, len(prompt) :]
    rollout = Rollout(
        sequences, torch.ones_like(sequences), response_mask(responses, data.stop_token_ids(tok)), len(prompt)
    )
    assert rollout.response_mask.tolist() == [[1, 1, 0]] and rollout.texts(tok) == ["3"]


def test_the_rollout_engine_stops_on_the_chat_models_end_token(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_chat_model(tmp_path / "m")).eval()
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)  # <|end|> the only likely token
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[END] = 10.0
    model.lm_head = head
    engine = HFRolloutEngine(model, tok)
    rollout = engine.generate([data.encode_prompt(tok, CONVERSATION, True)], max_new_tokens=4, greedy=True)
    assert (
        rollout.responses[0, 0].item() == END
        and rollout.response_lengths().tolist() == [1]
        and rollout.texts(tok) == [""]
    )


# ---------------------------------------------------------------------------------------------- eval


@pytest.mark.parametrize("labelled", [False, True])
def test_eval_of_chat_prompts_with_and_without_reference_answers(labelled, tok, tmp_path, ray_driver):
    from tasks.common import stage
    from tasks.eval.config import EvalConfig
    from tasks.eval.evaluate import evaluate
    from tasks.promote.gate import judge

    model = build_chat_model(tmp_path / "chat-model")
    rows = [{"prompt": r["messages"][:-1], **({"label": r["label"]} if labelled else {})} for r in chat_rows(6)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval-out"
    cfg = make_config(
        EvalConfig,
        {
            "output": str(out),
            "baseline": model,
            "policy": model,
            "reward_pretrain": model,
            "dataset": str(tmp_path / "eval.jsonl"),
            "apply_chat_template": True,
            "generate_max_len": 4,
        },
    )
    stage.run("eval", cfg, evaluate)
    report = json.loads((out / "report.json").read_text())
    for side in ("baseline", "policy"):
        assert {"reward_mean", "kl_to_ref", "response_length"} <= set(report["metrics"][side])
        # No metric declared: exact_match (the built-in) when there are labels; absent, not 0, without
        assert ({"exact_match", "sampled_exact_match"} <= set(report["metrics"][side])) == labelled
    assert (
        report["labelled"] is labelled and report["metrics"]["policy"]["kl_to_ref"] == 0
    )  # the same model on both sides
    assert report["samples"][0]["prompt"] == "system: Add. | user: " + rows[0]["prompt"][1]["content"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert ("policy_exact_match" in manifest["metrics"]) == labelled and "policy_reward_mean" in manifest["metrics"]
    if not labelled:
        assert (
            "No reference answers (no label column): the metrics that need them are left out."
            in (out / "report.md").read_text()
        )
        passed, reasons = judge(
            report["metrics"]["policy"], report["metrics"]["baseline"], {"exact_match": {"max_drop": 0.02}}
        )
        assert not passed and reasons == ["FAIL: exact_match: missing from the evaluation report"]


# ---------------------------------------------------------------------------------------------- a short SFT run


def test_sft_stage_trains_on_chat_conversations(ray_address, tmp_path):
    """The SFT stage as a process, on the tiny chat model and a chat dataset (prompts as messages)."""
    model = build_chat_model(tmp_path / "chat-model")
    rows = [{"prompt": r["messages"][:-1], "response": r["messages"][-1]["content"]} for r in chat_rows(32)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sft-out"
    args = [
        "--output",
        str(out),
        "--pretrain",
        model,
        "--dataset",
        str(tmp_path / "sft.jsonl"),
        "--apply_chat_template",
        "--max_steps",
        "4",
        "--train_batch_size",
        "16",
        "--logging_steps",
        "1",
        "--max_len",
        "14",
        "--learning_rate",
        "3e-3",
        "--lr_warmup_steps",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_address}
    done = subprocess.run(
        [sys.executable, "-m", "tasks.sft", *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    # <bos><|system|>Add.<|end|><|user|>a+b<|end|><|assistant|> is 13 tokens, with the answer 15 or 16: every row is cut
    assert manifest["metrics"]["rows"] == 32 and manifest["metrics"]["truncated"] == 32
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and losses[-1] < losses[0]
