"""allocwatch's benchmarks, each a module that prints its figures, run from the checkout's root
as `python -m bench.<folder>.<name>` (`--help` says what it measures and what it writes):

    native/    the core's C++ benchmarks and soak (bench/CMakeLists.txt builds them; shell
               scripts build and run them)
    replay/    replay studies on recorded traces, and the recording of traces on a GPU
    gpu/       studies on the GPU, and the shells that run a whole GPU check in one command
    sidecar/   the sidecar under load, and what the agent costs a training process
    lib/       what several of them share

The torch workloads they train live in the package (allocator_ext.workloads). docs/benchmarks.md
holds today's figures, each with the command that produced it.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout: its traces, data and packages
