"""Record PyTorch memory traces of varied workloads under varied allocator settings, on a GPU.

    python -m bench.replay.record_traces --out DIR [--only NAME...] [--steps N]
    python -m bench.replay.record_traces --oom --out DIR [--only NAME...]  # runs out of memory
    python -m bench.replay.record_traces --lockstep --out DIR [--only NAME...] [--rounds N]
    python -m bench.replay.record_traces --self-check     # no GPU needed: torch's CPU build will do

Writes DIR/<workload>__<setting>.pickle.gz (torch.cuda.memory._snapshot(), no stack frames) and
DIR/manifest.json. Each trace is recorded in a fresh process, with PYTORCH_CUDA_ALLOC_CONF set
before torch is imported and recording started before the first CUDA allocation, so that every
trace starts from an empty allocator: the condition for replaying it faithfully.

Workloads: gpt_varlen (the transformer), moe, convnet and decode draw random shapes every step;
gpt_fixed, moe_fixed and convnet_fixed run every step at the workload's largest shapes, as jobs
with a fixed batch and sequence length or image size train, so that their steps repeat exactly
(the MoE's routing still varies). The patterns of well-known libraries' code (kv_generate,
detection, graph, trainer, fsdp2, stream_pipeline, reduce_overhead: allocator_ext.workloads)
draw random shapes too; their traces are kept small enough to live in the repository (about
50,000 events, a few hundred KB: MAX_EVENTS), so they record fewer steps.

Settings: default, expandable (expandable_segments:True), max_split (max_split_size_mb:64), gc
(garbage_collection_threshold:0.6 under a per-process memory fraction of 1.3 x the workload's
peak reserved bytes with default settings, so that collection actually happens; the fraction is
stored in the manifest and in the snapshot under "allocwatch_recording") and roundup
(roundup_power2_divisions:4). --only takes workload names, setting names or
<workload>__<setting> names.

--oom records traces that end in out-of-memory errors, for replay and tune to answer "would
another setting have avoided it?": for each of gpt_varlen, convnet and moe, a measuring run under
PyTorch's defaults gives the workload's peak requested bytes; then the default and gc settings
are recorded under a per-process memory fraction of OOM_CAPS[0] (1.02) x that peak, low enough
that PyTorch's settings fail where allocwatch's fit. Each run catches torch.cuda.OutOfMemoryError,
drops the step's gradients and goes on with the next step (as jobs that skip a batch do) until
it has caught --max-ooms errors or run its steps. A recording that did not run out of memory
(cuDNN, say, chose algorithms with smaller workspaces and the step fitted) is recorded again
under the next, lower cap of OOM_CAPS (0.98, 0.94, 0.90 x), until one fails; the manifest keeps
every attempt under "attempts", and one that never failed is marked "no_oom" and not used.
Writes DIR/<workload>__<setting>_oom.pickle.gz and DIR/oom_manifest.json; the workloads record
side by side on the one GPU (about a minute on an H200). An oom_manifest.json already in DIR
keeps the entries of the traces this run does not record, so that `--only convnet__gc`
re-records one trace and leaves the others' entries as they were; so does a manifest.json
(`--only graph default` adds one trace to the folder's manifest).

--lockstep records, under PyTorch's defaults, what each pattern of bench.gpu.patterns runs in
its lockstep phase on the GPU: the warm-up (the workload's largest shapes twice, then the
pattern's quick steps of the warm-up seed) and --rounds rounds of those steps on the rounds'
seeds (bench.gpu.step_lockstep). The warm-up at the largest shapes lays memory out differently
from a run that starts small, so replaying these traces gives the figures the GPU benchmark
measures. Writes DIR/<workload>__default_lockstep.pickle.gz and DIR/lockstep_manifest.json.

The manifest gives, per trace, what torch.cuda.memory_stats() said at the end
(reserved_bytes.all.peak, num_device_alloc, ...) beside the same figures counted from the trace
itself, so a reader can see whether num_device_alloc counts like the trace's segment_alloc
events (with expandable segments PyTorch maps pages instead: segment_map events).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import os
import pickle
import platform
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Trace name -> the allocator_ext.workloads workload recorded under it, and whether its shapes
# are fixed (every step at the workload's largest shapes, as a job with a fixed batch and
# sequence length or image size trains: its steps repeat exactly) rather than random.
WORKLOADS = {"gpt_varlen": ("transformer", False), "moe": ("moe", False),
             "convnet": ("convnet", False), "decode": ("decode", False),
             "gpt_fixed": ("transformer", True), "moe_fixed": ("moe", True),
             "convnet_fixed": ("convnet", True),
             **{name: (name, False) for name in ("kv_generate", "detection", "graph", "trainer",
                                                 "fsdp2", "stream_pipeline", "reduce_overhead")}}
WORKLOAD_NAMES = tuple(WORKLOADS)
# Steps per trace when --steps is not given: enough steps for the shapes to vary widely, few
# enough that a trace stays under ~300k events (a few MB gzipped) and a run under ~20 s. Fixed
# shapes need fewer: every step after the first two repeats the one before.
DEFAULT_STEPS = {"gpt_varlen": 40, "moe": 40, "convnet": 40, "decode": 12,
                 "gpt_fixed": 16, "moe_fixed": 16, "convnet_fixed": 16,
                 "kv_generate": 8, "detection": 12, "graph": 30, "trainer": 16, "fsdp2": 16,
                 "stream_pipeline": 40, "reduce_overhead": 16}

# Setting name -> PYTORCH_CUDA_ALLOC_CONF (None: unset, PyTorch's defaults). Order matters:
# defaults first, because the gc setting sizes its memory cap from the default run.
SETTINGS: dict[str, str | None] = {
    "default": None,
    "expandable": "expandable_segments:True",
    "max_split": "max_split_size_mb:64",
    "gc": "garbage_collection_threshold:0.6",
    "roundup": "roundup_power2_divisions:4",
}
GC_SETTING = "gc"
GC_HEADROOM = 1.3  # memory cap = this x peak reserved under default settings

# --oom: which recordings, and their cap.
OOM_WORKLOADS = ("gpt_varlen", "convnet", "moe")
OOM_SETTINGS = ("default", GC_SETTING)
# Memory cap = this x peak requested bytes under default settings, uncapped: the first for every
# recording, each next one for a recording that did not run out of memory under the one before.
OOM_CAPS = (1.02, 0.98, 0.94, 0.90)
OOM_MAX = 3        # out-of-memory errors a recording catches before it stops
OOM_SUFFIX = "_oom"
OOM_MANIFEST = "oom_manifest.json"
# --lockstep: the patterns' lockstep programs (the warm-up and this many rounds by default: the
# warm-up meets each pattern's peak, so two rounds keep the traces small).
LOCKSTEP_SUFFIX = "_lockstep"
LOCKSTEP_MANIFEST = "lockstep_manifest.json"
LOCKSTEP_ROUNDS = 2

MAX_ENTRIES = 2_000_000  # ring buffer size: far above any trace here, so it never wraps
DEFAULT_MAX_EVENTS = 300_000  # keeps a trace file around 2 MB gzipped (about 6 B an event)
# The libraries' patterns, tests' data in the repository: about 300 KB each.
MAX_EVENTS = {name: 50_000 for name in WORKLOAD_NAMES[WORKLOAD_NAMES.index("kv_generate"):]}
DEFAULT_TIMEOUT_S = 150
# Recordings that compile first (inductor, CUDA graph capture) get longer.
MIN_TIMEOUT_S = {"reduce_overhead": 480}

RESULT_SUFFIX = ".result.json"
STATS_KEYS = (
    "reserved_bytes.all.peak", "allocated_bytes.all.peak", "requested_bytes.all.peak",
    "reserved_bytes.all.current", "num_device_alloc", "num_device_free", "num_alloc_retries",
    "num_ooms", "num_sync_all_streams", "segment.all.peak",
)


# ---- choosing what to record

def trace_name(workload: str, setting: str, oom: bool = False, lockstep: bool = False) -> str:
    return f"{workload}__{setting}" + (OOM_SUFFIX if oom else "") + (
        LOCKSTEP_SUFFIX if lockstep else "")


def lockstep_steps() -> dict[str, int]:
    """Trace workload -> the steps a round of its pattern's quick lockstep run."""
    from bench.gpu.patterns import PATTERNS
    return {p.trace: p.quick for p in PATTERNS.values() if p.trace in WORKLOAD_NAMES}


def select_lockstep_runs(only: list[str] | None) -> list[str]:
    """The workloads --lockstep records: the patterns' (all, or those --only names)."""
    every = list(lockstep_steps())
    if not only:
        return every
    unknown = set(only) - set(every)
    if unknown:
        raise ValueError(f"unknown name(s) for --only with --lockstep: "
                         f"{', '.join(sorted(unknown))}; known: {', '.join(every)}")
    return [w for w in every if w in only]


def select_runs(only: list[str] | None) -> list[tuple[str, str]]:
    """(workload, setting) pairs chosen by --only, settings in SETTINGS order."""
    every = [(w, s) for s in SETTINGS for w in WORKLOAD_NAMES]
    if not only:
        return every
    workloads = {n for n in only if n in WORKLOAD_NAMES}
    settings = {n for n in only if n in SETTINGS}
    pairs = {n for n in only if n in {trace_name(w, s) for w, s in every}}
    unknown = set(only) - workloads - settings - pairs
    if unknown:
        raise ValueError(
            f"unknown name(s) for --only: {', '.join(sorted(unknown))}; known workloads: "
            f"{', '.join(WORKLOAD_NAMES)}; settings: {', '.join(SETTINGS)}; "
            "or <workload>__<setting>")
    chosen = []
    for w, s in every:
        by_parts = (workloads or settings) and (not workloads or w in workloads) and (
            not settings or s in settings)
        if by_parts or trace_name(w, s) in pairs:
            chosen.append((w, s))
    return chosen


def child_environment(setting: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the process that records under `setting`."""
    env = dict(os.environ if base is None else base)
    conf = SETTINGS[setting]
    if conf is None:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env.pop("ALLOCWATCH_ALLOC_CONF", None)  # PyTorch's own allocator is what is recorded
    return env


def gc_memory_fraction(peak_reserved_default: int, device_total: int) -> float:
    return min(1.0, GC_HEADROOM * peak_reserved_default / device_total)


def select_oom_runs(only: list[str] | None) -> list[tuple[str, str]]:
    """The (workload, setting) pairs --oom records, narrowed by --only as select_runs does."""
    return [(w, s) for w, s in select_runs(only) if w in OOM_WORKLOADS and s in OOM_SETTINGS]


def oom_memory_fraction(peak_requested_default: int, device_total: int, cap: float) -> float:
    return min(1.0, cap * peak_requested_default / device_total)


def record_under_lowering_caps(record_at: Callable[[float, float], dict[str, Any]],
                               peak_requested: int, device_total: int,
                               caps: Sequence[float] = OOM_CAPS) -> dict[str, Any]:
    """Records under each cap of `caps` in turn (record_at(cap, memory fraction) records once)
    until a recording runs out of memory or fails otherwise; the last recording's result, with
    every attempt's cap and outcome under "attempts"."""
    attempts = []
    for cap in caps:
        result = record_at(cap, oom_memory_fraction(peak_requested, device_total, cap))
        result["cap_of_peak_requested"] = cap
        attempts.append({"cap_of_peak_requested": cap, "memory_fraction": result.get(
            "memory_fraction"), "allowed_bytes": result.get("allowed_bytes"),
            "status": result["status"], "ooms_caught": result.get("ooms_caught"),
            "oom_events": result.get("trace", {}).get("actions", {}).get("oom", 0)})
        if result["status"] != "no_oom":
            break
    result["attempts"] = attempts
    return result


def merge_manifest(previous: dict[str, Any] | None, manifest: dict[str, Any],
                   oom: bool = False, lockstep: bool = False) -> dict[str, Any]:
    """`manifest` (this run's) with the entries of `previous` (the folder's earlier manifest,
    of --oom's or --lockstep's traces where `oom` or `lockstep`) for the traces this run did not
    record, in the order they are recorded; the earlier recordings they come from are named
    under "earlier_recordings"."""
    if not previous:
        return manifest
    recorded = {(t["workload"], t["setting"]) for t in manifest["traces"]}
    kept = {(t["workload"], t["setting"]): t for t in previous.get("traces", [])
            if (t["workload"], t["setting"]) not in recorded}
    if not kept:
        return manifest
    ours = {(t["workload"], t["setting"]): t for t in manifest["traces"]}
    every = {**kept, **ours}
    order = sorted(every, key=lambda k: (WORKLOAD_NAMES.index(k[0]), list(SETTINGS).index(k[1])))
    kept_names = {trace_name(*k, oom=oom, lockstep=lockstep) for k in kept}
    earlier = [{**e, "traces": [n for n in e["traces"] if n in kept_names]}
               for e in previous.get("earlier_recordings", [])]
    earlier = [e for e in earlier if e["traces"]]
    from_previous = sorted(kept_names - {n for e in earlier for n in e["traces"]})
    if from_previous:
        earlier.append({"created": previous.get("created"), "command": previous.get("command"),
                        "traces": from_previous})
    return {**manifest, "traces": [every[k] for k in order], "earlier_recordings": earlier}


def run_steps(work: Any, steps: int, max_events: int, max_ooms: int,
              events_so_far: Any, oom_error: type[BaseException]) -> tuple[int, int]:
    """Steps `work` up to `steps` times; returns (steps run, out-of-memory errors caught).

    Two steps tell how many events a step makes (the first one more: optimizer state, library
    workspaces): the steps are capped there to keep the trace under `max_events`. With
    `max_ooms`, a step that runs out of memory is skipped, its gradients dropped, until
    `max_ooms` errors; without, the error ends the recording as any other would.
    """
    steps_cap = steps
    steps_run = ooms = 0
    for index in range(steps):
        try:
            work.step()
        except oom_error:
            if not max_ooms:
                raise
            ooms += 1
            work.optimizer.zero_grad(set_to_none=True)
        steps_run += 1
        if index == 1 and steps > 2:
            steps_cap = min(steps, max(2, int(max_events * 2 / max(events_so_far(), 1))))
        if steps_run >= steps_cap or (max_ooms and ooms >= max_ooms):
            break
    return steps_run, ooms


# ---- reading a snapshot

def trace_events(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for device in snapshot.get("device_traces", []) for event in device]


def summarize_trace(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What the trace itself says: event counts, peak reserved bytes, whether it starts from an
    empty allocator, and whether it accounts for every segment the snapshot holds at the end
    (it does not when recording started after memory was already reserved)."""
    events = trace_events(snapshot)
    actions = Counter(event["action"] for event in events)
    reserved = peak = 0
    for event in events:
        action = event["action"]
        if action in ("segment_alloc", "segment_map"):
            reserved += event["size"]
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= event["size"]
    segments_total = sum(segment["total_size"] for segment in snapshot.get("segments", []))
    first = events[0]["action"] if events else None
    return {
        "events": len(events),
        "actions": dict(sorted(actions.items())),
        "first_action": first,
        "peak_reserved_bytes": peak,
        "final_reserved_bytes": reserved,
        "snapshot_segments_bytes": segments_total,
        # Recording started before any memory was reserved: the first event reserves some.
        "starts_empty": first in ("segment_alloc", "segment_map", None),
        # And the trace saw every segment the snapshot holds (with expandable segments a
        # segment's total_size may count reserved address space, so this can differ there).
        "segments_match_trace": reserved == segments_total,
    }


# ---- the recording process (one per trace)

def run_lockstep_program(work: Any, workloads: Any, steps: int, rounds: int) -> int:
    """What a lockstep phase of bench.gpu.step_lockstep runs in each process: its warm-up, then
    `rounds` rounds of `steps` steps. Returns the steps run."""
    from bench.gpu.step_lockstep import ROUND_SEED, WARMUP_SEED
    workloads.warm_up(work, steps, WARMUP_SEED)
    for r in range(rounds):
        work.reseed(ROUND_SEED + r)
        for _ in range(steps):
            workloads.timed_step(work, work.draw())
    return 2 + steps * (rounds + 1)


def record(workload: str, setting: str, steps: int, out_dir: Path, fraction: float | None,
           max_events: int, save: bool, max_ooms: int = 0,
           lockstep_rounds: int = 0) -> dict[str, Any]:
    import torch  # imported here: the environment was set for this process before it started

    from allocator_ext import workloads

    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to torch in the recording process")
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    # Before anything touches the GPU's memory: the trace must start from an empty allocator.
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    model, fixed_shapes = WORKLOADS[workload]
    work = workloads.build(model, device, fixed_shapes=fixed_shapes)
    started = time.perf_counter()

    def events_so_far() -> int:
        torch.cuda.synchronize()
        return len(trace_events(torch.cuda.memory._snapshot()))

    if lockstep_rounds:
        steps_run, ooms = run_lockstep_program(work, workloads, steps, lockstep_rounds), 0
    else:
        steps_run, ooms = run_steps(work, steps, max_events, max_ooms, events_so_far,
                                    torch.cuda.OutOfMemoryError)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    snapshot = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats(0)
    torch.cuda.memory._record_memory_history(enabled=None)

    recording: dict[str, Any] = {
        "workload": workload, "setting": setting,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "memory_fraction": fraction, "device_total_bytes": total,
        "allowed_bytes": int(fraction * total) if fraction is not None else None,
        "steps": steps_run,
    }
    if lockstep_rounds:
        recording["lockstep"] = {"steps_a_round": steps, "rounds": lockstep_rounds}
    if max_ooms:
        recording["ooms_caught"] = ooms
    snapshot["allocwatch_recording"] = recording  # replay needs the cap of capped traces
    summary = summarize_trace(snapshot)
    result: dict[str, Any] = {
        **recording,
        "status": "ok",
        "steps_requested": steps,
        "workload_seconds": round(seconds, 3),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "trace": summary,
        "wrapped": summary["events"] >= MAX_ENTRIES,
        "stats": {key: stats.get(key) for key in STATS_KEYS},
    }
    counted = summary["actions"]
    result["num_device_alloc_vs_trace"] = {
        "num_device_alloc": stats.get("num_device_alloc"),
        "segment_alloc_events": counted.get("segment_alloc", 0),
        "segment_map_events": counted.get("segment_map", 0),
        "num_device_free": stats.get("num_device_free"),
        "segment_free_events": counted.get("segment_free", 0),
        "segment_unmap_events": counted.get("segment_unmap", 0),
        "alloc_counts_like_segment_alloc":
            stats.get("num_device_alloc") == counted.get("segment_alloc", 0),
    }
    result["peak_reserved_matches_trace"] = (
        stats.get("reserved_bytes.all.peak") == summary["peak_reserved_bytes"])
    if max_ooms and not ooms:
        result["status"] = "no_oom"  # not what was asked for: no file to mistake for one
        save = False
    if save:
        name = trace_name(workload, setting, bool(max_ooms), bool(lockstep_rounds))
        path = out_dir / f"{name}.pickle.gz"
        with gzip.open(path, "wb", compresslevel=6) as f:
            pickle.dump(snapshot, f, protocol=4)
        result["file"] = path.name
        result["file_bytes"] = path.stat().st_size
    return result


def child_main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    name = trace_name(args.workload, args.setting, bool(args.max_ooms), bool(args.lockstep))
    result_path = out_dir / (name + (".measure" if args.no_save else "") + RESULT_SUFFIX)
    try:
        result = record(args.workload, args.setting, args.steps, out_dir, args.memory_fraction,
                        args.max_events, save=not args.no_save, max_ooms=args.max_ooms or 0,
                        lockstep_rounds=args.rounds if args.lockstep else 0)
    except Exception as error:  # reported to the parent, which carries on with the others
        result = {"workload": args.workload, "setting": args.setting, "status": "failed",
                  "error": f"{type(error).__name__}: {error}"}
        result_path.write_text(json.dumps(result, indent=1))
        raise
    result_path.write_text(json.dumps(result, indent=1))
    return 0


# ---- the parent: one fresh process per trace, then the manifest

def run_child(workload: str, setting: str, steps: int, out_dir: Path, timeout_s: float,
              max_events: int | None, fraction: float | None = None, save: bool = True,
              max_ooms: int = 0, lockstep_rounds: int = 0) -> dict[str, Any]:
    """Records one trace in a process of its own; `max_events` None: the workload's own
    (MAX_EVENTS, else DEFAULT_MAX_EVENTS)."""
    max_events = max_events or MAX_EVENTS.get(workload, DEFAULT_MAX_EVENTS)
    timeout_s = max(timeout_s, MIN_TIMEOUT_S.get(workload, 0))
    name = trace_name(workload, setting, bool(max_ooms), bool(lockstep_rounds))
    result_path = out_dir / (name + ("" if save else ".measure") + RESULT_SUFFIX)
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", __spec__.name, "--child", "--out", str(out_dir),
            "--workload", workload, "--setting", setting, "--steps", str(steps),
            "--max-events", str(max_events)]
    if fraction is not None:
        argv += ["--memory-fraction", repr(fraction)]
    if not save:
        argv.append("--no-save")
    if max_ooms:
        argv += ["--max-ooms", str(max_ooms)]
    if lockstep_rounds:
        argv += ["--lockstep", "--rounds", str(lockstep_rounds)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=child_environment(setting), capture_output=True,
                              text=True, timeout=timeout_s)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = None
        stderr = (expired.stderr or b"").decode(errors="replace") if isinstance(
            expired.stderr, bytes) else (expired.stderr or "")
    wall = round(time.perf_counter() - started, 1)
    if result_path.exists():
        result = json.loads(result_path.read_text())
        result_path.unlink()
    else:
        result = {"workload": workload, "setting": setting, "status": "failed"}
    result["process_seconds"] = wall
    if returncode is None:
        result.update(status="timeout", error=f"no result within {timeout_s:.0f} s")
    elif returncode != 0 and result.get("status") == "ok":
        result["status"] = "failed"
    if result["status"] not in ("ok", "no_oom"):
        result["stderr_tail"] = stderr[-2000:]
    return result


def parent_main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = select_runs(args.only)
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    results: list[dict[str, Any]] = []
    default_peaks: dict[str, int] = {}
    device_total: int | None = None
    for workload, setting in runs:
        steps = args.steps or DEFAULT_STEPS[workload]
        name = trace_name(workload, setting)
        if deadline is not None and time.monotonic() > deadline:
            results.append({"workload": workload, "setting": setting, "status": "skipped",
                            "error": "time budget (--budget-s) spent"})
            print(f"{name:28s} skipped (time budget spent)", flush=True)
            continue
        fraction = None
        measure_error = None
        if setting == GC_SETTING:
            if workload not in default_peaks:  # measure it: same seed, same shapes
                measured = run_child(workload, "default", steps, out_dir, args.timeout_s,
                                     args.max_events, save=False)
                if measured["status"] == "ok":
                    default_peaks[workload] = measured["stats"]["reserved_bytes.all.peak"]
                    device_total = measured["device_total_bytes"]
                else:
                    measure_error = measured.get("error", measured["status"])
            if workload not in default_peaks or not device_total:
                why = "no default-settings run to size the memory cap from"
                if measure_error:
                    why += f" (measuring run: {measure_error})"
                results.append({"workload": workload, "setting": setting, "status": "failed",
                                "error": why})
                print(f"{name:28s} failed: {why}", flush=True)
                continue
            fraction = gc_memory_fraction(default_peaks[workload], device_total)
        result = run_child(workload, setting, steps, out_dir, args.timeout_s, args.max_events,
                           fraction=fraction)
        results.append(result)
        if result["status"] == "ok":
            device_total = result["device_total_bytes"]
            if setting == "default":
                default_peaks[workload] = result["stats"]["reserved_bytes.all.peak"]
        print(one_line(result), flush=True)

    return save_manifest(out_dir, "manifest.json", build_manifest(args, results), "traces")


def record_oom_workload(workload: str, settings: list[str], args: argparse.Namespace,
                        out_dir: Path) -> list[dict[str, Any]]:
    """--oom for one workload: the measuring run, then each setting under the cap it sizes,
    side by side."""
    steps = args.steps or DEFAULT_STEPS[workload]
    measured = run_child(workload, "default", steps, out_dir, args.timeout_s, args.max_events,
                         save=False)
    if measured["status"] != "ok":
        why = ("no default-settings run to size the memory cap from (measuring run: "
               f"{measured.get('error', measured['status'])})")
        return [{"workload": workload, "setting": s, "status": "failed", "error": why}
                for s in settings]
    def record_setting(setting: str) -> dict[str, Any]:
        return record_under_lowering_caps(
            lambda _cap, fraction: run_child(workload, setting, steps, out_dir, args.timeout_s,
                                             args.max_events, fraction=fraction,
                                             max_ooms=args.max_ooms),
            measured["stats"]["requested_bytes.all.peak"], measured["device_total_bytes"])

    with ThreadPoolExecutor(len(settings)) as pool:
        return list(pool.map(record_setting, settings))


def oom_parent_main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = select_oom_runs(args.only)
    by_workload: dict[str, list[str]] = {}
    for workload, setting in runs:
        by_workload.setdefault(workload, []).append(setting)
    # The workloads' caps are a few GiB each: they record at once on one GPU.
    with ThreadPoolExecutor(max(1, len(by_workload))) as pool:
        chains = pool.map(lambda item: record_oom_workload(item[0], item[1], args, out_dir),
                          by_workload.items())
        results = [result for chain in chains for result in chain]
    for result in results:
        if result["status"] == "no_oom":
            result["error"] = ("no cap made this run fail, down to "
                               f"{OOM_CAPS[-1]} x: not an out-of-memory trace")
        print(one_line(result, oom=True), flush=True)
    manifest = build_manifest(args, results)
    manifest["oom_setting"] = {
        "memory_fraction": f"{OOM_CAPS[0]} x the workload's peak requested bytes under default "
                           "settings, uncapped / device total; a recording that did not run out "
                           "of memory is recorded again at "
                           f"{', '.join(map(str, OOM_CAPS[1:]))} x in turn until one does "
                           "(each trace's attempts)",
        "max_ooms": args.max_ooms,
        "on_oom": "the step is skipped, its gradients dropped, and the next step runs"}
    return save_manifest(out_dir, OOM_MANIFEST, manifest, "out-of-memory traces", oom=True)


def lockstep_parent_main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_of = lockstep_steps()
    results = []
    for workload in select_lockstep_runs(args.only):
        result = run_child(workload, "default", args.steps or steps_of[workload], out_dir,
                           args.timeout_s, args.max_events, lockstep_rounds=args.rounds)
        results.append(result)
        print(one_line(result, lockstep=True), flush=True)
    manifest = build_manifest(args, results)
    manifest["lockstep_program"] = {
        "warm_up": "the workload's largest shapes twice, then the steps of a round on the "
                   "warm-up seed (bench.gpu.step_lockstep.WARMUP_SEED)",
        "rounds": f"{args.rounds} rounds of the pattern's quick steps (bench.gpu.patterns), "
                  "round r on seed ROUND_SEED + r", "setting": "PyTorch's defaults"}
    return save_manifest(out_dir, LOCKSTEP_MANIFEST, manifest, "lockstep traces", lockstep=True)


def save_manifest(out_dir: Path, file: str, manifest: dict[str, Any], what: str,
                  oom: bool = False, lockstep: bool = False) -> int:
    """Writes this run's `manifest` merged with the folder's earlier one (merge_manifest) and
    says how many of its traces were recorded; the exit status: 1 if any was not."""
    path = out_dir / file
    previous = json.loads(path.read_text()) if path.exists() else None
    path.write_text(json.dumps(merge_manifest(previous, manifest, oom, lockstep), indent=1))
    results = manifest["traces"]
    ok = [r for r in results if r["status"] == "ok"]
    print(f"{len(ok)} of {len(results)} {what} recorded in {out_dir}")
    return 0 if len(ok) == len(results) else 1


def one_line(result: dict[str, Any], oom: bool = False, lockstep: bool = False) -> str:
    name = trace_name(result["workload"], result["setting"], oom, lockstep)
    if result["status"] != "ok":
        return f"{name:28s} {result['status']}: {result.get('error', '')}"
    stats, trace = result["stats"], result["trace"]
    cap = ""
    if oom and "cap_of_peak_requested" in result:
        cap = (f"  cap {result['cap_of_peak_requested']} x (attempt "
               f"{len(result.get('attempts', [])) or 1})")
    return (f"{name:28s} ok{cap}  steps {result['steps']:3d}  events {trace['events']:7d}  "
            f"peak reserved {stats['reserved_bytes.all.peak'] / 2**30:6.2f} GiB  "
            f"device allocs {stats['num_device_alloc']:4d} (trace: "
            f"{trace['actions'].get('segment_alloc', 0)} alloc, "
            f"{trace['actions'].get('segment_map', 0)} map)  "
            f"{result.get('file_bytes', 0) / 2**20:5.2f} MiB  {result['process_seconds']:5.1f} s")


def build_manifest(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == "ok"]
    first = ok[0] if ok else {}
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": first.get("torch"), "cuda": first.get("cuda"), "device": first.get("device"),
        "device_total_bytes": first.get("device_total_bytes"),
        "settings": {name: conf or "" for name, conf in SETTINGS.items()},
        "gc_setting": {"threshold": 0.6, "memory_fraction": f"{GC_HEADROOM} x the workload's "
                       "peak reserved bytes under default settings / device total"},
        "snapshot_recording": {"enabled": "all", "context": None, "max_entries": MAX_ENTRIES,
                               "max_events": args.max_events or {
                                   "default": DEFAULT_MAX_EVENTS, **MAX_EVENTS}},
        "notes": "stats are torch.cuda.memory_stats(0) at the end of the run; 'trace' figures "
                 "are counted from the trace's own events. num_device_alloc_vs_trace says "
                 "whether num_device_alloc counts like segment_alloc events.",
        "traces": results,
    }


# ---- the self-check (CPU only)

def self_check() -> None:
    """Checks what can be checked without a GPU: arguments, run selection, environments, the
    trace summary, and every workload built and stepped on the CPU at a tiny size."""
    import torch

    from allocator_ext import workloads

    assert {model for model, _ in WORKLOADS.values()} <= set(workloads.NAMES)
    assert set(DEFAULT_STEPS) == set(WORKLOAD_NAMES)

    args = parse_args(["--out", "x", "--only", "moe", "gc", "--steps", "3"])
    assert args.out == "x" and args.steps == 3 and args.only == ["moe", "gc"]
    assert select_runs(["moe", "gc"]) == [("moe", "gc")]
    assert select_runs(["moe"]) == [("moe", s) for s in SETTINGS]
    assert select_runs(["expandable"]) == [(w, "expandable") for w in WORKLOAD_NAMES]
    assert select_runs(["decode__roundup", "convnet"])[-1] == ("decode", "roundup")
    assert len(select_runs(None)) == len(WORKLOAD_NAMES) * len(SETTINGS)
    try:
        select_runs(["nonsense"])
        raise AssertionError("an unknown --only name was accepted")
    except ValueError as error:
        assert "nonsense" in str(error)

    env = child_environment("default", {"PYTORCH_CUDA_ALLOC_CONF": "x", "PATH": "/bin"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["PATH"] == "/bin"
    assert child_environment("expandable", {})["PYTORCH_CUDA_ALLOC_CONF"] == (
        "expandable_segments:True")
    assert abs(gc_memory_fraction(10 * 2**30, 100 * 2**30) - 0.13) < 1e-9

    fake: dict[str, Any] = {"segments": [{"total_size": 2 << 20}], "device_traces": [[
        {"action": "segment_alloc", "size": 2 << 20}, {"action": "alloc", "size": 512},
        {"action": "segment_alloc", "size": 20 << 20}, {"action": "segment_free", "size": 20 << 20},
    ]]}
    summary = summarize_trace(fake)
    assert summary["peak_reserved_bytes"] == 22 << 20 and summary["starts_empty"]
    assert summary["segments_match_trace"]
    fake["segments"].append({"total_size": 2 << 20})  # memory the trace did not see reserved
    assert not summarize_trace(fake)["segments_match_trace"]

    assert set(MAX_EVENTS) <= set(WORKLOAD_NAMES)
    assert all(MAX_EVENTS[n] < DEFAULT_MAX_EVENTS for n in MAX_EVENTS)
    previous = {"created": "then", "command": "earlier", "traces": [
        {"workload": "moe", "setting": "gc"}, {"workload": "graph", "setting": "default"}]}
    merged = merge_manifest(previous, {"created": "now", "traces": [
        {"workload": "graph", "setting": "default", "new": True}]})
    assert [(t["workload"], t["setting"], "new" in t) for t in merged["traces"]] == [
        ("moe", "gc", False), ("graph", "default", True)]
    assert merged["earlier_recordings"] == [
        {"created": "then", "command": "earlier", "traces": ["moe__gc"]}]

    cpu = torch.device("cpu")
    for name in WORKLOAD_NAMES:
        model, fixed_shapes = WORKLOADS[name]
        why = workloads.unavailable(model)
        if why:  # its library: on the GPU machine, not always here
            print(f"not stepped: {why}")
            continue
        work = workloads.build(model, cpu, tiny=True, seed=1, fixed_shapes=fixed_shapes)
        for _ in range(2):
            work.step()
    _self_check_oom_mode(torch, workloads)
    _self_check_lockstep_mode(workloads)
    print("record_traces self-check passed")


def _self_check_lockstep_mode(workloads: Any) -> None:
    """--lockstep: its choices, its names, and its program stepped on the CPU."""
    import torch

    assert select_lockstep_runs(["graph", "trainer"]) == ["graph", "trainer"]
    assert "kv_generate" in select_lockstep_runs(None)
    try:
        select_lockstep_runs(["graph__default"])
        raise AssertionError("a trace name was taken for a workload with --lockstep")
    except ValueError as error:
        assert "graph__default" in str(error)
    assert trace_name("graph", "default", lockstep=True) == "graph__default_lockstep"
    args = parse_args(["--out", "x", "--lockstep", "--only", "graph", "--rounds", "3"])
    assert args.lockstep and args.rounds == 3
    merged = merge_manifest({"traces": [{"workload": "trainer", "setting": "default"}]},
                            {"traces": [{"workload": "graph", "setting": "default"}]},
                            lockstep=True)
    assert merged["earlier_recordings"][0]["traces"] == ["trainer__default_lockstep"]
    model, fixed_shapes = WORKLOADS["gpt_varlen"]
    work = workloads.build(model, torch.device("cpu"), tiny=True, seed=1,
                           fixed_shapes=fixed_shapes)
    drawn: list[bool] = []
    draw = work.draw

    def counted_draw(*a: Any, **k: Any) -> Any:
        drawn.append(k.get("largest", False))
        return draw(*a, **k)

    work.draw = counted_draw
    assert run_lockstep_program(work, workloads, steps=2, rounds=2) == 2 + 2 * 3
    # The warm-up meets the peak first (the largest shapes twice), then draws freely.
    assert drawn[:2] == [True, True] and not any(drawn[2:]) and len(drawn) == 8


class _FailingSteps:
    """A workload whose chosen steps run out of memory after their backward pass, as a step
    under a memory cap does on the GPU."""

    def __init__(self, work: Any, failing: set[int], oom_error: type[BaseException]) -> None:
        self.work, self.failing, self.oom_error = work, failing, oom_error
        self.optimizer = work.optimizer
        self.count = 0

    def step(self) -> None:
        self.count += 1
        if self.count in self.failing:
            for p in self.work.model.parameters():
                p.grad = p.detach().clone()  # gradients of the failed step
            raise self.oom_error("CUDA out of memory (simulated)")
        self.work.step()


def _self_check_oom_mode(torch: Any, workloads: Any) -> None:
    args = parse_args(["--oom", "--out", "x", "--only", "convnet"])
    assert args.oom and args.max_ooms == OOM_MAX
    assert select_oom_runs(["convnet"]) == [("convnet", "default"), ("convnet", GC_SETTING)]
    assert len(select_oom_runs(None)) == len(OOM_WORKLOADS) * len(OOM_SETTINGS)
    assert trace_name("moe", "gc", oom=True) == "moe__gc_oom"
    assert abs(oom_memory_fraction(10 * 2**30, 100 * 2**30, 1.02) - 0.102) < 1e-9
    for refused in (["--oom", "--out", "x", "--only", "decode"], ["--out", "x", "--max-ooms", "2"]):
        try:
            with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
                parse_args(refused)
            raise AssertionError(f"{refused} was accepted")
        except SystemExit as exit_:
            assert exit_.code == 2

    work = workloads.build(WORKLOADS["gpt_varlen"][0], torch.device("cpu"), tiny=True, seed=1)
    oom = torch.cuda.OutOfMemoryError
    failing = _FailingSteps(work, {2, 4}, oom)
    assert run_steps(failing, 6, DEFAULT_MAX_EVENTS, 2, lambda: 10, oom) == (4, 2)
    assert all(p.grad is None for p in work.model.parameters())  # the failed step's dropped
    assert run_steps(_FailingSteps(work, {9}, oom), 6, DEFAULT_MAX_EVENTS, 2, lambda: 10,
                     oom) == (6, 0)
    # Two steps that make half the event budget each: the recording stops there.
    assert run_steps(work, 6, 100, 2, lambda: 100, oom) == (2, 0)
    try:
        run_steps(_FailingSteps(work, {1}, oom), 6, DEFAULT_MAX_EVENTS, 0, lambda: 10, oom)
        raise AssertionError("without --oom an out-of-memory error was swallowed")
    except oom:
        pass


# ---- command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the traces and manifest.json")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="workloads, settings or <workload>__<setting> to record")
    parser.add_argument("--steps", type=int, help="steps per trace (default: per workload)")
    parser.add_argument("--max-events", type=int,
                        help=f"fewer steps when a trace would exceed this many events (default "
                             f"{DEFAULT_MAX_EVENTS:,}; {min(MAX_EVENTS.values()):,} for the "
                             f"libraries' patterns)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="per recording process")
    parser.add_argument("--budget-s", type=float,
                        help="skip the remaining traces once this many seconds have passed")
    parser.add_argument("--self-check", action="store_true",
                        help="check without a GPU (CPU build of torch) and exit")
    parser.add_argument("--oom", action="store_true",
                        help="record traces that run out of memory under a cap (see above)")
    parser.add_argument("--lockstep", action="store_true",
                        help="record the patterns' lockstep programs (see above)")
    parser.add_argument("--rounds", type=int, default=LOCKSTEP_ROUNDS,
                        help=f"with --lockstep: rounds after the warm-up (default "
                             f"{LOCKSTEP_ROUNDS})")
    parser.add_argument("--max-ooms", type=int,
                        help=f"with --oom: errors a recording catches before it stops "
                             f"(default {OOM_MAX})")
    # Internal: the recording process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--memory-fraction", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if not args.self_check and not args.out:
        parser.error("--out is required")
    if args.lockstep and args.oom:
        parser.error("--lockstep and --oom record different programs: give one")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.only:
        try:
            (select_lockstep_runs if args.lockstep and not args.child else select_runs)(args.only)
        except ValueError as error:
            parser.error(str(error))
    if args.max_ooms is not None and (args.max_ooms < 1 or not (args.oom or args.child)):
        parser.error("--max-ooms takes a count of at least 1, with --oom")
    if args.oom:
        if not select_oom_runs(args.only):
            parser.error(f"nothing to record: --oom records {', '.join(OOM_WORKLOADS)} under "
                         f"{', '.join(OOM_SETTINGS)}")
        args.max_ooms = args.max_ooms or OOM_MAX
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_check:
        self_check()
        return 0
    if args.child:
        return child_main(args)
    if args.lockstep:
        return lockstep_parent_main(args)
    return oom_parent_main(args) if args.oom else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
