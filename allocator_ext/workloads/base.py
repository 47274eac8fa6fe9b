"""What every workload shares: the Workload interface, timing a step, and the benchmarks'
warm-up."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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


def autocast(device: torch.device) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A generator of tensor values on `device`, seeded from the workload's own generator, so
    that two processes draw the same values too (None on the meta device, which has no
    generator and no values)."""
    if device.type == "meta":
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


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

    def _value_seed(self, largest: bool) -> int:
        """The seed of a step's tensor values: drawn from the generator, except for the largest
        shapes, which must leave it where it was."""
        return 0 if largest else self.rng.getrandbits(63)

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


def train_step(work: Any, loss: torch.Tensor) -> None:
    """The rest of a training step once the loss is computed: backward, the optimizer's step,
    gradients dropped (set to None, as training loops do, so their memory is freed)."""
    loss.backward()
    work.optimizer.step()
    work.optimizer.zero_grad(set_to_none=True)


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


def batch_shape(batch: Any) -> Any:
    """A batch's shapes, as JSON can hold them: each tensor's shape as a list, lists, tuples and
    dicts element by element, anything else as it is."""
    if hasattr(batch, "shape"):
        return list(batch.shape)
    if isinstance(batch, (list, tuple)):
        return [batch_shape(b) for b in batch]
    if isinstance(batch, dict):
        return {str(k): batch_shape(v) for k, v in batch.items()}
    return batch


def warm_up(work: Workload, steps: int, seed: int) -> list[Any]:
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
