"""The RL stage's actor: the policy, trained by the PPO-family loss (and PPO-ptx), with its rollout engine beside
it (the transformers engine on the trained module, or a colocated vLLM engine synced in place).

Placed as a WorkerGroup by tasks.rl.placement; every method that takes part in a collective (training steps,
ZeRO-3 gathers) runs on every rank of its group. With --lora_rank it is its own reference (its base with the
adapters off, `reference_logprobs`).
"""

from __future__ import annotations

import torch

from tasks.common.nn import data, lora, vision
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import BatchedRequests, Rollout, first_groups
from tasks.common.nn.engines.vllm_engine import gathered
from tasks.common.nn.losses import (
    aggregate,
    importance_weights,
    kl_loss,
    logprob_mismatch,
    loss_normalizer,
    policy_loss,
)
from tasks.common.nn.models import is_vision_model, kernels, load_causal_lm, load_tokenizer, resolve_model
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.rl.config import RLConfig
from tasks.rl.engine_factories import episode_runner_for, run_episodes_on, vllm_engine_for
from tasks.rl.experience import Experience, response_logprobs
from tasks.rl.micro_batches import rollout_logprobs
from tasks.rl.workers import Trainer


class ActorWorker(Trainer):
    """The policy: generates rollouts with its engine, scores log-probabilities, takes PPO steps."""

    vision = None  # a vision-language policy's VisionRows (load_policy), beside its processor; None for text

    def setup(self, cfg: RLConfig, total_updates: int) -> None:
        self.cfg = cfg
        path = resolve_model(cfg.pretrain)
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        # Sampling differs per rank; weights start identical (they are loaded, not drawn).
        torch.manual_seed(cfg.seed + self.rank)
        # A vision-language policy (tasks/rl/images.py): its processor, the vision tower frozen if asked, and every
        # log-prob pass fed the rows' images (self.vision); None for a text policy.
        model, self.processor, self.vision = load_policy(path, cfg)
        self.tokenizer = self.processor.tokenizer if self.processor is not None else load_tokenizer(path)
        model = lora.apply_lora(model, cfg)
        if self.vision is not None and cfg.freeze_visual_encoder and lora.enabled(cfg):
            vision.freeze_visual_encoder(model)  # the adapters LoRA put on the tower's layers too
        self.engine = self.strategy.prepare(model, cfg.actor_learning_rate, total_updates, cfg.lr_warmup_steps)
        self.micro = self.strategy.micro_batch_size
        if cfg.ptx_coef:  # PPO-ptx: supervised rows, drawn a micro-batch at a time (the sampler is checkpointed)
            from tasks.common.nn.supervised import tokenize_rows, tokenize_vlm_rows

            rows = data.load_rows(cfg.pretrain_data, cfg.pretrain_split, [cfg.input_key, cfg.output_key], 0)
            keys, max_len = (cfg.input_key, cfg.output_key), cfg.prompt_max_len + cfg.generate_max_len
            if self.vision is not None:  # each row with its images, too long ones dropped (never cut), as in SFT
                self.ptx_ids, self.ptx_masks, self.ptx_images, _ = tokenize_vlm_rows(
                    rows, self.processor, *keys, cfg.image_key, cfg.apply_chat_template, max_len
                )
            else:
                self.ptx_ids, self.ptx_masks, _ = tokenize_rows(
                    rows, self.tokenizer, *keys, cfg.apply_chat_template, max_len
                )
            self.sampler = data.BatchSampler(len(self.ptx_ids), self.micro, cfg.seed + self.rank)
        if cfg.vllm_num_engines and not cfg.separate_engines():
            self.rollout_engine = vllm_engine_for(
                cfg, path, self.tokenizer, seed=cfg.seed + self.rank, processor=self.processor
            )
        elif self.vision is not None:  # the model's own generate with its pixel inputs (engines/hf_vision.py)
            self.rollout_engine = make_engine(
                "transformers",
                self.tokenizer,
                module=self.engine.module,
                device=self.strategy.device,
                ignore_eos=cfg.ignore_eos,
                processor=self.processor,
            )
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
        self.episodes = episode_runner_for(cfg, self.rollout_engine, self.tokenizer)

    def run_episodes(self, rows: list[dict]):
        return run_episodes_on(self.episodes, rows, self.cfg)

    def generate(self, prompts: list[list[int]]) -> Rollout:
        rollout = self.rollout_engine.generate(
            prompts,
            self.cfg.generate_max_len,
            self.cfg.temperature,
            batch_size=self.cfg.micro_rollout_batch_size or len(prompts),
        )
        return rollout.to("cpu")

    def generate_vision(self, prompts: list[tuple[list[int], list]]) -> Rollout:
        """A vision-language policy's share of a rollout: (prompt ids, its images) pairs; the rollout keeps the images."""
        rollout = self.rollout_engine.generate(
            [ids for ids, _ in prompts],
            self.cfg.generate_max_len,
            self.cfg.temperature,
            batch_size=self.cfg.micro_rollout_batch_size or len(prompts),
            images=[images for _, images in prompts],
        )
        return rollout.to("cpu")

    def generate_first_groups(self, prompts: list[list[int]]) -> Rollout:
        """--over_sampling_batch_size: this worker's share of the over-sampled prompts, of whose groups only its share
        of rollout_batch_size is generated to the end (first_groups); the other groups' rows come back empty."""
        cfg, engine = self.cfg, self.rollout_engine
        requests = engine if hasattr(engine, "submit") else BatchedRequests(engine)
        keep = cfg.rollout_batch_size // self.world_size
        rollout, _ = first_groups(
            requests,
            prompts,
            cfg.n_samples_per_prompt,
            keep,
            cfg.generate_max_len,
            cfg.temperature,
            self.tokenizer.pad_token_id,
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
        else:  # the trained weights only: a frozen vision tower is the same in the engine as on disk
            self.rollout_engine.load_weights(self.engine.module, zero3=zero3, trainable_only=True)

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
        return [
            (name, list(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
            for name, p in self.engine.module.named_parameters()
        ]

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
        return rollout_logprobs(self.engine.module, rollout, self.cfg, self.strategy.device, self.vision)

    def reference_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """With LoRA: (log-probabilities, reference log-probabilities), the reference being this policy's
        frozen base (adapters off), so no reference model is loaded anywhere."""
        reference = lora.FrozenBase(self.engine.module)
        ref = rollout_logprobs(reference, rollout, self.cfg, self.strategy.device, self.vision)
        return self.logprobs(rollout), ref

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
                    packed=cfg.packing_samples,
                    images=mb.images,
                    vision=self.vision,
                )
                old = logprobs.detach() if mb.logprobs is None else mb.logprobs
                is_weights = None
                if mb.behaviour_logprobs is not None:  # the engine's policy against the trainer's, every step
                    is_weights = importance_weights(
                        old, mb.behaviour_logprobs, mb.action_mask, cfg.correction(), cfg.is_cap
                    )
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
                    loss = loss + kl_coef * kl_loss(
                        logprobs, mb.ref_logprobs, mb.action_mask, cfg.kl_estimator, normalizer=tokens
                    )
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
            result["train_gpu_peak_gb"] = round(
                self.strategy.all_reduce(torch.cuda.max_memory_allocated() / 2**30, op="max").item(), 2
            )
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
            keep = importance_weights(
                minibatch.logprobs, minibatch.behaviour_logprobs, minibatch.action_mask, "reject", self.cfg.is_cap
            )
        return loss_normalizer(minibatch.action_mask, loss_agg, keep=keep), loss_normalizer(minibatch.action_mask)

    def _ptx_loss(self) -> torch.Tensor:
        """Mean NLL of the response tokens of the next micro-batch of PPO-ptx rows (the SFT loss)."""
        from tasks.common.nn.supervised import micro_batch_loss, vlm_micro_batch_loss

        batch = self.sampler.next()
        if self.vision is not None:
            return vlm_micro_batch_loss(
                self.engine,
                self.processor,
                [self.ptx_ids[i] for i in batch],
                [self.ptx_masks[i] for i in batch],
                [self.ptx_images[i] for i in batch],
                self.tokenizer.pad_token_id,
                False,
                self.strategy.device,
            )
        return micro_batch_loss(
            self.engine,
            [self.ptx_ids[i] for i in batch],
            [self.ptx_masks[i] for i in batch],
            self.tokenizer.pad_token_id,
            False,
            self.strategy.device,
        )


def load_policy(path: str, cfg: RLConfig):
    """(model, processor, VisionRows) of a vision-language policy (its vision tower frozen with
    --freeze_visual_encoder), or (causal LM, None, None) of a text one."""
    if not is_vision_model(path):
        return load_causal_lm(path, **kernels(cfg)), None, None
    from tasks.common.nn.vision_passes import VisionRows

    model, processor = vision.load_vision_lm(path, flash_attn=cfg.flash_attn), vision.load_processor(path)
    if cfg.freeze_visual_encoder:
        vision.freeze_visual_encoder(model)
    return model, processor, VisionRows.of(processor)
