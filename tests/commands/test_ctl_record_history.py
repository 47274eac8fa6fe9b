"""`allocwatch ctl record-history start|stop`: memory history switched on in a running job, whose
allocator has been in use for a while, and a snapshot taken then read by PyTorch's memory
viewer (`python -m torch.cuda._memory_viz`) and replayed by `allocwatch replay`.

Here the agent's source is allocwatch's core on the simulated device (its history is the core's
trace ring buffer). With PyTorch's allocator the agent calls
torch.cuda.memory._record_memory_history, which a CPU build of torch cannot run: the last test
checks the call against a stand-in for torch, and tests/agent/test_agent_torch_gpu.py has the
real one, with PyTorch's allocator and with the native back end (on a GPU)."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.control import connect_agent, start_control_sidecar
from support.paths import REPO

import allocator_ext as ae
from allocator_ext.agent.history import PROLOGUE
from allocator_ext.agent.sources import TorchSource
from exporter.cli import main
from exporter.commands.ctl.client import AdminClient, CtlError

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def train(allocator: Any, steps: int, held: list[int]) -> None:
    for step in range(steps):
        activations = [allocator.malloc((step % 7 + 1) * k * MiB, stream=0) for k in (1, 2, 3)]
        if step % 10 == 0:
            held.append(allocator.malloc(MiB, stream=0))  # kept: live when the history stops
        for ptr in reversed(activations):
            allocator.free(ptr)


@pytest.fixture
def running_job(tmp_path: Path):
    allocator = ae.Allocator(ae.SimDevice(capacity=8 << 30))
    weights = [allocator.malloc(size * MiB, stream=0) for size in (96, 40, 3)]
    held: list[int] = []
    train(allocator, 50, held)  # in use well before anyone asks for its history
    sidecar = start_control_sidecar(tmp_path)
    agent = connect_agent(sidecar, tmp_path, {0: allocator})
    (address,) = sidecar.sidecar.admin.addresses()
    try:
        yield allocator, address, held, tmp_path
    finally:
        agent.stop()
        sidecar.stop()
        for ptr in weights + held:
            allocator.free(ptr)


def test_history_started_mid_run_gives_a_snapshot_that_replays_and_opens_in_the_viewer(
        running_job, capsys: pytest.CaptureFixture[str]) -> None:
    allocator, address, held, tmp_path = running_job
    assert allocator.trace() == []  # no history so far
    assert main(["ctl", "--admin", address, "record-history", "start"]) == 0
    assert "memory history on for cuda:0 (the last 100000 entries)" in capsys.readouterr().out
    train(allocator, 40, held)
    snapshot = tmp_path / "snap.pickle.gz"
    assert main(["ctl", "--admin", address, "snapshot", "-o", str(snapshot)]) == 0
    assert main(["ctl", "--admin", address, "record-history", "stop"]) == 0
    assert "memory history off for cuda:0" in capsys.readouterr().out
    recorded = len(allocator.trace())
    train(allocator, 5, held)
    assert len(allocator.trace()) == recorded  # stopped

    # What the file holds: the state at the start as entries of their own, then the history.
    data = pickle.loads(gzip.decompress(snapshot.read_bytes()))
    [trace] = data["device_traces"]
    prologue = [e for e in trace if e.get("user_metadata") == PROLOGUE]
    assert prologue and trace[:len(prologue)] == prologue
    assert {e["action"] for e in prologue} == {"segment_map", "alloc"}
    assert sum(e["size"] for e in prologue if e["action"] == "alloc") >= 139 * MiB  # weights

    replayed = subprocess.run([sys.executable, "-m", "exporter.cli", "replay", str(snapshot),
                               "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["events_replayed"] == len(trace)  # the prologue's and the history's
    assert report["peak_reserved_bytes"] >= 139 * MiB and report["num_ooms"] == 0

    pytest.importorskip("torch", reason="PyTorch's memory viewer ships with torch")
    html = tmp_path / "trace.html"
    viewer = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", "-",
                             "-o", str(html)], input=gzip.decompress(snapshot.read_bytes()),
                            capture_output=True, timeout=120)
    assert viewer.returncode == 0, viewer.stderr.decode()
    assert html.stat().st_size > 10_000
    stats = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", "-"],
                           input=gzip.decompress(snapshot.read_bytes()), capture_output=True,
                           timeout=120)
    assert stats.returncode == 0 and b"segments" in stats.stdout.lower(), stats.stderr.decode()


def test_without_the_prologue_the_same_history_would_be_refused(running_job) -> None:
    """The reason for the prologue: a history begun mid-run does not start from an empty
    allocator, and a replay of it cannot know what was already there."""
    from allocator_ext.replay.engine import replay
    from allocator_ext.replay.trace import TraceError, parse_snapshot

    allocator, _, held, _ = running_job
    allocator.record_history(True, 100_000)
    train(allocator, 10, held)
    with pytest.raises(TraceError, match="does not start from an empty allocator|inside no seg"):
        replay(parse_snapshot(allocator.snapshot()))


@pytest.mark.parametrize(("entries", "body", "message"), [
    ("20000000", {"enabled": True, "max_entries": 20_000_000}, "max_entries: expected 0"),
    ("-1", {"enabled": True, "max_entries": -1}, "max_entries: expected 0"),
    ("1.5", {"enabled": "yes"}, "enabled: expected true or false"),
])
def test_bad_arguments_are_refused_and_change_nothing(
        running_job, entries: str, body: dict[str, Any], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """ctl refuses before it sends anything; the admin API refuses the same for any client."""
    allocator, address, held, _ = running_job
    with pytest.raises(SystemExit) as refused:
        main(["ctl", "--admin", address, "record-history", "start", "--max-entries", entries])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-entries: " in err and entries in err, err
    with pytest.raises(CtlError, match=rf"refused \(400\): {message}"):
        AdminClient(address, timeout=10).post("/v1/record-history", body)
    train(allocator, 2, held)
    assert allocator.trace() == []


class RecordingTorch:
    """A stand-in for torch (a CPU build cannot record CUDA memory history): it records the
    call TorchSource makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        memory = type("memory", (), {"_record_memory_history":
                                     lambda _self, *a, **k: self.calls.append((a, k))})()
        self.cuda = type("cuda", (), {"memory": memory})()


def test_with_pytorchs_allocator_the_agent_calls_record_memory_history() -> None:
    torch = RecordingTorch()
    source = TorchSource(torch)
    source.record_history(1, True, 5000)
    source.record_history(1, False, 5000)
    assert torch.calls == [(("all",), {"max_entries": 5000, "device": 1}),
                           ((None,), {"max_entries": 5000, "device": 1})]


def test_a_source_without_memory_history_answers_unsupported(tmp_path: Path) -> None:
    """A Source written before record_history existed keeps working; the command says why not."""
    from support.sidecar import FakeSource

    from allocator_ext.agent.commands import execute
    from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

    class OlderSource(FakeSource):
        record_history = None  # type: ignore[assignment]

    result = execute(pb.Command(cuda_device=-1, record_history=pb.RecordHistory(enabled=True)),
                     OlderSource(), tmp_path, rank=0)
    assert result.status == pb.CommandResult.UNSUPPORTED
    assert "no memory history" in result.message
