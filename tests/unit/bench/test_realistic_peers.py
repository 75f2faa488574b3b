"""The peers on the realistic work (bench/realistic_peers.py): the settings each gets, and the figures taken from
their step lines (verl's console format, OpenRLHF's "Global step" dicts), on hand-written lines with hand-checked
medians. The runs themselves need a GPU and the peers installed (bench/gpu/run.sh real_verl4k, real_openrlhf4k)."""

import json

import pytest

from bench import realistic_peers as peers
from bench.common import PROMPT_TOKENS

# the peer benches as realistic_peers imports them (bench/ on sys.path, as its scripts run)
openrlhf_bench, verl_bench = peers.openrlhf_bench, peers.verl_bench


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "model_eos4096").mkdir()
    (tmp_path / "model_eos4096" / "config.json").write_text("{}")
    (tmp_path / "model_info.json").write_text(json.dumps({"shape": "qwen2.5-1.5b"}))
    return tmp_path


def test_each_peer_gets_the_work_with_eos_live_and_our_token_budget(bench_dir):
    budget = 8 * (PROMPT_TOKENS + 4096)  # 33,792: RLConfig.token_budget's at this shape
    verl = " ".join(
        verl_bench.verl_command(bench_dir, 3, 8, False, False, False, peers.verl_work(bench_dir, 4096, 3, 0.35))
    )
    for setting in (
        "actor_rollout_ref.rollout.ignore_eos=False",
        "data.max_response_length=4096",
        "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.model.use_remove_padding=True",
        f"actor_rollout_ref.model.path={bench_dir / 'model_eos4096'}",
        "data.train_max_samples=48",
    ):
        assert setting in verl, setting
    orl = openrlhf_bench.openrlhf_command(bench_dir, 3, 8, False, peers.openrlhf_work(bench_dir, 4096, 3, 0.35))
    flags = dict(zip(orl, orl[1:]))
    assert flags["--train.max_tokens_per_gpu"] == flags["--rollout.max_tokens_per_gpu"] == str(budget)
    assert flags["--rollout.max_new_tokens"] == "4096" and flags["--data.max_len"] == str(PROMPT_TOKENS + 4096)
    assert {"--ds.packing_samples", "--train.dynamic_batch_enable", "--vllm.enable_prefix_caching"} <= set(orl)
    smaller = openrlhf_bench.openrlhf_command(
        bench_dir, 3, 8, False, peers.openrlhf_work(bench_dir, 4096, 3, 0.35, 16192)
    )
    assert dict(zip(smaller, smaller[1:]))["--train.max_tokens_per_gpu"] == "16192"


VERL_LINES = [
    (
        100.0,
        "(TaskRunner pid=1) step:1 - timing_s/step:np.float64(60.5) - timing_s/gen:30.0 - response_length/mean:1000.0"
        " - response_length/max:4096.0 - response_length/clip_ratio:0.01 - perf/throughput:5000.0",
    ),
    (
        130.0,
        "step:2 - timing_s/step:29.0 - timing_s/gen:15.0 - response_length/mean:1100.0 - response_length/max:3000.0"
        " - response_length/clip_ratio:0.0 - perf/throughput:5500.0",
    ),
    (
        158.0,
        "step:3 - timing_s/step:27.5 - timing_s/gen:14.0 - response_length/mean:900.0 - response_length/max:3500.0"
        " - response_length/clip_ratio:0.02 - perf/throughput:5600.0",
    ),
]


def test_step_figures_come_from_the_line_arrivals_after_the_first_step():
    records = verl_bench.parse_steps(VERL_LINES)

    class Peak:
        gb = 70.0

    keys = ("timing_s/step", "response_length/mean", "response_length/clip_ratio", "response_length/max")
    out = peers.peer_result(records, 0, Peak(), keys, verl_bench.SPLIT, "timing_s/", 4096)
    assert out["step_times_s"] == [60.5, 30.0, 28.0]  # the first from verl's own timer, then the lines' gaps
    assert out["step_s"] == 29.0  # median of 30 and 28
    # 128 completions x (128 + mean length) over each step's time, the median of the two measured steps:
    # 128 x 1,228 / 30 = 5,239.5 and 128 x 1,028 / 28 = 4,699.4 -> 4,969
    assert out["tokens_per_s_per_gpu"] == 4969
    assert out["response_length_mean"] == 1000.0 and out["response_length_max"] == 3500.0
    assert out["truncation_rate"] == 0.01 and out["generate_s"] == 14.5 and out["steps_measured"] == 2


def test_openrlhf_lines_give_the_same_figures_without_a_maximum():
    lines = [
        (
            10.0,
            "Global step 1: {'timing/step_total': 90.0, 'rollout/response_length_mean': 1000.0, 'rollout/truncated_rate': 0.0}",
        ),
        (
            50.0,
            "Global step 2: {'timing/step_total': 39.0, 'rollout/response_length_mean': 972.0, 'rollout/truncated_rate': 0.02}",
        ),
    ]
    records = openrlhf_bench.parse_steps(lines)
    out = peers.summarise(records, "timing/step_total", "rollout/response_length_mean", "rollout/truncated_rate", None)
    assert out["step_times_s"] == [90.0, 40.0] and out["step_s"] == 40.0
    assert out["tokens_per_s_per_gpu"] == round(128 * (128 + 972.0) / 40.0)  # 3,520
    assert "response_length_max" not in out and out["truncation_rate"] == 0.02
