"""A compiled model (`reduce_overhead`): a small transformer language model trained under
`torch.compile(mode="reduce-overhead")`, whose forward and backward graphs run as CUDA graphs
(CUDA graph trees), their memory in the graphs' private pools. Three shapes (batch 8 of 128,
256 or 512 tokens) drawn at random: each is compiled and captured once, then replayed; the
optimizer's step runs eagerly outside the graphs.

On the CPU (tiny) there are no CUDA graphs, and inductor's C++ compilation takes minutes on a
small machine: the tiny model compiles with the `aot_eager` back end instead (the same
capture of forward and backward into graphs, run eagerly), so that the workload's plumbing
is checked where its library's GPU half cannot run.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from allocator_ext.workloads.base import Batch, Dims, Workload, autocast, train_step
from allocator_ext.workloads.tokens import TINY, LanguageModel

SHAPES = ((8, 128), (8, 256), (8, 512))
TINY_SHAPES = ((2, 8), (2, 16), (2, 24))
COMPILED = Dims(512, 4, 8, 8192, (8, 8), (128, 512))


class NextTokenLoss(nn.Module):
    """The language model and its loss, one module, so that the backward graph is compiled and
    captured too."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.lm = LanguageModel(dims)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with autocast(tokens.device):
            logits = self.lm(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   tokens[:, 1:].reshape(-1))


class ReduceOverhead(Workload):
    name = "reduce_overhead"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        self.dims = TINY if tiny else COMPILED
        self.shapes = TINY_SHAPES if tiny else SHAPES
        with torch.device(device):
            model = NextTokenLoss(self.dims)
        super().__init__(model, device, random.Random(seed))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        # One graph per shape (dynamic=False), as many as there are shapes.
        self.compiled = (torch.compile(self.model, backend="aot_eager", dynamic=False) if tiny
                         else torch.compile(self.model, mode="reduce-overhead", dynamic=False))

    def draw(self, largest: bool = False) -> Batch:
        if largest or self.fixed_shapes:
            batch, seq = self.shapes[-1]
        else:
            batch, seq = self.rng.choice(self.shapes)
        return (torch.randint(0, self.dims.vocab, (batch, seq + 1), device=self.device),)

    def run(self, batch: Batch) -> None:
        (tokens,) = batch
        # A new iteration: the graphs' outputs of the last one may be overwritten.
        torch.compiler.cudagraph_mark_step_begin()
        train_step(self, self.compiled(tokens))


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    assert name == "reduce_overhead", name
    return ReduceOverhead(device, tiny, seed)
