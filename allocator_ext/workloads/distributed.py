"""Distributed training on one rank: the transformer under FSDP2's `fully_shard` (`fsdp2`),
each block and the whole model sharded over a process group of one (NCCL on a GPU, gloo on
the CPU), parameters gathered in bf16 and gradients reduced in fp32. With one rank the
collectives copy rather than communicate, but the allocations are FSDP2's own: the
all-gather buffers of each block's parameters, freed after its forward and gathered again for
its backward, and the reduce-scatter buffers of its gradients."""

from __future__ import annotations

import atexit
import os
import tempfile
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from allocator_ext.workloads.base import Dims, Workload
from allocator_ext.workloads.tokens import TINY, LanguageModel, TokenTraining

FSDP2 = Dims(1024, 6, 16, 16384, (4, 16), (128, 1024))


def one_rank_group(device: torch.device) -> None:
    """Makes this process rank 0 of a process group of one, unless a group exists already
    (then it must be of one rank: the workload's shapes assume that). The rendezvous is a file
    of the process's own, so that processes side by side never meet."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"the fsdp2 workload runs on one rank, and this process is in a "
                               f"group of {dist.get_world_size()}")
        return
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="allocwatch-fsdp2-"), "rendezvous")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0,
                                world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0,
                                world_size=1)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    assert name == "fsdp2", name
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    one_rank_group(device)
    work = TokenTraining(name, TINY if tiny else FSDP2, device, seed)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in cast(LanguageModel, work.model).blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    work.wrap(lambda model: cast(nn.Module, fully_shard(model, mesh=mesh, mp_policy=policy)))
    return work
