"""Searching allocator settings on a recorded trace.

Each candidate is replayed on the simulated device; the recommendation is the candidate with
the lowest peak reserved memory among those that never ran out of memory. Peaks closer than
TIE_MARGIN of the trace's peak requested bytes count as a tie, which goes to fewer retries,
then to cheaper device calls (of every pass). On a trace that ended in out-of-memory errors,
the replay makes the requests that failed too, so a candidate under which one recurs ran out
of memory and is never recommended; the settings the trace was recorded under are a candidate
of their own. Where every candidate runs out of memory there is no recommendation.
PyTorch-expressible candidates are also reported as a PYTORCH_CUDA_ALLOC_CONF string, for jobs
that keep PyTorch's allocator.

With several passes (`allocwatch tune --passes N`) each candidate replays the trace N times on
one allocator, as a long run repeats its steps, and is judged by what the passes reached: the
peak reserved after the last pass, and the out-of-memory errors and retries of every pass (a
setting whose cache creeps into the cap in a later pass is not recommended); one that goes on
mapping its pages at new addresses (keeps_mapping_new_addresses) ranks after those that
settle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import allocator_ext._core as ae
from allocator_ext.replay.engine import STEADY_GROWTH_MARGIN, mapped_beyond_reserved, replay
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
    ("allocwatch, 2 MiB pages one by one, grown blocks aligned to them",
     "expandable_chunk_mb:0,align_to_pages:True", False),
    ("allocwatch, 2 MiB pages in 8 MiB chunks", "expandable_chunk_mb:8", False),
    ("allocwatch, 2 MiB pages in 20 MiB chunks", "expandable_chunk_mb:20", False),
    ("allocwatch, aliased 2 MiB pages", "alias_pages:True,expandable_chunk_mb:2", False),
    ("allocwatch, aliased 2 MiB pages in 4 MiB handles", "alias_pages:True,expandable_chunk_mb:4",
     False),
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


def keeps_mapping_new_addresses(c: Candidate) -> bool:
    """After several passes, aliased pages (alias_pages) still mapped at ever more addresses:
    the driver's mappings grow without bound while reserved memory does not. False after one
    pass, which cannot tell."""
    passes = c.report.get("passes") or []
    if len(passes) < 2:
        return False
    base = passes[1] if len(passes) >= 3 else passes[0]
    grown = mapped_beyond_reserved(passes[-1]) - mapped_beyond_reserved(base)
    # Beyond the steady-state bar's margin (of the peak requested bytes): from pass 2 (pass 1
    # with two passes) to the last, it keeps mapping its pages at new addresses.
    return grown > STEADY_GROWTH_MARGIN * c.report["peak_requested_bytes"]


def survives(c: Candidate) -> bool:
    """Never ran out of memory, in any pass (so no recorded out-of-memory error recurred
    either)."""
    return c.figures["num_ooms"] == 0


# Peaks of reserved memory closer than this share of the trace's peak requested bytes rank as
# equal: 0.01 is the resolution the reserved/requested ratio is judged at (the bar is 1.01),
# and a smaller difference is not worth trading retries or device calls for.
TIE_MARGIN = 0.01


def device_call_seconds(c: Candidate) -> float:
    """The device calls' estimated cost over every pass (the first alone where there is one)."""
    passes = c.report.get("passes")
    if passes:
        return float(sum(p["device_call_seconds_estimate"] for p in passes))
    return float(c.report["device_call_seconds_estimate"])


def later_passes(c: Candidate) -> dict[str, float] | None:
    """What the passes after the first cost at most, any one of them: device calls of every
    kind (maps, unmaps and creates of pages too: what a cache that keeps changing its layout
    goes on making) and their cost's share of the trace's active time; None with one pass."""
    passes = c.report.get("passes") or []
    if len(passes) < 2:
        return None
    return {"device_calls": max(sum(kind["count"] for kind in p["device_calls"].values())
                                for p in passes[1:]),
            "device_call_share": max(p["device_call_share"] for p in passes[1:])}


def group(c: Candidate) -> int:
    """Rank's groups, best first: never out of memory; never out of memory but mapping its
    pages at ever more addresses pass after pass; out of memory."""
    if not survives(c):
        return 2
    return 1 if keeps_mapping_new_addresses(c) else 0


def rank(results: list[Candidate]) -> list[Candidate]:
    """Best first, by group (group()); in each, by peak reserved, a run of peaks within
    TIE_MARGIN of the run's lowest ranked among themselves by retries, then by device calls'
    cost."""
    ranked: list[Candidate] = []
    for g in (0, 1, 2):
        left = sorted((c for c in results if group(c) == g),
                      key=lambda c: c.figures["peak_reserved_bytes"])
        while left:
            lowest = left[0].figures["peak_reserved_bytes"]
            margin = TIE_MARGIN * left[0].report["peak_requested_bytes"]
            tied = [c for c in left if c.figures["peak_reserved_bytes"] - lowest <= margin]
            left = left[len(tied):]
            ranked.extend(sorted(tied, key=lambda c: (c.figures["num_alloc_retries"],
                                                      device_call_seconds(c),
                                                      c.figures["peak_reserved_bytes"])))
    return ranked


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
    each; returns them best first (see rank)."""
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
    return rank(results)


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
    growing = [c for c in survivors if keeps_mapping_new_addresses(c)]
    which = "that never ran out of memory"
    if growing and group(best) == 0:
        lines.append(
            f"{len(growing)} candidate(s) that never ran out of memory keep mapping their pages "
            f"at new addresses pass after pass, so the driver's mappings grow without bound, and "
            "rank after those that do not (" + ", ".join(f"'{c.name}'" for c in growing) + ").")
        survivors = [c for c in survivors if c not in growing]
        which = "that never ran out of memory and keep their mappings"
    elif growing:
        lines.append(
            "Every candidate that never ran out of memory keeps mapping its pages at new "
            "addresses pass after pass (the driver's mappings grow without bound).")
    margin = TIE_MARGIN * r["peak_requested_bytes"]
    lowest = min(c.figures["peak_reserved_bytes"] for c in survivors)
    tied = [c for c in survivors if c is not best
            and c.figures["peak_reserved_bytes"] - lowest <= margin]
    costs = (f"{r['num_alloc_retries']} retries and device calls costing "
             f"{100 * r['device_call_share']:.2f} % of the trace's active time")
    if not tied:
        lines.append(
            f"'{best.name}' reserves the least at its peak{over} "
            f"({format_size(r['peak_reserved_bytes'])}, {r['reserved_ratio']:.3f} x what the "
            f"program requested) of the {len(survivors)} candidates {which}, with {costs}.")
    else:
        runner = tied[0]
        decided = ("fewer retries" if runner.figures["num_alloc_retries"]
                   > r["num_alloc_retries"] else
                   f"cheaper device calls ({1e3 * device_call_seconds(best):.1f} ms against "
                   f"{1e3 * device_call_seconds(runner):.1f} ms"
                   + (f" over {run['passes']} passes" if run else "") + ")")
        lines.append(
            f"'{best.name}' is one of {len(tied) + 1} candidates, of the {len(survivors)} "
            f"{which}, whose peaks reserved{over} lie within "
            f"{format_size(margin)} ({100 * TIE_MARGIN:.0f} % of the peak requested bytes) of "
            f"the least, which rank as equal (also "
            + ", ".join(f"'{c.name}'" for c in tied) + f"); it ranks first among them on "
            f"{decided}. It reserves {format_size(r['peak_reserved_bytes'])} "
            f"({r['reserved_ratio']:.3f} x what the program requested), with {costs}.")
    if r["device_call_share"] > 0.02:
        cheaper = next((c for c in ranked if survives(c)
                        and c.report["device_call_share"] <= 0.02), None)
        if cheaper is not None:
            more = cheaper.figures["peak_reserved_bytes"] - r["peak_reserved_bytes"]
            lines.append(
                f"Its device calls are costly, though: '{cheaper.name}' keeps them at "
                f"{100 * cheaper.report['device_call_share']:.2f} % for "
                f"{format_size(more)} more reserved memory.")
    if "alias_pages:True" in best.settings and not run:
        lines.append(
            "It maps pages at several addresses (aliased pages), which on many programs goes on "
            "mapping them at new ones step after step, the driver's mappings growing while "
            "reserved memory does not: tune with --passes 3 or more tells whether it settles "
            "here.")
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
