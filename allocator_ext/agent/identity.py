"""Who the training process is, from its environment.

Variables read (first one set wins):

| field         | variables                                                                    |
| ------------- | ---------------------------------------------------------------------------- |
| rank          | ALLOCWATCH_RANK, RANK (torchrun), OMPI_COMM_WORLD_RANK, SLURM_PROCID         |
| local_rank    | ALLOCWATCH_LOCAL_RANK, LOCAL_RANK (torchrun), OMPI_COMM_WORLD_LOCAL_RANK,    |
|               | SLURM_LOCALID                                                                |
| world_size    | ALLOCWATCH_WORLD_SIZE, WORLD_SIZE (torchrun), OMPI_COMM_WORLD_SIZE, SLURM_NTASKS |
| cuda_device   | the argument; ALLOCWATCH_CUDA_DEVICE; else the source's first device          |
| gpu_uuid      | ALLOCWATCH_GPU_UUID; else the source (torch) or NVML, through                |
|               | CUDA_VISIBLE_DEVICES                                                         |
| training_job  | ALLOCWATCH_TRAINING_JOB, JOB_NAME, TORCHELASTIC_RUN_ID (unless "none")       |
| pod           | ALLOCWATCH_POD_NAME, POD_NAME (downward API: metadata.name)                  |
| namespace     | ALLOCWATCH_POD_NAMESPACE, POD_NAMESPACE (downward API: metadata.namespace)   |
| node          | ALLOCWATCH_NODE_NAME, NODE_NAME (downward API: spec.nodeName)                |
| host          | socket.gethostname() (the pod's name in Kubernetes)                          |

In Kubernetes, set the training job from the Job's label through the downward API:
`valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/job-name']"}}`.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from allocator_ext.protocol.nvml import NvmlReader
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.version import PACKAGE_VERSION

RANK_VARS = ("ALLOCWATCH_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
LOCAL_RANK_VARS = ("ALLOCWATCH_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "SLURM_LOCALID")
WORLD_SIZE_VARS = ("ALLOCWATCH_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
JOB_VARS = ("ALLOCWATCH_TRAINING_JOB", "JOB_NAME", "TORCHELASTIC_RUN_ID")
POD_VARS = ("ALLOCWATCH_POD_NAME", "POD_NAME")
NAMESPACE_VARS = ("ALLOCWATCH_POD_NAMESPACE", "POD_NAMESPACE")
NODE_VARS = ("ALLOCWATCH_NODE_NAME", "NODE_NAME")

_PROCESS_START = time.time()


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value and not (name == "TORCHELASTIC_RUN_ID" and value == "none"):
            return value
    return ""


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int:
    value = _first(env, names)
    try:
        return int(value)
    except ValueError:
        return -1


def visible_device_entry(env: Mapping[str, str], index: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry behind CUDA device `index` (a GPU index or UUID)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if 0 <= index < len(entries) else None


def nvml_uuid(nvml: NvmlReader, device: int) -> str:
    """The UUID of CUDA device `device` as NVML names it ('' where unknown): CUDA's indices
    count only the visible devices, NVML's every one."""
    entry = visible_device_entry(os.environ, device)
    if entry is None:
        return ""
    if entry.startswith(("GPU-", "MIG-")):
        return entry
    try:
        gpu = nvml.find(index=int(entry))
    except ValueError:
        return ""
    return gpu.uuid if gpu is not None else ""


def device_uuid(source: Any, nvml: NvmlReader | None, device: int) -> str:
    """The UUID of CUDA device `device`: the source's, else NVML's ('' where neither knows)."""
    uuid = source.gpu_uuid(device)
    if not uuid and nvml is not None:
        uuid = nvml_uuid(nvml, device)
    return uuid


def build_identity(
    env: Mapping[str, str] | None = None,
    *,
    backend: str = "",
    cuda_device: int | None = None,
    gpu_uuid: str = "",
    torch_version: str = "",
    cuda_version: str = "",
    overrides: Mapping[str, object] | None = None,
) -> pb.Identity:
    env = os.environ if env is None else env
    if cuda_device is None:
        cuda_device = _first_int(env, ("ALLOCWATCH_CUDA_DEVICE",))
    identity = pb.Identity(
        instance_id=uuid.uuid4().hex,
        pid=os.getpid(),
        host=socket.gethostname(),
        rank=_first_int(env, RANK_VARS),
        local_rank=_first_int(env, LOCAL_RANK_VARS),
        world_size=_first_int(env, WORLD_SIZE_VARS),
        cuda_device=cuda_device,
        gpu_uuid=env.get("ALLOCWATCH_GPU_UUID", "") or gpu_uuid,
        training_job=_first(env, JOB_VARS),
        pod=_first(env, POD_VARS),
        namespace=_first(env, NAMESPACE_VARS),
        node=_first(env, NODE_VARS),
        backend=backend,
        torch_version=torch_version,
        cuda_version=cuda_version,
        agent_version=PACKAGE_VERSION,
        process_start_time_seconds=_PROCESS_START,
    )
    for key, value in (overrides or {}).items():
        setattr(identity, key, value)  # AttributeError/TypeError name the bad field
    return identity
