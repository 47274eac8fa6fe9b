"""Torch workloads whose tensor shapes change every step, as real jobs' do: what makes a caching
allocator fragment, and what its benchmarks, trace recordings and demo run.

    import torch
    from allocator_ext import workloads

    work = workloads.build("transformer", torch.device("cuda"), seed=0)
    for _ in range(100):
        work.step()                         # draws the next shapes, runs one step on them
    batch = work.draw()                     # or apart, to time the step alone:
    seconds = workloads.timed_step(work, batch)

- `transformer`: a language model trained with a random batch size and sequence length;
- `moe`: the same with a mixture of 16 experts in place of each MLP, every token routed to two
  of them, so each expert gets a random number of tokens every step;
- `convnet`: a residual convolutional net with BatchNorm trained on a random batch (8-64) of
  square images of a random side (128-416 in steps of 32);
- `decode`: autoregressive generation of a random number of tokens after a random prompt, its
  KV cache grown by concatenation.

Training steps run under bf16 autocast. Shapes (and the experts' token counts) come only from
the workload's seeded generator, never from tensor values: two processes built with the same
seed draw the same shapes in the same order on any device, which is what lets a benchmark
compare two allocators step by step and size a memory cap from one run for another.
`reseed(n)` starts a new sequence. `fixed_shapes=True` runs every step at the workload's
largest shapes instead, as a job with a fixed batch and sequence length or image size does: its
steps then repeat exactly (the MoE's routing still varies with the tokens drawn). `tiny=True`
shrinks every dimension so that the same code runs on a CPU in about a second (the
self-checks).

This is the one module of allocator_ext that imports torch: import it only where torch is
installed.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("transformer", "moe", "convnet", "decode")

Batch = tuple[Any, ...]


@dataclass(frozen=True)
class Dims:
    """The sizes of a token model, full (for the GPU) or tiny (for a CPU self-check)."""

    width: int
    layers: int
    heads: int
    vocab: int
    batch: tuple[int, int]  # inclusive range of the batch size
    seq: tuple[int, int]    # inclusive range of the sequence length


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class Workload:
    """One workload: its model on a device, and a generator of the shapes of its steps."""

    name = ""

    def __init__(self, model: nn.Module, device: torch.device, rng: random.Random) -> None:
        self.model = model.to(device)
        self.device = device
        self.rng = rng
        self.fixed_shapes = False  # every draw at the largest shapes (build's fixed_shapes)

    def reseed(self, seed: int) -> None:
        """Starts the sequence of shapes that `seed` gives (the same in every process)."""
        self.rng.seed(seed)

    def draw(self, largest: bool = False) -> Batch:
        """The next step's inputs, of shapes drawn from the generator; with `largest`, the
        largest shapes of every range instead (the generator is not advanced), so that a run
        can meet its peak before it sizes a memory cap. A workload with fixed shapes always
        draws the largest."""
        raise NotImplementedError

    def _pick(self, bounds: tuple[int, int], largest: bool) -> int:
        return bounds[1] if largest or self.fixed_shapes else self.rng.randint(*bounds)

    def run(self, batch: Batch) -> None:
        """One step on `batch`."""
        raise NotImplementedError

    def step(self) -> None:
        self.run(self.draw())

    def wrap(self, wrapper: Callable[[nn.Module], nn.Module]) -> None:
        """Puts the model under `wrapper` (DistributedDataParallel, FSDP's fully_shard, ...),
        before the first step; the optimizer then trains the parameters the wrapped model has,
        since fully_shard replaces every parameter with its shard."""
        self.model = wrapper(self.model)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            if optimizer.state:
                raise RuntimeError("wrap() a workload before its first step")
            optimizer.param_groups[0]["params"] = list(self.model.parameters())

    def parameter_count(self) -> int:
        return sum(math.prod(p.shape) for p in self.model.parameters())


def timed_step(work: Workload, batch: Batch) -> float:
    """Seconds of one step on `batch`, from a synchronised start to its synchronised end."""
    return timed_step_and_enqueue(work, batch)[0]


def timed_step_and_enqueue(work: Workload, batch: Batch) -> tuple[float, float]:
    """timed_step's seconds, and the seconds until the host had queued all of the step: a step
    whose enqueue time is close to its whole time is bound by the host (the allocator's calls
    among what it spends), one whose enqueue time is far shorter waits for the device."""
    cuda = work.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(work.device)
    started = time.perf_counter()
    work.run(batch)
    enqueued = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize(work.device)
    return time.perf_counter() - started, enqueued


def meet_the_peak(work: Workload, step: Callable[[Batch], object] | None = None) -> None:
    """Two steps at the workload's largest shapes, through `step` (default: timed_step): the
    first creates the optimizer's state, so only the second meets the peak that every later
    step, holding that state, can reach (what a cap or a flat-peak verdict must start from)."""
    for _ in range(2):
        batch = work.draw(largest=True)
        if step is None:
            timed_step(work, batch)
        else:
            step(batch)


def batch_shape(batch: Batch) -> list[Any]:
    """A batch's shapes: each tensor's as a list, anything else as it is."""
    return [list(t.shape) if hasattr(t, "shape") else t for t in batch]


def warm_up(work: Workload, steps: int, seed: int) -> list[list[Any]]:
    """The benchmarks' warm-up, untimed: the workload's peak met (meet_the_peak), then `steps`
    steps of the sequence `seed` draws (library plans, the allocator's first growth). Returns
    the shapes of those steps, so that timed steps can be shown to be others."""
    meet_the_peak(work)
    work.reseed(seed)
    shapes = []
    for _ in range(steps):
        batch = work.draw()
        shapes.append(batch_shape(batch))
        timed_step(work, batch)
    return shapes


# ---- token models

class Attention(nn.Module):
    """Causal self-attention, optionally extending a KV cache."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q, k, v = (self._split(t) for t in self.qkv(x).chunk(3, dim=-1))
        if past is not None:
            # Growing the cache by concatenation reallocates it every token, as simple
            # decoding loops do: the allocation pattern the decode workload exists for.
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        b, h, t, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, h * d)), (k, v)


class Block(nn.Module):
    """A pre-norm transformer block: attention, then an MLP (or a given feed-forward module)."""

    def __init__(self, width: int, heads: int, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.ffn = ffn or nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attended, cache = self.attention(self.norm1(x), past)
        x = x + attended
        return x + self.ffn(self.norm2(x)), cache


class MixtureOfExperts(nn.Module):
    """Every token goes to two of the experts, weighted by a learned gate. Which experts, and so
    how many tokens each gets, is drawn from the workload's generator: random token counts every
    step that two processes with the same seed draw alike (a learned router's choices depend on
    tensor values, which differ between runs in their last bits)."""

    def __init__(self, width: int, experts: int, hidden: int, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat.shape[0]
        routed = 2 * tokens
        # Token counts per expert: cuts of [0, routed) at random points (uneven, as routing
        # is), and the routed slots shuffled by a generator seeded from ours.
        cuts = sorted(self.rng.randrange(routed + 1) for _ in range(len(self.experts) - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, routed], strict=True)]
        shuffle = torch.Generator(device=flat.device)
        shuffle.manual_seed(self.rng.getrandbits(63))
        slots = torch.randperm(routed, generator=shuffle, device=flat.device) % tokens
        gates = self.gate(flat).softmax(dim=-1)
        out = torch.zeros_like(flat)
        start = 0
        for index, (expert, count) in enumerate(zip(self.experts, counts, strict=True)):
            if count:
                chosen = slots[start:start + count]
                y = expert(flat[chosen]) * gates[chosen, index:index + 1]
                out = out.index_add(0, chosen, y.to(out.dtype))
            start += count
        return out.view(x.shape)


class LanguageModel(nn.Module):
    def __init__(self, dims: Dims, ffn: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(dims.vocab, dims.width)
        self.blocks = nn.ModuleList(
            Block(dims.width, dims.heads, ffn() if ffn else None) for _ in range(dims.layers))
        self.norm = nn.LayerNorm(dims.width)
        self.head = nn.Linear(dims.width, dims.vocab, bias=False)

    def features(self, tokens: torch.Tensor,
                 caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The last block's output, and each block's KV cache (extended where given)."""
        x = self.embed(tokens)
        out_caches = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, caches[i] if caches is not None else None)
            out_caches.append(cache)
        return x, out_caches

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.features(tokens)[0])


class TokenTraining(Workload):
    """An optimizer step of a token model on a random batch of random length."""

    def __init__(self, name: str, dims: Dims, device: torch.device, seed: int,
                 experts: tuple[int, int] | None = None) -> None:
        rng = random.Random(seed)  # the experts draw their routing from it too
        ffn = None
        if experts is not None:
            count, hidden = experts

            def ffn() -> nn.Module:
                return MixtureOfExperts(dims.width, count, hidden, rng)
        super().__init__(LanguageModel(dims, ffn), device, rng)
        self.name = name
        self.dims = dims
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def draw(self, largest: bool = False) -> Batch:
        batch = self._pick(self.dims.batch, largest)
        seq = self._pick(self.dims.seq, largest)
        return (torch.randint(0, self.dims.vocab, (batch, seq + 1), device=self.device),)

    def run(self, batch: Batch) -> None:
        (tokens,) = batch
        with _autocast(self.device):
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Decoding(Workload):
    """Generates a random number of tokens after a random prompt, one token at a time."""

    name = "decode"

    def __init__(self, dims: Dims, device: torch.device, seed: int,
                 new_tokens: tuple[int, int]) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        super().__init__(LanguageModel(dims).to(dtype=dtype).eval(), device, random.Random(seed))
        self.dims = dims
        self.new_tokens = new_tokens

    def draw(self, largest: bool = False) -> Batch:
        batch = self._pick(self.dims.batch, largest)
        prompt = self._pick(self.dims.seq, largest)
        tokens = torch.randint(0, self.dims.vocab, (batch, prompt), device=self.device)
        return tokens, self._pick(self.new_tokens, largest)

    @torch.no_grad()
    def run(self, batch: Batch) -> None:
        tokens, new_tokens = batch
        model = self.model
        assert isinstance(model, LanguageModel)
        x, caches = model.features(tokens)
        next_token = model.logits(x[:, -1:]).argmax(dim=-1)
        for _ in range(new_tokens):
            x, caches = model.features(next_token, caches)
            next_token = model.logits(x).argmax(dim=-1)


# ---- a convolutional net

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


class ConvTraining(Workload):
    """A training step on a random batch of square images of a random side, as detection or
    multi-resolution training sees them: activation sizes change every step."""

    name = "convnet"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        # cuDNN's benchmark mode would try algorithms per shape and cache their workspaces: off,
        # so that what the allocator sees is the model's own tensors.
        torch.backends.cudnn.benchmark = False
        channels = [8, 16] if tiny else [64, 128, 256, 512]
        self.classes = 10 if tiny else 1000
        super().__init__(ConvNet(channels, self.classes), device, random.Random(seed))
        self.sides = [32, 48] if tiny else list(range(128, 417, 32))
        self.batch = (2, 3) if tiny else (8, 64)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def draw(self, largest: bool = False) -> Batch:
        side = self.sides[-1] if largest or self.fixed_shapes else self.rng.choice(self.sides)
        batch = self._pick(self.batch, largest)
        images = torch.randn(batch, 3, side, side, device=self.device)
        return images, torch.randint(0, self.classes, (batch,), device=self.device)

    def run(self, batch: Batch) -> None:
        images, labels = batch
        with _autocast(self.device):
            loss = F.cross_entropy(self.model(images).float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def build(name: str, device: torch.device, tiny: bool = False, seed: int = 0,
          fixed_shapes: bool = False) -> Workload:
    """The workload called `name` (one of NAMES), its model on `device`; with `fixed_shapes`,
    every step at its largest shapes."""
    work = _build(name, device, tiny, seed)
    work.fixed_shapes = fixed_shapes
    return work


def _build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    torch.manual_seed(seed)
    small = Dims(32, 2, 4, 128, (1, 3), (8, 24))
    if name == "transformer":
        return TokenTraining(name, small if tiny else
                             Dims(1024, 8, 16, 16384, (4, 16), (128, 1024)), device, seed)
    if name == "moe":
        return TokenTraining(name, small if tiny else
                             Dims(1024, 4, 16, 8192, (4, 16), (128, 512)), device, seed,
                             experts=(4, 64) if tiny else (16, 1024))
    if name == "convnet":
        return ConvTraining(device, tiny, seed)
    if name == "decode":
        dims = (Dims(32, 2, 4, 128, (1, 3), (4, 12)) if tiny else
                Dims(1024, 6, 16, 16384, (1, 16), (32, 512)))
        return Decoding(dims, device, seed, (2, 4) if tiny else (32, 128))
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")
