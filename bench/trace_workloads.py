"""Training and inference workloads whose allocation patterns bench/record_traces.py records.

Each workload varies its tensor shapes from step to step, as real jobs do, because that is what
makes a caching allocator fragment: a transformer LM with random batch and sequence length, a
mixture of experts whose token count per expert changes every step, a convolutional net on
images of varying size, and autoregressive decoding with a growing KV cache.

`build(name, device, tiny, seed)` gives an object with `step()`; `tiny=True` shrinks every
dimension so that the same code runs in a second on a CPU (the self-check). Shapes come from a
seeded generator, so a workload allocates the same sequence on every run with the same seed:
that is what lets record_traces.py size a memory cap from one run for another.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Dims:
    """The sizes of one workload, full (for the GPU) or tiny (for a CPU self-check)."""

    width: int
    layers: int
    heads: int
    vocab: int
    batch: tuple[int, int]
    seq: tuple[int, int]


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention and an MLP (or a given FFN)."""

    def __init__(self, width: int, heads: int, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.ffn = ffn or nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).transpose(1, 2)

    def attend(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if past is not None:
            # Growing the cache by concatenation reallocates it every token, as simple
            # decoding loops do: the allocation pattern this workload exists to record.
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        causal = past is None
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        b, h, t, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, h * d)), (k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)[0]
        return x + self.ffn(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self, dims: Dims, ffn_factory: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(dims.vocab, dims.width)
        self.blocks = nn.ModuleList(
            Block(dims.width, dims.heads, ffn_factory() if ffn_factory else None)
            for _ in range(dims.layers))
        self.norm = nn.LayerNorm(dims.width)
        self.head = nn.Linear(dims.width, dims.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TrainStep:
    """One optimizer step of a token model on a random batch of random length."""

    def __init__(self, model: nn.Module, dims: Dims, device: torch.device, seed: int) -> None:
        self.model = model.to(device)
        self.dims = dims
        self.device = device
        self.rng = random.Random(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> None:
        batch = self.rng.randint(*self.dims.batch)
        seq = self.rng.randint(*self.dims.seq)
        tokens = torch.randint(0, self.dims.vocab, (batch, seq + 1), device=self.device)
        with _autocast(self.device):
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class MixtureOfExperts(nn.Module):
    """Top-2 routing over experts: each expert gets a different number of tokens every step."""

    def __init__(self, width: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = self.router(flat).softmax(dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * weights[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y.to(out.dtype))
        return out.view(shape)


class ResidualConv(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip = (nn.Identity() if stride == 1 and channels_in == channels_out else
                     nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                   nn.BatchNorm2d(channels_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ConvNet(nn.Module):
    def __init__(self, channels: list[int], classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels[0], 7, 2, 3, bias=False),
                                   nn.BatchNorm2d(channels[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        previous = channels[0]
        for i, c in enumerate(channels):
            layers += [ResidualConv(previous, c, 1 if i == 0 else 2), ResidualConv(c, c, 1)]
            previous = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(previous, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class ConvTrainStep:
    """A training step on a random batch of square images of a random size."""

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        # cuDNN's benchmark mode would try algorithms per shape and cache workspaces: off, so
        # the trace shows the allocator's own behaviour (and our allocator's pluggable path
        # cannot serve benchmark mode anyway).
        torch.backends.cudnn.benchmark = False
        channels = [8, 16] if tiny else [64, 128, 256, 512]
        self.model = ConvNet(channels, 10 if tiny else 1000).to(device)
        self.device = device
        self.rng = random.Random(seed)
        self.sizes = [32, 48] if tiny else list(range(128, 385, 32))
        self.batch = (2, 3) if tiny else (8, 48)
        self.classes = 10 if tiny else 1000
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self) -> None:
        size = self.rng.choice(self.sizes)
        batch = self.rng.randint(*self.batch)
        images = torch.randn(batch, 3, size, size, device=self.device)
        labels = torch.randint(0, self.classes, (batch,), device=self.device)
        with _autocast(self.device):
            loss = F.cross_entropy(self.model(images).float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DecodeStep:
    """Generates a random number of tokens after a random prompt, one token at a time."""

    def __init__(self, dims: Dims, device: torch.device, tiny: bool, seed: int) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = LanguageModel(dims).to(device=device, dtype=dtype).eval()
        self.dims = dims
        self.device = device
        self.rng = random.Random(seed)
        self.new_tokens = (2, 4) if tiny else (32, 128)

    @torch.no_grad()
    def step(self) -> None:
        batch = self.rng.randint(*self.dims.batch)
        prompt = self.rng.randint(*self.dims.seq)
        tokens = torch.randint(0, self.dims.vocab, (batch, prompt), device=self.device)
        model = self.model
        blocks = [cast(Block, block) for block in model.blocks]
        caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = model.embed(tokens)
        for block in blocks:
            attended, cache = block.attend(x)
            caches.append(cache)
            x = x + attended
            x = x + block.ffn(block.norm2(x))
        next_token = model.head(model.norm(x[:, -1:])).argmax(dim=-1)
        for _ in range(self.rng.randint(*self.new_tokens)):
            x = model.embed(next_token)
            for i, block in enumerate(blocks):
                attended, caches[i] = block.attend(x, caches[i])
                x = x + attended
                x = x + block.ffn(block.norm2(x))
            next_token = model.head(model.norm(x)).argmax(dim=-1)


WORKLOAD_NAMES = ("gpt_varlen", "moe", "convnet", "decode")

# Steps per trace when --steps is not given: enough steps for the shapes to vary widely, few
# enough that a trace stays under ~300k events (a few MB gzipped) and a run under ~20 s.
DEFAULT_STEPS = {"gpt_varlen": 40, "moe": 40, "convnet": 40, "decode": 12}


def build(name: str, device: torch.device, tiny: bool = False, seed: int = 0) -> Any:
    """The workload called `name`, with its model on `device`."""
    torch.manual_seed(seed)
    if name == "gpt_varlen":
        dims = (Dims(32, 2, 4, 128, (1, 3), (8, 24)) if tiny else
                Dims(1024, 8, 16, 16384, (4, 16), (128, 1024)))
        return TrainStep(LanguageModel(dims), dims, device, seed)
    if name == "moe":
        dims = (Dims(32, 2, 4, 128, (1, 3), (8, 24)) if tiny else
                Dims(1024, 4, 16, 8192, (4, 16), (128, 512)))
        experts, hidden = (4, 64) if tiny else (8, 2048)
        return TrainStep(
            LanguageModel(dims, lambda: MixtureOfExperts(dims.width, experts, hidden)),
            dims, device, seed)
    if name == "convnet":
        return ConvTrainStep(device, tiny, seed)
    if name == "decode":
        dims = (Dims(32, 2, 4, 128, (1, 3), (4, 12)) if tiny else
                Dims(1024, 6, 16, 16384, (1, 16), (32, 512)))
        return DecodeStep(dims, device, tiny, seed)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")


def parameter_count(workload: Any) -> int:
    return sum(math.prod(p.shape) for p in workload.model.parameters())
