"""The one training strategy every stage uses: DeepSpeed (ZeRO 0/2/3) on GPU (NCCL) or CPU (gloo).

    strategy = DeepSpeedStrategy(zero_stage=2, bf16=False, seed=0)
    engine = strategy.prepare(model, learning_rate=1e-3, total_steps=500, warmup_steps=20)
    loss = …; engine.backward(loss); engine.step()
    strategy.save_hf(engine, tokenizer, "out/model")

On a machine without CUDA DeepSpeed runs its CPU accelerator over gloo; its communication op is
JIT-built once into TORCH_EXTENSIONS_DIR (about 30 s) and reused after. The optimizer is torch's
AdamW (no op build) unless adam_offload asks for DeepSpeedCPUAdam.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from tasks.common.nn import lora
from tasks.common.nn.models import compile_blocks


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int, schedule: str = "constant", min_ratio: float = 0.1
) -> float:
    """Learning-rate factor at optimizer step `step` (0-based): linear warmup over `warmup_steps`,
    then 1 ("constant") or a cosine from 1 down to `min_ratio` at `total_steps` ("cosine", as
    OpenRLHF's cosine_with_min_lr)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def init_distributed(rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """Join (or, alone, create) the torch.distributed world this process belongs to.

    A worker group passes its rank, size and rendezvous (tasks.common.nn.workers); a process on its
    own is a world of one, joined through a fresh file: torch's TCP store would listen on every
    interface whatever MASTER_ADDR says. DeepSpeed then adopts the group.
    """
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if init_method is None:
        rendezvous = tempfile.NamedTemporaryFile(prefix="rlhf-rendezvous-", delete=False).name
        os.unlink(rendezvous)
        init_method = f"file://{rendezvous}"
    # DeepSpeed reads these; Ray gives each worker its own GPU, so the local rank is 0. Nothing
    # listens on MASTER_PORT: the group below forms through init_method. They are written before the
    # group starts NCCL's threads, which read the environment: a write beside those reads crashed a
    # GPU worker in getenv (SIGSEGV).
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedStrategy:
    """DeepSpeed for one model in this process's data-parallel world (a worker group's, or a world of one).

    `micro_batch_size` sequences go through each forward/backward; `accumulation_steps` of them make
    one optimizer step per rank, so a step sees micro × accumulation × world sequences in all.
    """

    def __init__(
        self,
        zero_stage: int = 2,
        bf16: bool = False,
        seed: int = 0,
        max_norm: float = 1.0,
        micro_batch_size: int = 1,
        accumulation_steps: int = 1,
        adam_offload: bool = False,
        gradient_checkpointing: bool = False,
        torch_compile: bool = False,
    ):
        import torch.distributed as dist

        self.zero_stage = zero_stage
        self.bf16 = bf16
        self.seed = seed
        self.max_norm = max_norm
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        self.adam_offload = adam_offload
        self.gradient_checkpointing = gradient_checkpointing
        self.torch_compile = torch_compile
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        set_seed(seed)
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    @classmethod
    def for_training(cls, cfg, world_size: int, sequences_per_item: int = 1) -> "DeepSpeedStrategy":
        """The strategy of a training stage's worker, from the fields every TrainingConfig has: each of
        the `world_size` workers takes its share of train_batch_size in micro-batches of
        micro_train_batch_size items (`sequences_per_item` sequences each: 2 for a preference pair)."""
        from tasks.common.config import micro_batches

        micro, accumulation = micro_batches(cfg.train_batch_size, cfg.micro_train_batch_size, world_size)
        return cls(
            zero_stage=cfg.zero_stage,
            bf16=cfg.bf16,
            seed=cfg.seed,
            micro_batch_size=sequences_per_item * micro,
            accumulation_steps=accumulation,
            adam_offload=cfg.adam_offload,
            gradient_checkpointing=cfg.gradient_checkpointing,
            torch_compile=cfg.torch_compile,
        )

    def ds_config(self) -> dict:
        zero: dict = {"stage": self.zero_stage}
        if self.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.accumulation_steps,
            "gradient_clipping": self.max_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def prepare(
        self,
        model,
        learning_rate: float,
        total_steps: int,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        lr_scheduler: str = "constant",
    ):
        """Wrap a model for training: AdamW with linear warmup, then a constant or cosine learning rate."""
        import deepspeed

        if self.gradient_checkpointing:
            enable_checkpointing(model)  # recompute activations in backward: less memory for more compute
            if lora.is_peft_model(model):
                # The frozen embeddings' output needs requires_grad, or checkpointed blocks of a LoRA
                # model would have nothing to differentiate and its adapters would get no gradient.
                model.enable_input_require_grads()
        if self.torch_compile:
            compile_blocks(model)
        params = [p for p in model.parameters() if p.requires_grad]
        if self.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, lr=learning_rate, weight_decay=weight_decay)
        else:
            # On CUDA, torch's fused AdamW: one kernel over ZeRO's flat float32 partition, where the default
            # (foreach) makes several passes over it.
            optimizer = torch.optim.AdamW(
                params, lr=learning_rate, weight_decay=weight_decay, fused=self.device.type == "cuda"
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, total_steps, warmup_steps, lr_scheduler)
        )
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config()
        )
        fuse_zero_step_checks(engine.optimizer)
        return engine

    def frozen(self, model):
        """A model that only runs forward passes (reference, reward): eval mode, on the device."""
        model.requires_grad_(False)
        model.eval()
        return model.to(self.device, dtype=torch.bfloat16 if self.bf16 else torch.float32)

    def all_reduce(self, value: torch.Tensor | float, op: str = "sum") -> torch.Tensor:
        """Sum (or mean, or max) of a tensor over the data-parallel world; a copy, on this rank's device."""
        import torch.distributed as dist

        tensor = torch.as_tensor(value, dtype=torch.float32).clone().to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor / self.world_size if op == "mean" else tensor

    def save_hf(self, engine, tokenizer, out_dir: str | Path, merge_lora: bool = False, base_uri: str = "") -> Path:
        """Save an HF-format checkpoint from rank 0, gathering ZeRO-3 shards first (every rank must call).

        A LoRA (peft) model saves its adapter, whose config names `base_uri` as its base, or with
        `merge_lora` the full model with the adapter merged in (tasks.common.nn.lora.save_peft)."""
        import torch.distributed as dist

        out_dir = Path(out_dir)
        model = engine.module
        if lora.is_peft_model(model):
            state = lora.trainable_state(model, gather=self.zero_stage == 3)
            if dist.get_rank() == 0:
                lora.save_peft(model, state, out_dir, merge=merge_lora, base_uri=base_uri)
                if tokenizer is not None:
                    tokenizer.save_pretrained(out_dir)
            dist.barrier()
            return out_dir
        if self.zero_stage == 3:
            state_dict = engine._zero3_consolidated_16bit_state_dict()
        else:
            state_dict = model.state_dict()
        if dist.get_rank() == 0:
            model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
        dist.barrier()
        return out_dir

    def save_state(self, engine, out_dir: str | Path, client_state: dict) -> None:
        """DeepSpeed's own checkpoint (weights, optimizer, scheduler, every rank's ZeRO shard) plus
        `client_state` (rank 0's), and each rank's RNG states, under `out_dir` (every rank must call)."""
        engine.save_checkpoint(str(out_dir), tag="state", client_state=client_state)
        torch.save(rng_state(), Path(out_dir) / f"rng_rank{self.rank}.pt")

    def load_state(self, engine, in_dir: str | Path) -> dict:
        """Restore what `save_state` wrote, this rank's RNG included; returns the `client_state`."""
        _, client_state = engine.load_checkpoint(
            str(in_dir), tag="state", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if client_state is None:
            raise FileNotFoundError(f"{in_dir}: no DeepSpeed checkpoint")
        set_rng_state(torch.load(Path(in_dir) / f"rng_rank{self.rank}.pt", weights_only=False))
        return client_state


def fuse_zero_step_checks(optimizer) -> None:
    """Give ZeRO-1/2's step its two checks of the gradients in a few kernels, not a few per tensor.

    Before each step, ZeRO-1/2 checks every gradient tensor for inf/NaN, then takes the global norm
    (clipping needs it) as one float64 copy and one norm per tensor. For Qwen2-0.5B's 290 tensors that
    was 11,300 and 1,750 of the optimizer step's 17,300 host ops (counted on the CPU, bench/host_ops.py).
    On a GPU each is a small kernel or more, and the GPU waits while the host issues them.
    - In bf16 the per-tensor inf/NaN pass goes: one non-finite element makes the global norm non-finite,
      and a non-finite norm already marks the step as overflowed and skips it. DeepSpeed's bf16
      optimizers for ZeRO-0 and ZeRO-3 check only that. The steps skipped stay the same. (fp32 has no
      check; CPU-offloaded Adam's is a flag, kept.)
    - The norm comes from torch's multi-tensor norm, per tensor in float64 as DeepSpeed takes it, without
      the copies. Model or pipeline parallelism (neither used here) keeps DeepSpeed's own.
    """
    import deepspeed.comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    if (
        optimizer.dtype == torch.bfloat16
        and optimizer.check_grad_overflow
        and optimizer.compute_grad_norm
        and not optimizer.cpu_offload
    ):
        optimizer.check_overflow = lambda partition_gradients=True: None
    deepspeed_norm = optimizer.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if norm_type != 2 or optimizer.mpu is not None or any(getattr(p, "ds_pipe_replicated", False) for p in params):
            return deepspeed_norm(gradients, params, norm_type)
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if grads:
            total = torch.stack(torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())).pow(2).sum().float()
        else:
            total = torch.zeros((), dtype=torch.float32, device=optimizer.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        total = total.sqrt()
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)  # -1: what DeepSpeed's callers test for
        return total

    optimizer.get_grad_norm_direct = get_grad_norm_direct


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def enable_checkpointing(model) -> None:
    """Activation checkpointing, use_reentrant=False: the variant that works with frozen inputs and ZeRO-3.
    transformers 5.24 renamed gradient_checkpointing_enable (the old name goes in v6); older ones have only it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
