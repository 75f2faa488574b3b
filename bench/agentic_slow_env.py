"""The bench's tool loop with a slow tool: agentic_env.py's episodes, but each step waits 20-200 ms (spread by
the action's length), as a tool behind an HTTP service would. On vLLM an episode's next turn is submitted when
its own step returns and joins the running batch, so the spread costs the step little beyond the slowest
episode's waits; `time_env_s` is what the engine still sat idle.
"""

import asyncio


class Environment:
    def reset(self, row):
        return None

    async def step(self, action):
        await asyncio.sleep(0.02 + 0.02 * (len(action) % 10))
        return "<result>42</result>", float(len(action) % 2), False, {"tool_call": True}
