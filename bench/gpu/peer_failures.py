"""Prints the failures of one run of PyTorch's own allocator tests (the junit XML of .peer's
peer_runner.py), each with the line that says what went wrong, and the count of each outcome.
Failures that PyTorch's allocator has too on the GPU machine are marked: an API newer than the
installed torch, or a download the machine cannot make (no network). Run by
bench/gpu/dropin_check.sh's peer part:

    python -m bench.gpu.peer_failures allocwatch.xml
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET

# Why a test fails with PyTorch's own allocator too, by its message.
NATIVE_TOO = (
    (re.compile(r"has no attribute '(Graph|is_capturing|generate_graph_pool_handle)'"),
     "an API newer than this torch"),
    (re.compile(r"URLError|Temporary failure in name resolution"), "needs the network"),
)


ERROR_LINE = re.compile(r"^\w+(Error|Exception)\b")
# PyTorch's repro hint after every failure.
NOISE = ("To execute this test", "python test_cuda.py", "This message can be suppressed")


def message(failure: ET.Element) -> str:
    """pytest's 'E ' lines from the exception on (two more lines for the detail of an assertion),
    else the message attribute."""
    text = failure.text or ""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = [line for line in lines if line and not line.startswith(NOISE)]
    start = next((i for i, line in enumerate(lines) if ERROR_LINE.match(line)), None)
    if start is not None:
        return " / ".join(lines[start:start + 3])[:240]
    first = (failure.get("message") or text).strip().splitlines()
    return first[0][:240] if first else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("xml")
    args = parser.parse_args()
    try:
        root = ET.parse(args.xml).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"no results: {e}")
        return 1
    counts: collections.Counter[str] = collections.Counter()
    rows = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
                text = message(child)
                why = next((reason for pattern, reason in NATIVE_TOO
                            if pattern.search(child.text or "") or pattern.search(text)), None)
                label = "FAIL" if child.tag == "failure" else "ERROR"
                if why:  # lower case: not allocwatch's to fix
                    label = label.lower()
                rows.append((why is not None, f"  {label} {name}: {text}" +
                             (f"  [fails natively too: {why}]" if why else "")))
            elif child.tag == "skipped":
                outcome = "notrun" if child.get("type") == "notrun" else "skipped"
        counts[outcome] += 1
    if not counts:
        print("no test ran (the peer run's log says why)")
        return 1
    print(", ".join(f"{counts[k]} {k}" for k in ("passed", "failure", "error", "skipped", "notrun")
                    if counts[k]) + f"; {sum(not native for native, _ in rows)} not explained "
                                    f"by torch's version or the network")
    for _native, line in sorted(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
