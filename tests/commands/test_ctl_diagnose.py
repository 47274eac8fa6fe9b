"""`allocwatch ctl diagnose`: the troubleshooting order on live figures of our core, the classic
mistakes seen from counters, the snapshot replayed under candidates, and --apply."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest
from support.admin import call
from support.control import connect_agent, start_control_sidecar
from support.sidecar import MiB
from support.waiting import wait_for

from exporter.cli import main
from exporter.commands.ctl.diagnose import (
    EXPANDABLE,
    GC_THRESHOLD,
    MAX_SPLIT,
    diagnose,
    print_diagnosis,
)

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_agent(tmp_path: Path):
    running = start_control_sidecar(tmp_path)
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")
    allocator.record_history(True)  # from the start, so that its snapshot replays
    agent = connect_agent(running, tmp_path, {0: allocator}, rank=0)
    (address,) = running.sidecar.admin.addresses()
    yield address, allocator
    agent.stop()
    running.stop()


def growing_blocks(allocator) -> None:
    """Each large block freed before a larger one: fixed segments strand them (260 MiB reserved
    for 8 MiB in use under PyTorch's defaults, 140 MiB with expandable segments)."""
    for size in (30, 50, 70, 90):
        block = allocator.malloc(size * MiB)
        allocator.malloc(2 * MiB)
        allocator.free(block)


def test_fragmented_agent_walks_the_order_replays_and_applies(
        one_agent, capsys: pytest.CaptureFixture[str]) -> None:
    address, allocator = one_agent
    growing_blocks(allocator)

    def idle_since() -> bool:  # a report of an interval after the blocks: 8 MiB at its peak
        (device,) = call(address, "GET", "/v1/agents")[1]["agents"][0]["devices"]
        return device["reserved_bytes"] == 260 * MiB and device["interval_peaks"] == {
            "window": "interval", "allocated_bytes": 8 * MiB, "reserved_bytes": 260 * MiB}

    wait_for(idle_since, what="a report of an idle interval after the blocks")
    assert main(["ctl", "--admin", address, "diagnose", "--window", "0.2", "--replay",
                 "--apply"]) == 0
    out = capsys.readouterr().out
    steps = [line.split(":")[0] for line in out.splitlines() if line[:2] in
             ("1.", "2.", "3.", "4.", "5.")]
    assert steps == ["1. retries and peak fragmentation", "2. expandable segments",
                     "3. max_split_size_mb", "4. garbage_collection_threshold", "5. snapshot"]
    # At its peak the process held 98 MiB in 260 MiB reserved (since its start: the intervals
    # seen were idle, and say more), and now 8 MiB.
    assert "peak fragmentation 0.62 (98.0 MiB allocated at the peak of 260.0 MiB reserved, " \
           "since the process's last peak reset; 252.0 MiB of 260.0 MiB cached and unused " \
           "right now): no retries, fragmented cache" in out
    assert f"would apply: {EXPANDABLE}" in out
    # The replay measured each candidate on this process's own trace.
    assert "native: peak reserved 260.0 MiB" in out
    assert f"native,{EXPANDABLE}: peak reserved 140.0 MiB" in out
    assert f"lowest peak reserved: native,{EXPANDABLE}" in out
    assert f"recommendation: native,{EXPANDABLE}" in out
    # --apply: the recommendation is now in force in the process.
    assert allocator.config()["expandable_segments"] is True
    assert "settings in force: native,expandable_segments:True" in out


def test_empty_cache_every_step_is_named(one_agent, capsys: pytest.CaptureFixture[str]) -> None:
    address, allocator = one_agent
    stop = threading.Event()

    def training_steps() -> None:  # the mistake: empty_cache() at the end of each step
        while not stop.is_set():
            block = allocator.malloc(64 * MiB)
            allocator.free(block)
            allocator.empty_cache()
            stop.wait(0.02)

    thread = threading.Thread(target=training_steps)
    thread.start()
    try:
        assert main(["ctl", "--admin", address, "diagnose", "--window", "1"]) == 0
    finally:
        stop.set()
        thread.join()
    out = capsys.readouterr().out
    assert "empty_cache() called every step" in out
    assert "device-wide synchronisations" in out
    assert "recommendation: none" in out  # nothing is fragmented: only the mistake to fix
    assert "add --replay" in out


def test_diagnose_needs_one_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    running = start_control_sidecar(tmp_path)
    agents = [connect_agent(running, tmp_path, {0: ae.Allocator(ae.SimDevice(capacity=0))},
                            rank=rank) for rank in (0, 1)]
    (address,) = running.sidecar.admin.addresses()
    try:
        assert main(["ctl", "--admin", address, "diagnose", "--window", "0.01"]) == 2
        assert "diagnose looks at one agent: 2 connected agents match" in \
            capsys.readouterr().err
        assert main(["ctl", "--admin", address, "diagnose", "--rank", "1",
                     "--window", "0.01"]) == 0
    finally:
        for agent in agents:
            agent.stop()
        running.stop()


def device(*, reserved: int, allocated: int, retries: int = 0, expandable: bool = False,
           gc: float = 0.0, split: int = 0, large_reserved: int = 0,
           peak_allocated: int | None = None) -> dict:
    """One device as the admin API shows it; its peaks those of the figures given unless
    `peak_allocated` says otherwise."""
    counters = dict.fromkeys(("alloc_retries", "ooms", "device_mallocs", "device_frees",
                              "sync_all_streams", "gc_reclaims", "gc_reclaimed_bytes",
                              "empty_cache_calls", "allocations"), 0)
    counters["alloc_retries"] = retries
    peak_allocated = allocated if peak_allocated is None else peak_allocated
    return {"cuda_device": 0, "reserved_bytes": reserved, "allocated_bytes": allocated,
            "peak_allocated_bytes": peak_allocated, "peak_reserved_bytes": reserved,
            "peak_fragmentation_ratio": 1 - peak_allocated / reserved,
            "interval_peaks": {"window": "interval", "allocated_bytes": peak_allocated,
                               "reserved_bytes": reserved},
            "pending_events": 0, "pending_free_bytes": 0, "counters": counters,
            "large_pool": {"inactive_split_bytes": split, "reserved_bytes": large_reserved},
            "settings": {"expandable_segments": expandable, "garbage_collection_threshold": gc,
                         "max_split_size_bytes": None, "config_string": ""}}


def test_order_of_proposals() -> None:
    healthy = device(reserved=100 * MiB, allocated=95 * MiB)
    assert diagnose("a", healthy, healthy, 1.0).recommendation is None
    # Pressure with everything off: expandable segments first.
    pressed = device(reserved=100 * MiB, allocated=95 * MiB, retries=4)
    d = diagnose("a", pressed, pressed, 1.0)
    assert [s.proposal for s in d.steps] == [None, EXPANDABLE, None, GC_THRESHOLD, None]
    assert d.recommendation == EXPANDABLE
    # Expandable segments already on: the GC threshold is next.
    on = device(reserved=100 * MiB, allocated=95 * MiB, retries=4, expandable=True)
    assert diagnose("a", on, on, 1.0).recommendation == GC_THRESHOLD
    # Split remainders stranded: max_split_size_mb is offered as the alternative.
    split = device(reserved=200 * MiB, allocated=100 * MiB, split=80 * MiB,
                   large_reserved=180 * MiB)
    assert [s.proposal for s in diagnose("a", split, split, 1.0).steps][:3] == [
        None, EXPANDABLE, MAX_SPLIT]


def test_the_snapshot_step_proposes_only_a_setting_under_which_a_recorded_oom_does_not_recur(
        ) -> None:
    from support.capped_run import record_capped_run

    from allocator_ext.replay.trace import parse_snapshot
    from allocator_ext.replay.tune import tune
    from exporter.commands.ctl.diagnose import Replayed, replay_cap

    snapshot, stats = record_capped_run()  # PyTorch's settings ran out of memory under a cap
    trace = parse_snapshot(snapshot)
    cap, described, can_recur = replay_cap(trace, gpu_bytes=80 << 30)
    assert can_recur and described.startswith("the cap the snapshot keeps (256.00 MiB allowed")
    ranked = tune(trace, cap.device_memory, cap.memory_fraction,
                  candidates=[(s, s, True) for s in ("native", f"native,{EXPANDABLE}")])
    healthy = device(reserved=100 * MiB, allocated=95 * MiB)
    healthy["settings"]["config_string"] = "native"
    d = diagnose("a", healthy, healthy, 1.0, Replayed(ranked, described, can_recur))
    snapshot_step = d.steps[-1]
    assert f"holds {stats['num_ooms']} out-of-memory error(s)" in snapshot_step.finding
    assert f"recorded OOMs recurred: {stats['num_ooms']} of" in snapshot_step.finding
    assert snapshot_step.proposal == d.recommendation == f"native,{EXPANDABLE}"


@pytest.fixture
def capped_agent(tmp_path: Path, request: pytest.FixtureRequest):
    """An agent whose allocator (PyTorch's settings, history recorded from the start) ran
    out of memory several times: on a full 256 MiB device, or under a memory fraction of a
    1 GiB one (request.param)."""
    from support.capped_run import run_capped_steps

    fraction = request.param
    running = start_control_sidecar(tmp_path)
    allocator = ae.Allocator(ae.SimDevice(capacity=(1 << 30) if fraction else 256 * MiB),
                             "native")
    if fraction:
        allocator.set_memory_fraction(fraction)
    allocator.record_history(True, 1_000_000)
    agent = connect_agent(running, tmp_path, {0: allocator}, rank=0)
    (address,) = running.sidecar.admin.addresses()
    run_capped_steps(allocator)
    stats = allocator.stats()
    assert stats["num_ooms"] > 0
    after_the_run = agent.sequence + 1  # a report sampled once the run was over
    wait_for(lambda: any(a.last_report is not None and a.last_report.sequence >= after_the_run
                         for a in running.sidecar.registry.agents()),
             what="a report with these figures")
    yield address, allocator.stats()
    agent.stop()
    running.stop()


@pytest.mark.parametrize("capped_agent", [None], indirect=True)
def test_diagnose_replays_a_live_snapshot_under_what_the_process_could_reserve(
        capped_agent, capsys: pytest.CaptureFixture[str]) -> None:
    """A process with no memory fraction ran out of the GPU itself; its snapshot's out-of-memory
    events keep the GPU's free memory, which, with what the process had reserved, is the cap
    under which they recur."""
    address, stats = capped_agent
    assert main(["ctl", "--admin", address, "diagnose", "--window", "0.01", "--replay"]) == 0
    out = capsys.readouterr().out
    ooms = stats["num_ooms"]
    assert f"the snapshot holds {ooms} out-of-memory error(s), which each replay makes again" \
        in out
    assert ("replayed under 256.0 MiB, what the process could reserve at its out-of-memory "
            "errors") in out
    native = measured(out, "native")
    assert native.startswith(f"native: peak reserved "
                             f"{stats['reserved_bytes.all.peak'] / MiB:.1f} MiB")
    assert native.endswith(f"retries {stats['num_alloc_retries']}, OOMs {ooms} "
                           f"(recorded OOMs recurred: {ooms} of {ooms})")
    [proposal] = [line for line in out.splitlines() if line.startswith("recommendation: ")]
    chosen = proposal.removeprefix("recommendation: ")
    assert chosen != "native"
    assert measured(out, chosen).endswith(f"OOMs 0 (recorded OOMs recurred: 0 of {ooms})")


def measured(out: str, candidate: str) -> str:
    """What the snapshot step says it measured under `candidate`."""
    found = re.search(rf"(?:^|[:;] ){re.escape(candidate)}(: peak reserved [^;—]*[^;— ])", out,
                      re.MULTILINE)
    assert found, (candidate, out)
    return candidate + found.group(1)


@pytest.mark.parametrize("capped_agent", [0.25], indirect=True)
def test_diagnose_replays_a_live_snapshot_under_the_memory_fraction_the_process_ran_under(
        capped_agent, capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU had room at each error: the process's memory fraction failed them. The agent's
    snapshot keeps that fraction and the GPU's total, so the replay runs under the same cap,
    the recorded settings fail as the process did, and a setting under which none recurs is
    proposed."""
    address, stats = capped_agent
    assert main(["ctl", "--admin", address, "diagnose", "--window", "0.01", "--replay"]) == 0
    out = capsys.readouterr().out
    ooms = stats["num_ooms"]
    assert ooms >= 3
    assert ("replayed under the cap the snapshot keeps (256.00 MiB allowed: memory fraction "
            "0.25 (from the recording) of a 1.00 GiB device (from the recording))") in out
    assert measured(out, "native").endswith(f"retries {stats['num_alloc_retries']}, OOMs "
                                            f"{ooms} (recorded OOMs recurred: {ooms} of {ooms})")
    [proposal] = [line for line in out.splitlines() if line.startswith("recommendation: ")]
    chosen = proposal.removeprefix("recommendation: ")
    assert chosen != "native"
    assert measured(out, chosen).endswith(f"OOMs 0 (recorded OOMs recurred: 0 of {ooms})")


def test_a_snapshot_whose_errors_an_unkept_memory_fraction_made_gets_no_proposal(
        capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch's own snapshot keeps no cap (a torch that cannot report its memory fraction, or
    a snapshot taken by hand): where the GPU had room at each error, no replay can say which
    setting avoids them, and none is proposed."""
    from support.capped_run import record_capped_run

    from allocator_ext.replay.trace import parse_snapshot
    from allocator_ext.replay.tune import tune
    from exporter.commands.ctl.diagnose import Replayed, replay_cap

    snapshot, stats = record_capped_run(keep_cap=False)  # a fraction of 0.25 failed it
    trace = parse_snapshot(snapshot)
    cap, described, can_recur = replay_cap(trace, gpu_bytes=1 << 30)
    assert not can_recur and described == "the GPU's 1.0 GiB"
    ranked = tune(trace, cap.device_memory, cap.memory_fraction,
                  candidates=[(s, s, True) for s in ("native", f"native,{EXPANDABLE}")])
    healthy = device(reserved=100 * MiB, allocated=95 * MiB)
    healthy["settings"]["config_string"] = "native"
    d = diagnose("a", healthy, healthy, 1.0, Replayed(ranked, described, can_recur))
    print_diagnosis(d, sys.stdout)
    [step] = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("5. snapshot: ")]
    assert (f"the snapshot holds {stats['num_ooms']} out-of-memory error(s), but the GPU had "
            "room for the requests that failed: a per-process memory fraction") in step
    assert "none is proposed" in step
    assert d.steps[-1].proposal is None and d.recommendation is None
    assert "lowest peak reserved" not in step and "do best" not in step


def test_diagnose_refuses_to_replay_a_snapshot_with_no_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    running = start_control_sidecar(tmp_path)
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")  # no history recorded
    agent = connect_agent(running, tmp_path, {0: allocator}, rank=0)
    (address,) = running.sidecar.admin.addresses()
    try:
        allocator.free(allocator.malloc(64 * MiB))
        after_the_free = agent.sequence + 1
        wait_for(lambda: any(a.last_report is not None
                             and a.last_report.sequence >= after_the_free
                             for a in running.sidecar.registry.agents()),
                 what="a report of the allocation")
        assert main(["ctl", "--admin", address, "diagnose", "--window", "0.01", "--replay"]) == 0
    finally:
        agent.stop()
        running.stop()
    out = capsys.readouterr().out
    assert "cannot be replayed" in out and "no recorded events for device 0" in out
    assert "`allocwatch ctl record-history start --agent " in out  # what to do about it
    assert "do best" not in out


def test_a_cache_idle_between_steps_but_compact_at_its_peak_is_not_called_fragmented(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Between steps 75 % of the cache holds freed activations; at the step's peak it holds
    # 1.005 × what is allocated.
    between_steps = device(reserved=200 * MiB, allocated=50 * MiB, expandable=True,
                           peak_allocated=199 * MiB)
    d = diagnose("a", between_steps, between_steps, 1.0)
    print_diagnosis(d, sys.stdout)
    out = capsys.readouterr().out
    assert "compact cache" in out and "fragmented" not in out
    assert "150.0 MiB of 200.0 MiB cached and unused right now" in out
    assert "recommendation: none: nothing to change" in out


def test_fragmentation_with_every_fix_in_force_never_says_nothing_to_change(
        capsys: pytest.CaptureFixture[str]) -> None:
    stuck = device(reserved=200 * MiB, allocated=50 * MiB, expandable=True, gc=0.8,
                   peak_allocated=100 * MiB)
    d = diagnose("a", stuck, stuck, 1.0)
    assert d.recommendation is None
    print_diagnosis(d, sys.stdout)
    out = capsys.readouterr().out
    assert "peak fragmentation 0.50" in out and "fragmented cache" in out
    assert "nothing to change" not in out
    assert "recommendation: none of the settings above" in out
