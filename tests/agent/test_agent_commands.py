"""The agent over our allocator core (simulated device): figures reach /metrics, and the
sidecar's commands (set_config, reclaim, reset_peaks, snapshot) work and answer with the
settings in force."""

from __future__ import annotations

import gzip
import pickle
import stat
from pathlib import Path

import pytest
from support.sidecar import MiB, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")

pytestmark = pytest.mark.timeout(60)
Status = pb.CommandResult.Status


@pytest.fixture
def setup(tmp_path: Path):
    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    device = ae.SimDevice(capacity=0)
    allocator = ae.Allocator(device)
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1,
                        source={0: allocator}, identity={"rank": 0},
                        snapshot_dir=tmp_path / "snapshots", nvml=False, stop_at_exit=False)
    wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0], what="agent")
    yield running, url, allocator, agent, tmp_path
    agent.stop()
    running.stop()


def _send(running, command: pb.Command) -> pb.CommandResult:
    state = running.sidecar.registry.agents()[0]
    assert state.session is not None
    return running.call(state.session.send(command, timeout=10))


def test_real_allocator_figures_reach_metrics(setup) -> None:
    running, url, allocator, agent, _ = setup
    blocks = [allocator.malloc(30 * MiB) for _ in range(4)] + [allocator.malloc(1000)]
    stats = allocator.stats()
    wait_for(lambda: values(url, "torch_cuda_allocator_allocated_bytes")
             == [float(stats["allocated_bytes.all.current"])], what="allocated bytes")
    assert values(url, "torch_cuda_allocator_reserved_bytes") == [
        float(stats["reserved_bytes.all.current"])]
    assert values(url, "torch_cuda_allocator_pool_allocated_bytes", pool="small") == [
        float(stats["allocated_bytes.small_pool.current"])]
    assert values(url, "torch_cuda_allocator_device_mallocs_total") == [
        float(stats["num_device_alloc"])]
    assert values(url, "torch_cuda_allocator_allocations_total") == [
        float(stats["allocation.all.allocated"])]
    info = values(url, "torch_cuda_allocator_info", backend="allocwatch")
    assert info == [1.0]
    for b in blocks:
        allocator.free(b)


def test_set_config_changes_only_named_key_and_reports_settings(setup) -> None:
    running, url, allocator, agent, _ = setup
    before = allocator.config()
    result = _send(running, pb.Command(
        cuda_device=-1, set_config=pb.SetConfig(settings="garbage_collection_threshold:0.6")))
    assert result.status == Status.OK, result.message
    assert allocator.config()["garbage_collection_threshold"] == pytest.approx(0.6)
    assert allocator.config()["expandable_segments"] == before["expandable_segments"]
    (in_force,) = result.settings_in_force
    assert in_force.settings.garbage_collection_threshold == pytest.approx(0.6)
    assert "garbage_collection_threshold:0.6" in in_force.settings.config_string
    wait_for(lambda: values(url, "torch_cuda_allocator_gc_threshold_ratio") == [0.6],
             what="the new threshold on /metrics")
    assert values(url, "allocwatch_commands_total", command="set_config", result="ok") == [1.0]


def test_bad_set_config_changes_nothing(setup) -> None:
    running, url, allocator, agent, _ = setup
    before = allocator.config_string()
    result = _send(running, pb.Command(cuda_device=-1, set_config=pb.SetConfig(
        settings="garbage_collection_threshold:0.7,bogus_key:1")))
    assert result.status == Status.INVALID_ARGUMENT
    assert "bogus_key" in result.message
    assert allocator.config_string() == before
    result = _send(running, pb.Command(set_config=pb.SetConfig(settings="")))
    assert result.status == Status.INVALID_ARGUMENT
    assert values(url, "allocwatch_commands_total", command="set_config",
                  result="invalid_argument") == [2.0]


def test_reclaim_releases_cached_memory(setup) -> None:
    running, url, allocator, agent, _ = setup
    blocks = [allocator.malloc(50 * MiB) for _ in range(6)]
    for b in blocks:
        allocator.free(b)
    reserved = allocator.stats()["reserved_bytes.all.current"]
    assert reserved >= 300 * MiB
    wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes") == [float(reserved)],
             what="reserved bytes before the reclaim")
    result = _send(running, pb.Command(cuda_device=0,
                                       reclaim=pb.Reclaim(mode=pb.Reclaim.EMPTY_CACHE)))
    assert result.status == Status.OK, result.message
    assert result.bytes_released == reserved - allocator.stats()["reserved_bytes.all.current"]
    assert result.bytes_released >= 300 * MiB and result.sync_seconds >= 0
    # Reserved falls in the same run, as Prometheus sees it.
    wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes")[0] < reserved,
             what="reserved to fall")


def test_reclaim_during_a_graph_capture_is_refused_and_releases_nothing(setup) -> None:
    # A reclaim from the sidecar arrives on the agent's thread at any moment; releasing memory
    # waits for streams, which would invalidate a CUDA graph being captured in training.
    running, url, allocator, agent, _ = setup
    for b in [allocator.malloc(50 * MiB) for _ in range(4)]:
        allocator.free(b)
    reserved = allocator.stats()["reserved_bytes.all.current"]
    allocator.begin_allocate_to_pool((1, 0), 7)
    assert allocator.capture_underway
    result = _send(running, pb.Command(cuda_device=0,
                                       reclaim=pb.Reclaim(mode=pb.Reclaim.EMPTY_CACHE)))
    assert result.status == Status.FAILED
    assert "graph is being captured on cuda:0" in result.message
    assert result.bytes_released == 0
    assert allocator.stats()["reserved_bytes.all.current"] == reserved
    assert allocator.empty_cache() == 0       # the core itself refuses too (torch's hook)
    allocator.end_allocate_to_pool((1, 0))
    result = _send(running, pb.Command(cuda_device=0,
                                       reclaim=pb.Reclaim(mode=pb.Reclaim.EMPTY_CACHE)))
    assert result.status == Status.OK and result.bytes_released >= 200 * MiB


def test_reclaim_of_a_device_the_process_does_not_use(setup) -> None:
    running, url, allocator, agent, _ = setup
    result = _send(running, pb.Command(cuda_device=3, reclaim=pb.Reclaim()))
    assert result.status == Status.INVALID_ARGUMENT
    assert "cuda_device 3 is not used by this process" in result.message


def test_reset_peaks(setup) -> None:
    running, url, allocator, agent, _ = setup
    block = allocator.malloc(200 * MiB)
    allocator.free(block)
    small = allocator.malloc(1 * MiB)
    assert allocator.stats()["allocated_bytes.all.peak"] >= 200 * MiB
    result = _send(running, pb.Command(cuda_device=-1, reset_peaks=pb.ResetPeaks()))
    assert result.status == Status.OK
    assert allocator.stats()["allocated_bytes.all.peak"] < 200 * MiB
    wait_for(lambda: values(url, "torch_cuda_allocator_peak_allocated_bytes")[0] < 200 * MiB,
             what="the peak to reset on /metrics")
    allocator.free(small)


def test_snapshot_written_without_frames_unless_asked(setup) -> None:
    running, url, allocator, agent, tmp_path = setup
    allocator.record_history(True)
    block = allocator.malloc(3 * MiB)
    result = _send(running, pb.Command(cuda_device=-1, snapshot=pb.Snapshot()))
    assert result.status == Status.OK, result.message
    path = Path(result.snapshot_path)
    assert path.parent == tmp_path / "snapshots"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.stat().st_size == result.snapshot_bytes
    with gzip.open(path) as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces"} <= snapshot.keys()
    assert any(seg["total_size"] > 0 for seg in snapshot["segments"])

    def frames(value) -> int:
        if isinstance(value, dict):
            return sum(len(v) if k == "frames" else frames(v) for k, v in value.items())
        if isinstance(value, list):
            return sum(frames(v) for v in value)
        return 0

    assert frames(snapshot) == 0
    tiny = _send(running, pb.Command(snapshot=pb.Snapshot(max_bytes=10)))
    assert tiny.status == Status.INVALID_ARGUMENT and "above the cap" in tiny.message
    allocator.free(block)


def test_command_to_a_departed_agent_fails_cleanly(setup) -> None:
    running, url, allocator, agent, _ = setup
    state = running.sidecar.registry.agents()[0]
    session = state.session
    agent.stop()
    wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], what="departure")
    from exporter.shared.registry import AgentGoneError

    with pytest.raises(AgentGoneError):
        running.call(session.send(pb.Command(reset_peaks=pb.ResetPeaks()), timeout=5))
