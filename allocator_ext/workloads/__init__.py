"""Torch workloads whose tensor shapes change every step, as real jobs' do: what makes a caching
allocator fragment, and what its benchmarks, trace recordings and demo run.

    import torch
    from allocator_ext import workloads

    work = workloads.build("transformer", torch.device("cuda"), seed=0)
    for _ in range(100):
        work.step()                         # draws the next shapes, runs one step on them
    batch = work.draw()                     # or apart, to time the step alone:
    seconds = workloads.timed_step(work, batch)

Our own models (tokens.py, vision.py):
- `transformer`: a language model trained with a random batch size and sequence length;
- `moe`: the same with a mixture of 16 experts in place of each MLP, every token routed to two
  of them, so each expert gets a random number of tokens every step;
- `convnet`: a residual convolutional net with BatchNorm trained on a random batch (8-64) of
  square images of a random side (128-416 in steps of 32);
- `decode`: autoregressive generation of a random number of tokens after a random prompt, its
  KV cache grown by concatenation.

Well-known libraries' code, as their users run it, models built from configurations (no
weights are downloaded):
- `kv_generate` (hf.py): Hugging Face `generate` on a Llama model, random batch, prompt length
  and number of new tokens, its KV cache growing token by token;
- `detection` (vision.py): torchvision's Mask R-CNN trained on images of random sizes with
  random numbers of boxes;
- `graph` (graph.py): torch_geometric's GraphSAGE on random graphs of 1,000-100,000 nodes;
- `trainer` (hf.py): a BERT classifier fine-tuned as Hugging Face's Trainer does it, with
  gradient checkpointing and DataCollatorWithPadding's dynamic padding;
- `fsdp2` (distributed.py): the transformer under FSDP2's `fully_shard` on a process group of
  one rank;
- `stream_pipeline` (streams.py): a producer on a side stream and a consumer on the main one,
  items of 1-16 MiB handed over with `record_stream`, every result checked against the CPU's
  (a wrong one raises WrongResult);
- `reduce_overhead` (compiled.py): `torch.compile(mode="reduce-overhead")`, CUDA graph trees
  with their private pools, three shapes.
`unavailable(name)` says why one cannot run here (its library missing or broken), or None.

Training steps run under bf16 autocast (detection and graph in fp32, as their libraries'
examples train). Shapes (and the experts' token counts, and the values of tensors whose values
decide sizes) come only from the workload's seeded generator, never from tensor values: two
processes built with the same seed draw the same shapes in the same order on any device,
which is what lets a benchmark compare two allocators step by step and size a memory cap from
one run for another. (Where a library's own code sizes tensors from values computed on the
GPU, as Mask R-CNN's proposals, two processes can still differ in the last bits of those
values after a few steps.) `reseed(n)` starts a new sequence. `fixed_shapes=True` runs every
step at the workload's largest shapes instead, as a job with a fixed batch and sequence length
or image size does: its steps then repeat exactly (the MoE's routing, and detection's
proposals, still vary with the values drawn). `tiny=True` shrinks every dimension so that the
same code runs on a CPU in seconds (the self-checks).

This package is the part of allocator_ext that imports torch: import it only where torch is
installed. The libraries are imported when a workload that needs them is built.
"""

from __future__ import annotations

import importlib

import torch

from allocator_ext.workloads import compiled, distributed, graph, hf, streams, tokens, vision
from allocator_ext.workloads.base import (
    Batch,
    Dims,
    Workload,
    batch_shape,
    meet_the_peak,
    timed_step,
    timed_step_and_enqueue,
    warm_up,
)
from allocator_ext.workloads.streams import WrongResult
from allocator_ext.workloads.tokens import LanguageModel, MixtureOfExperts

__all__ = ["NAMES", "REQUIRES", "Batch", "Dims", "LanguageModel", "MixtureOfExperts", "Workload",
           "WrongResult", "batch_shape", "build", "meet_the_peak", "timed_step",
           "timed_step_and_enqueue", "unavailable", "warm_up"]

# Each workload's family: the module that builds it.
_FAMILIES = {"transformer": tokens, "moe": tokens, "convnet": vision, "decode": tokens,
             "kv_generate": hf, "detection": vision, "graph": graph, "trainer": hf,
             "fsdp2": distributed, "stream_pipeline": streams, "reduce_overhead": compiled}
NAMES = tuple(_FAMILIES)
# The libraries beyond torch that a workload imports (on the GPU machine: all of them).
REQUIRES = {"kv_generate": ("transformers",), "trainer": ("transformers",),
            "detection": ("torchvision",), "graph": ("torch_geometric",)}


def unavailable(name: str) -> str | None:
    """Why workload `name` cannot be built in this process (a library it needs is missing, or
    fails to import, as PyPI's torchvision does beside a torch build it was not made for), or
    None."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")
    for module in REQUIRES.get(name, ()):
        try:
            importlib.import_module(module)
        except Exception as e:  # torchvision built for another torch raises RuntimeError
            return f"the {name} workload needs {module}, which does not import here " \
                   f"({type(e).__name__}: {str(e)[:200]})"
    return None


def build(name: str, device: torch.device, tiny: bool = False, seed: int = 0,
          fixed_shapes: bool = False) -> Workload:
    """The workload called `name` (one of NAMES), its model on `device`; with `fixed_shapes`,
    every step at its largest shapes."""
    family = _FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")
    torch.manual_seed(seed)
    work = family.build(name, device, tiny, seed)
    work.fixed_shapes = fixed_shapes
    return work
