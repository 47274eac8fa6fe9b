"""What `replay` and `tune` share: the trace and cap arguments, and a progress bar on a
terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="the snapshot file (.pickle or .pickle.gz)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="cap the simulated device: a size (80GiB, 1.5G) or a multiple of the "
                        "trace's peak requested bytes (1.03x); default: the recorded device's "
                        "total where the trace recorded a memory fraction, else no cap")
    p.add_argument("--memory-fraction", type=float, metavar="F",
                   help="as torch.cuda.set_per_process_memory_fraction(F); default: the "
                        "fraction the trace recorded (bench/replay/record_traces.py keeps it in "
                        "the snapshot), unless --device-memory is given")


def device_memory_arg(text: str | None, peak_requested: int) -> int | None:
    """A size, or a multiple of the trace's peak requested bytes ("1.03x"); None if not given."""
    from allocator_ext.replay.sizes import parse_size

    if not text:
        return None
    if text.strip().lower().endswith("x"):
        try:
            factor = float(text.strip()[:-1])
        except ValueError:
            raise ValueError(f"not a multiple: {text!r} (example: 1.03x)") from None
        if factor <= 0:
            raise ValueError(f"--device-memory {text}: the multiple must be positive")
        return int(factor * peak_requested)
    return parse_size(text)


@contextmanager
def progress_bar(total: int, desc: str, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A callback taking the number of events done, drawing a bar on a terminal (stderr);
    None when quiet or not on a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="ev", desc=desc, file=sys.stderr)
    done = [0]

    def update(n: int) -> None:
        bar.update(n - done[0])
        done[0] = n

    try:
        yield update
    finally:
        bar.close()
