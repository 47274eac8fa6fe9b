"""Trace replay: run a recorded PyTorch memory snapshot through the core on the simulated device."""

from allocator_ext.replay.costs import CostTable, load_cost_table
from allocator_ext.replay.engine import ReplayResult, replay
from allocator_ext.replay.replayer import PassResult, Replayer
from allocator_ext.replay.trace import Trace, TraceError, load_trace

__all__ = [
    "CostTable",
    "PassResult",
    "ReplayResult",
    "Replayer",
    "Trace",
    "TraceError",
    "load_cost_table",
    "load_trace",
    "replay",
]
