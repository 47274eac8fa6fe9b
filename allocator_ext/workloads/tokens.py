"""Token models: a language model trained on random batches and lengths (`transformer`), the
same with a mixture of experts (`moe`), and autoregressive decoding with a KV cache grown by
concatenation (`decode`)."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from allocator_ext.workloads.base import Batch, Dims, Workload, autocast


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
        with autocast(self.device):
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




TINY = Dims(32, 2, 4, 128, (1, 3), (8, 24))  # every token model's CPU size
TRANSFORMER = Dims(1024, 8, 16, 16384, (4, 16), (128, 1024))


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    if name == "transformer":
        return TokenTraining(name, TINY if tiny else TRANSFORMER, device, seed)
    if name == "moe":
        return TokenTraining(name, TINY if tiny else
                             Dims(1024, 4, 16, 8192, (4, 16), (128, 512)), device, seed,
                             experts=(4, 64) if tiny else (16, 1024))
    assert name == "decode", name
    dims = (Dims(32, 2, 4, 128, (1, 3), (4, 12)) if tiny else
            Dims(1024, 6, 16, 16384, (1, 16), (32, 512)))
    return Decoding(dims, device, seed, (2, 4) if tiny else (32, 128))
