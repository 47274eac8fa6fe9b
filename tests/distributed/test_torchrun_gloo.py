"""torchrun with two gloo ranks on the CPU, launched under `allocwatch run` as
bench/gpu/distributed_train.py launches them on GPUs, each rank's agent publishing to a real
sidecar (a process of its own) over its Unix socket, and a command sent through the admin API by
selector.

Why the simulated device: this machine's torch is a CPU build, and PyTorch's CPU allocator
keeps no statistics (torch.cpu has no memory_stats, torch.accelerator's need an accelerator,
the profiler's memory events come only after a run), so a CPU rank has no figures of PyTorch's
to publish. Each rank mirrors its own tensor storages (FSDP's shards and re-gathered parameters
included) into allocwatch's core on the simulated device (bench/lib/storage_mirror.py) and
publishes that core: the rank's real requests, which differ between ranks since each rank draws
its own shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO
from support.waiting import wait_for

pytest.importorskip("torch", reason="torch is not installed")
from bench.gpu import distributed_train as dt
from bench.lib.sidecar_process import SidecarProcess

pytestmark = pytest.mark.timeout(180)


def test_each_gloo_rank_has_its_own_series_and_a_reclaim_by_rank_reaches_that_rank_only(
        tmp_path: Path) -> None:
    sidecar = SidecarProcess("allocwatch-gloo-", agents_yaml="  expiry_seconds: 600\n").start()
    cmd = dt.launch_command(nproc=2, mode="fsdp", allocator="allocwatch", target=sidecar.target,
                            out=tmp_path, backend="gloo", device="cpu", steps=30, warmup=1,
                            interval=0.3, linger=3.0)
    launch = subprocess.Popen(cmd, env=dt.launch_environment("allocwatch", "gloo-test", 0.3),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        ranks = dt.wait_for_ranks(sidecar.metrics_url, 2, timeout=90,
                                  alive=lambda: launch.poll() is None)
        assert sorted(ranks) == ["0", "1"], ranks
        for rank, entry in ranks.items():
            assert entry["labels"]["rank"] == entry["labels"]["local_rank"] == rank
        probe = dt.reclaim_one_rank(sidecar, 1)
        assert probe["exit"] == 0, probe
        answer = json.loads(probe["answer"])
        assert [r["rank"] for r in answer["results"]] == [1] and answer["ok"]

        def calls() -> dict[str, float]:
            return {rank: entry["series"]["torch_cuda_allocator_empty_cache_calls_total"]
                    for rank, entry in dt.rank_series(sidecar.metrics_url).items()}
        seen = wait_for(lambda: calls().get("1", 0) >= 1 and calls(), timeout=20, interval=0.2,
                        what="rank 1's empty_cache in its series")
        assert seen["0"] == 0  # rank 0 never got the command
        output, _ = launch.communicate(timeout=120)
        assert launch.returncode == 0, output[-3000:]
        final = dt.rank_series(sidecar.metrics_url)
    finally:
        if launch.poll() is None:
            launch.kill()
        sidecar.stop()
    figures = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Lockstep: both ranks hold the same step times, each the slower rank's.
    assert figures[0]["step_s"] == figures[1]["step_s"] and len(figures[0]["step_s"]) == 30
    for f in figures:
        assert all(step >= own for step, own in zip(f["step_s"], f["own_step_s"], strict=True))
    # Each rank's own figures, the same in its result and in its series: its shapes are its own.
    peaks = [f["peak_requested_bytes"] for f in figures]
    assert peaks[0] != peaks[1] and min(peaks) > 0
    assert {r: final[str(r)]["series"]["torch_cuda_allocator_peak_reserved_bytes"]
            for r in (0, 1)} == {r: figures[r]["peak_reserved_bytes"] for r in (0, 1)}


def test_the_driver_refuses_an_unknown_mode_before_launching_anything(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu.distributed_train", "--modes",
                          "ddp,zero3", "--backend", "gloo", "--device", "cpu", "--out-dir",
                          str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "unknown mode zero3 (known: ddp, fsdp)" in out.stderr
    assert not (tmp_path / "out").exists()


def test_nccl_on_the_cpu_is_refused_with_the_way_out() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu.distributed_train", "--device", "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "use --backend gloo" in out.stderr
