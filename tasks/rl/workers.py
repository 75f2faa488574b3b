"""The RL stage's Ray worker roles but the actor (tasks/rl/actor.py): rollout engines of their own, critic,
reference, reward; and what the roles share (Trainer; micro-batches are tasks/rl/micro_batches.py's, the engines
they build tasks/rl/engine_factories.py's).

Each role is a tasks.common.nn.workers.Worker, placed as a WorkerGroup (tasks.rl.placement). With --lora_rank the actor trains adapters and is its own reference (its base
with the adapters off, `reference_logprobs`): no ReferenceWorker is placed. Tensors travel between
the controller and the workers on the CPU; a worker moves them to its device. Every method that takes part in a collective (training steps, ZeRO-3
gathers) runs on every rank of its group.
"""

from __future__ import annotations

import threading

import torch

from tasks.common.nn import lora
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import Rollout
from tasks.common.nn.losses import loss_normalizer, value_loss
from tasks.common.nn.models import (
    is_vision_model,
    kernels,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    resolve_model,
)
from tasks.common.nn.rewards import RewardBatch, RewardModels
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.common.nn.token_batches import token_batches
from tasks.common.nn.vision_reward import VisionRewardModel, is_vision_reward_model
from tasks.common.nn.workers import TrainingWorker, Worker
from tasks.rl.config import RLConfig
from tasks.rl.engine_factories import (
    episode_runner_for,
    load_vision_processor,
    model_dtype,
    run_episodes_on,
    vllm_engine_for,
)
from tasks.rl.experience import Experience, response_values
from tasks.rl.micro_batches import _micro_batches, chunks, response_used, rollout_logprobs, trimmed  # noqa: F401  (importers of workers)


class Trainer(TrainingWorker):
    """What actor and critic share: the micro-batch size, and averaging statistics over the world."""

    cfg: RLConfig

    def _token_micro_batches(self, exp: Experience) -> list[Experience]:
        """--max_tokens_per_gpu: this rank's minibatch in micro-batches of rows of similar length whose padded size
        (rows × prompt width + longest response) stays within the budget, each trimmed to its rows; packed
        (--packing_samples), whose real tokens do. Every rank runs as many as the rank that needs the most: ZeRO-2
        reduces the gradients on every backward."""
        packed, budget = self.cfg.packing_samples, self.cfg.token_budget()
        lengths = (exp.attention_mask.sum(1) if packed else exp.prompt_width + response_used(exp)).tolist()
        count = int(self.strategy.all_reduce(len(token_batches(lengths, budget, packed=packed)), op="max").item())
        return [trimmed(exp, rows) for rows in token_batches(lengths, budget, min_count=count, packed=packed)]

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
        # A vision-language policy's engine generates from each prompt's images (generate_vision).
        self.processor = load_vision_processor(path)
        self.tokenizer = self.processor.tokenizer if self.processor is not None else load_tokenizer(path)
        self.version = 0
        self.received = None  # (version, [(name, tensor)]): the newest weights not loaded yet
        self.lock = threading.Lock()
        # Distinct seeds from the actor ranks' and from each other's.
        seed = cfg.seed + 1000 * (self.rank + 1)
        if cfg.vllm_num_engines:
            self.engine = vllm_engine_for(cfg, path, self.tokenizer, seed=seed, processor=self.processor)
        else:
            torch.manual_seed(seed)
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
            if self.processor is not None:
                from tasks.common.nn.vision import load_vision_lm

                self.model = load_vision_lm(path, dtype=model_dtype(cfg)).to(device).eval()
            else:
                self.model = load_causal_lm(path, dtype=model_dtype(cfg)).to(device).eval()
            # Eager steps: new weights load on another thread while it generates, and a kernel of that thread's on
            # the default stream would break a capture.
            self.engine = make_engine(
                "transformers",
                self.tokenizer,
                module=self.model,
                device=device,
                ignore_eos=cfg.ignore_eos,
                processor=self.processor,
            )
        self.episodes = episode_runner_for(cfg, self.engine, self.tokenizer, policy_version=self.newest_weights)

    def generate(self, prompts: list[list[int]]) -> Rollout:
        version = self.newest_weights()
        rollout = self.engine.generate(prompts, self.cfg.generate_max_len, self.cfg.temperature).to("cpu")
        rollout.versions = torch.full_like(rollout.response_mask, version)
        return rollout

    def generate_vision(self, prompts: list[tuple[list[int], list]]) -> Rollout:
        """A vision-language policy's share: (prompt ids, its images) pairs; the rollout keeps the images."""
        version = self.newest_weights()
        rollout = self.engine.generate(
            [ids for ids, _ in prompts],
            self.cfg.generate_max_len,
            self.cfg.temperature,
            images=[images for _, images in prompts],
        ).to("cpu")
        rollout.versions = torch.full_like(rollout.response_mask, version)
        return rollout

    def run_episodes(self, rows: list[dict]):
        return run_episodes_on(self.episodes, rows, self.cfg)

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
                raise RuntimeError(
                    f"rollout engine: the actor's weights {unexpected[:3]} have no place in the engine's model"
                )
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


class CriticWorker(Trainer):
    """The value model: V(s) per response token, fitted to the returns. A vision-language policy's is the VLM with a
    value head (tasks/rl/vision_critic.py; a VLM reward model's VisionRewardModel when it starts from one), fed each
    row's images."""

    vision = None  # a vision-language critic's VisionRows

    def setup(self, cfg: RLConfig, critic_uri: str, total_updates: int) -> None:
        self.cfg = cfg
        path = resolve_model(critic_uri)
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        if is_vision_model(path):
            from tasks.common.nn import vision
            from tasks.common.nn.vision_passes import VisionRows
            from tasks.rl.vision_critic import VisionValueModel

            processor = vision.load_processor(path)
            self.tokenizer, self.vision = processor.tokenizer, VisionRows.of(processor)
            if is_vision_reward_model(path):  # a VLM reward model's backbone and head, as a text critic starts
                model = VisionRewardModel.from_pretrained(path, flash_attn=cfg.flash_attn)
            else:  # the policy's backbone and a head of zeros
                model = VisionValueModel(vision.load_vision_lm(path, flash_attn=cfg.flash_attn))
            if cfg.freeze_visual_encoder:
                vision.freeze_visual_encoder(model)
        else:
            self.tokenizer = load_tokenizer(path)
            model = lora.apply_lora(load_scalar_model(path, **kernels(cfg)), cfg, scalar=True)
        self.engine = self.strategy.prepare(model, cfg.critic_learning_rate, total_updates, cfg.lr_warmup_steps)
        self.micro = self.strategy.micro_batch_size

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        self.engine.eval()
        out = []
        for r in chunks(rollout, self.cfg.micro_rollout_batch_size):
            mask = r.attention_mask.to(self.strategy.device)
            v = self._values(r.sequences.to(self.strategy.device), mask, r.prompt_width, r.images)
            out.append((v * r.response_mask.to(v.device)).cpu())
        return torch.cat(out)

    def train(self, minibatches: list[Experience]) -> dict[str, float]:
        self.engine.train()
        stats: dict[str, list[float]] = {"value_loss": [], "value_clip_fraction": []}
        by_tokens = bool(self.cfg.token_budget())
        for minibatch in minibatches:
            minibatch = minibatch.to(self.strategy.device)
            tokens = (
                loss_normalizer(minibatch.action_mask) if by_tokens else None
            )  # each loss its share of the minibatch's
            share = 0.0
            for mb, _ in self._micro_steps(minibatch):
                values = self._values(mb.sequences, mb.attention_mask, mb.prompt_width, mb.images)
                v_loss, v_clip = value_loss(
                    values, mb.values, mb.returns, mb.action_mask, self.cfg.value_clip, normalizer=tokens
                )
                self._backward_step(v_loss)
                stats["value_clip_fraction"].append(v_clip.item())
                if by_tokens:
                    share += v_loss.item()
                else:
                    stats["value_loss"].append(v_loss.item())
            if by_tokens:
                stats["value_loss"].append(share)
        return self._mean_stats(stats)

    def _values(self, sequences, attention_mask, prompt_width: int, images) -> torch.Tensor:
        if self.vision is not None:
            from tasks.rl.vision_critic import response_values as vision_values

            return vision_values(self.engine.module, self.vision, sequences, attention_mask, images, prompt_width)
        return response_values(self.engine.module, sequences, attention_mask, prompt_width, self.cfg.packing_samples)

    def save_model(self, out_dir: str) -> None:
        # Always full weights: critic/ is not a stage's model/ and has no manifest entry naming a base.
        self.strategy.save_hf(self.engine, self.tokenizer, out_dir, merge_lora=True)


class ReferenceWorker(Worker):
    """The frozen initial policy, for the KL penalty."""

    vision = None  # a vision-language policy's VisionRows: its rows scored with their images

    def setup(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.strategy = DeepSpeedStrategy(zero_stage=0, bf16=cfg.bf16, seed=cfg.seed)
        path = resolve_model(cfg.pretrain)
        if is_vision_model(path):
            from tasks.common.nn import vision
            from tasks.common.nn.vision_passes import VisionRows

            model, self.vision = vision.load_vision_lm(path), VisionRows.of(vision.load_processor(path))
        else:
            model = load_causal_lm(path, **kernels(cfg))
        self.model = self.strategy.frozen(model)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        return rollout_logprobs(self.model, rollout, self.cfg, self.strategy.device, self.vision)


class RewardWorker(Worker):
    """One or several reward models (--reward_pretrain a,b), scores summed; a vision-language policy's score each row
    with its images (RewardBatch.images)."""

    def setup(self, cfg: RLConfig) -> None:
        self.strategy = DeepSpeedStrategy(zero_stage=0, bf16=cfg.bf16, seed=cfg.seed)
        self.models = RewardModels(
            cfg.reward_pretrain,
            self.strategy.device,
            model_dtype(cfg),
            cfg.normalize_reward,
            batch_size=cfg.micro_rollout_batch_size or 256,
        )

    def score(self, batch: RewardBatch) -> torch.Tensor:
        return self.models.score(batch).cpu()
