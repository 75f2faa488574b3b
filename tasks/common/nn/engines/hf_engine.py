"""The transformers engine: the policy in this process decoding with a loop of its own (static KV cache,
CUDA graphs on a GPU). The CPU path, and the rollout engine at short responses on a GPU (tasks.common.nn.engines).

    engine = HFRolloutEngine(policy, tokenizer)
    rollout = engine.generate(prompt_ids, max_new_tokens=16, temperature=1.0)   # a Rollout (engines.rollout)
    engine = HFRolloutEngine(vlm, processor.tokenizer, processor=processor)     # a vision-language model:
    rollout = engine.generate(prompt_ids, 16, images=[[png], ...])              # hf_vision, its own generate

A response stops at the tokenizer's EOS or at the special token its chat template closes an assistant
turn with (data.stop_token_ids): a chat model ends its answer with <|im_end|> or <|eot_id|>, not EOS.

Positions in training forward passes are cumsum(attention_mask) - 1, which is what `generate()`
uses for left-padded prompts, so log-probabilities match between generation and training.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
from transformers import StaticCache

from tasks.common.nn import lora
from tasks.common.nn.data import pad, stop_token_ids

# The decode loop's attention functions; packed_gqa_sdpa is imported from here by tests too.
from tasks.common.nn.engines.decode_attention import (
    DECODE_ATTENTION,
    FLASH_DECODE_ATTENTION,
    flash_attn_with_kvcache,
    packed_gqa_sdpa,  # noqa: F401
)
from tasks.common.nn.engines.hf_vision import generate_with_images
from tasks.common.nn.engines.rollout import Rollout, concat_rollouts, distinct_rows, response_mask
from tasks.common.nn.fused_linears import FusedSiblings
from tasks.common.nn.vision_passes import VisionRows

# Static-cache prompt widths round up to this: each (batch, cache length) shape compiles its own decode.
STATIC_PROMPT_BUCKET = 64
# On CUDA the decode loop asks the device whether every row has stopped once per this many tokens: each look
# waits for every queued step, and between looks the host only queues work.
STOP_CHECK_EVERY = 16
# Eager decode steps of a shape before its capture: the kernels' lazy setup (cuBLAS workspaces, Triton's
# compiles) happens outside the graph.
CUDA_GRAPH_WARMUPS = 3

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    """One batch shape's decode buffers, reused rollout after rollout: a captured decode step reads and writes
    these very tensors, so they are refilled in place, never replaced."""

    cache: StaticCache
    mask: torch.Tensor  # [B, 1, 1, L] bool: the cache slots each row attends (its prompt, then each token once written)
    token: torch.Tensor  # [B]: the newest token, the next step's input
    position: torch.Tensor  # [B]: its position (cumsum(mask) - 1, as in training)
    cache_position: torch.Tensor  # [1]: its cache slot
    step: torch.Tensor  # [1]: its column in `tokens`
    stopped: torch.Tensor  # [B] bool
    tokens: (
        torch.Tensor
    )  # [B, L] (as wide as the cache, so any call of this length fits): the response so far, padding after a stop
    logprobs: torch.Tensor  # [B, L]: each token's log-probability under the distribution it was drawn from
    stops: torch.Tensor  # the stop token ids
    graphs: dict = field(
        default_factory=dict
    )  # (temperature, greedy) -> torch.cuda.CUDAGraph, or None where capture failed
    warmups: dict = field(default_factory=dict)  # (temperature, greedy) -> eager steps run so far


class HFRolloutEngine:
    """The policy in this process decoding with a loop of its own: the CPU path, and on CUDA a fast one at small batches.

    A prefill fills a static KV cache; each decode step then forwards the newest token of every row, samples on
    the device and writes the result into the shape's DecodeState. The loop looks at the device only every
    STOP_CHECK_EVERY steps on CUDA (whether every row has stopped), so the host queues steps ahead of the GPU.

    compile_decode: run the decode forward through torch.compile (fused kernels), inside the captured graph on CUDA.
    fuse_projections: while decoding, run each block's q/k/v projections as one GEMM and its gate/up as one
    (fused_linears: a copy of those weights, refreshed at each call).

    cuda_graphs: on CUDA, capture the decode step (forward, sampling, bookkeeping) as one CUDA graph per batch
    shape and sampling setting, after CUDA_GRAPH_WARMUPS eager steps, and replay it: the host launches a token
    step in one call. At RL's rollout sizes a decode step is well under a millisecond of GPU work, while vLLM's
    scheduler and transformers' `generate` spend milliseconds of Python on each (bench/RESULTS.md). Prompts
    are left-padded to a multiple of STATIC_PROMPT_BUCKET so varying widths share a few shapes. The graph reads
    the weights in place, so an update needs no sync; a model whose forward cannot be captured (ZeRO-3's
    gathering hooks: the caller leaves cuda_graphs off) decodes eagerly, said once in the log. Attention goes
    through SDPA while decoding (packed_gqa_sdpa), or, for a model that trains with flash-attn, through its
    kv-cache kernel (flash_kvcache_attention).
    """

    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device | None = None,
        cuda_graphs: bool = False,
        ignore_eos: bool = False,
        compile_decode: bool = False,
        fuse_projections: bool = False,
        processor=None,
    ):
        self.model, self.tokenizer, self.cuda_graphs = model, tokenizer, cuda_graphs
        # A vision-language model's prompts carry images: generated by hf_vision (the model's own generate).
        self.vision = VisionRows.of(processor) if processor is not None else None
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = [] if ignore_eos else stop_token_ids(tokenizer)
        self.device = device or next(model.parameters()).device
        self.states: dict[tuple[int, int], DecodeState] = {}  # (batch, cache length) -> its buffers (cuda_graphs)
        self.stop_check_every = STOP_CHECK_EVERY if self.device.type == "cuda" else 1
        self.capture = cuda_graphs and self.device.type == "cuda"
        self.graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        flash = (
            lora.unwrap(model).config._attn_implementation == "flash_attention_2"
            and flash_attn_with_kvcache is not None
        )
        self.decode_attention = FLASH_DECODE_ATTENTION if flash and self.device.type == "cuda" else DECODE_ATTENTION
        # The whole model's decode forward as one compiled graph (per batch shape): its elementwise kernels fuse.
        # Parameters are graph inputs, so updates are read.
        self.decode_forward = torch.compile(model, dynamic=False) if compile_decode else model
        self.fused = FusedSiblings(lora.unwrap(model)) if fuse_projections else None
        # transformers 5.24 names the forward's KV cache `cache` (`past_key_values` goes in 5.40); older ones, the
        # GPU image's 5.17 among them, only know `past_key_values`.
        self.cache_arg = (
            "cache" if "cache" in inspect.signature(lora.unwrap(model).forward).parameters else "past_key_values"
        )

    def captured(self) -> bool:
        """Whether decode steps ran from CUDA graphs: at least one captured, and none that failed to be."""
        graphs = [g for state in self.states.values() for g in state.graphs.values()]
        return bool(graphs) and all(g is not None for g in graphs)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        greedy: bool = False,
        batch_size: int = 256,
        images: list[list] | None = None,
    ) -> Rollout:
        if self.vision is not None:
            rows = images if images is not None else [[] for _ in prompt_ids]
            one = functools.partial(generate_with_images, self.model, self.vision, stop_ids=self.stop_ids)
            chunks = [
                one(
                    prompt_ids[i : i + batch_size],
                    rows[i : i + batch_size],
                    max_new_tokens,
                    temperature,
                    greedy,
                    pad_id=self.pad_id,
                    device=self.device,
                )
                for i in range(0, len(prompt_ids), batch_size)
            ]
            return concat_rollouts(chunks, self.pad_id)
        if images is not None:
            raise ValueError("generate: images given to a text model's engine; build it with the model's processor")
        chunks = [
            self._generate(prompt_ids[i : i + batch_size], max_new_tokens, temperature, greedy)
            for i in range(0, len(prompt_ids), batch_size)
        ]
        return concat_rollouts(chunks, self.pad_id)

    def _generate(self, prompt_ids, max_new_tokens, temperature, greedy) -> Rollout:
        ids, mask = pad(prompt_ids, self.pad_id, side="left")
        if self.cuda_graphs:  # extra left padding is harmless: positions come from the attention mask
            extra = -ids.size(1) % STATIC_PROMPT_BUCKET
            ids = torch.nn.functional.pad(ids, (extra, 0), value=self.pad_id)
            mask = torch.nn.functional.pad(mask, (extra, 0), value=0)
        ids, mask = ids.to(self.device), mask.to(self.device)
        rows, width = ids.shape
        s = self._state(rows, width + max_new_tokens)
        sampling = (1.0 if greedy else temperature, greedy)
        was_training = self.model.training
        self.model.eval()
        with self._decoding():
            logits = self._prefill(ids, mask, s, prompt_ids)
            token, logprob = sample_next(logits, *sampling)
            full_mask = torch.cat([mask, torch.ones(rows, max_new_tokens, dtype=mask.dtype, device=self.device)], dim=1)
            s.mask.copy_(full_mask.bool()[:, None, None, :]).narrow(-1, width, max_new_tokens).fill_(False)
            s.tokens.fill_(self.pad_id)
            s.logprobs.zero_()
            s.tokens[:, 0], s.logprobs[:, 0] = token, logprob
            s.stopped.copy_(torch.isin(token, s.stops))
            s.token.copy_(token)
            s.position.copy_(mask.sum(-1))  # the first response token's: positions are cumsum(mask) - 1
            s.cache_position.fill_(width)
            s.step.fill_(1)
            for t in range(1, max_new_tokens):
                if t % self.stop_check_every == 0 and bool(s.stopped.all()):
                    break
                self._step(s, sampling)
        self.model.train(was_training)
        tokens = s.tokens[:, :max_new_tokens]
        r_mask = response_mask(tokens, self.stop_ids)
        kept = int(r_mask.sum(-1).max())  # as wide as the longest response, however often the loop looked
        responses, r_mask = tokens[:, :kept].clone(), r_mask[:, :kept]
        logprobs = (s.logprobs[:, :kept] * r_mask).cpu()
        return Rollout(torch.cat([ids, responses], dim=1), torch.cat([mask, r_mask], dim=1), r_mask, width, logprobs)

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, s: DecodeState, prompt_ids: list[list[int]]
    ) -> torch.Tensor:
        """The prompts' forward, eager, once per distinct prompt: a group's samples (GRPO's n per prompt) share
        theirs, so at 8 per prompt the prefill is an eighth of the work. Each row's keys and values are then
        written into its slots of the static cache. Returns the last position's logits of every row, [B, V]."""
        firsts, inverse = distinct_rows(prompt_ids)
        firsts, inverse = torch.tensor(firsts, device=self.device), torch.tensor(inverse, device=self.device)
        ids, mask = ids[firsts], mask[firsts]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        for i, layer in enumerate(getattr(out, self.cache_arg).layers):
            s.cache.update(layer.keys[inverse], layer.values[inverse], i)
        return out.logits[inverse, -1]

    def _decode_step(self, s: DecodeState, temperature: float, greedy: bool) -> None:
        """One token for every row, in place in `s`: no host sync and no new buffer, so it can be captured."""
        s.mask.index_fill_(-1, s.cache_position, True)  # the newest token's slot, written by this forward
        logits = self.decode_forward(
            input_ids=s.token[:, None],
            position_ids=s.position[:, None],
            attention_mask=s.mask,
            **{self.cache_arg: s.cache},
            cache_position=s.cache_position,
            use_cache=True,
        ).logits[:, -1]
        token, logprob = sample_next(logits, temperature, greedy)
        token = token.masked_fill(s.stopped, self.pad_id)
        s.tokens.index_copy_(1, s.step, token[:, None])
        s.logprobs.index_copy_(1, s.step, logprob[:, None])
        s.stopped.logical_or_(torch.isin(token, s.stops))
        s.token.copy_(token)
        for counter in (s.position, s.cache_position, s.step):
            counter.add_(1)

    def _step(self, s: DecodeState, sampling: tuple[float, bool]) -> None:
        """The decode step: replayed from its graph; eager before capture (the warm-ups, on a side stream as CUDA
        graphs want), on the CPU, or where capture failed."""
        graph = s.graphs.get(sampling)
        if graph is not None:
            graph.replay()
            return
        if not self.capture or sampling in s.graphs:
            self._decode_step(s, *sampling)
            return
        if s.warmups.get(sampling, 0) < CUDA_GRAPH_WARMUPS:
            s.warmups[sampling] = s.warmups.get(sampling, 0) + 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode_step(s, *sampling)
            torch.cuda.current_stream().wait_stream(side)
            return
        graph = torch.cuda.CUDAGraph()
        try:
            # Capture records this step without running it; the replay below runs it.
            with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                self._decode_step(s, *sampling)
        except RuntimeError as e:
            logger.warning(
                "hf engine: the decode step could not be captured as a CUDA graph (%s); decoding eagerly",
                str(e).splitlines()[0],
            )
            s.graphs[sampling] = None
            self._decode_step(s, *sampling)
            return
        s.graphs[sampling] = graph
        graph.replay()

    def _state(self, rows: int, length: int) -> DecodeState:
        """The buffers for this shape: kept with cuda_graphs (prompt widths bucketed, so a few shapes), new each
        call without (any width: keeping them all would only grow)."""
        state = self.states.get((rows, length))
        if state is None:
            device, cfg = self.device, lora.unwrap(self.model).config
            one = functools.partial(torch.zeros, 1, dtype=torch.long, device=device)
            state = DecodeState(
                cache=StaticCache(config=cfg, max_cache_len=length),
                mask=torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device),
                token=torch.zeros(rows, dtype=torch.long, device=device),
                position=torch.zeros(rows, dtype=torch.long, device=device),
                cache_position=one(),
                step=one(),
                stopped=torch.zeros(rows, dtype=torch.bool, device=device),
                tokens=torch.zeros(rows, length, dtype=torch.long, device=device),
                logprobs=torch.zeros(rows, length, device=device),
                stops=torch.tensor(self.stop_ids, dtype=torch.long, device=device),
            )
            if self.cuda_graphs:
                self.states[(rows, length)] = state
        else:
            state.cache.reset()
        return state

    @contextlib.contextmanager
    def _decoding(self):
        """The model as the decode loop runs it. Attention through self.decode_attention (packed_gqa_sdpa, or
        flash_kvcache_attention, or transformers' "sdpa" to compare), attention a boolean [B, 1, 1, L] mask works
        with: transformers' FlashAttention-2 (the trainer's, for packed rows) unpads a padded batch on every call,
        a host sync no graph can hold. And blocks compiled for training (--torch_compile) run their plain code:
        with a cache, each would recompile for its own layer index, past torch's recompile limit (compile_decode
        compiles the whole forward instead)."""
        base = lora.unwrap(self.model)
        kept = base.config._attn_implementation
        if kept != self.decode_attention:
            base.set_attn_implementation(self.decode_attention)
        compiled = {
            m: m._compiled_call_impl for m in base.modules() if getattr(m, "_compiled_call_impl", None) is not None
        }
        for m in compiled:
            m._compiled_call_impl = None
        try:
            with self.fused.applied() if self.fused else contextlib.nullcontext():
                yield
        finally:
            for m, impl in compiled.items():
                m._compiled_call_impl = impl
            if kept != self.decode_attention:
                base.set_attn_implementation(kept)


def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, greedy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> each row's next token and its log-probability under the distribution it was drawn from:
    softmax(logits / temperature), or softmax(logits) for the greedy pick. Sampling is the exponential race
    (argmax of p / E, E ~ Exp(1), which draws from p) so it stays on the device, with no host sync.

    On CUDA the race runs compiled (fused_sample): eager, the upcast, tempering, log-softmax, log and difference
    each wrote a float32 copy of the logits, every token (39 MB each for 64 rows of a 152k vocabulary). The
    noise is drawn outside it, by the generator a captured decode step advances at every replay."""
    noise = None if greedy else torch.empty(logits.shape, device=logits.device).exponential_()
    return (_compiled_sample() if logits.is_cuda else fused_sample)(logits, noise, 1.0 if greedy else temperature)


def fused_sample(
    logits: torch.Tensor, noise: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_next's arithmetic with its noise given (None: the greedy pick), for torch.compile to fuse."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token = logprobs.argmax(-1) if noise is None else (logprobs - noise.log()).argmax(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


@functools.cache
def _compiled_sample():
    return torch.compile(fused_sample, dynamic=True)
