"""Datasets by URI: a JSONL/Parquet/CSV file, or a named split of a stage output's manifest.

    rows = load_rows("s3://bucket/…/prepare_data/manifest.json", split="sft", keys=["prompt", "response"])

A stage output lists its datasets in its manifest (`datasets: {split: relative path}`); the files
are fetched with their sizes and sha256 checked and read through 🤗 datasets.

Every stage encodes the same way, so SFT, the reward model, RL and DPO/KTO see one rendering:

    p = encode_prompt(tokenizer, [{"role": "system", …}, {"role": "user", …}], chat_template=True)
    r = encode_response(tokenizer, "the answer", chat_template=True)   # closed like the template closes a turn
    p, [r], cut = fit(p, [r], max_len)                                  # the prompt loses its start first
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.nn.models import is_stage_output

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve_dataset(uri: str, split: str) -> Path:
    """A local file holding the dataset named by `uri` (and `split`, for a stage output)."""
    if is_stage_output(uri):
        manifest = manifests.read_manifest(uri)
        splits = manifest.get("datasets") or {}
        if split not in splits:
            raise ConfigError(f"dataset: {manifest['uri']} has no split {split!r}; it has {sorted(splits) or 'none'}")
        relative = splits[split]
        local_dir, _ = manifests.fetch(
            manifest["uri"], manifests.local_cache_dir(manifest["uri"]), subdir=str(Path(relative).parent)
        )
        return local_dir / Path(relative).name
    if storage.is_s3(uri):
        raise ConfigError(
            f"dataset: {uri} is not a stage output (no manifest.json); register it with the prepare_data stage"
        )
    path = Path(uri.removeprefix("file://"))
    if not path.is_file():
        raise ConfigError(f"dataset: {uri} not found; pass a JSONL, Parquet or CSV file or a stage output's manifest")
    return path


def load_rows(uri: str, split: str, keys: list[str], max_samples: int = 0):
    """A 🤗 Dataset of the rows at `uri` (the first `max_samples` if not 0), checked to carry every key in `keys`."""
    import datasets

    path = resolve_dataset(uri, split)
    fmt = _FORMATS.get(path.suffix)
    if fmt is None:
        raise ConfigError(f"dataset: {path.name} has an unknown format; use .jsonl, .parquet or .csv")
    rows = datasets.load_dataset(fmt, data_files=str(path), split="train")
    for key in keys:
        if key not in rows.column_names:
            raise ConfigError(
                f"dataset: key {key!r} missing in {uri} ({split}); keys present: {', '.join(rows.column_names)}"
            )
    if max_samples and max_samples < len(rows):
        rows = rows.select(range(max_samples))
    return rows


# Stands in for an assistant's answer when rendering a conversation to find what the template writes after it.
_PROBE = "@@response-probe@@"
_TURN_ENDS: dict[tuple, str] = {}  # (template, bos, eos) -> text after the assistant's content


def _require_template(tokenizer) -> None:
    if not tokenizer.chat_template:
        raise ConfigError(
            f"apply_chat_template: the tokenizer of {tokenizer.name_or_path} has no chat template; drop --apply_chat_template or use a model that ships one"
        )


def as_messages(prompt) -> list[dict]:
    """A prompt as chat messages: a string is one user turn; a list of messages is checked and kept
    (keys a dataset filled with None for rows without them are dropped: templates test them with `is defined`)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = []
    for message in prompt:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"prompt: a chat message must be an object with string 'role' and 'content', got {str(message)[:80]!r}; fix the dataset's prompt column"
            )
        messages.append({k: v for k, v in message.items() if v is not None})
    if not messages:
        raise ConfigError("prompt: an empty list of chat messages; give each row at least one turn")
    return messages


def encode_prompt(tokenizer, prompt, chat_template: bool = False, tools: list | None = None) -> list[int]:
    """Token ids of a prompt: a string, or a list of chat messages (system, user and earlier assistant turns).

    With `chat_template`, the tokenizer's chat template renders it (a string as one user turn), ending
    with the assistant's opening (the generation prompt). Without, a string's tokens after the
    tokenizer's BOS, when it has one; a list of messages needs the template."""
    if chat_template:
        _require_template(tokenizer)
        extra = {"tools": tools} if tools else {}  # tool schemas, for templates that describe tools to the model
        return list(
            tokenizer.apply_chat_template(
                as_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False, **extra
            )
        )
    if not isinstance(prompt, str):
        raise ConfigError(
            "apply_chat_template: the prompt is a list of chat messages, which only the tokenizer's chat template can render; pass --apply_chat_template"
        )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def _is_special(tokenizer, token_id: int) -> bool:
    added = tokenizer.added_tokens_decoder.get(token_id)
    return token_id in tokenizer.all_special_ids or (added is not None and added.special)


def turn_end_text(tokenizer) -> str:
    """What the chat template writes after an assistant message's content ('<|end|>', '<|im_end|>\\n',
    '<|eot_id|>'): a one-exchange conversation rendered once per template, the text after the answer."""
    _require_template(tokenizer)
    key = (str(tokenizer.chat_template), tokenizer.bos_token, tokenizer.eos_token)
    if key not in _TURN_ENDS:
        probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception as e:  # jinja's TemplateError and whatever a template raises itself
            raise ConfigError(
                f"apply_chat_template: the chat template of {tokenizer.name_or_path} cannot render a user/assistant "
                f"exchange ({type(e).__name__}: {e}); use a model whose template can"
            ) from None
        _TURN_ENDS[key] = text[text.rindex(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
    return _TURN_ENDS[key]


def turn_end_ids(tokenizer) -> list[int]:
    """Ids that close an assistant turn: the template's text after the content (turn_end_text), up to
    and including its first special token (<|end|>, <|im_end|>, <|eot_id|>, </s>). What follows that
    token (ChatML's newline) only separates it from a next turn: generation stops at the token and never
    writes it, so a reward model trained without it scores RL's rollouts at the same last token. EOS
    when the template writes nothing after the content, as then nothing else marks the end."""
    ids = tokenizer.encode(turn_end_text(tokenizer), add_special_tokens=False)
    special = next((i for i, t in enumerate(ids) if _is_special(tokenizer, t)), None)
    if special is not None:
        return ids[: special + 1]
    return ids or [tokenizer.eos_token_id]


def decode_rows(tokenizer, ids, keep) -> list[str]:
    """`tokenizer.decode(..., skip_special_tokens=True)` of each row's kept tokens (`ids`, `keep`: [B, T]
    tensors), in one call to a fast tokenizer's Rust backend: filtering and checking 25k ids in Python, row
    by row, was a third of a 64 × 384-token rollout's reward time. A tokenizer that asks for transformers'
    text clean-up gets it through the per-row path."""
    keep = keep.bool()
    flat, ends = ids[keep].tolist(), list(itertools.accumulate(keep.sum(-1).tolist()))
    rows = [flat[a:b] for a, b in zip([0, *ends], ends)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
    return backend.decode_batch(rows, skip_special_tokens=True)


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end a generated response: EOS and, with a chat template, the special token that closes
    an assistant turn (<|im_end|>, <|eot_id|>, <end_of_turn>), which chat models emit instead of EOS."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    try:
        end = turn_end_ids(tokenizer)[-1] if tokenizer.chat_template else None
    except ConfigError:  # a template that cannot render an exchange: stages using it refuse it themselves
        end = None
    if end is not None and _is_special(tokenizer, end) and end not in ids:
        ids.append(end)
    return ids


def encode_response(tokenizer, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a response, ending so the model learns to stop: with `chat_template` the way the
    template closes an assistant turn (turn_end_ids), so encode_prompt(messages) + encode_response(answer)
    is the template's rendering of messages + [answer] (less a separator after the closing token, as in
    ChatML's '<|im_end|>\n'); without, EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + (turn_end_ids(tokenizer) if chat_template else [tokenizer.eos_token_id])


def fit(prompt: list[int], responses: list[list[int]], max_len: int) -> tuple[list[int], list[list[int]], int]:
    """Cut prompt + each response to `max_len` tokens: (prompt, responses, number of sequences cut).

    The prompt, shared by the responses (DPO's chosen and rejected see the same context), loses its
    first tokens until the longest response fits; it keeps at least its last token (the assistant's
    opening) so every response token has a position to be predicted from. A response longer than that
    loses its end, closing token included: counted like every cut, so none is silent."""
    longest = max((len(r) for r in responses), default=0)
    keep = min(len(prompt), max(max_len - longest, 1))
    cut_prompt = keep < len(prompt)
    room = max_len - keep
    cuts = sum(cut_prompt or len(r) > room for r in responses)
    return prompt[len(prompt) - keep :], [r[:room] for r in responses], cuts


def pack(sequences: list[list[int]]):
    """Several sequences as one row (sequence packing): (ids [1, T], position_ids [1, T] restarting at 0
    for each sequence, sequence index [T]), for tasks.common.nn.packed.packed_logprobs. No padding."""
    import torch

    ids = torch.tensor([[t for seq in sequences for t in seq]], dtype=torch.long)
    positions = torch.tensor([[i for seq in sequences for i in range(len(seq))]], dtype=torch.long)
    index = torch.tensor([k for k, seq in enumerate(sequences) for _ in seq], dtype=torch.long)
    return ids, positions, index


def pad(sequences: list[list[int]], pad_id: int, side: str = "right"):
    """Pad to one length: returns (ids, attention_mask) as LongTensors [B, T]."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, span] = torch.tensor(seq, dtype=torch.long)
        mask[row, span] = 1
    return ids, mask


class BatchSampler:
    """Endless shuffled batches of row indices, reshuffled each epoch with a seeded generator."""

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        import numpy as np

        if n_rows < batch_size:
            raise ConfigError(
                f"train_batch_size: {batch_size} is larger than the {n_rows} rows of the dataset; lower it"
            )
        self.n_rows, self.batch_size = n_rows, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch, self.position = 0, 0
        self.order = self.rng.permutation(n_rows)

    def next(self) -> list[int]:
        if self.position + self.batch_size > self.n_rows:
            self.epoch += 1
            self.position = 0
            self.order = self.rng.permutation(self.n_rows)
        batch = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch.tolist()

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.bit_generator.state,
            "epoch": self.epoch,
            "position": self.position,
            "order": self.order.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.position, self.order = state["epoch"], state["position"], np.array(state["order"])
