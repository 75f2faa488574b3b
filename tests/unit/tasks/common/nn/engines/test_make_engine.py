"""tasks/common/nn/engines/__init__.py: make_engine, the one factory RL and eval build their rollout engines with."""

import pytest


def test_make_engine_builds_the_transformers_engine_on_the_live_module_and_refuses_an_unknown_kind():
    """The one factory RL and eval build their engines with (tasks.common.nn.engines.make_engine)."""
    from tasks.common.nn.data import encode_prompt
    from tasks.common.nn.engines import RolloutEngine, make_engine
    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1).eval()
    engine = make_engine("transformers", tok, module=model, ignore_eos=True)
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine) and engine.model is model
    rollout = engine.generate([encode_prompt(tok, "3+4=")], max_new_tokens=4, greedy=True)
    assert rollout.responses.shape == (1, 4) and rollout.logprobs.shape == (1, 4)  # EOS ignored: every token kept
    with pytest.raises(ValueError, match="rollout engine: unknown 'tgi'"):
        make_engine("tgi", tok, module=model)
