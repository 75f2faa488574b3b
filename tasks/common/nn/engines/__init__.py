"""Rollout engines: turn prompts into sampled responses, behind one contract that RL and eval both use.

    from tasks.common.nn.engines.hf_engine import HFRolloutEngine      # transformers: the policy's own decode loop
    from tasks.common.nn.engines.vllm_engine import VLLMRolloutEngine  # vLLM (the gpu extra)
    rollout = engine.generate(prompt_ids, max_new_tokens=256, temperature=1.0)   # a Rollout (engines.rollout)

Every engine has `generate` (the RolloutEngine protocol below). vLLM's also takes requests one at a time
(`submit`, then `step` until a Completion comes back: a request joins the running batch at its next decode step),
and takes new weights (`load_weights`, `load_adapter`); an engine without `submit` gets the same calls from
engines.rollout.BatchedRequests, and one without `load_weights` reads the trainer's weights in place (the
transformers engine decodes the training module itself).

Which engine a stage runs is its config's choice (`--rollout_engine auto|vllm|transformers`): RLConfig and
EvalConfig.choose_rollout_engine, from the measurements in bench/RESULTS.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tasks.common.nn.engines.rollout import Rollout


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> Rollout:
        """Responses to the prompts (token ids, no padding), each ending at a stop token or after max_new_tokens."""
        ...


def make_engine(
    kind: str, tokenizer, *, module=None, path: str = "", device=None, max_len: int = 0, **options
) -> RolloutEngine:
    """The rollout engine of `kind`, the one way a stage builds one. "transformers" decodes `module` (the live policy,
    on `device`) in this process; "vllm" (the gpu extra) loads the model at `path` for prompt + response lengths up
    to `max_len`, clamped to the model's positions, which vLLM refuses to exceed (0: the positions). `options` go to
    the engine's constructor."""
    if kind == "transformers":
        from tasks.common.nn.engines.hf_engine import HFRolloutEngine

        return HFRolloutEngine(module, tokenizer, device, **options)
    if kind == "vllm":
        from transformers import AutoConfig

        from tasks.common.nn.engines.vllm_engine import VLLMRolloutEngine

        positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        limit = min(max_len, positions) if max_len and positions else max_len or positions or 4096
        return VLLMRolloutEngine(path, tokenizer, max_model_len=limit, **options)
    raise ValueError(f"rollout engine: unknown {kind!r}; use vllm or transformers")
