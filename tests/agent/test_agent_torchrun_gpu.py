"""Two torchrun ranks on two GPUs publishing through one sidecar: both ranks show, each with its
own device and series — with PyTorch's allocator as the source (agent started from the
environment), and under `allocwatch run` with allocwatch's allocator installed in every worker
without a code change. Needs 2 CUDA GPUs (skipped elsewhere, saying why)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.paths import REPO
from support.sidecar import samples, start_sidecar
from support.waiting import wait_for

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs"),
]

RANK_SCRIPT = textwrap.dedent("""\
    import os, time, torch
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    blocks = [torch.empty((1 + local_rank) * 64 << 20, dtype=torch.uint8, device="cuda")]
    from allocator_ext.agent import maybe_start_from_env
    agent = maybe_start_from_env(source="pytorch")
    assert agent is not None
    deadline = time.time() + float(os.environ["RUN_SECONDS"])
    while time.time() < deadline:
        x = torch.randn(1024, 1024, device="cuda")
        (x @ x).sum().item()
        time.sleep(0.05)
    """)


@pytest.fixture
def torchrun() -> str:
    path = shutil.which("torchrun")
    if path is None:
        pytest.skip("torchrun is not on PATH")
    return path


def allocated_by_rank(url: str) -> dict[str, tuple[dict[str, str], float]]:
    """Each rank's allocated-bytes series (all pools): its labels and value."""
    return {dict(ls)["rank"]: (dict(ls), v) for (n, ls), v in samples(url).items()
            if n == "torch_cuda_allocator_allocated_bytes" and "pool" not in dict(ls)}


def test_two_ranks_through_one_sidecar(tmp_path: Path, torchrun: str) -> None:
    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "ALLOCWATCH_TARGET": running.sidecar.agent_targets[0],
           "ALLOCWATCH_INTERVAL": "0.2", "RUN_SECONDS": "12",
           "PYTHONPATH": os.pathsep.join([str(REPO),
                                          os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                             env=env)
    try:
        def ranks() -> dict[str, tuple[str, str, float]]:
            return {rank: (ls["cuda_device"], ls["gpu_uuid"], v)
                    for rank, (ls, v) in allocated_by_rank(url).items()}
        found = wait_for(lambda: len(ranks()) == 2 and ranks(), timeout=90, interval=0.5,
                         what="both ranks on /metrics")
        assert {found["0"][0], found["1"][0]} == {"0", "1"}
        assert found["0"][1] != found["1"][1] and all(v[1].startswith("GPU-")
                                                      for v in found.values())
        assert found["1"][2] > found["0"][2]  # rank 1 holds twice the memory
        assert child.wait(120) == 0
    finally:
        if child.poll() is None:
            child.kill()
        running.stop()


OURS_RANK_SCRIPT = textwrap.dedent("""\
    import os, time, torch
    import allocator_ext
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    assert allocator_ext.installed(), "allocwatch run did not install the allocator"
    blocks = [torch.empty((1 + local_rank) * 64 << 20, dtype=torch.uint8, device="cuda")]
    assert torch.cuda.memory_allocated() >= (1 + local_rank) * 64 << 20
    deadline = time.time() + float(os.environ["RUN_SECONDS"])
    while time.time() < deadline:
        x = torch.randn(1024, 1024, device="cuda")
        assert torch.allclose((x @ x)[0, :4], x[0] @ x[:, :4], rtol=1e-3, atol=1e-3)
        time.sleep(0.05)
    """)


def test_allocwatch_run_under_torchrun_installs_ours_in_every_rank(tmp_path: Path,
                                                                   torchrun: str) -> None:
    """`allocwatch run -- torchrun ...`: no code change, our allocator in both workers, each
    rank publishing its own device's allocwatch series."""
    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    script = tmp_path / "rank.py"
    script.write_text(OURS_RANK_SCRIPT)
    env = {**os.environ, "ALLOCWATCH_INTERVAL": "0.2", "RUN_SECONDS": "12"}
    child = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "run", "--target",
         running.sidecar.agent_targets[0], "--", torchrun, "--standalone", "--nproc-per-node",
         "2", str(script)], env=env)
    try:
        def ranks() -> dict[str, tuple[str, float]]:
            backends = {dict(ls)["rank"]: dict(ls)["backend"]
                        for (n, ls), _ in samples(url).items()
                        if n == "torch_cuda_allocator_info" and "rank" in dict(ls)}
            return {rank: (ls["cuda_device"], v)
                    for rank, (ls, v) in allocated_by_rank(url).items()
                    if backends.get(rank) == "allocwatch"}
        found = wait_for(lambda: len(ranks()) == 2 and ranks(), timeout=90, interval=0.5,
                         what="both ranks with allocwatch's allocator on /metrics")
        assert {found["0"][0], found["1"][0]} == {"0", "1"}
        assert found["1"][1] > found["0"][1] >= 64 << 20
        assert child.wait(120) == 0
    finally:
        if child.poll() is None:
            child.kill()
        running.stop()
