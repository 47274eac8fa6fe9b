"""PyTorch's own allocator as the agent's source, on a real GPU (skipped elsewhere, saying why).

Runs for real on the H200 machine: torch.cuda.memory_stats for every device the process uses,
the GPU's UUID from torch, NVML device figures from the agent, and the reclaim/reset/settings
commands mapped onto PyTorch's calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.environment import without_allocwatch
from support.sidecar import MiB, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
]


def test_pytorch_source_on_the_gpu(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    torch.cuda.init()
    device = torch.device("cuda", 0)
    keep = [torch.empty(64 * MiB, dtype=torch.uint8, device=device) for _ in range(4)]
    scratch = [torch.empty(32 * MiB, dtype=torch.uint8, device=device) for _ in range(4)]
    del scratch
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1, source="pytorch",
                        identity={"rank": 0}, stop_at_exit=False)
    try:
        uuid = agent.identity.gpu_uuid
        assert uuid.startswith("GPU-"), uuid
        wait_for(lambda: values(url, "torch_cuda_allocator_allocated_bytes", gpu_uuid=uuid),
                 what="series of cuda:0")
        assert values(url, "torch_cuda_allocator_allocated_bytes", gpu_uuid=uuid)[0] >= 256 * MiB
        assert values(url, "torch_cuda_allocator_info", backend="pytorch") == [1.0]
        assert values(url, "allocwatch_gpu_memory_total_bytes", gpu_uuid=uuid)[0] > 0
        reserved = torch.cuda.memory_reserved(0)
        session = running.sidecar.registry.agents()[0].session
        assert session is not None
        result = running.call(session.send(
            pb.Command(cuda_device=0, reclaim=pb.Reclaim(mode=pb.Reclaim.EMPTY_CACHE))))
        assert result.status == pb.CommandResult.OK, result.message
        assert result.bytes_released == reserved - torch.cuda.memory_reserved(0)
        assert result.bytes_released >= 128 * MiB
        result = running.call(session.send(pb.Command(
            set_config=pb.SetConfig(settings="garbage_collection_threshold:0.9"))))
        assert result.status == pb.CommandResult.OK, result.message
        assert result.settings_in_force[0].settings.garbage_collection_threshold == 0.9
    finally:
        agent.stop()
        running.stop()
        del keep


def test_record_history_mid_run_with_pytorchs_allocator(tmp_path: Path) -> None:
    """record_history on PyTorch's allocator, switched on while tensors are live: the snapshot
    replays (its prologue holds them) and PyTorch's memory viewer reads it."""
    import gzip
    import pickle
    import subprocess
    import sys

    from allocator_ext.agent.history import PROLOGUE
    from allocator_ext.replay.engine import replay
    from allocator_ext.replay.trace import parse_snapshot

    running = start_sidecar(tmp_path)
    torch.cuda.init()
    device = torch.device("cuda", 0)
    weights = [torch.empty(64 * MiB, dtype=torch.uint8, device=device) for _ in range(3)]
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1, source="pytorch",
                        identity={"rank": 0}, snapshot_dir=tmp_path / "snapshots",
                        stop_at_exit=False)
    try:
        wait_for(lambda: running.sidecar.registry.agents(), what="the agent")
        session = running.sidecar.registry.agents()[0].session
        on = running.call(session.send(pb.Command(
            cuda_device=0, record_history=pb.RecordHistory(enabled=True, max_entries=100_000))))
        assert on.status == pb.CommandResult.OK, on.message
        for step in range(20):
            activations = [torch.empty((step + 1) * k * MiB, dtype=torch.uint8, device=device)
                           for k in (1, 2, 3)]
            del activations
        taken = running.call(session.send(pb.Command(cuda_device=0, snapshot=pb.Snapshot())))
        assert taken.status == pb.CommandResult.OK, taken.message
        data = pickle.loads(gzip.decompress(Path(taken.snapshot_path).read_bytes()))
        trace = data["device_traces"][0]
        assert any(e.get("user_metadata") == PROLOGUE for e in trace)
        replay(parse_snapshot(data, device=0), config="native")
        viewer = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot",
                                 "-", "-o", str(tmp_path / "t.html")],
                                input=pickle.dumps(data), capture_output=True, timeout=120)
        assert viewer.returncode == 0, viewer.stderr.decode()
        off = running.call(session.send(pb.Command(
            cuda_device=0, record_history=pb.RecordHistory(enabled=False))))
        assert off.status == pb.CommandResult.OK, off.message
    finally:
        agent.stop()
        running.stop()
        del weights


NATIVE_HISTORY = """
import gzip, pickle, subprocess, sys
from pathlib import Path

tests, tmp = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(tests))
from support.sidecar import MiB, start_sidecar
from support.waiting import wait_for

running = start_sidecar(tmp)  # listens where ALLOCWATCH_TARGET points, before install()
import torch
import allocator_ext
from allocator_ext import torch_integration
from allocator_ext.agent.history import PROLOGUE
from allocator_ext.replay.engine import replay
from allocator_ext.replay.trace import parse_snapshot
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

assert allocator_ext.install() and torch_integration.native(), "the native back end is not in"
device = torch.device("cuda", 0)
weights = [torch.empty(64 * MiB, dtype=torch.uint8, device=device) for _ in range(3)]
state = wait_for(lambda: [a for a in running.sidecar.registry.agents() if a.session], timeout=30,
                 what="the agent install() started")[0]
assert state.identity.backend == "allocwatch", state.identity.backend
session = state.session
OK = pb.CommandResult.OK

def command(**action):
    result = running.call(session.send(pb.Command(cuda_device=0, **action)))
    assert result.status == OK, result.message
    return result

def allocs(trace):
    return [(e["action"], e["addr"], e["size"]) for e in trace
            if e.get("user_metadata") != PROLOGUE and e["action"] == "alloc"]

command(record_history=pb.RecordHistory(enabled=True, max_entries=100_000))
for step in range(20):
    activations = [torch.empty((step + 1) * k * MiB, dtype=torch.uint8, device=device)
                   for k in (1, 2, 3)]
    del activations
# PyTorch's own call reads the buffer the command switched on.
from_torch = torch.cuda.memory._snapshot()["device_traces"][0]
assert len(allocs(from_torch)) == 60, len(allocs(from_torch))
data = pickle.loads(gzip.decompress(Path(command(snapshot=pb.Snapshot()).snapshot_path)
                                    .read_bytes()))
trace = data["device_traces"][0]
assert any(e.get("user_metadata") == PROLOGUE for e in trace)  # the weights, live at the start
assert allocs(trace) == allocs(from_torch)
replay(parse_snapshot(data, device=0), config="native")
viewer = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", "-",
                         "-o", str(tmp / "t.html")], input=pickle.dumps(data),
                        capture_output=True, timeout=120)
assert viewer.returncode == 0, viewer.stderr.decode()
command(record_history=pb.RecordHistory(enabled=False))
extra = torch.empty(8 * MiB + 4096, dtype=torch.uint8, device=device)  # a size no step makes
# Stopped: nothing more is recorded (PyTorch's recordHistory(false) also empties the buffer).
after = allocs(torch.cuda.memory._snapshot()["device_traces"][0])
assert not any(size == 8 * MiB + 4096 for _, _, size in after), after[-3:]
running.stop()
print("PASS native record-history")
"""


def test_record_history_mid_run_with_the_native_back_end(tmp_path: Path) -> None:
    """allocwatch's allocator serving torch through the native back end: record_history sent to
    the agent install() started switches on the core's ring buffer, the one PyTorch's own
    torch.cuda.memory._snapshot() reads; the agent's snapshot replays and opens in the viewer,
    and after `stop` nothing more is recorded. In a fresh process: install() precedes CUDA."""
    import subprocess
    import sys

    env = without_allocwatch(ALLOCWATCH_TARGET=f"unix://{tmp_path / 'run' / 'agent.sock'}")
    out = subprocess.run([sys.executable, "-c", NATIVE_HISTORY, str(Path(__file__).parents[1]),
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "PASS native record-history" in out.stdout


SPAWNING_TRAINER = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.02)  # the workers live a while
        return torch.full((16,), float(i * i))


if __name__ == "__main__":
    weights = torch.ones(1 << 20, device="cuda")
    loader = DataLoader(Squares(), batch_size=4, num_workers=3,
                        multiprocessing_context="spawn")
    for _ in range(2):  # two epochs: the workers end and are spawned again
        for batch in loader:
            weights += batch.cuda().sum()
    torch.cuda.synchronize()
    time.sleep(float(sys.argv[1]))
    print("done", flush=True)
"""


def test_spawned_dataloader_workers_stay_out_of_the_sidecar(tmp_path: Path) -> None:
    # Each worker imports torch, so `allocwatch run`'s hook starts an agent in it; none uses the
    # GPU, so none connects: the sidecar sees the trainer alone, epoch after epoch.
    import subprocess
    import sys

    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    script = tmp_path / "spawning_trainer.py"
    script.write_text(SPAWNING_TRAINER)
    env = without_allocwatch(ALLOCWATCH_TARGET=running.sidecar.agent_targets[0],
                             ALLOCWATCH_INTERVAL="0.1")
    seen: list[float] = []
    try:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", "run", "--", sys.executable, str(script), "3"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while trainer.poll() is None:
            seen += values(url, "allocwatch_agents_connected")
        out = trainer.communicate(timeout=60)[0]
        assert trainer.returncode == 0 and "done" in out, out[-3000:]
        assert max(seen) == 1.0, seen  # the trainer, never a worker beside it
    finally:
        running.stop()


def test_pytorchs_snapshot_keeps_the_memory_fraction_in_force() -> None:
    # What the agent writes at an out-of-memory error keeps PyTorch's cap, which PyTorch's
    # snapshot does not, so that `ctl diagnose --replay` replays under it.
    from allocator_ext.agent.sources import TorchSource
    from allocator_ext.replay.trace import RECORDING_KEY

    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.37, 0)
    try:
        kept = TorchSource().snapshot(0)[RECORDING_KEY]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert kept["device_total_bytes"] == total
    assert int(kept["memory_fraction"] * total) == int(0.37 * total)
    assert TorchSource().snapshot(0)[RECORDING_KEY]["memory_fraction"] is None  # 1.0: no cap
