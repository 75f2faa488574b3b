"""The agentic demo tasks: multiplication with a calculator tool, and a guessing game.

    splits = calculator_datasets(seed=0)    # {"sft": [...], "prompts": [...], "eval": [...]}
    splits = guess_datasets(seed=0)
    tokenizer = build_tokenizer()           # character-level (digits, arithmetic, lowercase, tags)
    model = demo.build_base_model(tokenizer, **BASE_MODEL)

Calculator: `347*8=` asks for `2776`. A tiny model rarely gets a 3-digit × 1-digit product right on
its own; with the tool it only has to copy: `<calc>347*8</calc>` (a turn ending in EOS), the
environment answers `<result>2776</result>`, the model answers `2776`. The SFT traces use the tool on
only `tool_fraction` of the rows (each traced turn is one prompt/response row; a row's prompt holds the
turns before it, EOS included, exactly as an RL episode's tokens are), so RL has something to learn:
call the tool more, and success follows.

Guess: `guess 1-16:` with a hidden target; the environment answers `higher` or `lower`. The SFT traces
guess at random within what the feedback allows (3.4 guesses on average); bisection needs at most 4.
"""

from __future__ import annotations

import random

from tasks.data import demo

CHARACTERS = list("0123456789+-*/=()<>: ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
EOS = "<eos>"
GUESS_RANGE = (1, 16)
#: demo.build_base_model's shape for these tasks: episodes are longer than the demo's answers.
BASE_MODEL = {"hidden_size": 64, "num_layers": 1, "max_positions": 128}


def build_tokenizer():
    """A character-level tokenizer over the agentic tasks' characters, as an HF fast tokenizer."""
    return demo.build_tokenizer(CHARACTERS, max_length=128)


def calculator_rows(a: int, b: int) -> dict:
    return {"prompt": f"{a}*{b}=", "label": str(a * b)}


def calculator_trace(a: int, b: int, use_tool: bool) -> list[dict]:
    """SFT rows of one episode: each model turn a row whose prompt is everything before it."""
    row = calculator_rows(a, b)
    if not use_tool:
        return [{"prompt": row["prompt"], "response": row["label"]}]
    call = f"<calc>{a}*{b}</calc>"
    return [
        {"prompt": row["prompt"], "response": call},
        {"prompt": f"{row['prompt']}{call}{EOS}<result>{a * b}</result>", "response": row["label"]},
    ]


def calculator_datasets(
    seed: int = 0, tool_fraction: float = 0.3, n_train: int = 4000, n_eval: int = 200
) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(100, 1000) for b in range(2, 10)]
    rng.shuffle(pairs)
    train, test = pairs[:n_train], pairs[n_train : n_train + n_eval]
    sft = [r for a, b in train for r in calculator_trace(a, b, rng.random() < tool_fraction)]
    return {
        "sft": sft,
        "prompts": [calculator_rows(a, b) for a, b in train],
        "eval": [calculator_rows(a, b) for a, b in test],
    }


def guess_trace(target: int, rng: random.Random) -> list[dict]:
    low, high = GUESS_RANGE
    prompt = f"guess {low}-{high}:"
    rows, history = [], prompt
    while True:
        guess = rng.randint(low, high)
        rows.append({"prompt": history, "response": str(guess)})
        if guess == target:
            return rows
        feedback = "higher" if guess < target else "lower"
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)
        history += f"{guess}{EOS}{feedback}"


def guess_datasets(
    seed: int = 0, n_traces: int = 2000, n_prompts: int = 1000, n_eval: int = 200
) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    low, high = GUESS_RANGE

    def row():
        target = rng.randint(low, high)
        return {"prompt": f"guess {low}-{high}:", "target": target, "label": str(target)}

    return {
        "sft": [r for _ in range(n_traces) for r in guess_trace(rng.randint(low, high), rng)],
        "prompts": [row() for _ in range(n_prompts)],
        "eval": [row() for _ in range(n_eval)],
    }
