"""The RL stage's Ray worker roles: actor (policy + its rollout engine), critic, reference, reward.

Each role is a tasks.common.nn.workers.Worker, placed as a WorkerGroup by the controller
(tasks.rl.trainer). With --lora_rank the actor trains adapters and is its own reference (its base
with the adapters off, `reference_logprobs`): no ReferenceWorker is placed. Tensors travel between
the controller and the workers on the CPU; a worker moves them to its device. Every method that takes part in a collective (training steps, ZeRO-3
gathers) runs on every rank of its group.
"""

from __future__ import annotations

import threading

import torch

from tasks.common.nn import data, lora
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import Rollout
from tasks.common.nn.engines.vllm_engine import gathered
from tasks.common.nn.losses import aggregate, importance_weights, kl_loss, logprob_mismatch, loss_normalizer, policy_loss, value_loss
from tasks.common.nn.models import kernels, load_causal_lm, load_scalar_model, load_tokenizer, resolve_model
from tasks.common.nn.rewards import RewardBatch, RewardModels
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.common.nn.token_batches import token_batches
from tasks.common.nn.workers import TrainingWorker, Worker
from tasks.rl.config import RLConfig
from tasks.rl.experience import Experience, response_logprobs, response_values


def _dtype(cfg: RLConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


def _chunks(rollout: Rollout, size: int):
    """Row slices of a rollout for inference passes of at most `size` sequences (0: all at once)."""
    n = rollout.sequences.size(0)
    size = size or n
    for start in range(0, n, size):
        yield rollout.select(slice(start, start + size))


def _micro_batches(exp: Experience, size: int):
    n = exp.sequences.size(0)
    for start in range(0, n, size):
        yield exp.minibatch(torch.arange(start, min(n, start + size)))


def response_used(exp: Experience) -> torch.Tensor:
    """[B]: response positions each row uses, up to its last attended or trained token (0 for none). The
    responses are right-padded: past that, nothing is attended to and nothing enters a loss."""
    live = (exp.attention_mask[:, exp.prompt_width :] > 0) | (exp.action_mask > 0)
    positions = torch.arange(1, live.size(1) + 1, device=live.device)
    return (live * positions).amax(1)


def trimmed(exp: Experience, rows: list[int]) -> Experience:
    """The micro-batch of `rows`, cut to their own widths: the prompts' left padding that none of them uses, and
    the response positions past the longest of them. Every [B, R] tensor (log-probs, advantages, masks …) keeps its
    first columns, sequences and attention_mask the same response columns; the prompt width shrinks with the
    left cut. Causal attention and positions from the attention mask (cumsum - 1) leave every kept position's
    numbers as they were, to float rounding."""
    mb = exp.minibatch(torch.as_tensor(rows, dtype=torch.long, device=exp.sequences.device))
    width = mb.action_mask.size(1)
    keep = max(1, int(response_used(mb).max()))
    left = min(int((mb.attention_mask[:, : mb.prompt_width] > 0).int().argmax(1).min()), mb.prompt_width - 1)
    fields = {}
    for name, value in mb.__dict__.items():
        if name in ("sequences", "attention_mask"):
            value = value[:, left : mb.prompt_width + keep]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.size(1) != width:
                raise ValueError(f"Experience.{name}: {list(value.shape)} is not per response token ([B, {width}]); say how to trim it")
            value = value[:, :keep]
        fields[name] = value
    fields["prompt_width"] = mb.prompt_width - left
    return Experience(**fields)


class _Trainer(TrainingWorker):
    """What actor and critic share: the micro-batch size, and averaging statistics over the world."""

    cfg: RLConfig

    def _token_micro_batches(self, exp: Experience) -> list[Experience]:
        """--max_tokens_per_gpu: this rank's minibatch in micro-batches of rows of similar length whose padded size
        (rows × prompt width + longest response) stays within the budget, each trimmed to its rows. Every rank
        runs as many as the rank that needs the most: ZeRO-2 reduces the gradients on every backward."""
        lengths = (exp.prompt_width + response_used(exp)).tolist()
        budget = self.cfg.token_budget()
        count = int(self.strategy.all_reduce(len(token_batches(lengths, budget)), op="max").item())
        return [trimmed(exp, rows) for rows in token_batches(lengths, budget, min_count=count)]

    def _micro_steps(self, minibatch: Experience):
        """The micro-batches of one optimizer step over `minibatch`, as (micro-batch, how many). By count, DeepSpeed
        steps after its fixed gradient_accumulation_steps and divides each loss by them. By token budget their number
        varies: the accumulation boundary is set by hand, on the last one only (before its forward, as DeepSpeed
        asks), and each loss is already its share of the minibatch's (the losses' normalizer), so backward does not
        divide it (_backward_step: scale_wrt_gas=False)."""
        if not self.cfg.token_budget():
            mbs = list(_micro_batches(minibatch, self.micro))
            yield from ((mb, len(mbs)) for mb in mbs)
            return
        mbs = self._token_micro_batches(minibatch)
        for i, mb in enumerate(mbs):
            self.engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            yield mb, len(mbs)

    def _backward_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=not self.cfg.token_budget())
        self.engine.step()  # the optimizer steps only at the accumulation boundary

    def _mean_stats(self, stats: dict[str, list[float]]) -> dict[str, float]:
        means = torch.tensor([sum(v) / max(1, len(v)) for v in stats.values()])
        return dict(zip(stats, (self.strategy.all_reduce(means) / self.world_size).tolist()))


class ActorWorker(_Trainer):
    """The policy: generates rollouts with its engine, scores log-probabilities, takes PPO steps."""

    def setup(self, cfg: RLConfig, total_updates: int) -> None:
        self.cfg = cfg
        path = resolve_model(cfg.pretrain)
        self.tokenizer = load_tokenizer(path)
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        # Sampling differs per rank; weights start identical (they are loaded, not drawn).
        torch.manual_seed(cfg.seed + self.rank)
        model = lora.apply_lora(load_causal_lm(path, **kernels(cfg)), cfg)
        self.engine = self.strategy.prepare(model, cfg.actor_learning_rate, total_updates, cfg.lr_warmup_steps)
        self.micro = self.strategy.micro_batch_size
        if cfg.ptx_coef:  # PPO-ptx: supervised rows, drawn a micro-batch at a time (the sampler is checkpointed)
            from tasks.common.nn.supervised import tokenize_rows

            rows = data.load_rows(cfg.pretrain_data, cfg.pretrain_split, [cfg.input_key, cfg.output_key], 0)
            self.ptx_ids, self.ptx_masks, _ = tokenize_rows(
                rows, self.tokenizer, cfg.input_key, cfg.output_key, cfg.apply_chat_template, cfg.prompt_max_len + cfg.generate_max_len
            )
            self.sampler = data.BatchSampler(len(self.ptx_ids), self.micro, cfg.seed + self.rank)
        if cfg.vllm_num_engines and not cfg.separate_engines():
            self.rollout_engine = _vllm_engine(cfg, path, self.tokenizer, seed=cfg.seed + self.rank)
        else:
            # Decode steps replayed as CUDA graphs on CUDA, not under ZeRO-3: it gathers parameters through hooks
            # each forward, which a captured graph cannot hold. With --torch_compile their forward is compiled too,
            # with each block's sibling projections fused (a copy of their weights: memory traded for speed, as there).
            graphs = self.strategy.device.type == "cuda" and self.strategy.zero_stage != 3
            self.rollout_engine = make_engine(
                "transformers",
                self.tokenizer,
                module=self.engine.module,
                device=self.strategy.device,
                cuda_graphs=graphs,
                ignore_eos=cfg.ignore_eos,
                compile_decode=graphs and cfg.torch_compile,
                fuse_projections=graphs and cfg.torch_compile,
            )
        self.channel = None
        self.episodes = _episode_runner(cfg, self.rollout_engine, self.tokenizer)

    def run_episodes(self, rows: list[dict]):
        return _run_episodes(self.episodes, rows, self.cfg)

    def generate(self, prompts: list[list[int]]) -> Rollout:
        rollout = self.rollout_engine.generate(
            prompts, self.cfg.generate_max_len, self.cfg.temperature, batch_size=self.cfg.micro_rollout_batch_size or len(prompts)
        )
        return rollout.to("cpu")

    def sync_weights(self) -> None:
        """Load the updated weights into this worker's vLLM engine (the HF engine uses them in place); with
        LoRA, the adapter alone."""
        if not hasattr(self.rollout_engine, "load_weights"):
            return
        zero3 = self.strategy.zero_stage == 3
        if lora.enabled(self.cfg):
            self.rollout_engine.load_adapter(lora.adapter_weights(self.engine.module, gather=zero3, every_rank=True))
        else:
            self.rollout_engine.load_weights(self.engine.module, zero3=zero3)

    def adapter_weights(self) -> lora.AdapterWeights | None:
        """Rank 0: the adapter now, for vLLM engines elsewhere (every rank enters the ZeRO-3 gathers)."""
        return lora.adapter_weights(self.engine.module, gather=self.strategy.zero_stage == 3)

    # ---- feeding vLLM engines on other GPUs (RolloutEngineWorker): rank 0 broadcasts, every rank gathers

    def weight_channel_address(self) -> tuple[str, int]:
        import socket

        host = self.node_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return host, sock.getsockname()[1]

    def open_weight_channel(self, host: str, port: int, world_size: int) -> None:
        if self.rank == 0:
            from tasks.common.nn.engines.vllm_engine import WeightChannel

            self.channel = WeightChannel(host, port, 0, world_size)

    def weight_shapes(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of every parameter, whole (ZeRO-3 shards report their full shape)."""
        return [(name, list(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch.")) for name, p in self.engine.module.named_parameters()]

    @torch.no_grad()
    def engine_state(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the whole weights on the CPU, for a transformers rollout engine elsewhere (every rank enters
        the ZeRO-3 gathers); the other ranks None."""
        gather, state = self.strategy.zero_stage == 3, {}
        for name, param in self.engine.module.named_parameters():
            with gathered(param, gather):
                if self.rank == 0:
                    state[name] = param.data.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    @torch.no_grad()
    def send_weights(self) -> None:
        gather = self.strategy.zero_stage == 3
        for _, param in self.engine.module.named_parameters():
            with gathered(param, gather):
                if self.rank == 0:
                    self.channel.send(param.data)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        self.engine.eval()
        out = [
            response_logprobs(
                self.engine.module,
                r.sequences.to(self.strategy.device),
                r.attention_mask.to(self.strategy.device),
                r.prompt_width,
                temperature=self.cfg.temperature,
            ).cpu()
            for r in _chunks(rollout, self.cfg.micro_rollout_batch_size)
        ]
        return torch.cat(out)

    def reference_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """With LoRA: (log-probabilities, reference log-probabilities), the reference being this policy's
        frozen base (adapters off), so no reference model is loaded anywhere."""
        reference = lora.FrozenBase(self.engine.module)
        device = self.strategy.device
        ref = [
            response_logprobs(reference, r.sequences.to(device), r.attention_mask.to(device), r.prompt_width, temperature=self.cfg.temperature).cpu()
            for r in _chunks(rollout, self.cfg.micro_rollout_batch_size)
        ]
        return self.logprobs(rollout), torch.cat(ref)

    def train(self, minibatches: list[Experience], kl_coef: float) -> dict[str, float]:
        """One optimizer step per minibatch (this rank's share of it), in micro-batches."""
        cfg, device = self.cfg, self.strategy.device
        self.engine.train()
        if torch.cuda.is_available():  # the training phase's own peak, apart from a colocated engine's generation
            torch.cuda.reset_peak_memory_stats()
        stats: dict[str, list[float]] = {"policy_loss": [], "clip_fraction": [], "entropy": []}
        sync_gaps = []  # the largest |engine - actor| log-probability gap of each micro-batch
        loss_agg = "seq_mean_token_sum_norm" if cfg.advantage_estimator == "dr_grpo" else "token_mean"
        by_tokens = bool(cfg.token_budget())
        for minibatch in minibatches:
            minibatch = minibatch.to(device)
            # By token budget every loss term is its micro-batch's share of the minibatch's: divided by the whole
            # minibatch's tokens (or sequences), so the sum over micro-batches is the padded path's loss.
            norm, tokens = self._normalizers(minibatch, loss_agg) if by_tokens else (None, None)
            shares = {"policy_loss": 0.0, "entropy": 0.0}
            for mb, n_micro in self._micro_steps(minibatch):
                # The entropy is logged every step but trained on only with --entropy_coef: without it, it stays out of
                # autograd and the backward pass makes no vocabulary-wide passes for it.
                logprobs, entropy = response_logprobs(
                    self.engine,
                    mb.sequences,
                    mb.attention_mask,
                    mb.prompt_width,
                    return_entropy=True,
                    temperature=cfg.temperature,
                    entropy_grad=bool(cfg.entropy_coef),
                )
                old = logprobs.detach() if mb.logprobs is None else mb.logprobs
                is_weights = None
                if mb.behaviour_logprobs is not None:  # the engine's policy against the trainer's, every step
                    is_weights = importance_weights(old, mb.behaviour_logprobs, mb.action_mask, cfg.correction(), cfg.is_cap)
                    mismatch = logprob_mismatch(old, mb.behaviour_logprobs, mb.action_mask, is_weights)
                    sync_gaps.append(mismatch.pop("engine_logprob_max_diff"))
                    for key, value in mismatch.items():
                        stats.setdefault(key, []).append(value)
                p_loss, clip_fraction = policy_loss(
                    logprobs,
                    old,
                    mb.advantages,
                    mb.action_mask,
                    cfg.eps_clip,
                    clip_eps_low=cfg.eps_clip_low or None,
                    clip_eps_high=cfg.eps_clip_high or None,
                    dual_clip=cfg.dual_clip or None,
                    loss_agg=loss_agg,
                    max_len=cfg.generate_max_len,
                    is_weights=is_weights,
                    normalizer=norm,
                )
                loss = p_loss
                if cfg.use_kl_loss:
                    loss = loss + kl_coef * kl_loss(logprobs, mb.ref_logprobs, mb.action_mask, cfg.kl_estimator, normalizer=tokens)
                if cfg.ptx_coef:  # the mean over the micro-batches of each one's ptx batch, either way
                    ptx = self._ptx_loss()
                    loss = loss + cfg.ptx_coef * (ptx / n_micro if by_tokens else ptx)
                    stats.setdefault("ptx_loss", []).append(ptx.item())
                mean_entropy = aggregate(entropy.detach(), mb.action_mask, normalizer=tokens)
                if cfg.entropy_coef:
                    loss = loss - cfg.entropy_coef * aggregate(entropy, mb.action_mask, normalizer=tokens)
                self._backward_step(loss)
                stats["clip_fraction"].append(clip_fraction.item())
                if by_tokens:  # shares: the minibatch's values are their sums
                    shares["policy_loss"] += p_loss.item()
                    shares["entropy"] += mean_entropy.item()
                else:
                    stats["policy_loss"].append(p_loss.item())
                    stats["entropy"].append(mean_entropy.item())
            if by_tokens:
                for key, value in shares.items():
                    stats[key].append(value)
            # The minibatch's optimizer step has run: its gradients' global norm before clipping (resumes are checked
            # against it). DeepSpeed keeps none for ZeRO-0 in fp32, which then logs no grad_norm.
            grad_norm = self.engine.get_global_grad_norm()
            if grad_norm is not None:
                stats.setdefault("grad_norm", []).append(float(grad_norm))
        result = self._mean_stats(stats)
        if sync_gaps:
            result["engine_logprob_max_diff"] = self.strategy.all_reduce(max(sync_gaps), op="max").item()
        if torch.cuda.is_available():
            result["train_gpu_peak_gb"] = round(self.strategy.all_reduce(torch.cuda.max_memory_allocated() / 2**30, op="max").item(), 2)
        return result

    def _normalizers(self, minibatch: Experience, loss_agg: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the policy loss's, the token-mean terms') denominators over this rank's whole minibatch. The policy
        loss's counts, under --is_correction reject, only the tokens the correction keeps (as policy_loss does):
        their weights come from the rollout's old log-probabilities (RLConfig refuses reject by token budget
        without them)."""
        keep = None
        if self.cfg.correction() == "reject" and minibatch.behaviour_logprobs is not None:
            if minibatch.logprobs is None:
                raise ValueError("max_tokens_per_gpu: --is_correction reject needs the rollout's old log-probabilities")
            keep = importance_weights(minibatch.logprobs, minibatch.behaviour_logprobs, minibatch.action_mask, "reject", self.cfg.is_cap)
        return loss_normalizer(minibatch.action_mask, loss_agg, keep=keep), loss_normalizer(minibatch.action_mask)

    def _ptx_loss(self) -> torch.Tensor:
        """Mean NLL of the response tokens of the next micro-batch of PPO-ptx rows (the SFT loss)."""
        from tasks.common.nn.supervised import micro_batch_loss

        batch = self.sampler.next()
        return micro_batch_loss(
            self.engine, [self.ptx_ids[i] for i in batch], [self.ptx_masks[i] for i in batch], self.tokenizer.pad_token_id, False, self.strategy.device
        )

    def save_model(self, out_dir: str) -> None:
        self.strategy.save_hf(self.engine, self.tokenizer, out_dir, merge_lora=self.cfg.merge_lora, base_uri=self.cfg.pretrain)


class RolloutEngineWorker(Worker):
    """A rollout engine on a device of its own, generating while the actor trains (--async_train): a vLLM engine
    on a GPU (--vllm_num_engines without --colocate_all_models), fed the actor's new weights over NCCL, or a
    transformers engine (no vLLM engines, e.g. on CPUs), fed them through Ray's object store. Both start from
    the policy's weights on disk. New weights load between rollouts, in the engine's queue order; with
    --partial_rollouts they arrive beside a running rollout and load before its episodes' next turn. Every
    response token is tagged with the version (updates so far) of the weights that generated it."""

    def setup(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        path = resolve_model(cfg.pretrain)
        self.tokenizer = load_tokenizer(path)
        self.version = 0
        self.received = None  # (version, [(name, tensor)]): the newest weights not loaded yet
        self.lock = threading.Lock()
        # Distinct seeds from the actor ranks' and from each other's.
        seed = cfg.seed + 1000 * (self.rank + 1)
        if cfg.vllm_num_engines:
            self.engine = _vllm_engine(cfg, path, self.tokenizer, seed=seed)
        else:
            torch.manual_seed(seed)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            self.model = load_causal_lm(path, dtype=_dtype(cfg)).to(device).eval()
            # Eager steps: new weights load on another thread while it generates, and a kernel of that thread's on
            # the default stream would break a capture.
            self.engine = make_engine("transformers", self.tokenizer, module=self.model, device=device, ignore_eos=cfg.ignore_eos)
        self.episodes = _episode_runner(cfg, self.engine, self.tokenizer, policy_version=self.newest_weights)

    def generate(self, prompts: list[list[int]]) -> Rollout:
        version = self.newest_weights()
        rollout = self.engine.generate(prompts, self.cfg.generate_max_len, self.cfg.temperature).to("cpu")
        rollout.versions = torch.full_like(rollout.response_mask, version)
        return rollout

    def run_episodes(self, rows: list[dict]):
        return _run_episodes(self.episodes, rows, self.cfg)

    def newest_weights(self) -> int:
        """Load the weights received beside a running rollout, if any; the version generating from now on."""
        with self.lock:
            received, self.received = self.received, None
        if received is not None:
            self._load(*received)
        return self.version

    def _receive(self, version: int, weights) -> None:
        """The actor's weights after `version` updates, as (name, tensor) pairs. Between rollouts (the queue's
        order) they load at once, one tensor at a time; beside a running rollout (--partial_rollouts) they are
        held, a second copy meanwhile, until its next turn; a newer version replaces one not loaded yet."""
        if not self.cfg.partial_rollouts:
            self._load(version, weights)
            return
        if not isinstance(weights, lora.AdapterWeights):
            weights = list(weights)
        with self.lock:
            self.received = (version, weights)

    @torch.no_grad()
    def _load(self, version: int, weights) -> None:
        if isinstance(weights, lora.AdapterWeights):
            self.engine.load_adapter(weights)
        elif self.cfg.vllm_num_engines:
            self.engine.load_named(weights)
        else:
            # Parameters only (buffers such as rotary frequencies stay), so not strict; but every name must land.
            unexpected = self.model.load_state_dict(dict(weights), strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"rollout engine: the actor's weights {unexpected[:3]} have no place in the engine's model")
        self.version = version

    def open_weight_channel(self, host: str, port: int, world_size: int) -> None:
        from tasks.common.nn.engines.vllm_engine import WeightChannel

        self.channel = WeightChannel(host, port, 1 + self.rank, world_size)

    def receive_weights(self, shapes: list[tuple[str, list[int], str]], version: int) -> None:
        """The actor's weights after `version` updates, over NCCL from its rank 0 (ActorWorker.send_weights)."""
        self._receive(version, ((name, self.channel.receive(shape, dtype)) for name, shape, dtype in shapes))

    def load_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The actor's weights after `version` updates (ActorWorker.engine_state), for the transformers engine."""
        self._receive(version, state.items())

    def load_adapter(self, adapter: lora.AdapterWeights, version: int) -> None:
        """The actor's adapter after `version` updates (ActorWorker.adapter_weights), for a vLLM engine with LoRA."""
        self._receive(version, adapter)


def _episode_runner(cfg: RLConfig, engine, tokenizer, policy_version=None):
    """Multi-turn episodes on `engine`, one environment per episode (--env_path); None without one."""
    if not cfg.env_path:
        return None
    from tasks.common.nn.environment import episode_runner

    return episode_runner(cfg, engine, tokenizer, policy_version)


def _run_episodes(runner, rows: list[dict], cfg: RLConfig):
    """A worker's share of a rollout's episodes (tasks.common.nn.environment.Episodes) on the CPU, None for no rows."""
    if not rows:
        return None
    result = runner.run(rows, cfg.temperature)
    result.rollout, result.episodes = result.rollout.to("cpu"), []  # the environments stay here
    return result


def _vllm_engine(cfg: RLConfig, path: str, tokenizer, seed: int):
    return make_engine(
        "vllm",
        tokenizer,
        path=path,
        # An episode's next turn reads everything before it: up to max_episode_tokens after the prompt, then a turn.
        max_len=cfg.prompt_max_len + cfg.generate_max_len + (cfg.max_episode_tokens if cfg.env_path else 0),
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        seed=seed,
        dtype=str(_dtype(cfg)).removeprefix("torch."),
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_sleep=cfg.vllm_enable_sleep,
        ignore_eos=cfg.ignore_eos,
        lora_rank=cfg.lora_rank,
    )


class CriticWorker(_Trainer):
    """The value model: V(s) per response token, fitted to the returns."""

    def setup(self, cfg: RLConfig, critic_uri: str, total_updates: int) -> None:
        self.cfg = cfg
        path = resolve_model(critic_uri)
        self.tokenizer = load_tokenizer(path)
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        model = lora.apply_lora(load_scalar_model(path, **kernels(cfg)), cfg, scalar=True)
        self.engine = self.strategy.prepare(model, cfg.critic_learning_rate, total_updates, cfg.lr_warmup_steps)
        self.micro = self.strategy.micro_batch_size

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        self.engine.eval()
        out = []
        for r in _chunks(rollout, self.cfg.micro_rollout_batch_size):
            mask = r.attention_mask.to(self.strategy.device)
            v = response_values(self.engine.module, r.sequences.to(self.strategy.device), mask, r.prompt_width)
            out.append((v * r.response_mask.to(v.device)).cpu())
        return torch.cat(out)

    def train(self, minibatches: list[Experience]) -> dict[str, float]:
        self.engine.train()
        stats: dict[str, list[float]] = {"value_loss": [], "value_clip_fraction": []}
        by_tokens = bool(self.cfg.token_budget())
        for minibatch in minibatches:
            minibatch = minibatch.to(self.strategy.device)
            tokens = loss_normalizer(minibatch.action_mask) if by_tokens else None  # each loss its share of the minibatch's
            share = 0.0
            for mb, _ in self._micro_steps(minibatch):
                values = response_values(self.engine.module, mb.sequences, mb.attention_mask, mb.prompt_width)
                v_loss, v_clip = value_loss(values, mb.values, mb.returns, mb.action_mask, self.cfg.value_clip, normalizer=tokens)
                self._backward_step(v_loss)
                stats["value_clip_fraction"].append(v_clip.item())
                if by_tokens:
                    share += v_loss.item()
                else:
                    stats["value_loss"].append(v_loss.item())
            if by_tokens:
                stats["value_loss"].append(share)
        return self._mean_stats(stats)

    def save_model(self, out_dir: str) -> None:
        # Always full weights: critic/ is not a stage's model/ and has no manifest entry naming a base.
        self.strategy.save_hf(self.engine, self.tokenizer, out_dir, merge_lora=True)


class ReferenceWorker(Worker):
    """The frozen initial policy, for the KL penalty."""

    def setup(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.strategy = DeepSpeedStrategy(zero_stage=0, bf16=cfg.bf16, seed=cfg.seed)
        self.model = self.strategy.frozen(load_causal_lm(resolve_model(cfg.pretrain), **kernels(cfg)))

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        device = self.strategy.device
        return torch.cat(
            [
                response_logprobs(self.model, r.sequences.to(device), r.attention_mask.to(device), r.prompt_width, temperature=self.cfg.temperature).cpu()
                for r in _chunks(rollout, self.cfg.micro_rollout_batch_size)
            ]
        )


class RewardWorker(Worker):
    """One or several reward models (--reward_pretrain a,b), scores summed."""

    def setup(self, cfg: RLConfig) -> None:
        self.strategy = DeepSpeedStrategy(zero_stage=0, bf16=cfg.bf16, seed=cfg.seed)
        self.models = RewardModels(cfg.reward_pretrain, self.strategy.device, _dtype(cfg), cfg.normalize_reward, batch_size=cfg.micro_rollout_batch_size or 256)

    def score(self, batch: RewardBatch) -> torch.Tensor:
        return self.models.score(batch).cpu()
