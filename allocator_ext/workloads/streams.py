"""A producer/consumer pipeline across two streams (`stream_pipeline`), every result checked.

Each step passes a random number of items (4-12) of random sizes (1-16 MiB) through it. The
producer, on a side stream of its own, makes each item's input and transforms it; the
consumer, on the main stream, waits for that item only (an event), transforms it again and
reduces it to two checksums. The producer never waits for the consumer, so it runs ahead:
while the consumer still reads item i, the producer is already allocating item i + 2 on its
stream. Item i's memory was allocated on the producer's stream and freed by the consumer's
thread while the consumer's kernels may still read it; `record_stream` tells the allocator
so, and the allocator must not hand that memory to the producer until those kernels are done.
An allocator that does would let the producer overwrite an item under the consumer, and the
checksums, compared with their values computed on the CPU after every step, would differ: the
step raises WrongResult.

The arithmetic is exact (int32 elements, int64 sums well inside their range), so the expected
checksums are closed forms of the item's size and coefficients. On the CPU (tiny) both sides
run on the one CPU stream and the sizes are 1-16 KiB: the same checks, no concurrency.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from allocator_ext.workloads.base import Batch, Workload

KiB, MiB = 1 << 10, 1 << 20
ELEMENT = 4  # bytes of an int32


class WrongResult(RuntimeError):
    """An item came out of the pipeline other than the CPU computes it."""


def expected_checksums(n: int, a: int, b: int, c: int, d: int) -> tuple[int, int]:
    """The sum of the consumer's output z[j] = c * (a * j + b) + d over j < n, and over every
    third j, computed on the CPU in closed form."""
    def total(count: int, step: int) -> int:  # sum over j = 0, step, ..., step * (count - 1)
        return c * a * step * count * (count - 1) // 2 + (c * b + d) * count

    return total(n, 1), total((n + 2) // 3, 3)


class StreamPipeline(Workload):
    name = "stream_pipeline"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        super().__init__(nn.Module(), device, random.Random(seed))  # no model: the streams are it
        self.items = (2, 4) if tiny else (4, 12)
        unit = KiB if tiny else MiB
        self.elements = (unit // ELEMENT, 16 * unit // ELEMENT)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def draw(self, largest: bool = False) -> Batch:
        """The items' sizes (elements), and each item's coefficients (a, b, c, d) in a tensor
        on the CPU."""
        count = self._pick(self.items, largest)
        sizes = tuple(self._pick(self.elements, largest) for _ in range(count))
        if largest:
            coefficients = [(127, 1 << 20, 3, 1000) for _ in sizes]
        else:
            coefficients = [(self.rng.randint(1, 127), self.rng.randint(0, 1 << 20),
                             self.rng.randint(1, 3), self.rng.randint(-1000, 1000))
                            for _ in sizes]
        # Values, not shapes: a tensor, whose shape alone the benchmarks compare.
        return sizes, torch.tensor(coefficients, dtype=torch.int64)

    def _produce(self, n: int, a: int, b: int) -> torch.Tensor:
        """On the producer's stream: the item's input, and its first transform."""
        x = torch.arange(n, dtype=torch.int32, device=self.device)
        return x * a + b

    def _consume(self, y: torch.Tensor, c: int, d: int) -> torch.Tensor:
        """On the consumer's stream: the second transform and the item's two checksums."""
        z = y * c + d
        return torch.stack([z.sum(dtype=torch.int64), z[::3].sum(dtype=torch.int64)])

    def run(self, batch: Batch) -> None:
        sizes, coefficients = batch[0], batch[1].tolist()
        side = self.side
        main = torch.cuda.current_stream(self.device) if side is not None else None
        produced: list[tuple[torch.Tensor | None, Any]] = []

        def produce(i: int) -> None:
            n, (a, b, _, _) = sizes[i], coefficients[i]
            if side is None:
                produced.append((self._produce(n, a, b), None))
                return
            with torch.cuda.stream(side):
                y = self._produce(n, a, b)
                ready = torch.cuda.Event()
                ready.record(side)
            produced.append((y, ready))

        checksums = []
        for i in range(min(2, len(sizes))):  # the producer two items ahead
            produce(i)
        for i, (_, _, c, d) in enumerate(coefficients):
            y, ready = produced[i]
            assert y is not None
            if main is not None:
                main.wait_event(ready)
                y.record_stream(main)  # freed below while the consumer may still read it
            checksums.append(self._consume(y, c, d))
            produced[i] = (None, None)
            del y
            if i + 2 < len(sizes):
                produce(i + 2)
        got = torch.stack(checksums).cpu().tolist()  # the step's one wait for the device
        for i, (n, coef, sums) in enumerate(zip(sizes, coefficients, got, strict=True)):
            want = expected_checksums(n, *coef)
            if tuple(sums) != want:
                raise WrongResult(f"item {i} of the step ({n * ELEMENT} bytes, coefficients "
                                  f"{tuple(coef)}) came out with checksums {tuple(sums)}, not "
                                  f"{want}: its memory was overwritten while in use")


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    assert name == "stream_pipeline", name
    return StreamPipeline(device, tiny, seed)
