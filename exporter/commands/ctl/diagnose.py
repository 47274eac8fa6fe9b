"""`allocwatch ctl diagnose`: the usual out-of-memory troubleshooting order, on one agent's live
figures.

1. retries and peak fragmentation    (is there pressure? does the cache strand memory at its
                                      peak, not merely hold freed blocks between steps?)
2. expandable_segments                (the fix for fragmentation, where it is not on yet)
3. max_split_size_mb                  (the older fix, where expandable segments cannot be used)
4. garbage_collection_threshold       (release old cached blocks before retrying)
5. the snapshot                       (with --replay: replayed under each candidate, measured;
                                      a recorded out-of-memory error must not recur)

Each step says what it found and which setting it would apply; the first proposal wins unless
the replay measured a better one. Counters read twice, `--window` seconds apart, also show the
classic mistakes, e.g. empty_cache() every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from exporter.commands.ctl.client import AdminClient, CtlError
from exporter.commands.ctl.output import human_bytes, print_results
from exporter.shared.figures import peak_fragmentation_ratio

FRAGMENTED = 0.2             # peak fragmentation from which the cache strands memory (peak
                             # reserved at least 1.25 × peak allocated)
SPLIT_SHARE = 0.2            # inactive split bytes ÷ large-pool reserved worth max_split_size_mb
EMPTY_CACHE_RATE = 0.2       # empty_cache() calls a second that look like "every step"
PENDING_EVENTS = 100
EXPANDABLE = "expandable_segments:True"
MAX_SPLIT = "max_split_size_mb:512"
GC_THRESHOLD = "garbage_collection_threshold:0.8"


@dataclasses.dataclass
class Step:
    title: str
    finding: str
    proposal: str | None = None


@dataclasses.dataclass
class Diagnosis:
    agent: str
    cuda_device: int
    steps: list[Step]
    mistakes: list[str]
    recommendation: str | None
    # Pressure or fragmentation was found: "nothing to change" would contradict it.
    trouble: bool = False


@dataclasses.dataclass
class Replayed:
    """The agent's snapshot replayed under each candidate: `allocwatch tune`'s ranking, best
    first (allocator_ext.replay.tune.Candidate, each named by its settings string), and the cap
    the replays ran under."""

    ranked: list[Any]
    cap: str                     # what the cap is, and where it comes from
    ooms_can_recur: bool = True  # False: the snapshot's errors cannot recur under that cap


def _delta(before: dict[str, Any], after: dict[str, Any], name: str) -> int:
    return max(0, after["counters"][name] - before["counters"][name])


def peak_fragmentation(before: dict[str, Any], after: dict[str, Any]
                       ) -> tuple[float, int, int, str]:
    """(ratio, peak allocated, peak reserved, over what) at its least among the readings of the
    window: the two report intervals seen and the peaks since the process's last reset. Each
    overstates what the cache strands when it misses the moment of highest use (an interval
    without a training step's peak; a reset that predates an empty_cache()), never the reverse,
    so the least is the closest."""
    readings = []
    for device in (before, after):
        peaks = device["interval_peaks"]
        where = ("over a report interval" if peaks["window"] == "interval"
                 else "since the process's last peak reset")
        readings.append((device["peak_fragmentation_ratio"], peaks["allocated_bytes"],
                         peaks["reserved_bytes"], where))
    allocated, reserved = after["peak_allocated_bytes"], after["peak_reserved_bytes"]
    readings.append((peak_fragmentation_ratio(reserved, allocated), allocated, reserved,
                     "since the process's last peak reset"))
    return min(readings, key=lambda r: r[0])


def diagnose(agent: str, before: dict[str, Any], after: dict[str, Any], window: float,
             replayed: Replayed | None = None,
             replay_note: str | None = None) -> Diagnosis:
    """`before`/`after`: one device's figures (the admin API's device view) `window` s apart.
    `replayed`: the agent's snapshot replayed under the candidates (None: not replayed, and
    `replay_note` says why)."""
    counters, settings = after["counters"], after["settings"]
    steps: list[Step] = []
    reserved, allocated = after["reserved_bytes"], after["allocated_bytes"]
    ratio, peak_allocated, peak_reserved, where = peak_fragmentation(before, after)
    retries, ooms = counters["alloc_retries"], counters["ooms"]
    new_retries = _delta(before, after, "alloc_retries")
    pressure = retries > 0 or ooms > 0
    fragmented = ratio >= FRAGMENTED
    verdict = ("memory pressure" if pressure else "no retries") + ", " + (
        "fragmented cache" if fragmented else "compact cache")
    steps.append(Step(
        "retries and peak fragmentation",
        f"{retries} allocation retries ({new_retries} in the last {window:g} s), {ooms} "
        f"out-of-memory errors; peak fragmentation {ratio:.2f} ({human_bytes(peak_allocated)} "
        f"allocated at the peak of {human_bytes(peak_reserved)} reserved, {where}; "
        f"{human_bytes(reserved - allocated)} of {human_bytes(reserved)} cached and unused "
        f"right now): {verdict}"))
    needs_help = pressure or fragmented

    if settings["expandable_segments"]:
        steps.append(Step("expandable segments", "already on"))
    elif needs_help:
        steps.append(Step("expandable segments",
                          "off: segments of fixed size strand their free tails; expandable "
                          "segments grow one mapping instead, usually the most effective fix",
                          EXPANDABLE))
    else:
        steps.append(Step("expandable segments", "off, and nothing calls for it"))

    large = after["large_pool"]
    split_share = large["inactive_split_bytes"] / large["reserved_bytes"] \
        if large["reserved_bytes"] else 0.0
    split_note = (f"inactive split bytes {human_bytes(large['inactive_split_bytes'])} = "
                  f"{split_share:.0%} of the large pool")
    if settings["expandable_segments"]:
        steps.append(Step("max_split_size_mb", f"not needed with expandable segments "
                          f"({split_note})"))
    elif settings["max_split_size_bytes"]:
        steps.append(Step("max_split_size_mb", f"already set to "
                          f"{human_bytes(settings['max_split_size_bytes'])} ({split_note})"))
    elif needs_help and split_share >= SPLIT_SHARE:
        steps.append(Step("max_split_size_mb", f"{split_note}: large blocks are split and their "
                          "remainders stranded; where expandable segments cannot be used, stop "
                          "splitting blocks above 512 MiB", MAX_SPLIT))
    else:
        steps.append(Step("max_split_size_mb", f"{split_note}: not the problem"))

    gc = settings["garbage_collection_threshold"]
    if gc > 0:
        steps.append(Step("garbage_collection_threshold",
                          f"on at {gc:g}: {counters['gc_reclaims']} reclaims released "
                          f"{human_bytes(counters['gc_reclaimed_bytes'])}"))
    elif pressure:
        steps.append(Step("garbage_collection_threshold",
                          "off while the allocator retries: release old cached blocks before a "
                          "retry flushes the whole cache (acts only with a per-process memory "
                          "fraction set)", GC_THRESHOLD))
    else:
        steps.append(Step("garbage_collection_threshold", "off, and no retries call for it"))

    recommendation = next((s.proposal for s in steps if s.proposal), None)
    in_force = candidates(settings["config_string"])[0]
    steps.append(_snapshot_step(replayed, in_force, replay_note))
    if steps[-1].proposal:
        recommendation = steps[-1].proposal  # measured on this job's own trace: it wins
    return Diagnosis(agent, after["cuda_device"], steps, _mistakes(before, after, window),
                     recommendation, needs_help)


def _snapshot_step(replayed: Replayed | None, in_force: str, note: str | None) -> Step:
    if replayed is None:
        return Step("snapshot", note or "not replayed (add --replay to replay this agent's "
                    "snapshot under each candidate setting)")
    from allocator_ext.replay.tune import recommended

    ranked = replayed.ranked
    recorded = len(ranked[0].report["recorded_ooms"])
    lines = []
    for c in ranked:
        r = c.report
        lines.append(f"{c.name}: peak reserved {human_bytes(r['peak_reserved_bytes'])}, "
                     f"ratio {r['reserved_ratio']:.3f}, retries {r['num_alloc_retries']}, "
                     f"OOMs {r['num_ooms']}"
                     + (f" (recorded OOMs recurred: {r['recorded_ooms_recurred']} of {recorded})"
                        if recorded else ""))
    finding = f"replayed under {replayed.cap}: " + "; ".join(lines)
    if recorded and not replayed.ooms_can_recur:
        return Step("snapshot", f"the snapshot holds {recorded} out-of-memory error(s), but the "
                    "GPU had room for the requests that failed: a per-process memory fraction, "
                    "which the snapshot does not keep, failed them, and without it no replay "
                    "can say which setting avoids them, so none is proposed; " + finding)
    if recorded:
        finding = (f"the snapshot holds {recorded} out-of-memory error(s), which each replay "
                   "makes again: a candidate under which one recurs is not proposed; " + finding)
    best = recommended(list(ranked))
    if best is None:
        return Step("snapshot", finding + " — no candidate ran without out-of-memory")
    if best.name == in_force:
        return Step("snapshot", finding + " — the settings in force do best")
    return Step("snapshot", finding + f" — lowest peak reserved: {best.name} (as `allocwatch "
                "tune` ranks: peaks within 1 % of the peak requested tie, and go to fewer "
                "retries, then cheaper device calls)", best.name)


def _mistakes(before: dict[str, Any], after: dict[str, Any], window: float) -> list[str]:
    found = []
    empties = _delta(before, after, "empty_cache_calls")
    syncs = _delta(before, after, "sync_all_streams")
    mallocs = _delta(before, after, "device_mallocs")
    frees = _delta(before, after, "device_frees")
    if window > 0 and empties >= 2 and empties / window >= EMPTY_CACHE_RATE:
        found.append(
            f"empty_cache() called every step: {empties} calls in {window:g} s "
            f"({empties / window:.1f}/s); each synchronises the device ({syncs} device-wide "
            f"synchronisations) and hands back memory the next step allocates again ({mallocs} "
            f"device allocations, {frees} frees in the window). Remove it from the loop.")
    elif frees >= 2 and mallocs >= 2 and _delta(before, after, "alloc_retries") > 0:
        found.append(f"cache churn under pressure: {frees} device frees and {mallocs} device "
                     f"allocations in {window:g} s, with retries flushing the cache")
    if after["counters"]["ooms"] > 0:
        found.append(f"{after['counters']['ooms']} out-of-memory errors so far: the agent "
                     "writes a snapshot at each (see `allocwatch ctl snapshot` for a fresh one)")
    if after["pending_events"] >= PENDING_EVENTS:
        found.append(f"{after['pending_events']} stream events pending "
                     f"({human_bytes(after['pending_free_bytes'])} waiting): tensors used on "
                     "side streams (record_stream) are freed long before those streams finish")
    return found


# ---------------------------------------------------------------------- the command


def _one_agent(client: AdminClient, selector: dict[str, Any]) -> dict[str, Any]:
    agents = [a for a in client.get("/v1/agents", **selector)["agents"] if a["connected"]]
    if len(agents) != 1:
        names = ", ".join(a["agent"] for a in agents) or "none"
        raise CtlError(f"diagnose looks at one agent: {len(agents)} connected agents match "
                       f"({names}); narrow with --rank/--host/--job/--agent")
    return agents[0]


def _device(agent: dict[str, Any], cuda_device: int | None) -> dict[str, Any]:
    for device in agent["devices"]:
        if cuda_device is None or device["cuda_device"] == cuda_device:
            return device
    raise CtlError(f"agent {agent['agent']} reports no "
                   f"{'device' if cuda_device is None else f'cuda:{cuda_device}'} yet")


def candidates(current: str) -> list[str]:
    base = current or "native"
    return [base] + [f"{base},{extra}" for extra in (EXPANDABLE, MAX_SPLIT)
                     if extra.split(":")[0] not in base]


def replay_snapshot(client: AdminClient, agent: str, device: dict[str, Any]
                    ) -> tuple[Replayed | None, str | None]:
    """The agent's snapshot replayed under each candidate, ranked as `allocwatch tune` ranks
    them (or None and why not)."""
    from allocator_ext.replay import TraceError, load_trace
    from allocator_ext.replay.tune import tune

    answer = client.post("/v1/snapshot", {"agent": agent, "frames": False})
    result = answer["results"][0]
    if "snapshot" not in result:
        return None, f"no snapshot: {result['message']}"
    data = client.request("GET", result["snapshot"]["download"])
    where = f"snapshot {result['snapshot']['path']}"
    with tempfile.TemporaryDirectory(prefix="allocwatch-diagnose-") as tmp:
        path = Path(tmp) / "snapshot.pickle.gz"
        path.write_bytes(data)
        try:
            trace = load_trace(path, device["cuda_device"])
        except TraceError as err:
            return None, f"{where} cannot be replayed: {err} ({_record_first(agent, err)})"
    cap, described, can_recur = replay_cap(trace, (device["device_memory"] or {}).get(
        "total_bytes", 0))
    settings = candidates(device["settings"]["config_string"])
    try:
        ranked = tune(trace, cap.device_memory, cap.memory_fraction,
                      candidates=[(s, s, True) for s in settings])
    except (TraceError, ValueError) as err:
        return None, f"{where} cannot be replayed: {err}"
    return Replayed(ranked, described, can_recur), None


def _record_first(agent: str, err: Exception) -> str:
    """What to do where the snapshot holds no history to replay, or one that did not start
    from an empty allocator."""
    if "no recorded events" in str(err) or "device_traces" in str(err):
        return (f"the allocator's history is not being recorded: `allocwatch ctl "
                f"record-history start --agent {shlex.quote(agent)}` starts it; run diagnose "
                "--replay again once the job has run a few steps")
    return "record the allocator's history from the start of the process"


def replay_cap(trace: Any, gpu_bytes: int) -> tuple[Any, str, bool]:
    """The cap to replay an agent's snapshot under, what it is, and whether the snapshot's
    out-of-memory errors can recur under it: the cap the snapshot keeps; else what the process
    could reserve at its errors (reserved plus the GPU's free memory at each); else the GPU's
    size where the agent knows it (`gpu_bytes`; 0: unknown)."""
    from allocator_ext.replay.cap import INFERRED, resolve_cap
    from allocator_ext.replay.replayer import recorded_figures

    cap = resolve_cap(trace)
    if cap.device_memory_from == INFERRED:
        return (cap, f"{human_bytes(cap.device_memory)}, what the process could reserve at its "
                "out-of-memory errors (reserved plus the GPU's free memory at each)", True)
    if cap.device_memory or cap.memory_fraction is not None:
        return cap, f"the cap the snapshot keeps ({cap.describe()})", True
    # No error, or a memory fraction failed them (the GPU had room): they cannot recur.
    can_recur = recorded_figures(trace).num_ooms == 0
    if gpu_bytes:
        return resolve_cap(trace, device_memory=gpu_bytes), \
            f"the GPU's {human_bytes(gpu_bytes)}", can_recur
    return cap, "no cap (the agent reports no GPU size)", can_recur


def print_diagnosis(d: Diagnosis, out: TextIO) -> None:
    print(f"diagnosis of {d.agent}, cuda:{d.cuda_device}", file=out)
    for i, step in enumerate(d.steps, 1):
        print(f"{i}. {step.title}: {step.finding}", file=out)
        if step.proposal:
            print(f"   would apply: {step.proposal}", file=out)
    if d.mistakes:
        print("classic mistakes seen:", file=out)
        for mistake in d.mistakes:
            print(f"  - {mistake}", file=out)
    if d.recommendation:
        print(f"recommendation: {d.recommendation}", file=out)
    elif d.trouble:
        print("recommendation: none of the settings above; they are in force or do not apply. "
              "Replay this agent's snapshot under candidates (--replay), or lower what the job "
              "holds at its peak", file=out)
    else:
        print("recommendation: none: nothing to change", file=out)


def run_diagnosis(args: argparse.Namespace, client: AdminClient, selector: dict[str, Any],
                  out: TextIO) -> int:
    agent = _one_agent(client, selector)
    before = _device(agent, args.device)
    time.sleep(args.window)
    after_agent = _one_agent(client, {"agent": agent["agent"]})
    after = _device(after_agent, before["cuda_device"])
    replayed, note = (replay_snapshot(client, agent["agent"], after) if args.replay
                      else (None, None))
    diagnosis = diagnose(agent["agent"], before, after, args.window, replayed, note)
    if args.json:
        import json

        print(json.dumps(dataclasses.asdict(diagnosis), indent=2), file=out)
    else:
        print_diagnosis(diagnosis, out)
    if args.apply and diagnosis.recommendation:
        answer = client.post("/v1/settings", {"agent": agent["agent"],
                                              "settings": diagnosis.recommendation})
        print_results(answer, out)
        return 0 if answer["ok"] else 1
    return 0
