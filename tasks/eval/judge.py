"""An LLM judge: an OpenAI-compatible chat endpoint (vLLM's server, or any provider) compares two responses.

    judge = ChatJudge("http://127.0.0.1:8000/v1", model="judge")
    outcomes = judge.compare(prompts, candidate_responses, reference_responses)   # per prompt, in [0, 1]

Each pair is asked twice, the candidate shown first and then second, so a judge that favours a position
cancels out: a prompt's outcome is the mean of the two verdicts from the candidate's side (1 it is better,
0 worse, 0.5 a tie), so 0.5 also when the two orders disagree. The key, when the endpoint needs one,
comes from $RLHF_JUDGE_API_KEY, never from a flag.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tasks.common import allowlist, http_json
from tasks.common.config import ConfigError

API_KEY_ENV = "RLHF_JUDGE_API_KEY"
INSTRUCTIONS = "You compare two responses to the same prompt and say which one is better: more correct, more helpful, clearer. Answer with exactly one word: A, B or tie."
_VERDICT = re.compile(r"\b(A|B|tie)\b", re.I)


class JudgeError(ConfigError):
    """The judge endpoint could not be used; one line naming --judge_url."""


def question(prompt: str, first: str, second: str) -> str:
    return (
        f"Prompt:\n{prompt}\n\nResponse A:\n{first}\n\nResponse B:\n{second}\n\nWhich response is better: A, B or tie?"
    )


def verdict(text: str) -> float:
    """The first response's score from the judge's answer: 1.0 (A), 0.0 (B), 0.5 (tie or no clear answer)."""
    found = _VERDICT.search(text or "")
    return {"a": 1.0, "b": 0.0}.get(found.group(1).lower(), 0.5) if found else 0.5


class ChatJudge:
    def __init__(
        self, url: str, model: str, timeout: float = 60, retries: int = 3, backoff: float = 1.0, workers: int = 8
    ):
        allowlist.check_url(url, "judge_url", JudgeError)  # the key below goes to this host only
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.timeout, self.retries, self.backoff, self.workers = model, timeout, retries, backoff, workers
        key = os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def ask(self, prompt: str, first: str, second: str) -> float:
        """The first response's score (1, 0 or 0.5) in the judge's eyes."""
        reply = http_json.post_json(
            self.url,
            {
                "model": self.model,
                "temperature": 0,
                "max_tokens": 8,
                "messages": [
                    {"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": question(prompt, first, second)},
                ],
            },
            who="judge_url",
            error=JudgeError,
            headers=self.headers,
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
        )
        try:
            return verdict(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise JudgeError(
                f"judge_url: {self.url} answered without choices[0].message.content: {str(reply)[:120]!r}"
            ) from None

    def compare(self, prompts: Sequence[str], candidate: Sequence[str], reference: Sequence[str]) -> list[float]:
        """Per prompt, the candidate's outcome against the reference, both orders asked (see the module)."""

        def both_orders(i: int) -> float:
            return (
                self.ask(prompts[i], candidate[i], reference[i])
                + 1.0
                - self.ask(prompts[i], reference[i], candidate[i])
            ) / 2

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(both_orders, range(len(prompts))))
