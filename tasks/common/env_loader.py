"""An environment file, loaded and checked: the contract a tool or game implements for multi-turn episodes.

    make_env = load_environment("calculator")     # a built-in's name, a .py path or an s3:// URI (pinned: #sha256=…)
    check_environment(make_env, rows[0], timeout=10.0)   # build one and reset it, before any training
    env = make_env()                              # a fresh Environment per episode

The contract, one Python file (`--env_path`, OpenRLHF's `--agent_func_path`):

    TOOLS = [...]                    # optional: tool schemas for the chat template's `tools` argument
    class Environment:               # a fresh instance per episode
        def reset(self, row: dict) -> str | list[dict] | None     # the first observation; None: the row's prompt
        def step(self, action: str) -> tuple[str | None, float, bool, dict]   # observation, reward, done, info

Either method may be `async def` (a tool may await an HTTP service). `info` may say {"tool_call": True},
{"tool_error": True} and, on the last step, {"success": bool}; they are counted (tasks.common.nn.episodes).
What changes here is that contract and how a file is found; running episodes is tasks.common.nn.environment.
No torch here.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass

from tasks.common import user_code
from tasks.common.config import ConfigError

BUILT_IN = {"calculator": "tasks.common.envs.calculator", "guess": "tasks.common.envs.guess"}


class EnvError(ConfigError):
    """An environment that cannot be used; one line naming it and the fix."""


@dataclass
class EnvironmentFile:
    """An environment as loaded: calling it builds a fresh episode's environment."""

    spec: str  # as messages name it: the file's URI, without its pin (#sha256=…)
    cls: type
    tools: list | None = None

    def __call__(self):
        return self.cls()


def load_environment(spec: str) -> EnvironmentFile:
    """The Environment class of a built-in (calculator, guess) or of a file (a local path or an s3:// URI)."""
    import importlib

    if spec in BUILT_IN:
        module = importlib.import_module(BUILT_IN[spec])
    else:
        module = user_code.load_module(spec, "env_path", EnvError, purpose="env")
    env = getattr(module, "Environment", None)
    if not isinstance(env, type) or not all(callable(getattr(env, m, None)) for m in ("reset", "step")):
        raise EnvError(
            f"env_path: {user_code.split_pin(spec)[0]} defines no class Environment with reset(row) and step(action); define both (see docs/agentic-rl.md)"
        )
    return EnvironmentFile(user_code.split_pin(spec)[0], env, getattr(module, "TOOLS", None))


def check_environment(env: EnvironmentFile, row: dict, timeout: float) -> None:
    """Build one episode's environment and reset it on a row, before any training: a file whose class
    cannot be built or whose reset fails or hangs past `timeout` stops the stage here, in one line."""
    outcome: dict = {}

    def reset():  # on a daemon thread: a reset that never returns is left there, not waited for
        try:
            value = env().reset(row)
            outcome["first"] = asyncio.run(asyncio.wait_for(value, timeout)) if inspect.isawaitable(value) else value
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=reset, name="env-check", daemon=True)
    thread.start()
    thread.join(timeout)
    try:
        if thread.is_alive():
            raise TimeoutError(f"no answer in {timeout:g} s (--env_step_timeout)")
        if "error" in outcome:
            raise outcome["error"]
        first = outcome["first"]
    except Exception as e:
        raise EnvError(
            f"env_path: {env.spec}: reset failed on the first prompt row ({type(e).__name__}: {e}); fix Environment.reset for rows like it"
        ) from None
    if not (first is None or isinstance(first, (str, list))):
        raise EnvError(
            f"env_path: {env.spec}: reset returned {type(first).__name__}; return the first observation "
            "(a string or chat messages) or None for the row's prompt"
        )
