"""Searching allocator settings on a recorded trace.

Each candidate is replayed on the simulated device; the recommendation is the candidate with
the lowest peak reserved memory among those that never ran out of memory, ties going to fewer
retries, then to cheaper device calls. On a trace that ended in out-of-memory errors, the replay
makes the requests that failed too, so a candidate under which one recurs ran out of memory and
is never recommended; the settings the trace was recorded under are a candidate of their own.
Where every candidate runs out of memory there is no recommendation. PyTorch-expressible
candidates are also reported as a PYTORCH_CUDA_ALLOC_CONF string, for jobs that keep PyTorch's
allocator.

With several passes (`allocwatch tune --passes N`) each candidate replays the trace N times on
one allocator, as a long run repeats its steps, and is judged by what the passes reached: the
peak reserved after the last pass, and the out-of-memory errors and retries of every pass (a
setting whose cache creeps into the cap in a later pass is not recommended).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import allocator_ext._core as ae
from allocator_ext.replay.engine import replay
from allocator_ext.replay.sizes import format_size
from allocator_ext.replay.trace import Trace

RECORDED = "recorded settings"

# (name, settings, whether PyTorch's own allocator understands them)
CANDIDATES: list[tuple[str, str | None, bool]] = [
    ("pytorch defaults", "native", True),
    ("expandable segments", "native,expandable_segments:True", True),
    ("max_split_size_mb:128", "native,max_split_size_mb:128", True),
    ("max_split_size_mb:512", "native,max_split_size_mb:512", True),
    ("roundup_power2_divisions:4", "native,roundup_power2_divisions:4", True),
    ("expandable + roundup 4", "native,expandable_segments:True,roundup_power2_divisions:4", True),
    ("allocwatch defaults", None, False),
    ("allocwatch, page moves repeated", "settle_page_moves:False", False),
    ("allocwatch, 20 MiB pages (PyTorch's)", "expandable_large_page_mb:20,expandable_chunk_mb:0",
     False),
    ("allocwatch, 8 MiB pages", "expandable_large_page_mb:8,expandable_chunk_mb:0", False),
    ("allocwatch, 2 MiB pages one by one", "expandable_chunk_mb:0", False),
    ("allocwatch, 2 MiB pages in 8 MiB chunks", "expandable_chunk_mb:8", False),
    ("allocwatch, 2 MiB pages in 20 MiB chunks", "expandable_chunk_mb:20", False),
]


@dataclass
class Candidate:
    name: str
    settings: str
    pytorch_conf: str | None  # the PYTORCH_CUDA_ALLOC_CONF equivalent, where there is one
    report: dict[str, Any]

    @property
    def figures(self) -> dict[str, Any]:
        """The report's figures the candidate is judged by: after several passes, the peak
        reserved after the last and the retries and out-of-memory errors of them all."""
        r, run = self.report, self.report.get("long_run")
        if not run:
            return r
        return {**r, "peak_reserved_bytes": run["peak_reserved_bytes"],
                "reserved_ratio": run["reserved_ratio"],
                "num_ooms": r["num_ooms"] + run["num_ooms_later_passes"],
                "num_alloc_retries": r["num_alloc_retries"] + run["num_alloc_retries_later_passes"]}


def _pytorch_conf(settings: str) -> str:
    keys = [k for k in settings.split(",") if k and k != "native"]
    return ",".join(keys)


def survives(c: Candidate) -> bool:
    """Never ran out of memory, in any pass (so no recorded out-of-memory error recurred
    either)."""
    return c.figures["num_ooms"] == 0


def rank_key(c: Candidate) -> tuple:
    r = c.figures
    return (not survives(c), r["peak_reserved_bytes"], r["num_alloc_retries"],
            r["device_call_seconds_estimate"])


def _canonical(settings: str | None) -> str | None:
    try:
        return str(ae.parse_config(settings or "")["string"])
    except ValueError:
        return None


def candidates_for(trace: Trace) -> list[tuple[str, str | None, bool]]:
    """CANDIDATES, and first the settings the trace was recorded under where none of them is
    those (a recording's settings PyTorch's allocator understood, on top of its defaults)."""
    conf = trace.recorded_config
    if not conf:
        return list(CANDIDATES)
    settings = conf if conf.startswith("native") else f"native,{conf}"
    recorded = _canonical(settings)
    if recorded is None or recorded in {_canonical(c[1]) for c in CANDIDATES}:
        return list(CANDIDATES)
    return [(RECORDED, settings, True), *CANDIDATES]


def tune(trace: Trace, device_memory: int = 0, memory_fraction: float | None = None,
         candidates: list[tuple[str, str | None, bool]] | None = None,
         progress: Callable[[int], None] | None = None, passes: int = 1) -> list[Candidate]:
    """Replays every candidate (default: candidates_for(trace)) `passes` times on one allocator
    each; returns them best first (see rank_key)."""
    results: list[Candidate] = []
    n = len(trace.events) * passes
    for i, (name, settings, pytorch_ok) in enumerate(candidates or candidates_for(trace)):
        def step(done: int, base: int = i * n) -> None:
            if progress is not None:
                progress(base + done)

        report = replay(trace, config=settings, device_memory=device_memory,
                        memory_fraction=memory_fraction, progress=step, passes=passes).report
        results.append(Candidate(name, report["config"],
                                 _pytorch_conf(report["config"]) if pytorch_ok else None, report))
    return sorted(results, key=rank_key)


def recommended(ranked: list[Candidate]) -> Candidate | None:
    """The best candidate, if any never ran out of memory."""
    return ranked[0] if ranked and survives(ranked[0]) else None


def explain(best: Candidate, ranked: list[Candidate]) -> str:
    """Why the recommendation won (or, where every candidate ran out of memory, why there is
    none), in a sentence or two."""
    r = best.figures
    survivors = [c for c in ranked if survives(c)]
    run = best.report.get("long_run")
    over = f" over {run['passes']} passes" if run else ""
    lines = []
    recorded_ooms = len(r["recorded_ooms"])
    if recorded_ooms and not r["device_memory"] and r["memory_fraction"] is None:
        lines.append(
            f"The recorded run ran out of memory {recorded_ooms} time(s), but these replays "
            "had no cap, so no error could recur: the ranking does not say whether another "
            "setting would have avoided them (the cap line says which cap to give).")
    elif recorded_ooms:
        recurs = [c.name for c in ranked if c.report["recorded_ooms_recurred"]]
        lines.append(
            f"The recorded run ran out of memory {recorded_ooms} time(s); replayed, the failed "
            f"request{'s' if recorded_ooms > 1 else ''} recur under {len(recurs)} of the "
            f"{len(ranked)} candidates" + (f" ({', '.join(recurs)})" if recurs else "")
            + ", and only a candidate under which no out-of-memory error recurs is recommended.")
    if not survives(best):
        lines.append(f"Every candidate ran out of memory under this cap{over}: no "
                     f"recommendation; the least bad, '{best.name}', failed {r['num_ooms']} "
                     "time(s).")
        return " ".join(lines)
    lines.append(
        f"'{best.name}' reserves the least at its peak{over} "
        f"({format_size(r['peak_reserved_bytes'])}, {r['reserved_ratio']:.3f} x what the "
        f"program requested) of the {len(survivors)} candidates that never ran out of memory, "
        "with "
        f"{r['num_alloc_retries']} retries and device calls costing "
        f"{100 * r['device_call_share']:.2f} % of the trace's active time.")
    if r["device_call_share"] > 0.02:
        cheaper = next((c for c in ranked if survives(c)
                        and c.report["device_call_share"] <= 0.02), None)
        if cheaper is not None:
            more = cheaper.figures["peak_reserved_bytes"] - r["peak_reserved_bytes"]
            lines.append(
                f"Its device calls are costly, though: '{cheaper.name}' keeps them at "
                f"{100 * cheaper.report['device_call_share']:.2f} % for "
                f"{format_size(more)} more reserved memory.")
    pytorch = next((c for c in ranked if c.settings == "native"), None)
    if pytorch is not None and pytorch is not best and not survives(pytorch):
        # What it reserved stopped short of its failed requests: no saving to compare.
        lines.append(f"PyTorch's defaults ran out of memory {pytorch.figures['num_ooms']} "
                     "time(s) here.")
    elif pytorch is not None and pytorch is not best:
        saved = pytorch.figures["peak_reserved_bytes"] - r["peak_reserved_bytes"]
        lines.append(f"Against PyTorch's defaults it saves {format_size(saved)} of reserved "
                     "memory.")
    return " ".join(lines)
