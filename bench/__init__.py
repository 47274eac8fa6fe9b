"""allocwatch's benchmarks, each a command that prints its figures (`--help` says how):

    native/    the core's C++ benchmarks and soak (bench/CMakeLists.txt builds them)
    replay/    replay studies on recorded traces, and the recording of traces on a GPU
    gpu/       studies on the GPU, and the shells that run a whole GPU check in one command
    sidecar/   the sidecar under load, and what the agent costs a training process
    lib/       what several of them share

The torch workloads they train live in the package (allocator_ext.workloads). Importable as
`bench.*` from the checkout's root, for the scripts' shared parts and the tests.
"""
