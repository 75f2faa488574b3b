"""The built-in demo task: fixed-width addition answered in one of two styles.

    rows = make_datasets(seed=0)          # {"sft": [...], "preference": [...], "style_pairs": [...], "unpaired": [...], ...}
    tokenizer = build_tokenizer()          # character-level, saved and loaded as an HF tokenizer
    model = build_base_model(tokenizer)    # tiny Llama, random weights, no hub needed

A prompt is `37+45=` (operands 0–99, two digits each); the answer is `082` (three digits). The SFT
data gives the answer in two styles, half each: terse (`082`) and wordy (`082 is the sum`). The
preference pairs favour the terse style with the same answer on both sides, so the reward model
learns style, which a tiny model judges reliably, and not correctness, which it cannot (a reward
model asked to judge sums gets hacked by PPO; see docs/design-notes.md). Exact match parses
the answer out of either style, so eval measures correctness on its own. The wordy words come
after the digits: were they before, they would give the model extra positions to compute the sum
in, and preferring the terse style would cost accuracy for a reason that has nothing to do with RL.
"""

from __future__ import annotations

import random
import re

TERSE, WORDY = "terse", "wordy"
WORDY_SUFFIX = " is the sum"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+=") + sorted(set(WORDY_SUFFIX))
# Disjoint by prompt: all 10,000 (a, b) pairs, shuffled once with the data seed.
SPLIT_SIZES = {"train": 8500, "val": 500, "test": 1000}

_ANSWER = re.compile(r"^\s*(\d{3})(?!\d)")
# What the demo's RL run must show against its SFT start, on every seed (tests/e2e/test_e2e.py, tests/e2e/test_demo_claim.py,
# and the verdict `make demo` prints): the preferred style up by this much, held-out greedy accuracy down by no
# more than this.
MIN_STYLE_GAIN = 0.30
MAX_ACCURACY_DROP = 0.03


def prompt_text(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def answer_text(a: int, b: int) -> str:
    return f"{a + b:03d}"


def styled(answer: str, style: str) -> str:
    return answer if style == TERSE else answer + WORDY_SUFFIX


def extract_answer(response: str) -> str | None:
    """The three-digit answer a response starts with, in either style, or None."""
    match = _ANSWER.search(response.strip())
    return match.group(1) if match else None


def is_preferred_style(response: str) -> bool:
    """The terse style: the response is the answer's three digits and nothing else."""
    return re.fullmatch(r"\d{3}", response.strip()) is not None


def verdict(baseline: dict, policy: dict) -> tuple[bool, str]:
    """Whether an eval report's metrics show the demo's claim, and one line saying so."""
    gain = policy["sampled_preferred_style_rate"] - baseline["sampled_preferred_style_rate"]
    change = policy["accuracy"] - baseline["accuracy"]
    ok = gain >= MIN_STYLE_GAIN and change >= -MAX_ACCURACY_DROP
    head = (
        "PASS: the policy gained the preferred style with accuracy held"
        if ok
        else "FAIL: the demo's claim does not hold"
    )
    return ok, (
        f"{head} (preferred style {gain:+.3f}, needs +{MIN_STYLE_GAIN:.2f} or more; accuracy {change:+.3f}, needs -{MAX_ACCURACY_DROP:.2f} or better)"
    )


def make_datasets(seed: int = 0) -> dict[str, list[dict]]:
    """Deterministic rows for every stage; splits are disjoint by prompt."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pairs)
    n_train, n_val = SPLIT_SIZES["train"], SPLIT_SIZES["val"]
    train, val, test = pairs[:n_train], pairs[n_train : n_train + n_val], pairs[n_train + n_val :]

    def labelled(split):
        return [{"prompt": prompt_text(a, b), "label": answer_text(a, b)} for a, b in split]

    sft = []
    for a, b in train:
        style = TERSE if rng.random() < 0.5 else WORDY
        sft.append({"prompt": prompt_text(a, b), "response": styled(answer_text(a, b), style), "style": style})

    def preference_pairs(split):
        rows = []
        for a, b in split:
            # Half the pairs carry a wrong answer on both sides: the preference is about style only.
            answer = answer_text(a, b) if rng.random() < 0.5 else f"{rng.randrange(199):03d}"
            rows.append(
                {"prompt": prompt_text(a, b), "chosen": styled(answer, TERSE), "rejected": styled(answer, WORDY)}
            )
        return rows

    def style_pairs(split):
        # DPO's pairs: the right answer in both styles. Unlike the reward model's pairs, these carry no
        # wrong answers, because DPO with an NLL term (the pipeline's default) also imitates the chosen side.
        return [
            {
                "prompt": prompt_text(a, b),
                "chosen": styled(answer_text(a, b), TERSE),
                "rejected": styled(answer_text(a, b), WORDY),
            }
            for a, b in split
        ]

    def unpaired(split):
        # KTO's data: one completion per prompt with a thumbs up (terse) or down (wordy), answers right,
        # so what separates the two labels is the style alone.
        return [
            {
                "prompt": prompt_text(a, b),
                "completion": styled(answer_text(a, b), TERSE if i % 2 == 0 else WORDY),
                "label": i % 2 == 0,
            }
            for i, (a, b) in enumerate(split)
        ]

    return {
        "sft": sft,
        "preference": preference_pairs(train),
        "style_pairs": style_pairs(train),
        "unpaired": unpaired(train),
        "preference_eval": preference_pairs(val),
        "prompts": labelled(train),
        "eval": labelled(test),
    }


def build_tokenizer(characters: list[str] = CHARACTERS, max_length: int = 64):
    """A character-level tokenizer (the special tokens, then one id per character) wrapped as an HF fast tokenizer;
    the agentic tasks' (tasks.data.agentic) has more characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + characters)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_length,
    )


def build_base_model(tokenizer, seed: int = 0, hidden_size: int = 128, num_layers: int = 2, max_positions: int = 64):
    """A tiny Llama (about 0.4 M parameters at the defaults) with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
