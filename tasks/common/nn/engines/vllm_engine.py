"""vLLM rollouts on the GPU: one engine inside each actor worker, colocated with training on its GPU
(--colocate_all_models: the layout of TRL's colocate mode and verl's hybrid engine), or engines on GPUs
of their own (tasks.rl.workers.RolloutEngineWorker), fed over NCCL by a WeightChannel.

    engine = VLLMRolloutEngine(model_dir, tokenizer, max_model_len=512, gpu_memory_utilization=0.3, seed=0)
    rollout = engine.generate(prompt_ids, max_new_tokens=256, temperature=1.0)   # rollout.logprobs: vLLM's own
    engine.submit(key, prompt_ids[0], max_new_tokens=64); engine.step()          # or request by request: [Completion]
    engine.load_weights(actor.module, zero3=False)                              # after every update
    engine.load_adapter(lora.adapter_weights(actor.module))                      # or, with --lora_rank, the adapter only

The engine runs in its worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the external_launcher
executor on the worker's torch.distributed world). Colocated, a weight sync is a device-to-device copy
of each parameter into vLLM's model; under ZeRO-3 each parameter is gathered first, one at a time. On
separate GPUs, the actor's rank 0 broadcasts each parameter over NCCL and the engines load it. With `enable_sleep` vLLM gives its weights and KV cache
back while the actor trains (sleep level 1) and takes them again before the sync.

With LoRA (`lora_rank`) the engine holds the frozen base and vLLM's LoRA layers; a sync hands it the adapter
alone (peft's files, written to a local folder), registered under a new id each time (versioned: the
previous one is removed), and every rollout after it generates through that adapter.

A vision-language model (`image_token_id` set, its processor's) takes prompts with images:

    engine = VLLMRolloutEngine(model_dir, tokenizer, ..., image_token_id=151655, banned_ids=[...], max_images=1)
    rollout = engine.generate(prompt_ids, 64, images=[[png], ...])    # rollout.images: the rows' images

How those requests are built, and why, is in vllm_vision.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from tasks.common.config import ConfigError
from tasks.common.nn.data import stop_token_ids
from tasks.common.nn.engines.rollout import Completion, Rollout, to_rollout
from tasks.common.nn.engines.vllm_vision import ban_bias, image_requests, unloadable


def _model_of(llm):
    """vLLM's nn.Module for the in-process engine (its location moved between vLLM releases)."""
    paths = (
        ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
        ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
        (
            "llm_engine",
            "engine_core",
            "engine_core",
            "model_executor",
            "driver_worker",
            "worker",
            "model_runner",
            "model",
        ),
    )
    for path in paths:
        obj = llm
        try:
            for name in path:
                obj = getattr(obj, name)
        except AttributeError:
            continue
        if isinstance(obj, torch.nn.Module):
            return obj
    raise RuntimeError("vLLM's model is not reachable in this process; run with VLLM_ENABLE_V1_MULTIPROCESSING=0")


def gathered(param, gather: bool = True):
    """ZeRO-3: the whole parameter for the duration (a collective: every rank of the group enters it)."""
    if not gather:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param])


class VLLMRolloutEngine:
    # Episodes (tasks.common.nn.environment.EpisodeRunner): each episode's turn is submitted as soon as it is ready, while
    # the others' turns decode and their environment steps run; vLLM's batches are not reproducible bit for bit anyway.
    overlap_turns = True

    def __init__(
        self,
        model_path: str,
        tokenizer,
        max_model_len: int,
        gpu_memory_utilization: float,
        seed: int,
        dtype: str = "bfloat16",
        enable_prefix_caching: bool = False,
        enable_sleep: bool = False,
        ignore_eos: bool = False,
        lora_rank: int = 0,
        logprobs: bool = True,
        max_num_seqs: int = 0,
        image_token_id: int | None = None,
        image_run: int = 0,
        banned_ids=(),
        max_images: int = 0,
    ):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":  # a worker has it from its start (WorkerGroup)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.tokenizer, self.ignore_eos, self.enable_sleep = tokenizer, ignore_eos, enable_sleep
        # A vision-language model: prompts with images, its placeholder ids never sampled.
        self.image_token_id, self.image_run, self.bias = image_token_id, image_run, ban_bias(banned_ids)
        vision = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": max_images}}
        # Each token's log-prob (RL's sync check and off-policy correction read them) costs the engine Python work per
        # token on the host; eval reads none and asks for none.
        self.logprobs = logprobs
        # vLLM sizes its LoRA buffers by a rank from a fixed list; an adapter of a smaller rank fits.
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": lora_max_rank(lora_rank)} if lora_rank else {}
        # Up to max_num_seqs sequences per decode step, every step width replayed from a CUDA graph. vLLM captures
        # graphs up to 512 wide by default and runs wider steps eagerly, a kernel launch at a time from the host;
        # capturing to the full width costs startup seconds (bench/RESULTS.md, vllm_probe).
        batch = (
            {"max_num_seqs": max_num_seqs, "compilation_config": {"max_cudagraph_capture_size": max_num_seqs}}
            if max_num_seqs
            else {}
        )
        if why := unloadable(model_path):
            raise ConfigError(f"rollout_engine: {why}; use --rollout_engine transformers for this model")
        self.llm = LLM(
            model=model_path,
            # Token ids in and out: no tokenizer, but for a VLM, whose multimodal processor needs one.
            **(vision if image_token_id is not None else {"skip_tokenizer_init": True}),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep,
            distributed_executor_backend="external_launcher",
            # vLLM's memory profiler sizes activations by this; its default (tens of thousands of tokens)
            # reserves memory the colocated trainer needs. Prefill beyond it is chunked.
            max_num_batched_tokens=max(8192, max_model_len),
            # The sampled tokens' log-probs after temperature (vLLM's default, raw_logprobs, is before it): the
            # actor scores rollouts at the sampling temperature too, so the sync check compares one distribution.
            logprobs_mode="processed_logprobs",
            **lora,
            **batch,
        )
        self.model = _model_of(self.llm)
        self.asleep = False
        self.in_flight, self.requests_made = {}, 0  # submitted requests' ids -> their keys
        # Before the first sync the adapter is peft's initial one, whose update B·A is zero: the base alone.
        self.adapter, self.adapter_loads = None, 0

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        greedy: bool = False,
        batch_size: int = 0,
        images: list[list] | None = None,
    ) -> Rollout:
        """Every prompt at once (vLLM schedules its own batches; batch_size is the HF engine's knob); a VLM's with
        each row's images."""
        if images is not None and self.image_token_id is None:
            raise ValueError("generate: images given to a text model's engine; build it with image_token_id")
        self.wake_up()
        params = self._sampling(max_new_tokens, temperature, greedy)
        requests = image_requests(prompt_ids, images, self.image_token_id, self.image_run)
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)
        responses = [self._response(o) for o in outputs]
        if self.enable_sleep:
            self.sleep()
        logprobs = [values for _, values in responses] if self.logprobs else None
        return to_rollout(prompt_ids, [ids for ids, _ in responses], logprobs, self.tokenizer.pad_token_id, images)

    # Request by request (tasks.common.nn.engines's Completion; the episode runner's turns): vLLM's engine loop
    # driven one scheduler step at a time, as its async engine drives it, so a request submitted between steps
    # joins the running batch at the next one. In process, beside the weights the trainer syncs.

    def submit(
        self, key: int, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> None:
        from vllm.inputs import tokens_input

        self.wake_up()
        self.requests_made += 1
        request_id = f"turn-{self.requests_made}"  # what the request's outputs carry back (vLLM adds a suffix inside)
        self.llm.llm_engine.add_request(
            request_id,
            tokens_input(prompt_ids),
            self._sampling(max_new_tokens, temperature, greedy),
            lora_request=self.adapter,
        )
        self.in_flight[request_id] = key

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """One scheduler step (a decode step of every running request, prefill of new ones): the requests it finished."""
        finished = []
        for output in self.llm.llm_engine.step():
            if output.finished:
                finished.append(Completion(self.in_flight.pop(output.request_id), *self._response(output)))
        if self.enable_sleep and not self.in_flight:
            self.sleep()
        return finished

    def abort(self, keys) -> None:
        """Drop the running requests of `keys` (submitted, not finished): vLLM frees their KV cache at once."""
        keys = set(keys)
        ids = [request_id for request_id, key in self.in_flight.items() if key in keys]
        self.llm.llm_engine.abort_request(ids)
        for request_id in ids:
            del self.in_flight[request_id]
        if self.enable_sleep and not self.in_flight:
            self.sleep()

    def _sampling(self, max_new_tokens: int, temperature: float, greedy: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=0.0 if greedy else temperature,
            max_tokens=max_new_tokens,
            logprobs=0 if self.logprobs else None,
            flat_logprobs=self.logprobs,  # a request's log-probs in flat lists, not a dict and an object per token
            stop_token_ids=[] if self.ignore_eos else stop_token_ids(self.tokenizer),
            ignore_eos=self.ignore_eos,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # a request's output once, when it finishes
            logit_bias=self.bias,  # a VLM's image placeholder ids, never sampled
        )

    def _response(self, output) -> tuple[list[int], list[float] | None]:
        """A finished request's token ids (at least one: an empty response reads as EOS) and their log-probs."""
        sample = output.outputs[0]
        if not sample.token_ids:
            return [self.tokenizer.eos_token_id], [0.0] if self.logprobs else None
        if not self.logprobs:
            return list(sample.token_ids), None
        flat = (
            sample.logprobs
        )  # vLLM's FlatLogprobs: each position's entries from its start index, the sampled token's first
        return list(sample.token_ids), [flat.logprobs[start] for start in flat.start_indices]

    @torch.no_grad()
    def load_weights(self, module: torch.nn.Module, zero3: bool = False, trainable_only: bool = False) -> None:
        """Copy the trained module's weights into vLLM's model (`zero3`: shards, so gather each first); with
        `trainable_only`, those that train (a frozen vision tower is already the engine's, loaded from disk)."""
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable_only]
        if not zero3:
            self.load_named((name, param.data) for name, param in params)
            return
        self.wake_up()
        for name, param in params:
            with gathered(param):
                self.model.load_weights(weights=[(name, param.data)])
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def load_named(self, weights) -> None:
        """Load (HF name, tensor) pairs, consumed one by one; vLLM's own loader maps the names onto its
        fused projections."""
        self.wake_up()
        self.model.load_weights(weights=weights)
        # Cached prompt KV was computed with the old weights.
        self.llm.reset_prefix_cache()

    def load_adapter(self, adapter) -> None:
        """Generate through `adapter` (tasks.common.nn.lora.AdapterWeights) from now on, in place of the last one."""
        from vllm.lora.request import LoRARequest

        self.wake_up()
        self.adapter_loads += 1
        path = adapter.save(tempfile.mkdtemp(prefix=f"rlhf-vllm-adapter-{self.adapter_loads}-"))
        if self.adapter is not None:  # first: vLLM holds max_loras (1) adapters
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
            shutil.rmtree(self.adapter.lora_path, ignore_errors=True)
        self.adapter = LoRARequest(f"policy-{self.adapter_loads}", self.adapter_loads, str(path))
        self.llm.llm_engine.add_lora(self.adapter)  # loaded now, not by the next rollout's first request

    def sleep(self) -> None:
        if self.enable_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm.config.lora)


def lora_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds an adapter of `rank`."""
    return next(r for r in LORA_RANKS if r >= rank)


class WeightChannel:
    """NCCL from the actor's rank 0 (rank 0 here) to vLLM engines on GPUs of their own (ranks 1…), on
    vLLM's stateless process group, which leaves each process's own torch.distributed world alone.
    Every member calls the constructor at once (NCCL's rendezvous), then `send` on rank 0 pairs with
    `receive` on the others, tensor by tensor in the same order."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self.comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def send(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def receive(self, shape: list[int], dtype: str) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        self.comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
        return buffer
