"""Sibling linear layers run as one GEMM while the hf engine decodes: an attention's q, k and v projections,
an MLP's gate and up projections. Each group reads one input, so one matmul over their stacked weights gives
all of their outputs.

    fused = FusedSiblings(model)       # finds the groups; allocates the stacked weights once
    with fused.applied():              # refreshes them from the layers' weights, swaps the layers in
        model(...)                     # q_proj computes [q | k | v]; k_proj and v_proj return their slices

Why: at decode sizes (64 rows of one token) a projection's GEMM costs its launch and tile setup more than its
bytes. On the H200 the five projections of a 0.5B block took 0.55 of a compiled 1.63 ms token step, at 4-5 µs
a GEMM whose weights read in 0.2-2 µs (bench/RESULTS.md). Fusing drops three GEMMs a block.

The stacked weights are copies, refreshed in place on each entry, so CUDA graphs captured inside read the
same buffers and a training update reaches them at the next rollout. They cost memory: a copy of those
weights, about 1.7 GB at the 1.5B shape in bf16. So only the hf engine's --torch_compile path (which already
trades memory for speed) uses them. Layers of any class but nn.Linear are left as they are (peft's LoRA
layers among them), and so are groups whose layers differ in input size, dtype or device.

The lead layer keeps the group's outputs for the others, and the group's last layer lets them go. The model's
forward must call the group's layers in order (q, k, v; gate, up), as the Llama-family forwards in transformers
do. tests/unit checks the outputs against the unfused layers', and that none are kept after a forward. Kept,
a prefill's outputs outlived it: the decode steps after it are graph replays, which run no Python to replace
them. At the 1.5B shape that was 9 GB of [64, 128, 17920] gate/up outputs, 28 layers of them, held through
the training phase, and the second step ran out of memory on an 80 GB H100 (bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# Groups by attribute name, the lead first.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLead(nn.Module):
    """Stands in for the group's first layer. Its call computes the whole group's output, returns its own
    slice and keeps the rest for the followers."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        first = linears[0].weight
        self.sizes = [m.out_features for m in linears]
        self.linears = linears  # a plain list: the originals are not submodules of this one
        self.register_buffer(
            "weight",
            torch.empty(sum(self.sizes), first.shape[1], dtype=first.dtype, device=first.device),
            persistent=False,
        )
        has_bias = any(m.bias is not None for m in linears)
        self.register_buffer(
            "bias",
            torch.zeros(sum(self.sizes), dtype=first.dtype, device=first.device) if has_bias else None,
            persistent=False,
        )
        self.outputs: tuple[torch.Tensor, ...] = ()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the layers' current weights in, in place (never a new buffer: captured graphs read these)."""
        torch.cat([m.weight for m in self.linears], out=self.weight)
        if self.bias is not None:
            for part, m in zip(self.bias.split(self.sizes), self.linears):
                part.copy_(m.bias) if m.bias is not None else part.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.outputs = torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return self.outputs[0]


class FusedFollower(nn.Module):
    """Stands in for a later layer of the group: returns its slice of what the lead computed."""

    def __init__(self, lead: FusedLead, index: int):
        super().__init__()
        self.index = index
        object.__setattr__(self, "lead", lead)  # not a submodule: the lead sits in the model in its own place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lead.outputs[self.index]
        if self.index == len(self.lead.sizes) - 1:  # the group's last layer: nothing else reads them
            self.lead.outputs = ()
        return out


class FusedSiblings:
    """Every sibling group of a model, and the swap of its layers for the fused ones."""

    def __init__(self, model: nn.Module):
        self.leads: list[FusedLead] = []
        self.swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []  # (parent, name, original, stand-in)
        for parent in list(model.modules()):
            for names in SIBLINGS:
                linears = [getattr(parent, name, None) for name in names]
                if not all(type(m) is nn.Linear for m in linears):
                    continue
                if len({(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) != 1:
                    continue
                lead = FusedLead(linears)
                stand_ins = [lead] + [FusedFollower(lead, i) for i in range(1, len(names))]
                self.leads.append(lead)
                self.swaps += [(parent, name, m, s) for name, m, s in zip(names, linears, stand_ins)]

    @contextlib.contextmanager
    def applied(self):
        """The fused layers in the model, their weights the layers' current ones; the originals back after."""
        for lead in self.leads:
            lead.refresh()
        for parent, name, _, stand_in in self.swaps:
            setattr(parent, name, stand_in)
        try:
            yield
        finally:
            for parent, name, original, _ in self.swaps:
                setattr(parent, name, original)
            for lead in self.leads:  # a forward that stopped midway leaves a group's outputs behind
                lead.outputs = ()
