"""Reward sources (tasks/common/nn/rewards.py) and the demo reward file, against real files, servers and models."""

import re
from pathlib import Path

import pytest
import torch

from tasks.common.nn.data import decode_rows, encode_prompt, encode_response, pad
from tasks.common.nn.engines.rollout import Rollout, response_mask
from tasks.common.nn.models import load_scalar_model, sequence_scores
from tasks.common.nn.rewards import (
    RewardBatch,
    RewardEndpoint,
    RewardError,
    RewardFunction,
    RewardModels,
    SummedRewards,
    build_reward_batch,
    make_reward_source,
)
from tasks.data import demo

from tests.conftest import REPO, free_port
from tests.json_server import JSONServer

DEMO_REWARD = str(REPO / "tasks" / "data" / "demo_reward.py")


def text_batch(queries, prompts, labels=None) -> RewardBatch:
    n = len(queries)
    return RewardBatch(
        torch.zeros(n, 1, dtype=torch.long),
        torch.ones(n, 1, dtype=torch.long),
        list(queries),
        list(prompts),
        [q[len(p) :] for q, p in zip(queries, prompts)],
        list(labels) if labels is not None else [None] * n,
    )


def make_rollout(tok, pairs: list[tuple[str, str]]) -> Rollout:
    """A rollout by hand: left-padded prompts, right-padded responses ending in EOS."""
    prompts, p_mask = pad([encode_prompt(tok, p) for p, _ in pairs], tok.pad_token_id, side="left")
    responses, _ = pad([encode_response(tok, r) for _, r in pairs], tok.pad_token_id, side="right")
    r_mask = response_mask(responses, tok.eos_token_id)
    return Rollout(torch.cat([prompts, responses], 1), torch.cat([p_mask, r_mask], 1), r_mask, prompts.size(1))


# ---------------------------------------------------------------------------------------------- reward functions


def test_demo_reward_file_scores_exact_match_in_either_style():
    rf = RewardFunction(DEMO_REWARD)
    cases = [  # (query, prompt, label, reward)
        ("37+45=082", "37+45=", "082", 1.0),  # terse, right
        ("37+45=082 is the sum", "37+45=", "082", 1.0),  # wordy, right
        ("37+45=081", "37+45=", "082", 0.0),  # wrong
        ("37+45=82", "37+45=", "082", 0.0),  # not three digits
        ("37+45=", "37+45=", "082", 0.0),  # empty response
        ("10+20=030", "10+20=", None, 0.0),  # no label
        ("5=082", "37+45=", "082", 1.0),  # prompt cut from the left
        ("37 + 45 = 082", "37+45=", "082", 1.0),  # whitespace re-spaced by the tokenizer
        ("<s> 37+45=082 </s>", "37+45=", "082", 1.0),  # prompt found inside the query
        ("00+01=001 is the sum", "00+01=", "001", 1.0),  # a prompt whose digits could be read as an answer
        ("00+01=", "00+01=", "001", 0.0),
    ]
    rewards = rf.score(text_batch([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]))
    assert rewards.dtype == torch.float32 and rewards.shape == (len(cases),)
    assert rewards.tolist() == [c[3] for c in cases]


def test_a_reward_file_pinned_to_its_content_is_a_reward_function():
    """The RL stage hands its workers the file pinned (uri#sha256=…, StageRun.code_input): it still scores."""
    import hashlib

    pinned = f"{DEMO_REWARD}#sha256={hashlib.sha256(Path(DEMO_REWARD).read_bytes()).hexdigest()}"
    source = make_reward_source("", pinned)
    assert isinstance(source, RewardFunction)
    assert source.score(text_batch(["37+45=082"], ["37+45="], ["082"])).tolist() == [1.0]


def test_demo_reward_recovers_the_response_from_the_query():
    from tasks.data import demo_reward

    assert demo_reward.response_of("12+34=046", "12+34=") == "046"
    assert demo_reward.response_of("4=046", "12+34=") == "046"


def test_demo_reward_on_a_rollout_built_by_build_reward_batch():
    tok = demo.build_tokenizer()
    pairs = [("37+45=", "082"), ("03+04=", "007 is the sum"), ("99+99=", "198 "), ("10+10=", "021")]
    rollout = make_rollout(tok, pairs)
    batch = build_reward_batch(rollout, tok, [p for p, _ in pairs], ["082", "007", "198", "020"])
    assert batch.queries == [p + r for p, r in pairs]  # decoded without <bos>/<eos>/<pad>
    assert batch.responses == [r for _, r in pairs]
    assert batch.sequences is rollout.sequences and batch.attention_mask is rollout.attention_mask
    assert RewardFunction(DEMO_REWARD).score(batch).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert build_reward_batch(rollout, tok, [p for p, _ in pairs], None).labels == [None] * 4
    with pytest.raises(ValueError, match="4 sequences but 3 prompts"):
        build_reward_batch(rollout, tok, ["a", "b", "c"], None)


def test_decode_rows_equals_decoding_each_row_on_its_own():
    tok = demo.build_tokenizer()
    ids, _ = pad(
        [encode_prompt(tok, "37+45=") + [tok.eos_token_id], encode_prompt(tok, "1+1=2 is it")], tok.pad_token_id
    )
    keep = (
        torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.7
    )  # holes anywhere, special tokens kept

    def each_row():
        return [
            tok.decode([t for t, k in zip(row, mask) if k], skip_special_tokens=True)
            for row, mask in zip(ids.tolist(), keep.tolist())
        ]

    assert decode_rows(tok, ids, keep) == each_row()
    assert decode_rows(tok, ids, torch.zeros_like(keep)) == ["", ""]
    tok.clean_up_tokenization_spaces = True  # transformers' own clean-up: the per-row path
    assert decode_rows(tok, ids, keep) == each_row()


def test_custom_reward_file_receives_queries_prompts_labels(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "import json\n"
        "SEEN = []\n"
        "def reward_func(queries, prompts, labels):\n"
        "    SEEN.append((queries, prompts, labels))\n"
        "    return [float(len(q) - len(p)) + (0.5 if l == 'x' else 0.0) for q, p, l in zip(queries, prompts, labels)]\n"
    )
    rf = RewardFunction(str(path))
    assert rf.score(text_batch(["ab", "abcd"], ["a", "a"], ["x", None])).tolist() == [1.5, 3.0]
    dict_file = tmp_path / "dict_reward.py"  # newer OpenRLHF reward functions return a dict
    dict_file.write_text(
        "import torch\ndef reward_func(queries, prompts, labels):\n"
        "    return {'rewards': torch.ones(len(queries)), 'scores': torch.zeros(len(queries)), 'extra_logs': {}}\n"
    )
    assert RewardFunction(f"file://{dict_file}").score(text_batch(["a", "b"], ["", ""])).tolist() == [1.0, 1.0]
    # a Ray actor ships the source by pickling: it reloads the file by path
    import pickle

    assert pickle.loads(pickle.dumps(rf)).score(text_batch(["abc"], ["a"])).tolist() == [2.0]


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "def reward_func(queries, prompts, labels):\n    return [1.0]\n",
            r"reward_func returned rewards of shape \[1\] for a batch of 2",
        ),
        (
            "def reward_func(queries, prompts, labels):\n    return 'good'\n",
            r"reward_func returned str; return a torch tensor or a list of 2 floats",
        ),
        (
            "def reward_func(queries, prompts, labels):\n    return ['a', 'b']\n",
            r"reward_func returned a list of str, not numbers",
        ),
        ("def reward_func(queries, prompts, labels):\n    return None\n", r"reward_func returned NoneType"),
        (
            "def reward_func(queries, prompts, labels):\n    return [1.0, float('nan')]\n",
            r"reward_func returned non-finite rewards",
        ),
        (
            "def reward_func(queries, prompts, labels):\n    return {'extra_logs': {}}\n",
            r"returned a dict with keys \['extra_logs'\]",
        ),
    ],
)
def test_reward_file_wrong_output_is_one_line_naming_it(tmp_path, body, expected):
    path = tmp_path / "bad.py"
    path.write_text(body)
    with pytest.raises(RewardError) as excinfo:
        RewardFunction(str(path)).score(text_batch(["a1", "a2"], ["a", "a"]))
    message = _one_line_error(excinfo)
    assert message.startswith(f"remote_rm_url: {path}: reward_func")
    assert re.search(expected, message), message


def test_reward_file_load_errors_are_one_line(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(RewardError) as excinfo:
        RewardFunction(str(missing))
    assert _one_line_error(excinfo) == f"remote_rm_url: {missing} not found"
    empty = tmp_path / "empty.py"
    empty.write_text("def reward(queries):\n    return []\n")
    with pytest.raises(RewardError) as excinfo:
        RewardFunction(str(empty))
    assert _one_line_error(excinfo) == f"remote_rm_url: {empty} defines no reward_func(queries, prompts, labels)"
    broken = tmp_path / "broken.py"
    broken.write_text("def reward_func(queries, prompts, labels)\n    return []\n")
    with pytest.raises(RewardError) as excinfo:
        RewardFunction(str(broken))
    assert _one_line_error(excinfo).startswith(f"remote_rm_url: {broken} failed to import: SyntaxError")
    raising = tmp_path / "raising.py"
    raising.write_text("def reward_func(queries, prompts, labels):\n    raise KeyError('gold')\n")
    with pytest.raises(KeyError) as excinfo:  # the user's own bug keeps its traceback, with a note naming the file
        RewardFunction(str(raising)).score(text_batch(["a"], [""]))
    assert any(str(raising) in note for note in excinfo.value.__notes__)


def test_reward_file_from_s3(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    s3_server.client().upload_file(DEMO_REWARD, s3_server.bucket, "rewards/demo_reward.py")
    rf = RewardFunction(s3_server.uri("rewards/demo_reward.py"))
    assert rf.score(text_batch(["37+45=082", "37+45=083"], ["37+45="] * 2, ["082", "082"])).tolist() == [1.0, 0.0]
    missing = s3_server.uri("rewards/missing.py")
    with pytest.raises(RewardError) as excinfo:
        RewardFunction(missing)
    assert _one_line_error(excinfo) == f"remote_rm_url: {missing} not found"


# ---------------------------------------------------------------------------------------------- HTTP endpoint


def RewardServer(script) -> JSONServer:
    """A reward server answering from a script at /get_reward (tests/json_server.py)."""
    return JSONServer(script, path="/get_reward")


def length_rewards(payload):
    return {"rewards": [float(len(q)) for q in payload["query"]]}


def test_endpoint_posts_openrlhf_payload_and_reads_rewards():
    batch = text_batch(["37+45=082", "1+1=2"], ["37+45=", "1+1="], ["082", None])
    with RewardServer([(200, length_rewards)]) as server:
        assert RewardEndpoint(server.url).score(batch).tolist() == [9.0, 5.0]
    path, headers, payload = server.requests[0]
    assert (path, headers["Content-Type"]) == ("/get_reward", "application/json")
    assert payload == {"query": ["37+45=082", "1+1=2"], "prompts": ["37+45=", "1+1="], "labels": ["082", None]}


@pytest.mark.parametrize("reply", [[0.5, -1.0], {"scores": [0.5, -1.0]}, {"rewards": [[0.5], [-1.0]]}])
def test_endpoint_accepts_a_bare_list_or_scores(reply):
    with RewardServer([(200, reply)]) as server:
        assert RewardEndpoint(server.url).score(text_batch(["a", "b"], ["", ""])).tolist() == [0.5, -1.0]


def test_endpoint_retries_5xx_then_succeeds():
    with RewardServer(
        [(503, {"error": "warming up"}), (503, {"error": "warming up"}), (200, length_rewards)]
    ) as server:
        assert RewardEndpoint(server.url, retries=3, backoff=0.01).score(text_batch(["abc"], ["a"])).tolist() == [3.0]
    assert len(server.requests) == 3


def test_endpoint_gives_up_with_one_line_naming_the_url():
    with RewardServer([(500, b"boom")]) as server:
        with pytest.raises(RewardError) as excinfo:
            RewardEndpoint(server.url, retries=2, backoff=0.01).score(text_batch(["a"], [""]))
    assert (
        _one_line_error(excinfo)
        == f"remote_rm_url: {server.url} failed after 3 attempts: HTTP 500 Internal Server Error: boom"
    )
    assert len(server.requests) == 3


def test_endpoint_down_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    with pytest.raises(RewardError) as excinfo:
        RewardEndpoint(url, retries=2, backoff=0.01).score(text_batch(["a"], [""]))
    message = _one_line_error(excinfo)
    assert message.startswith(f"remote_rm_url: {url} failed after 3 attempts: ConnectionRefusedError"), message


@pytest.mark.parametrize(
    "status, reply, expected",
    [
        (400, {"detail": "bad labels"}, r'answered HTTP 400 Bad Request: {"detail": "bad labels"}$'),  # not retried
        (200, b"<html>oops</html>", r"answered with no JSON: '<html>oops</html>'"),
        (200, {"reward": [1.0]}, r"answered JSON with keys \['reward'\]; expected"),
        (200, {"rewards": [1.0, 2.0, 3.0]}, r"returned rewards of shape \[3\] for a batch of 1"),
    ],
)
def test_endpoint_bad_answers_are_one_line(status, reply, expected):
    with RewardServer([(status, reply)]) as server:
        with pytest.raises(RewardError) as excinfo:
            RewardEndpoint(server.url, backoff=0.01).score(text_batch(["a"], [""]))
    message = _one_line_error(excinfo)
    assert message.startswith(f"remote_rm_url: {server.url} ") and re.search(expected, message), message
    assert len(server.requests) == 1


# ---------------------------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def tiny_reward_models(tmp_path_factory):
    """Two tiny scalar models with different heads and stored statistics, and one with none."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("rms")
    tok = demo.build_tokenizer()
    demo.build_base_model(tok, seed=0, hidden_size=32, num_layers=1).save_pretrained(root / "base")
    paths = []
    for name, seed, stats in (("a", 1, (0.3, 2.0)), ("b", 2, (-0.1, 0.5)), ("plain", 3, None)):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(root / "base", num_labels=1)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, not 0.02
        if stats is not None:
            model.config.reward_mean, model.config.reward_std = stats
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(str(root / name))
    return tok, paths


def test_reward_models_sum_of_normalised_scores(tiny_reward_models):
    tok, (a, b, plain) = tiny_reward_models
    rollout = make_rollout(tok, [("37+45=", "082"), ("03+04=", "007 is the sum"), ("1+1=", "2")])
    batch = build_reward_batch(rollout, tok, ["37+45=", "03+04=", "1+1="], None)
    with torch.no_grad():
        sa, sb, sp = (
            sequence_scores(load_scalar_model(p).eval(), rollout.sequences, rollout.attention_mask)
            for p in (a, b, plain)
        )
    assert not torch.allclose(sa, sb)

    both = RewardModels([a, b], "cpu", torch.float32, normalize=True)
    assert both.stats == [(0.3, 2.0), (-0.1, 0.5)]
    assert all(not p.requires_grad for m in both.models for p in m.parameters()) and not any(
        m.training for m in both.models
    )
    expected = (sa - 0.3) / 2.0 + (sb + 0.1) / 0.5
    assert torch.allclose(both.score(batch), expected, atol=1e-5)
    assert torch.allclose(RewardModels(f"{a}, {b}", normalize=False).score(batch), sa + sb, atol=1e-5)
    assert torch.allclose(RewardModels([a], normalize=True, batch_size=2).score(batch), (sa - 0.3) / 2.0, atol=1e-5)
    # a model without stored statistics is left as it is
    assert torch.allclose(RewardModels([plain, a], normalize=True).score(batch), sp + (sa - 0.3) / 2.0, atol=1e-5)


def test_reward_models_reject_another_tokenizer(tiny_reward_models):
    tok, (a, _, _) = tiny_reward_models
    batch = RewardBatch(torch.tensor([[1, 500]]), torch.ones(1, 2, dtype=torch.long), ["x"], [""], ["x"], [None])
    with pytest.raises(
        RewardError, match=r"reward_pretrain: .* has \d+ token embeddings but the sequences hold id 500"
    ):
        RewardModels([a]).score(batch)


# ---------------------------------------------------------------------------------------------- dispatch


def test_make_reward_source_dispatch(tiny_reward_models):
    _, (a, b, _) = tiny_reward_models
    assert isinstance(make_reward_source("", DEMO_REWARD, "cpu", torch.float32, True), RewardFunction)
    endpoint = make_reward_source("", "http://127.0.0.1:9/reward", "cpu", torch.float32, True)
    assert isinstance(endpoint, RewardEndpoint) and endpoint.url == "http://127.0.0.1:9/reward"
    assert isinstance(make_reward_source(a, DEMO_REWARD, "cpu", torch.float32, True), RewardFunction)  # remote wins
    models = make_reward_source(f"{a},{b}", "", "cpu", torch.float32, False)
    assert isinstance(models, RewardModels) and models.paths == [a, b] and models.normalize is False
    summed = make_reward_source("", f"{DEMO_REWARD},{DEMO_REWARD}", "cpu", torch.float32, True)
    assert isinstance(summed, SummedRewards)
    assert summed.score(text_batch(["37+45=082", "37+45=081"], ["37+45="] * 2, ["082"] * 2)).tolist() == [2.0, 0.0]

    with pytest.raises(ValueError) as excinfo:
        make_reward_source("", "", "cpu", torch.float32, True)
    assert _one_line_error(excinfo) == "reward: set --reward_pretrain or --remote_rm_url"
    with pytest.raises(ValueError) as excinfo:
        make_reward_source(" , ", "  ", "cpu", torch.float32, True)
    assert _one_line_error(excinfo) == "reward: set --reward_pretrain or --remote_rm_url"
    with pytest.raises(RewardError, match=r"^remote_rm_url: ftp://x/y is neither a \.py file nor an http\(s\):// URL$"):
        make_reward_source("", "ftp://x/y", "cpu", torch.float32, True)
