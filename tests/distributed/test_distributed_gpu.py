"""DDP and FSDP training on GPUs under `allocwatch run -- torchrun`, NCCL, one process per GPU,
through bench/gpu/distributed_train.py's driver: every rank completes under each allocator, its
series are on /metrics with its own device (gpu_uuid joined to NVML), and a reclaim sent by
selector reaches the last rank only. The figures themselves are the benchmark's (figures in
docs/benchmarks.md), not asserted here. Needs CUDA GPUs: one for the one-rank run, two for the
others (skipped with fewer, saying why)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import REPO

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(count: int) -> pytest.MarkDecorator:
    why = " (one rank per GPU: NCCL refuses two ranks on one GPU)" if count > 1 else ""
    return pytest.mark.skipif(gpus() < count,
                              reason=f"needs {count} CUDA GPU(s), found {gpus()}{why}")


def drive(tmp_path: Path, *options: str) -> dict[str, Any]:
    out_file = tmp_path / "distributed.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.distributed_train", "--steps", "6",
                          "--warmup", "2", "--interval", "0.5", "--out-dir",
                          str(tmp_path / "ranks"), "--json", str(out_file), *options],
                         cwd=REPO, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out_file.read_text())


def check_launches(result: dict[str, Any], nproc: int) -> None:
    for run in result["runs"]:
        assert run["every_rank_completed"] and run["every_rank_on_metrics"], run["allocator"]
        devices = {entry["labels"]["cuda_device"] for entry in run["series"].values()}
        uuids = {entry["labels"]["gpu_uuid"] for entry in run["series"].values()}
        assert len(devices) == len(uuids) == nproc  # one GPU per rank, each its own
        assert all(entry["nvml_joined"] for entry in run["series"].values())
        assert all(r["allocwatch_installed"] == r["allocator"].startswith("allocwatch")
                   for r in run["ranks"])
    probes = [r["selector_probe"] for r in result["runs"] if "selector_probe" in r]
    assert probes and all(p["reached_that_rank_only"] for p in probes)


@needs(1)
def test_one_rank_trains_under_each_allocator_with_nccl(tmp_path: Path) -> None:
    check_launches(drive(tmp_path, "--nproc", "1"), 1)


@needs(2)
def test_two_ranks_train_ddp_and_fsdp_each_watched_and_steered_alone(tmp_path: Path) -> None:
    check_launches(drive(tmp_path, "--nproc", "2"), 2)


@needs(2)
def test_nccl_buffer_registration_hook_with_allocwatchs_paged_segments(tmp_path: Path) -> None:
    """TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 with allocwatch's defaults (paged
    segments, pages mapped and unmapped, a reclaim --all unmapping free ones mid-run) and with
    PyTorch's allocator, and with allocwatch's plain segments. Until the back end follows the
    rule of docs/torch.md ("NCCL buffer registration"), install() switches the hook off under
    paged segments: every rank completes, with the hook off under allocwatch's defaults and on
    (registering every segment) under the other two."""
    result = drive(tmp_path, "--nproc", "2", "--allocators",
                   "pytorch,allocwatch,allocwatch-plain", "--nccl-register-hook")
    check_launches(result, 2)
    hook = {r["allocator"]: {rank["nccl_register_hook"] for rank in r["ranks"]}
            for r in result["runs"]}
    assert hook == {"pytorch": {"1"}, "allocwatch": {"0"}, "allocwatch-plain": {"1"}}
