"""A guessing game over several turns: the model guesses a number, the environment says higher or lower.

    prompt: `guess 1-16:`      row: {"prompt": ..., "target": 11} (or "label")
    model: `8`   env: `higher`
    model: `12`  env: `lower`
    model: `11`  reward 1.0 - 0.2 × (guesses - 1), at least 0.2: fewer turns, more reward

A guess that is not a number gets `invalid` (a tool error) and uses up a turn.
"""

from __future__ import annotations

import re

PENALTY = 0.2  # reward lost per extra guess


class Environment:
    def reset(self, row: dict):
        self.target = int(row.get("target", row.get("label")))
        self.guesses = 0
        return None

    def step(self, action: str):
        self.guesses += 1
        number = re.fullmatch(r"\s*(-?\d+)\s*", action)
        if number is None:
            return "invalid", 0.0, False, {"tool_error": True}
        guess = int(number.group(1))
        if guess == self.target:
            return None, max(PENALTY, 1.0 - PENALTY * (self.guesses - 1)), True, {"success": True}
        return ("higher" if guess < self.target else "lower"), 0.0, False, {}
