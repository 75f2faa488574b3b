"""A tiny chat model built offline: a character tokenizer over printable ASCII whose chat template
marks user and assistant turns, and a random-weight Llama. What a team's pretrained chat model looks
like to the pipeline, small enough for CPU tests.

    path = build_chat_model(tmp_path / "chat-model")
    tokenizer = AutoTokenizer.from_pretrained(path)   # tokenizer.chat_template is set
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))

# Each turn is `<|role|>content<|end|>`; the assistant's opening is `<|assistant|>`. The model's EOS
# is <|end|>: a response stops where its turn ends.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(max_length: int = 256):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_chat_model(out_dir: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> str:
    """Save tokenizer + tiny Llama (random weights) under `out_dir`; returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def chat_rows(n: int = 48, seed: int = 0) -> list[dict]:
    """User-style preference rows with a chat column: `messages` (system + user turns, then the
    assistant's answer), `chosen` and `rejected` answers, and a `label` for exact-match eval."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        answer = str(a + b)
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "Add."},
                    {"role": "user", "content": f"{a}+{b}"},
                    {"role": "assistant", "content": answer},
                ],
                "chosen": answer,
                "rejected": f"{answer}, I think",
                "label": answer,
                "id": i,
            }
        )
    return rows
