"""What `replay` and `tune` share: the trace, cap and plot arguments."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from exporter.commands._arguments import fraction


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="the snapshot file (.pickle or .pickle.gz)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="cap the simulated device: a size in powers of 1024 (80GiB, 80G, "
                        "1.5T, bytes with B: 123456789B; a number without a unit, and "
                        "KB/MB/GB/TB, are refused) or a multiple of the trace's peak requested "
                        "bytes (1.03x), or none (no cap); "
                        "default: the recorded device's total where the trace recorded a "
                        "memory fraction, else what the run could reserve at its recorded "
                        "out-of-memory errors, else no cap")
    p.add_argument("--memory-fraction", type=fraction, metavar="F",
                   help="as torch.cuda.set_per_process_memory_fraction(F); default: the "
                        "fraction the trace recorded (bench/replay/record_traces.py keeps it in "
                        "the snapshot), unless --device-memory is given")


def add_passes_argument(p: argparse.ArgumentParser, judged: str) -> None:
    p.add_argument("--passes", type=_passes, default=1, metavar="N",
                   help="replay the trace N times on one allocator, as a long run repeats its "
                        f"steps, and {judged} (default: 1)")


def _passes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def device_memory_arg(text: str | None, peak_requested: int) -> int | None:
    """A size, or a multiple of the trace's peak requested bytes ("1.03x"); 0 for "none" (no
    cap, whatever the trace keeps or implies); None when none is given. ValueError naming
    --device-memory for anything else, a cap of 0 bytes included (leaving the option out means
    the trace's own cap)."""
    from allocator_ext.replay.sizes import SizeWithoutUnit, parse_size

    if text is None:
        return None
    if text.strip().lower() == "none":
        return 0
    if text.strip().lower().endswith("x"):
        try:
            factor = float(text.strip()[:-1])
        except ValueError:
            raise ValueError(f"--device-memory: not a multiple: {text!r} (example: 1.03x)") \
                from None
        if factor <= 0:
            raise ValueError(f"--device-memory {text}: the multiple must be positive")
        cap = int(factor * peak_requested)
    else:
        try:
            cap = parse_size(text)
        except SizeWithoutUnit as err:
            n = err.number
            bytes_too = "" if "." in n else f" (bytes are written {n}B)"
            raise ValueError(f"--device-memory {text}: no unit; did you mean {n}x ({n} × the "
                             f"trace's peak requested bytes) or {n}G?{bytes_too}") from None
        except ValueError as err:
            raise ValueError(f"--device-memory: {err}") from None
    if cap <= 0:
        raise ValueError(f"--device-memory {text}: a cap of 0 bytes leaves the device no memory "
                         "(leave the option out for the trace's own cap; none for no cap)")
    return cap


def add_plot_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", metavar="FILE.png",
                   help=f"{what} (needs matplotlib: pip install matplotlib, the plot extra)")


def check_plot_target(path: str | None) -> None:
    """Before any replay runs: the plot can be drawn and written. ValueError saying why not."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--plot {path}: drawing needs matplotlib, which is not installed "
                         "(pip install matplotlib: what the extra 'allocwatch[plot]' adds)")
    directory = Path(path).parent
    if not directory.is_dir():
        raise ValueError(f"--plot {path}: there is no directory {directory}")
    from matplotlib.backend_bases import FigureCanvasBase

    # matplotlib picks the format by the suffix: refuse here what it would refuse (or, with no
    # suffix, write under another name) only after the replays.
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        what = f"matplotlib cannot write .{suffix} files" if suffix else \
            "the file's suffix must name its format"
        raise ValueError(f"--plot {path}: {what} (.png, .svg, .pdf, …)")
