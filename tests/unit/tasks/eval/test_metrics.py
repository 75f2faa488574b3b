"""The evaluation's metrics (tasks/eval/metrics.py), its statistics (tasks/eval/stats.py), its LLM judge
(tasks/eval/judge.py, against a judge served over real HTTP here) and the gate rules that read them, against
hand-computed values; then the eval stage on a team's own data and metric file."""

import json

import pytest

from tasks.common.config import ConfigError, make_config
from tasks.eval import metrics, stats
from tasks.promote.gate import check_rules, judge

from tests.json_server import JSONServer

# ---------------------------------------------------------------------------------------------- built-ins


def test_exact_match_normalises_and_leaves_unlabelled_rows_unscored():
    assert metrics.exact_match(["Paris.", " the  Answer ", "Lyon", "x"], ["paris", "the answer", "Paris", None]) == [
        1.0,
        1.0,
        0.0,
        None,
    ]


def test_regex_compares_the_first_group_or_the_whole_match():
    responses = ["so the answer is 42.", "answer is 7", "no idea"]
    assert metrics.regex_match(r"answer is (\d+)", responses, ["42", "8", "1"]) == [1.0, 0.0, 0.0]
    assert metrics.regex_match(r"\d+", responses, ["42", "7", None]) == [1.0, 1.0, None]


def test_json_valid_and_length():
    scorers = metrics.resolve(["json_valid", "length"])
    assert metrics.score(scorers, ["p", "q"], ['{"a": 1}', "{a: 1}"], None, [{}, {}]) == {
        "json_valid": [1.0, 0.0],
        "length": [8.0, 6.0],
    }


def test_math_verify_compares_the_answers_mathematically():
    scores = metrics.math_verify(["The result is $\\frac{1}{2}$", "It is 0.75", "x"], ["0.5", "$\\frac{3}{4}$", "2"])
    assert scores == [1.0, 1.0, 0.0]


def test_labelled_metrics_are_left_out_without_labels():
    scorers = metrics.resolve(["exact_match", "math_verify", r"regex:(\d+)", "length"])
    assert set(metrics.score(scorers, ["p"], ["1"], None, [{}])) == {"length"}


def test_unknown_or_broken_metrics_are_refused_in_one_line():
    with pytest.raises(metrics.MetricError, match="unknown metric 'bleu'"):
        metrics.builtin("bleu")
    with pytest.raises(metrics.MetricError, match="not a valid regular expression"):
        metrics.builtin("regex:(")


def test_eval_config_reads_the_metric_list_and_refuses_bad_ones():
    from tasks.eval.config import EvalConfig

    base = {"output": "/tmp/x", "baseline": "a", "policy": "b", "dataset": "d"}
    cfg = make_config(
        EvalConfig, {**base, "metrics": "exact_match, length,regex:(\\d+),(\\d+)", "n_samples_per_prompt": 4}
    )
    assert cfg.metric_names() == ["exact_match", "length", "regex:(\\d+),(\\d+)"]  # a pattern's commas stay its own
    assert cfg.ks() == [1, 4]
    with pytest.raises(ConfigError, match="unknown metric 'bleu'"):
        make_config(EvalConfig, {**base, "metrics": "bleu"})
    with pytest.raises(ConfigError, match="pass_k: 8 is not between 1 and n_samples_per_prompt"):
        make_config(EvalConfig, {**base, "n_samples_per_prompt": 4, "pass_k": "1,8"})


# ---------------------------------------------------------------------------------------------- a metric file


def test_a_metric_file_is_loaded_and_its_scores_checked(tmp_path):
    good = tmp_path / "good.py"
    good.write_text(
        "def metrics(prompts, responses, labels, rows):\n"
        "    return {'starts_like_label': [None if l is None else float(r[:1] == l[:1]) for r, l in zip(responses, labels)],\n"
        "            'weight': [float(row['w']) for row in rows]}\n"
    )
    scorers = metrics.resolve([], str(good))
    out = metrics.score(scorers, ["p1", "p2"], ["abc", "xyz"], ["a", None], [{"w": 2}, {"w": 3}])
    assert out == {"starts_like_label": [1.0, None], "weight": [2.0, 3.0]}

    short = tmp_path / "short.py"
    short.write_text("def metrics(prompts, responses, labels, rows):\n    return {'m': [1.0]}\n")
    with pytest.raises(metrics.MetricError, match="metric 'm': 1 scores for 2 responses"):
        metrics.score(metrics.resolve([], str(short)), ["p", "q"], ["a", "b"], None, [{}, {}])
    clash = tmp_path / "clash.py"
    clash.write_text("def metrics(prompts, responses, labels, rows):\n    return {'length': [1.0] * len(responses)}\n")
    with pytest.raises(metrics.MetricError, match="given twice"):
        metrics.score(metrics.resolve(["length"], str(clash)), ["p"], ["a"], None, [{}])
    wordy = tmp_path / "wordy.py"
    wordy.write_text("def metrics(prompts, responses, labels, rows):\n    return {'m': ['good'] * len(responses)}\n")
    with pytest.raises(metrics.MetricError, match="scores must be numbers or None"):
        metrics.score(metrics.resolve([], str(wordy)), ["p"], ["a"], None, [{}])
    with pytest.raises(metrics.MetricError, match="metric_func: .*missing.py not found"):
        metrics.resolve([], str(tmp_path / "missing.py"))
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(metrics.MetricError, match=r"defines no metrics\(prompts, responses, labels, rows\)"):
        metrics.resolve([], str(tmp_path / "none.py"))


# ---------------------------------------------------------------------------------------------- pass@k


def test_pass_at_k_is_the_unbiased_estimator():
    assert metrics.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # 1 - C(3,1)/C(5,1) = 1 - 3/5
    assert metrics.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert metrics.pass_at_k(5, 0, 3) == 0.0
    assert metrics.pass_at_k(5, 3, 3) == 1.0  # fewer failures than k: some draw always holds a success
    with pytest.raises(ValueError):
        metrics.pass_at_k(4, 1, 5)


def test_success_metrics_are_the_zero_one_ones():
    assert metrics.is_success_metric([1.0, 0.0, None])
    assert not metrics.is_success_metric([1.0, 0.5])
    assert not metrics.is_success_metric([None, None])


# ---------------------------------------------------------------------------------------------- intervals


def test_scores_average_per_prompt_before_resampling():
    assert stats.per_prompt([1.0, 0.0, None, None, 1.0, 1.0], 2) == [0.5, None, 1.0]
    with pytest.raises(ValueError):
        stats.per_prompt([1.0, 0.0, 1.0], 2)


def test_mean_interval_holds_the_mean_and_is_repeatable():
    assert stats.mean_interval([0.7] * 20) == [0.7, 0.7]
    values = [1.0] * 30 + [0.0] * 70
    lo, hi = stats.mean_interval(values, seed=3)
    assert lo < 0.3 < hi and hi - lo < 0.25  # about ±0.09 for 100 coin flips at 0.3
    assert stats.mean_interval(values, seed=3) == [lo, hi]
    assert stats.mean_interval([1.0, None]) is None  # one scored value: no interval


def test_paired_delta_cancels_what_both_sides_share():
    reference = [0.1 * i for i in range(10)]
    candidate = [v + 0.2 for v in reference]  # the same prompts, each 0.2 better
    assert stats.delta_interval(candidate, reference) == (0.2, [0.2, 0.2])
    delta, interval = stats.delta_interval([1.0, None, 0.0, 1.0], [0.0, 1.0, None, 0.0])
    assert delta == 1.0 and interval == [1.0, 1.0]  # only the prompts both sides scored: the first and last


def test_win_rate_counts_ties_within_the_margin():
    record = stats.win_rate([1.0, 0.05, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0], margin=0.1)
    assert (record["wins"], record["ties"], record["losses"]) == (2, 1, 1)
    assert record["rate"] == pytest.approx((2 + 0.5) / 4)
    assert record["interval"][0] <= record["rate"] <= record["interval"][1]


def test_the_hacking_alarm_needs_both_a_significant_rise_and_fall():
    rise = {"delta": 0.8, "interval": [0.5, 1.1]}
    fall = {"delta": -0.1, "interval": [-0.15, -0.05]}
    alarms = stats.hacking_alarms({"reward_mean": rise, "accuracy": fall, "style": fall}, ["accuracy"])
    assert alarms == [
        "reward hacking suspected: reward_mean rose +0.8000 (95% CI +0.5000 to +1.1000) while accuracy fell -0.1000 (95% CI -0.1500 to -0.0500)"
    ]
    assert (
        stats.hacking_alarms({"reward_mean": rise, "accuracy": {"delta": -0.1, "interval": [-0.2, 0.01]}}, ["accuracy"])
        == []
    )
    assert (
        stats.hacking_alarms({"reward_mean": {"delta": 0.8, "interval": [-0.1, 1.1]}, "accuracy": fall}, ["accuracy"])
        == []
    )


# ---------------------------------------------------------------------------------------------- the LLM judge


def shorter_wins(body: dict, biased: bool = False) -> dict:
    """An OpenAI-compatible chat reply whose judge prefers the shorter response (biased: always the first)."""
    user = body["messages"][-1]["content"]
    first = user.split("Response A:\n", 1)[1].split("\n\nResponse B:\n")[0]
    second = user.split("\n\nResponse B:\n", 1)[1].split("\n\nWhich response")[0]
    answer = "A" if biased or len(first) < len(second) else "B" if len(second) < len(first) else "tie"
    return {"choices": [{"message": {"role": "assistant", "content": f"{answer}."}}]}


def test_the_judge_asks_both_orders_and_cancels_a_position_bias(monkeypatch):
    from tasks.eval.judge import ChatJudge

    monkeypatch.setenv("RLHF_JUDGE_API_KEY", "k-123")
    with JSONServer([(200, shorter_wins)], path="/v1") as server:
        judge = ChatJudge(server.url, model="tiny-judge")
        outcomes = judge.compare(
            ["p1", "p2", "p3"], ["short", "a longer answer", "same"], ["a longer answer", "short", "same"]
        )
    assert outcomes == [1.0, 0.0, 0.5]
    seen = server.requests
    assert len(seen) == 6 and {path for path, _, _ in seen} == {"/v1/chat/completions"}
    assert {headers["Authorization"] for _, headers, _ in seen} == {"Bearer k-123"} and seen[0][2][
        "model"
    ] == "tiny-judge"
    asked = sorted(body["messages"][-1]["content"].split("Response A:\n")[1].split("\n")[0] for _, _, body in seen)
    assert asked.count("short") == 2 and asked.count("a longer answer") == 2  # each response shown first once

    with JSONServer([(200, lambda body: shorter_wins(body, biased=True))], path="/v1") as biased:
        # always "A": both orders asked, the bias cancels to ties
        assert ChatJudge(biased.url, "j").compare(["p1", "p2"], ["short", "x"], ["a longer answer", "yy"]) == [0.5, 0.5]


def test_the_judge_retries_what_is_transient_and_names_the_rest_in_one_line():
    from tasks.eval.judge import ChatJudge, JudgeError

    with JSONServer(
        [(503, {"error": "warming up"}), (503, {"error": "warming up"}), (200, shorter_wins)], path="/v1"
    ) as server:
        assert ChatJudge(server.url, "j", backoff=0.01).compare(["p"], ["a"], ["bb"]) == [1.0]
    with JSONServer([(401, {"error": "bad key"})], path="/v1") as server:
        with pytest.raises(
            JudgeError, match=r"^judge_url: http://127.0.0.1:\d+/v1/chat/completions answered HTTP 401 Unauthorized"
        ):
            ChatJudge(server.url, "j", backoff=0.01).compare(["p"], ["a"], ["bb"])
    with pytest.raises(JudgeError, match="not an http"):
        ChatJudge("localhost:8000", "j")


# ---------------------------------------------------------------------------------------------- the gate


def test_the_gate_can_ask_for_a_gain_that_is_not_noise():
    rules = {"exact_match": {"min_gain_lower": 0.0}, "kl_to_ref": {"max": 2.0}}
    check_rules(rules)
    candidate, reference = {"exact_match": 0.62, "kl_to_ref": 1.0}, {"exact_match": 0.55}
    ok, reasons = judge(candidate, reference, rules, {"exact_match": {"delta": 0.07, "interval": [0.02, 0.12]}})
    assert ok and reasons[0] == "pass: exact_match gain's 95% interval [+0.0200, +0.1200] starts >= +0.0"
    ok, reasons = judge(candidate, reference, rules, {"exact_match": {"delta": 0.07, "interval": [-0.01, 0.15]}})
    assert not ok and reasons[0].startswith("FAIL: exact_match gain's 95% interval [-0.0100")
    ok, reasons = judge(candidate, reference, rules)
    assert not ok and reasons[0] == "FAIL: exact_match: no interval of its change in the evaluation report"


def test_an_alarm_fails_the_gate_whatever_the_rules():
    ok, reasons = judge(
        {"accuracy": 0.9},
        {"accuracy": 0.9},
        {"accuracy": {"max_drop": 0.02}},
        alarms=["against the baseline: reward hacking suspected: ..."],
    )
    assert not ok and reasons == [
        "pass: accuracy drop +0.0000 from 0.9000 <= 0.02",
        "FAIL: against the baseline: reward hacking suspected: ...",
    ]


# ---------------------------------------------------------------------------------------------- the stage


def test_eval_stage_scores_a_teams_own_data_with_its_metric_file(tmp_path, ray_driver):
    """Not the demo: the team's labels, its own metric file (reading its rows), a built-in, four samples per
    prompt (pass@k), a slice column. Every number is checked against what it must be."""
    from tasks.common import stage
    from tasks.eval.config import EvalConfig
    from tasks.eval.evaluate import evaluate

    from tests.tiny_chat import build_chat_model

    model = build_chat_model(tmp_path / "model")
    rows = [
        {"prompt": f"question {i}?", "label": "ab"[i % 2], "topic": "even" if i % 2 == 0 else "odd", "w": i}
        for i in range(8)
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "team_metrics.py").write_text(
        "def metrics(prompts, responses, labels, rows):\n"
        "    assert [r['prompt'] for r in rows] == prompts\n"
        "    return {'weight': [float(r['w']) for r in rows], 'even': [float(r['w'] % 2 == 0) for r in rows]}\n"
    )
    out = tmp_path / "eval-out"
    flags = {
        "output": str(out),
        "baseline": model,
        "policy": model,
        "dataset": str(tmp_path / "eval.jsonl"),
        "metrics": "exact_match",
        "metric_func": str(tmp_path / "team_metrics.py"),
        "n_samples_per_prompt": 4,
        "slice_key": "topic",
        "generate_max_len": 3,
        "num_shown_samples": 8,
        "bootstrap_resamples": 500,
    }
    with JSONServer([(200, shorter_wins)], path="/v1") as judge_server:
        stage.run(
            "eval",
            make_config(EvalConfig, {**flags, "judge_url": judge_server.url, "judge_model": "tiny-judge"}),
            evaluate,
        )
    report = json.loads((out / "report.json").read_text())
    policy = report["metrics"]["policy"]

    assert report["declared_metrics"] == [
        "exact_match",
        "weight",
        "even",
        "sampled_exact_match",
        "sampled_weight",
        "sampled_even",
    ]
    assert policy["weight"] == policy["sampled_weight"] == 3.5  # the mean of 0..7: rows line up with responses
    assert (
        policy["even"] == 0.5 and policy["pass@1_even"] == policy["pass@4_even"] == 0.5
    )  # all or none of a prompt's samples
    greedy = [s["policy"] for s in report["samples"]]
    assert policy["exact_match"] == sum(g.strip().lower() == r["label"] for g, r in zip(greedy, rows)) / 8
    lo, hi = report["intervals"]["policy"]["weight"]
    assert 0 <= lo < 3.5 < hi <= 7
    assert report["comparisons"]["baseline"]["weight"] == {"delta": 0.0, "interval": [0.0, 0.0]}  # one model both sides
    assert report["verifiable_metrics"] == ["exact_match", "even", "sampled_exact_match", "sampled_even"]
    # No reward model: no alarm, and the LLM judge alone compares; one model both sides, so every prompt ties.
    judged = report["win_rates"]["baseline"]["llm_judge tiny-judge"]
    assert (judged["ties"], judged["rate"]) == (8, 0.5) and len(judge_server.requests) == 16 and report["alarms"] == []

    groups = report["slices"]["groups"]
    assert {k: g["prompts"] for k, g in groups.items()} == {"even": 4, "odd": 4}
    assert groups["even"]["policy"]["weight"]["mean"] == 3.0 and groups["odd"]["policy"]["weight"]["mean"] == 4.0
    assert groups["even"]["policy"]["even"] == {"mean": 1.0, "interval": [1.0, 1.0]}
    page = (out / "report.html").read_text()
    assert 'id="slices"' in page and "pass@4_even" in page


def test_the_default_gate_is_made_from_the_declared_metrics():
    from tasks.promote.gate import default_rules, real_gain

    report = {
        "verifiable_metrics": ["exact_match", "sampled_exact_match"],
        "comparisons": {
            "baseline": {
                "exact_match": {"delta": 0.01, "interval": [-0.02, 0.04]},
                "sampled_exact_match": {"delta": 0.08, "interval": [0.03, 0.13]},
            },
            "champion": {"exact_match": {"delta": -0.01, "interval": [-0.04, 0.02]}},
        },
    }
    assert default_rules(report) == {"exact_match": {"max_drop": 0.02}, "kl_to_ref": {"max": 2.0}}
    assert real_gain(report, "baseline") == (
        True,
        "pass: sampled_exact_match gained +0.0800 (95% interval [+0.0300, +0.1300]) against the baseline",
    )
    ok, line = real_gain(report, "champion")
    assert not ok and line.startswith("FAIL: no declared metric gained beyond noise against the champion")
    check_rules({})  # {} is the default gate, not a malformed one


# ---------------------------------------------------------------------------------------------- lm-eval tasks


def test_lm_eval_sample_logs_become_one_score_per_document():
    from tasks.eval.lm_eval_tasks import per_document_scores

    samples = {
        "sums": [
            {"doc_id": 1, "filter": "none", "metrics": ["exact_match"], "exact_match": 0.0},
            {"doc_id": 0, "filter": "none", "metrics": ["exact_match"], "exact_match": 1.0},
        ],
        # two filters of one task; a corpus-level metric's per-document value is a tuple, left to lm-eval's table
        "gsm": [
            {
                "doc_id": 0,
                "filter": "strict-match",
                "metrics": ["exact_match", "bleu"],
                "exact_match": 1,
                "bleu": ("a", "b"),
            },
            {"doc_id": 0, "filter": "flexible", "metrics": ["exact_match"], "exact_match": 0},
            {
                "doc_id": 1,
                "filter": "strict-match",
                "metrics": ["exact_match", "bleu"],
                "exact_match": True,
                "bleu": ("c", "d"),
            },
        ],
    }
    assert per_document_scores(samples) == {
        "lm_eval/sums/exact_match": [1.0, 0.0],
        "lm_eval/gsm/exact_match/strict-match": [1.0, 1.0],
        "lm_eval/gsm/exact_match/flexible": [0.0],
    }


def test_eval_stage_runs_a_teams_own_lm_eval_tasks(tmp_path, ray_driver):
    """Two tasks of the team's own, as lm-eval YAML files over local data (no hub): a generated answer scored by
    exact match and a multiple choice scored by log-likelihood. Each per-document metric is in the report with
    its interval and delta, its mean is lm-eval's own aggregate, and an unknown task is refused in one line."""
    from tasks.common import stage
    from tasks.eval.config import EvalConfig
    from tasks.eval.evaluate import evaluate
    from tasks.eval.lm_eval_tasks import LmEvalError, task_manager

    from tests.tiny_chat import build_chat_model

    model = build_chat_model(tmp_path / "model")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"question": f"{i}+1=", "answer": str(i + 1), "choices": [str(i + 1), "x"], "gold": 0} for i in range(6)]
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'docs.jsonl'}\ntest_split: test\ndoc_to_text: '{{{{question}}}}'\n"
    (tasks / "team_sums.yaml").write_text(
        "task: team_sums\n" + data + "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['<|end|>']\n  max_gen_toks: 3\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    (tasks / "team_choice.yaml").write_text(
        "task: team_choice\n"
        + data
        + "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}?", "label": "a"}) + "\n" for i in range(2))
    )
    out = tmp_path / "eval-out"
    stage.run(
        "eval",
        make_config(
            EvalConfig,
            {
                "output": str(out),
                "baseline": model,
                "policy": model,
                "dataset": str(tmp_path / "eval.jsonl"),
                "generate_max_len": 2,
                "bootstrap_resamples": 200,
                "lm_eval_tasks": "team_sums,team_choice",
                "lm_eval_include_path": str(tasks),
                "lm_eval_limit": 5,
            },
        ),
        evaluate,
    )
    report = json.loads((out / "report.json").read_text())
    policy = report["metrics"]["policy"]
    for name, task, key in (
        ("lm_eval/team_sums/exact_match", "team_sums", "exact_match,none"),
        ("lm_eval/team_choice/acc", "team_choice", "acc,none"),
    ):
        assert (
            name in report["declared_metrics"] and name in report["verifiable_metrics"]
        )  # 0/1: the hacking alarm reads it
        assert policy[name] == round(
            report["lm_eval"]["policy"][task][key], 4
        )  # lm-eval's own aggregate over the 5 documents
        assert report["comparisons"]["baseline"][name] == {"delta": 0.0, "interval": [0.0, 0.0]}  # one model both sides
    with pytest.raises(LmEvalError, match="^lm_eval_tasks: 'team_nope' is not an lm-eval task nor in"):
        task_manager(["team_nope"], str(tasks))
    with pytest.raises(ConfigError, match="^lm_eval_include_path: names task files but --lm_eval_tasks names no task"):
        make_config(
            EvalConfig,
            {"output": "o", "baseline": "b", "policy": "p", "dataset": "d", "lm_eval_include_path": str(tasks)},
        )
