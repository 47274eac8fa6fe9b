"""What `allocwatch ctl` prints: byte counts, the agents' table, commands' results.

Every text an agent chose (its key, host, job, backend, settings, messages, paths) is printed
through `safe`: a terminal acts on control characters (ESC starts a sequence that can move the
cursor or clear the screen, CR returns to the line's start, BEL rings) and Unicode's format
characters reorder or hide text, so a row could be forged or another hidden. They are shown
escaped instead."""

from __future__ import annotations

import unicodedata
from typing import Any, TextIO

# Unicode categories a terminal may act on or render as nothing: controls, format characters
# (bidi overrides, zero-width joiners), line and paragraph separators, unassigned.
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def safe(text: Any) -> str:
    """`text` with every character a terminal could act on escaped (\\xNN, \\uNNNN,
    \\UNNNNNNNN); a backslash is doubled, so that an escape cannot be forged either."""
    if text is None:
        return ""
    out = []
    for char in str(text):
        if char == "\\":
            out.append("\\\\")
        elif unicodedata.category(char) in _UNSAFE:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def print_agents(agents: list[dict[str, Any]], out: TextIO) -> None:
    """One row per agent and device. PEAK_FRAG: 1 - peak allocated / peak reserved over the
    last report interval (0 for a cache with nothing stranded); the cache's idle share between
    steps is the API's fragmentation_ratio, not shown here. SETTINGS names each distinct
    settings string by a number, written out once under the table: a string runs to over a
    hundred characters, and the ranks of a job mostly share one."""
    if not agents:
        print("no agent matches", file=out)
        return
    legend: dict[str, str] = {}

    def settings(device: dict[str, Any] | None) -> str:
        text = safe(device["settings"]["config_string"]) if device else ""
        if not text:
            return "-"
        return legend.setdefault(text, f"#{len(legend) + 1}")

    rows = [["AGENT", "RANK", "HOST", "JOB", "BACKEND", "STATE", "DEV", "ALLOCATED", "RESERVED",
             "PEAK_FRAG", "RETRIES", "OOMS", "SETTINGS"]]
    for agent in agents:
        state = "connected" if agent["connected"] else "gone"
        devices = agent["devices"] or [None]
        for device in devices:
            rows.append([
                safe(agent["agent"]), str(agent["rank"]) if agent["rank"] >= 0 else "-",
                safe(agent["host"]) or "-", safe(agent["job"]) or "-",
                safe(agent["backend"]) or "-", state,
                str(device["cuda_device"]) if device else "-",
                human_bytes(device["allocated_bytes"]) if device else "-",
                human_bytes(device["reserved_bytes"]) if device else "-",
                f"{device['peak_fragmentation_ratio']:.2f}" if device else "-",
                str(device["counters"]["alloc_retries"]) if device else "-",
                str(device["counters"]["ooms"]) if device else "-",
                settings(device)])
    _table(rows, out)
    for text, number in legend.items():
        print(f"settings {number}: {text}", file=out)


def print_results(answer: dict[str, Any], out: TextIO) -> None:
    print(f"{answer['command']}: {answer['selected']} agent(s)", file=out)
    for r in answer["results"]:
        line = f"  {safe(r['agent'])} (rank {r['rank']}, {safe(r['host'])}): {r['status']}"
        if r.get("message"):
            line += f" — {safe(r['message'])}"
        print(line, file=out)
        if answer["command"] == "reclaim" and r["status"] == "ok":
            print(f"    released {human_bytes(r['bytes_released'])} in "
                  f"{r['sync_seconds'] * 1e3:.2f} ms (device synchronisation included)", file=out)
        if "snapshot" in r:
            print(f"    snapshot {safe(r['snapshot']['path'])} "
                  f"({human_bytes(r['snapshot']['bytes'])})", file=out)
        for s in r.get("settings_in_force", []):
            print(f"    cuda:{s['cuda_device']} settings in force: "
                  f"{safe(s['config_string']) or '-'}", file=out)
