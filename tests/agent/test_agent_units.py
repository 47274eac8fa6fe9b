"""The agent's small parts: identity from the environment, the bounded outbox, backoff,
stats conversion, and the PyTorch source's settings handling."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from allocator_ext.agent import convert
from allocator_ext.agent.backoff import Backoff
from allocator_ext.agent.identity import build_identity, visible_device_entry
from allocator_ext.agent.outbox import Outbox
from allocator_ext.agent.sources import TorchSource
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb


def test_identity_from_torchrun_and_kubernetes_env() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "none",
           "JOB_NAME": "llm-7b", "POD_NAME": "llm-7b-worker-1", "POD_NAMESPACE": "training",
           "NODE_NAME": "gpu-node-3"}
    ident = build_identity(env, backend="pytorch", cuda_device=1, gpu_uuid="GPU-x")
    assert (ident.rank, ident.local_rank, ident.world_size) == (5, 1, 16)
    assert ident.training_job == "llm-7b" and ident.pod == "llm-7b-worker-1"
    assert ident.namespace == "training" and ident.node == "gpu-node-3"
    assert ident.pid == os.getpid() and len(ident.instance_id) == 32
    assert ident.cuda_device == 1 and ident.gpu_uuid == "GPU-x" and ident.backend == "pytorch"


def test_identity_precedence_and_unknowns() -> None:
    ident = build_identity({"ALLOCWATCH_RANK": "2", "RANK": "9", "TORCHELASTIC_RUN_ID": "abc",
                            "ALLOCWATCH_GPU_UUID": "GPU-env", "LOCAL_RANK": "x"},
                           gpu_uuid="GPU-probe")
    assert ident.rank == 2 and ident.training_job == "abc"
    assert ident.gpu_uuid == "GPU-env"
    assert ident.local_rank == -1 and ident.world_size == -1 and ident.cuda_device == -1
    assert build_identity({}, overrides={"training_job": "x"}).training_job == "x"
    with pytest.raises(AttributeError):
        build_identity({}, overrides={"no_such_field": 1})


def test_visible_devices_mapping() -> None:
    assert visible_device_entry({}, 2) == "2"
    assert visible_device_entry({"CUDA_VISIBLE_DEVICES": "3,1"}, 1) == "1"
    assert visible_device_entry({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, 0) == "GPU-a"
    assert visible_device_entry({"CUDA_VISIBLE_DEVICES": "3"}, 1) is None


def _report(seq: int) -> pb.AgentMessage:
    return pb.AgentMessage(report=pb.Report(sequence=seq))


def test_outbox_drops_oldest_and_results_go_first() -> None:
    box = Outbox(capacity=3)
    for seq in range(1, 6):
        box.put_report(_report(seq))
    assert box.dropped == 2 and len(box) == 3
    box.put_result(pb.AgentMessage(command_result=pb.CommandResult(command_id=9)))
    first = box.get(timeout=0)
    assert first is not None and first.command_result.command_id == 9
    got = [box.get(timeout=0) for _ in range(3)]
    assert [m.report.sequence for m in got if m is not None] == [3, 4, 5]
    assert box.get(timeout=0.01) is None


def test_backoff_grows_with_jitter_to_a_ceiling_and_resets() -> None:
    backoff = Backoff(initial=0.2, maximum=2.0, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(10)]
    assert 0.1 <= delays[0] <= 0.2
    assert all(d <= 2.0 for d in delays) and max(delays) > 1.0
    assert len(set(delays)) == len(delays)  # jittered
    backoff.reset()
    assert backoff.next_delay() <= 0.2


def test_stats_conversion_from_torch_keys() -> None:
    stats = {"allocated_bytes.all.current": 10, "reserved_bytes.large_pool.current": 20,
             "segment.small_pool.current": 3, "num_alloc_retries": 4, "num_ooms": 1,
             "allocation.all.allocated": 99, "reserved_bytes.all.peak": 50}
    converted = convert.allocator_stats(stats)
    assert converted.all.allocated_bytes == 10 and converted.large_pool.reserved_bytes == 20
    assert converted.small_pool.segments == 3 and converted.alloc_retries == 4
    assert converted.allocations == 99 and converted.all.peak_reserved_bytes == 50
    assert converted.pending_events == 0  # PyTorch has no such key


def test_settings_parsing() -> None:
    assert convert.parse_settings_string("native, expandable_segments:True") == {
        "native": "", "expandable_segments": "True"}
    with pytest.raises(ValueError, match="has no value"):
        convert.parse_settings_string("max_split_size_mb")
    settings = convert.allocator_settings(
        {"garbage_collection_threshold": "0.8", "max_split_size_mb": "512",
         "expandable_segments": "True"})
    assert settings.garbage_collection_threshold == 0.8
    assert settings.max_split_size_bytes == 512 << 20 and settings.expandable_segments
    assert convert.allocator_settings({"max_split_size": -1}).max_split_size_bytes == 0
    assert convert.allocator_settings({"max_split_size": 2**64 - 1}).max_split_size_bytes == 0


class _FakeTorch:
    """A stand-in for torch (no CUDA build of torch can run here): records the settings PyTorch
    would receive, to check the agent sends the full string each time."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        memory = SimpleNamespace(_set_allocator_settings=self._set)
        self.cuda = SimpleNamespace(memory=memory)
        self.__version__ = "2.11.0"
        self.version = SimpleNamespace(cuda="13.0")

    def _set(self, text: str) -> None:
        if "bogus" in text:
            raise RuntimeError("Unrecognized key 'bogus' in CUDA allocator config.")
        self.applied.append(text)


class _FractionTorch:
    """A stand-in for torch's CUDA memory calls (no CUDA build of torch runs here): PyTorch's
    allocator reports its memory fraction as its limit in bytes over the device's total, and
    1.0 where none is set."""

    def __init__(self, total: int, allowed: int | None, has_getter: bool = True) -> None:
        props = SimpleNamespace(total_memory=total)
        self.cuda = SimpleNamespace(
            memory=SimpleNamespace(_snapshot=lambda: {"segments": [], "device_traces": [[]]}),
            get_device_properties=lambda device: props)
        if has_getter:
            self.cuda.get_per_process_memory_fraction = (
                lambda device: 1.0 if allowed is None else allowed / total)


H200_TOTAL = 150_109_880_320  # bytes, as cudaMemGetInfo reports an H200's


# 300 MiB + 21 bytes over the H200's total, multiplied back, falls a byte short of the limit.
@pytest.mark.parametrize("allowed", [None, H200_TOTAL // 2, int(0.0762 * H200_TOTAL),
                                     300 * (1 << 20) + 21])
def test_torch_source_snapshot_keeps_pytorchs_memory_fraction_to_the_byte(
        allowed: int | None) -> None:
    from allocator_ext.replay.trace import RECORDING_KEY, parse_snapshot

    snapshot = TorchSource(_FractionTorch(H200_TOTAL, allowed)).snapshot(0)
    assert snapshot["segments"] == []  # PyTorch's snapshot, as it was
    kept = snapshot[RECORDING_KEY]
    assert kept["device_total_bytes"] == H200_TOTAL
    if allowed is None:
        assert kept["memory_fraction"] is None
        return
    # A replay sets the kept fraction on a device of the kept total: PyTorch's very limit.
    assert int(kept["memory_fraction"] * H200_TOTAL) == allowed
    one_event = [[{"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 0}]]
    assert parse_snapshot({**snapshot, "device_traces": one_event}).limits.memory_fraction \
        == kept["memory_fraction"]


def test_torch_source_snapshot_of_a_torch_that_cannot_say_its_fraction_keeps_the_total() -> None:
    from allocator_ext.replay.trace import RECORDING_KEY

    snapshot = TorchSource(_FractionTorch(1 << 30, 1 << 29, has_getter=False)).snapshot(0)
    assert snapshot[RECORDING_KEY] == {"memory_fraction": None, "device_total_bytes": 1 << 30}


def test_torch_source_sends_the_whole_settings_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:256")
    torch = _FakeTorch()
    source = TorchSource(torch)
    source.set_config("garbage_collection_threshold:0.7")
    assert torch.applied[-1] == ("expandable_segments:True,max_split_size_mb:256,"
                                 "garbage_collection_threshold:0.7")
    with pytest.raises(ValueError, match="bogus"):
        source.set_config("bogus:1")
    settings = source.settings(0)
    assert settings.garbage_collection_threshold == 0.7  # unchanged by the refused one
    assert settings.max_split_size_bytes == 256 << 20 and settings.expandable_segments
    assert source.versions() == ("2.11.0", "13.0")
