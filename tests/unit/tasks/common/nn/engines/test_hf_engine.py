import torch

from tasks.common.nn.data import encode_prompt
from tasks.common.nn.engines.hf_engine import HFRolloutEngine
from tasks.common.nn.engines.rollout import distinct_rows, response_mask
from tasks.common.nn.models import sequence_logprobs
from tasks.data import demo


def test_demo_datasets_are_deterministic_disjoint_and_half_terse():
    a, b = demo.make_datasets(0), demo.make_datasets(0)
    assert a == b
    train = {r["prompt"] for r in a["sft"]}
    assert not train & {r["prompt"] for r in a["eval"]}
    assert (len(a["sft"]), len(a["eval"]), len(a["preference_eval"])) == (8500, 1000, 500)
    terse = sum(r["style"] == demo.TERSE for r in a["sft"]) / len(a["sft"])
    assert 0.45 < terse < 0.55
    pair = a["preference"][0]
    assert demo.is_preferred_style(pair["chosen"]) and not demo.is_preferred_style(pair["rejected"])
    assert demo.extract_answer(pair["chosen"]) == demo.extract_answer(pair["rejected"])


def test_answer_parsing_and_style():
    assert demo.extract_answer("082") == demo.extract_answer("082 is the sum") == "082"
    assert demo.extract_answer("08 is the sum") is None and demo.extract_answer("0821") is None
    assert demo.is_preferred_style("082") and not demo.is_preferred_style("082 is the sum")


def test_tokenizer_round_trip():
    tok = demo.build_tokenizer()
    ids = encode_prompt(tok, "37+45=")
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(tok.encode("082 is the sum", add_special_tokens=False)) == "082 is the sum"


def test_response_mask_stops_after_first_eos():
    eos = 2
    assert response_mask(torch.tensor([[5, 6, 2, 0, 0], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]]), eos).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
    ]


def test_training_logprobs_match_generation_with_left_padded_prompts():
    """Positions in the training forward pass equal those generate() used for left-padded prompts."""
    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1).eval()
    prompts = [encode_prompt(tok, "3+4="), encode_prompt(tok, "37+45="), encode_prompt(tok, "1+99=")]
    engine = HFRolloutEngine(model, tok)
    rollout = engine.generate(prompts, max_new_tokens=6, greedy=True)
    assert rollout.sequences[0, 0] == tok.pad_token_id and rollout.attention_mask[0, 0] == 0
    with torch.no_grad():
        out = model.generate(
            input_ids=rollout.sequences[:, : rollout.prompt_width],
            attention_mask=rollout.attention_mask[:, : rollout.prompt_width],
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        gen_logprobs = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)
        gen_logprobs = gen_logprobs.gather(-1, out.sequences[:, rollout.prompt_width :].unsqueeze(-1)).squeeze(-1)
        train_logprobs = sequence_logprobs(model, rollout.sequences, rollout.attention_mask)[
            :, rollout.prompt_width - 1 :
        ]
    mask = rollout.response_mask.bool()
    assert torch.allclose(gen_logprobs[mask], train_logprobs[mask], atol=1e-4)


def test_cuda_graph_engine_matches_the_default_one_with_bucketed_prompt_widths():
    """The CUDA-graph path (decode steps captured on CUDA; eager here) left-pads prompts to a bucket
    multiple and still decodes the same greedy tokens as the dynamic cache."""
    from tasks.common.nn.engines.hf_engine import STATIC_PROMPT_BUCKET

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=6).eval()  # seed 6: the last two rows stop at EOS, the others run on
    prompts = [encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=", "12+3=4+5+6+7+8=")]
    dynamic = HFRolloutEngine(model, tok).generate(prompts, max_new_tokens=8, greedy=True)
    assert dynamic.response_lengths().tolist() == [8, 8, 2, 2]
    for batch_size in (
        4,
        3,
    ):  # one chunk; two chunks of different raw widths and response widths, joined by concat_rollouts
        static = HFRolloutEngine(model, tok, cuda_graphs=True).generate(
            prompts, max_new_tokens=8, greedy=True, batch_size=batch_size
        )
        assert static.prompt_width % STATIC_PROMPT_BUCKET == 0 and static.prompt_width > dynamic.prompt_width
        assert torch.equal(static.responses, dynamic.responses) and torch.equal(
            static.response_mask, dynamic.response_mask
        )
        extra = static.prompt_width - dynamic.prompt_width
        assert torch.equal(static.sequences[:, extra:], dynamic.sequences)
        assert (
            torch.equal(static.attention_mask[:, extra:], dynamic.attention_mask)
            and not static.attention_mask[:, :extra].any()
        )


def test_packed_grouped_query_attention_equals_attention_over_repeated_key_value_heads():
    """A one-token query of 6 heads over 2 key/value heads, with a padding mask: the packed call gives what SDPA
    gives over the key/value heads repeated to 6 (head h reads key/value head h // 3)."""
    from types import SimpleNamespace

    from tasks.common.nn.engines.hf_engine import packed_gqa_sdpa

    torch.manual_seed(0)
    query, key, value = torch.randn(4, 6, 1, 8), torch.randn(4, 2, 10, 8), torch.randn(4, 2, 10, 8)
    mask = torch.ones(4, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., :3] = False  # a left-padded row
    mask[2, ..., 7:] = False  # cache slots not written yet
    out, _ = packed_gqa_sdpa(SimpleNamespace(num_key_value_groups=3), query, key, value, mask, scaling=0.5)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.5
    )
    assert out.shape == (4, 1, 6, 8) and torch.allclose(out, repeated.transpose(1, 2), atol=1e-6)


def test_a_compiled_decode_forward_is_one_graph_that_reads_updated_weights_beside_blocks_compiled_for_training():
    """compile_decode with fuse_projections (the hf engine under --torch_compile): the whole decode forward
    compiles once, however many blocks, even where the actor's blocks are compiled for training (their per-layer
    cache index would recompile each) and with the fused projections' kept outputs; its greedy tokens and
    log-probabilities are the plain eager engine's, before and after an in-place update (which the fused weights'
    refresh must carry)."""
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.common.nn.models import compile_blocks

    tok = demo.build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    compile_blocks(model)  # as --torch_compile leaves the actor
    compiled = HFRolloutEngine(model, tok, cuda_graphs=True, compile_decode=True, fuse_projections=True)
    prompts = [encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=")]
    torch._dynamo.reset()
    counters.clear()
    before = None
    for _ in range(2):
        ours = compiled.generate(prompts, max_new_tokens=6, greedy=True)
        eager = HFRolloutEngine(model, tok).generate(prompts, max_new_tokens=6, greedy=True)
        extra = ours.prompt_width - eager.prompt_width
        assert torch.equal(ours.sequences[:, extra:], eager.sequences) and torch.allclose(
            ours.logprobs, eager.logprobs, atol=1e-5
        )
        assert before is None or not torch.allclose(ours.logprobs, before)  # the update reached the compiled graph
        before = ours.logprobs
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.2)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert all(lead.outputs == () for lead in compiled.fused.leads)


def test_fused_sibling_projections_give_the_layers_outputs_and_carry_weight_updates():
    """FusedSiblings: the model's logits with q/k/v and gate/up fused equal the plain layers' (biases on q, k and v,
    none on gate and up), after an in-place update too; no group keeps its outputs after a forward (a prefill's,
    kept through the decode's graph replays, filled an 80 GB GPU at 1.5B); the layers are the originals again
    outside the context, and a group with a layer of another class (as LoRA wraps them) is left as it is."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.common.nn.fused_linears import FusedFollower, FusedLead, FusedSiblings

    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()

    class Wrapped(torch.nn.Linear):
        pass

    mlp = model.model.layers[1].mlp
    mlp.up_proj = Wrapped(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    fused = FusedSiblings(model)
    assert len(fused.leads) == 3  # two attentions, one MLP
    ids = torch.randint(0, 50, (3, 7))
    for _ in range(2):
        with torch.no_grad():
            plain = model(ids).logits
            with fused.applied():
                attn = model.model.layers[0].self_attn
                assert isinstance(attn.q_proj, FusedLead) and isinstance(attn.v_proj, FusedFollower)
                assert type(mlp.gate_proj) is torch.nn.Linear
                assert torch.allclose(model(ids).logits, plain, atol=1e-5)
                assert all(lead.outputs == () for lead in fused.leads)
            for p in model.parameters():
                p.mul_(1.1)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_sample_next_draws_from_the_tempered_softmax_and_reports_its_log_probability():
    """The exponential race draws token i with probability softmax(logits / T)_i; greedy takes the argmax under T = 1."""
    from tasks.common.nn.engines.hf_engine import fused_sample, sample_next

    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).repeat(40000, 1)
    torch.manual_seed(0)
    token, logprob = sample_next(logits, temperature=0.5)
    tempered = torch.tensor([0.25, 0.09, 0.04]) / 0.38  # p^(1/T) normalized, T = 0.5
    assert torch.allclose(torch.bincount(token, minlength=3) / 40000, tempered, atol=0.01)
    assert torch.allclose(logprob, tempered.log()[token], atol=1e-5)
    token, logprob = sample_next(logits[:2], temperature=0.5, greedy=True)
    assert token.tolist() == [0, 0] and torch.allclose(logprob, torch.tensor([0.5, 0.5]).log())
    # A GPU runs the race compiled: here compiled for the CPU, the same draws from the same noise.
    noise = torch.empty(logits.shape).exponential_()
    compiled = torch.compile(fused_sample, dynamic=True)
    for given in (noise, None):
        (want_token, want_logprob), (got_token, got_logprob) = (
            fused_sample(logits, given, 0.5),
            compiled(logits, given, 0.5),
        )
        assert torch.equal(got_token, want_token) and torch.allclose(got_logprob, want_logprob, atol=1e-6)


def test_the_decode_loop_gives_the_same_rollout_however_often_it_checks_for_stops():
    """On CUDA the loop looks for stopped rows once every few steps; rows stopped meanwhile get padding and the
    rollout is cut to its longest response, as when it looks every step (the CPU's)."""
    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=6).eval()  # rows 3 and 4 stop after 2 tokens
    prompts = [encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=", "12+3=4+5+6+7+8=")]
    every_step = HFRolloutEngine(model, tok).generate(prompts[2:], max_new_tokens=8, greedy=True)
    sparse = HFRolloutEngine(model, tok)
    sparse.stop_check_every = 5
    rollout = sparse.generate(prompts[2:], max_new_tokens=8, greedy=True)
    assert rollout.response_lengths().tolist() == [2, 2] and rollout.responses.size(1) == 2
    assert torch.equal(rollout.sequences, every_step.sequences) and torch.equal(rollout.logprobs, every_step.logprobs)
    full = HFRolloutEngine(model, tok, ignore_eos=True).generate(prompts, max_new_tokens=8, greedy=True)
    assert full.response_lengths().tolist() == [8, 8, 8, 8]


def test_a_batch_shape_reuses_its_decode_buffers_from_a_clean_start():
    """Each (batch, length) keeps its cache and buffers, refilled in place (a captured step reads those very
    tensors): a sampled call in between leaves the next greedy call as it would be alone, and a call of the same
    length with a shorter prompt and more tokens reuses them too."""
    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=6).eval()
    prompts = [encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=", "12+3=" * 16)]  # the last is over 64 tokens
    engine = HFRolloutEngine(model, tok, cuda_graphs=True)
    first = engine.generate(prompts, max_new_tokens=8, greedy=True)
    assert first.prompt_width == 128
    engine.generate(prompts, max_new_tokens=8, temperature=1.3)
    assert torch.equal(engine.generate(prompts, max_new_tokens=8, greedy=True).sequences, first.sequences)
    state = engine.states[(4, 136)]
    short = engine.generate(prompts[:3] + prompts[:1], max_new_tokens=72, greedy=True)  # width 64: the same 136 slots
    assert list(engine.states) == [(4, 136)] and engine.states[(4, 136)] is state
    alone = HFRolloutEngine(model, tok, cuda_graphs=True).generate(
        prompts[:3] + prompts[:1], max_new_tokens=72, greedy=True
    )
    assert torch.equal(short.sequences, alone.sequences) and torch.equal(short.logprobs, alone.logprobs)


def test_distinct_rows_maps_every_row_to_the_first_of_its_kind():
    rows = [[5, 6], [7], [5, 6], [7], [8], [5, 6]]
    firsts, inverse = distinct_rows(rows)
    assert firsts == [0, 1, 4] and inverse == [0, 1, 0, 1, 2, 0]
    assert all(rows[i] == rows[firsts[k]] for i, k in enumerate(inverse))


def test_a_group_of_samples_shares_one_prefill_and_decodes_as_if_alone():
    """GRPO asks for n samples of each prompt: the prefill runs once per distinct prompt, its keys and values copied
    to each sample's rows; greedy rows then match the prompt decoded alone, and sampled ones draw apart."""
    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=6).eval()
    a, b = encode_prompt(tok, "37+45="), encode_prompt(tok, "12+3=4+5+6+7+8=")
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    for cuda_graphs in (False, True):
        widths.clear()
        engine = HFRolloutEngine(model, tok, cuda_graphs=cuda_graphs, ignore_eos=True)
        grouped = engine.generate([a, a, b, a, b], max_new_tokens=6, greedy=True)
        assert widths[0][0] == 2 and all(w == (5, 1) for w in widths[1:])  # the prefill: 2 rows; the decode: 5 rows
        for rows, prompt in (([0, 1, 3], a), ([2, 4], b)):
            alone = HFRolloutEngine(model, tok, cuda_graphs=cuda_graphs, ignore_eos=True).generate(
                [prompt], max_new_tokens=6, greedy=True
            )
            for row in rows:
                assert torch.equal(grouped.responses[row], alone.responses[0])
                assert torch.allclose(grouped.logprobs[row], alone.logprobs[0], atol=1e-5)
    hook.remove()
    torch.manual_seed(0)
    sampled = HFRolloutEngine(model, tok, ignore_eos=True).generate([a] * 4, max_new_tokens=6, temperature=1.5)
    assert len({tuple(r) for r in sampled.responses.tolist()}) > 1
