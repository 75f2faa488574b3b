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


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str = "constant", min_ratio: float = 0.1) -> float:
    """Learning-rate factor at optimizer step `step` (0-based): linear warmup over `warmup_steps`,
    then 1 ("constant") or a cosine from 1 down to `min_ratio` at `total_steps` ("cosine", as
    OpenRLHF's cosine_with_min_lr)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def init_distributed() -> None:
    """Join (or, alone, create) the torch.distributed world this process belongs to."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher (or a worker group) set up the rendezvous
        deepspeed.init_distributed(dist_backend=backend)
        return
    # A process started alone is a world of one, joined through a file: torch's TCP store would
    # listen on every interface whatever MASTER_ADDR says. DeepSpeed then adopts the group.
    rendezvous = tempfile.NamedTemporaryFile(prefix="rlhf-rendezvous-", delete=False).name
    os.unlink(rendezvous)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
    # Some DeepSpeed paths read these even for a world of one; nothing listens on them.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedStrategy:
    def __init__(
        self,
        zero_stage: int = 2,
        bf16: bool = False,
        seed: int = 0,
        max_norm: float = 1.0,
        micro_batch_size: int = 1,
        adam_offload: bool = False,
    ):
        self.zero_stage = zero_stage
        self.bf16 = bf16
        self.seed = seed
        self.max_norm = max_norm
        self.micro_batch_size = micro_batch_size
        self.adam_offload = adam_offload
        init_distributed()
        set_seed(seed)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")

    def ds_config(self) -> dict:
        zero: dict = {"stage": self.zero_stage}
        if self.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.max_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def prepare(self, model, learning_rate: float, total_steps: int, warmup_steps: int = 0, weight_decay: float = 0.0,
                lr_scheduler: str = "constant"):
        """Wrap a model for training: AdamW with linear warmup, then a constant or cosine learning rate."""
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        if self.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, lr=learning_rate, weight_decay=weight_decay)
        else:
            optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, total_steps, warmup_steps, lr_scheduler))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config())
        return engine

    def frozen(self, model):
        """A model that only runs forward passes (reference, reward): eval mode, on the device."""
        model.requires_grad_(False)
        model.eval()
        return model.to(self.device, dtype=torch.bfloat16 if self.bf16 else torch.float32)

    def save_hf(self, engine, tokenizer, out_dir: str | Path) -> Path:
        """Save an HF-format checkpoint from rank 0, gathering ZeRO-3 shards first."""
        import torch.distributed as dist

        out_dir = Path(out_dir)
        model = engine.module
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
