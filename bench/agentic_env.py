"""The bench's tool loop: every turn the environment answers with a fixed tool result, until --max_turns.

A random-weight model never ends an episode on its own, so this measures multi-turn throughput (each turn a
batched generate over the live episodes, then the observations appended) at a fixed shape: max_turns turns
of generate_max_len tokens. The reward (the last action's length, odd or even) only gives groups some spread.
"""


class Environment:
    def reset(self, row):
        return None

    def step(self, action):
        return "<result>42</result>", float(len(action) % 2), False, {"tool_call": True}
