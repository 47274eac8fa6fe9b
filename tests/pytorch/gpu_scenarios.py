"""GPU scenarios for allocwatch's allocator inside PyTorch, one per fresh process (the allocator
is installed before CUDA starts). Run by tests/pytorch/test_native_gpu.py (the native back end)
and, with ALLOCWATCH_NATIVE=0, by tests/pytorch/test_torch_gpu.py (the pluggable path, for the
scenarios that path serves):

    python tests/pytorch/gpu_scenarios.py NAME      prints "PASS NAME: ..." or raises

Each scenario drives PyTorch's own API, as a training script would, and checks that allocwatch's
core is the one answering (its figures, through allocator_ext._core, agree with PyTorch's).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator_ext
from allocator_ext import _core

MiB = 1 << 20


class Unavailable(Exception):
    """What a scenario needs is missing on this machine (not a failure of allocwatch): the
    scenario prints SKIP with the reason, and the test skips with it."""


def core_stats(device: int = 0) -> dict[str, int]:
    a = _core.torch_allocator(device)
    assert a is not None, "allocwatch's core has no allocator for the device"
    return a.stats()


def installed() -> str:
    """Every way PyTorch reaches an allocator reaches allocwatch's core."""
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    core = core_stats()["allocated_bytes.all.current"]
    assert torch.cuda.memory_allocated() == core, (torch.cuda.memory_allocated(), core)
    acc = torch.accelerator.memory_stats()
    assert acc["allocated_bytes.all.current"] == core
    assert acc["active_bytes.all.current"] == core_stats()["active_bytes.all.current"] > 0
    assert torch.cuda.memory.memory_stats()["reserved_bytes.all.current"] == \
        core_stats()["reserved_bytes.all.current"]
    assert torch.cuda.get_allocator_backend() == "native"
    del x
    return f"allocated {core} bytes through torch, torch.accelerator and torch.cuda agree"


def history_and_snapshot() -> str:
    """Memory history with stacks; the snapshot opens in torch.cuda._memory_viz: its views that
    work offline as commands (stats, trace, trace_plot, segment_plot), and the flamegraph views
    (segments, memory) as the lines they hand to flamegraph.pl, which _memory_viz downloads
    from the network on first use (the GPU machine has none)."""
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=100000)
    keep = [torch.randn(1024, 1024, device="cuda") for _ in range(3)]
    tmp = torch.randn(4096, 4096, device="cuda")
    del tmp
    snap = torch.cuda.memory._snapshot()
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert allocs and all(e["frames"] for e in allocs), "trace entries without stacks"
    assert any("history_and_snapshot" in f["name"] for f in allocs[0]["frames"])
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert blocks and any(b["frames"] for b in blocks), "allocated blocks without stacks"
    for view in (_memory_viz.segments, _memory_viz.memory):
        lines = view(snap, format_flamegraph=lambda lines: lines)
        assert "history_and_snapshot" in lines, (view.__name__, lines[:500])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "snap.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        for view in ("stats", "trace", "trace_plot", "segment_plot"):
            html = ["-o", str(Path(d) / f"{view}.html")] if "plot" in view else []
            out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", view, str(path),
                                  *html], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "ALLOCWATCH_RUN": ""})
            assert out.returncode == 0, (view, out.stderr[-2000:])
    torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.cuda.memory._snapshot()["device_traces"][0] == []
    del keep
    return (f"{len(allocs)} allocations with stacks; _memory_viz stats/trace/trace_plot/"
            f"segment_plot read it, segments/memory give flamegraph lines")


def _expect_out_of_memory(what: str, allocate: object) -> str:
    """Runs `allocate`, which must raise torch.cuda.OutOfMemoryError; says on stdout where it is
    (a crash report then shows how far it got)."""
    print(f"out_of_memory: {what}", flush=True)
    try:
        allocate()  # type: ignore[operator]
    except torch.cuda.OutOfMemoryError as e:
        print(f"out_of_memory: {what}: raised", flush=True)
        return str(e)
    raise AssertionError(f"{what}: no OutOfMemoryError")


def out_of_memory() -> str:
    """PyTorch's exception type and opening words, allocwatch's advice after; observers told;
    the same under a memory fraction and inside a CUDA graph's capture; the device works on.
    The pluggable path raises a RuntimeError with allocwatch's explanation (docs/torch.md)."""
    if not allocator_ext.torch_integration.native():
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(int(total * 1.5), dtype=torch.uint8, device="cuda")
        except RuntimeError as e:
            message = str(e)
            assert "out of memory" in message and "Tried to allocate" in message, message
        else:
            raise AssertionError("no error for 1.5x the device's memory")
        assert torch.ones(1024, device="cuda").sum().item() == 1024
        return "raised: " + message.split(".")[0]
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
    with_pattern = re.compile(r"^CUDA out of memory\. Tried to allocate 800000000\.00 GiB\. "
                              r"GPU 0 has a total capacity of .* allocwatch: ")
    message = _expect_out_of_memory("800000000 GiB", lambda: torch.empty(
        1024 * 1024 * 1024 * 800000000, dtype=torch.int8, device="cuda"))
    assert with_pattern.search(message), message
    assert len(seen) == 1 and seen[0][0] == 0, seen
    assert core_stats()["num_ooms"] == 1
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25)
    message = _expect_out_of_memory("a third of the device under a fraction of 0.25", lambda:
                                    torch.empty(total // 3, dtype=torch.int8, device="cuda"))
    assert " allowed; " in message, message
    torch.cuda.set_per_process_memory_fraction(1.0)

    def in_a_capture() -> None:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.zeros(2**40, device="cuda")

    _expect_out_of_memory("4 TiB inside a CUDA graph's capture", in_a_capture)
    x = torch.ones(1024, device="cuda")
    assert x.sum().item() == 1024
    return (f"torch.cuda.OutOfMemoryError with PyTorch's wording, 3 times; the observer was "
            f"called {len(seen)} times")


def _read_while_freed(i: int, side: torch.cuda.Stream, then_on: torch.cuda.Stream | None = None
                      ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Buffer i is filled with i, summed on the slow side stream and freed while that read may
    still run (record_stream); the next buffer, filled with -1 on the current stream (or
    `then_on`), would overwrite it. Returns the side stream's sum, the freed buffer's address
    and the next buffer."""
    x = torch.full((4 * MiB,), float(i), device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)                    # the consumer is slow
        total = x.sum()
    x.record_stream(side)
    x_ptr = x.data_ptr()
    del x                                               # freed while the side stream reads
    with torch.cuda.stream(then_on or torch.cuda.current_stream()):
        return total, x_ptr, torch.full((4 * MiB,), -1.0, device="cuda")


def record_stream() -> str:
    """A producer and a consumer on two streams; without record_stream's events, the
    producer's next buffer would reuse memory the consumer is still reading."""
    torch.empty(1, device="cuda")                         # device 0's allocator exists
    side = torch.cuda.Stream()
    checked = 0
    for i in range(200):
        total, _, y = _read_while_freed(i, side)
        side.synchronize()
        assert total.item() == float(i) * 4 * MiB, (i, total.item())
        del y
        checked += 1
    return f"{checked} iterations checked, num_sync_all_streams=" \
        f"{core_stats()['num_sync_all_streams']}"


def waiting_frees(on: bool = True) -> str:
    """record_stream's producer and consumer under a memory fraction that holds one buffer, not
    two: the producer's next buffer takes the memory the consumer still reads, its stream
    waiting for the consumer on the device; no retry, no host wait, no release of the cache
    (Note [waiting frees] in core/allocator.cpp). Ordered any other way, the sums differ."""
    torch.empty(1, device="cuda")                         # device 0's allocator exists
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((4 * MiB + 24 * MiB) / total)
    side = torch.cuda.Stream()
    checked = reused = 0
    start = core_stats()
    for i in range(50):
        total_x, x_ptr, y = _read_while_freed(i, side)   # y: no room beside x's memory
        reused += y.data_ptr() == x_ptr
        side.synchronize()
        assert total_x.item() == float(i) * 4 * MiB, (i, total_x.item())
        del y
        checked += 1
    end = core_stats()
    waits = {k: end[k] - start[k] for k in ("num_stream_waits", "num_alloc_retries",
                                             "num_host_waits.event", "num_sync_all_streams")}
    if on:
        assert reused == checked, f"{reused} of {checked} buffers reused the waiting memory"
        assert waits["num_stream_waits"] >= checked, waits
        assert waits["num_alloc_retries"] == waits["num_host_waits.event"] == 0, waits
        assert waits["num_sync_all_streams"] == 0, waits
    else:
        # Every buffer after the first is a retry that waits on the host for the consumer.
        assert waits["num_alloc_retries"] >= checked - 1, waits
        assert waits["num_host_waits.event"] >= checked - 1, waits
    return (f"{checked} iterations checked under a fraction of one buffer "
            f"(reuse_waiting_frees {'on' if on else 'off'}): {waits}")


def waiting_frees_across_streams() -> str:
    """The same under a fraction of one buffer, but the next buffer is made on a third stream:
    the waiting buffer's stream is ordered after the consumer's read on the device, and its
    pages move to the third stream's segment, that stream ordered after the first (Note
    [waiting frees], Note [moving pages]). No retry, no host wait; ordered any other way, the
    third stream's -1s land in memory the consumer is still summing, and the sums differ."""
    torch.empty(1, device="cuda")                         # device 0's allocator exists
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((4 * MiB + 24 * MiB) / total)
    side, third = torch.cuda.Stream(), torch.cuda.Stream()
    checked = 0
    start = core_stats()
    for i in range(50):
        total_x, _, y = _read_while_freed(i, side, then_on=third)
        side.synchronize()
        assert total_x.item() == float(i) * 4 * MiB, (i, total_x.item())
        with torch.cuda.stream(third):
            del y
        third.synchronize()
        checked += 1
    end = core_stats()
    waits = {k: end[k] - start[k] for k in ("num_stream_waits", "num_alloc_retries",
                                             "num_host_waits.event", "num_host_waits.stream",
                                             "num_host_waits.device", "num_sync_all_streams")}
    # Each buffer: the first stream waits for the read, the third for the first.
    assert waits["num_stream_waits"] >= 2 * checked, waits
    assert all(v == 0 for k, v in waits.items() if k != "num_stream_waits"), waits
    return f"{checked} iterations checked under a fraction of one buffer, three streams: {waits}"


def waiting_frees_off() -> str:
    """The same loop with reuse_waiting_frees:False (ENVIRONMENT below): every buffer is a
    retry, the host waiting for the consumer, as under PyTorch's allocator."""
    return waiting_frees(on=False)


def graph_capture() -> str:
    """Capture and replay a CUDA graph while eager code allocates around it."""
    static_in = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            (static_in @ w).relu_()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = static_in @ w
        static_out = tmp.relu() + 1
    for _ in range(20):
        data = torch.randn(1024, 1024, device="cuda")
        noise = [torch.randn(257 * (j + 1), device="cuda") for j in range(8)]  # eager churn
        static_in.copy_(data)
        g.replay()
        expected = (data @ w).relu() + 1
        torch.testing.assert_close(static_out, expected, rtol=1e-3, atol=1e-3)
        del noise
    del g, static_out, tmp
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return "20 replays correct"


def expandable_and_empty_cache() -> str:
    """Pages are mapped on demand and returned to the device by empty_cache."""
    free0, _ = torch.cuda.mem_get_info()
    xs = [torch.empty(300 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    free1, _ = torch.cuda.mem_get_info()
    assert core_stats()["reserved_bytes.all.current"] >= 8 * 300 * MiB
    assert free0 - free1 >= 8 * 300 * MiB, (free0, free1)
    del xs
    torch.cuda.empty_cache()
    free2, _ = torch.cuda.mem_get_info()
    s = core_stats()
    assert s["reserved_bytes.all.current"] == 0, s["reserved_bytes.all.current"]
    assert free2 - free1 >= 8 * 300 * MiB, (free1, free2)
    assert s["num_device_free"] > 0
    # The driver calls behind it, counted where the allocator makes them: every physical page
    # created was mapped, and all of them went back to the device.
    calls = {k.split(".", 1)[1]: v for k, v in s.items() if k.startswith("num_device_calls.")}
    assert calls["create"] > 0 and calls["map"] > 0 and calls["set_access"] > 0, calls
    assert calls["release"] == calls["create"] and calls["unmap"] > 0, calls
    return (f"mapped {(free0 - free1) >> 20} MiB, returned {(free2 - free1) >> 20} MiB, "
            f"expandable={_core.torch_allocator(0).config()['expandable_segments']}")


def statistics() -> str:
    """torch.cuda's statistics functions report allocwatch's figures under every name."""
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    a = torch.cuda.memory_allocated()
    assert a == torch.cuda.memory.memory_allocated() == core_stats()["allocated_bytes.all.current"]
    assert a >= 64 * MiB
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == a
    reserved = torch.cuda.memory_reserved()
    assert torch.cuda.memory.memory_stats()["reserved_bytes.all.current"] == reserved
    del x
    assert torch.cuda.max_memory_allocated() >= 64 * MiB
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary
    snap = torch.cuda.memory._snapshot()
    assert snap["segments"] and "device_traces" in snap
    from torch.cuda import _memory_viz

    html = _memory_viz.segment_plot(allocator_ext.snapshot())
    assert len(html) > 1000
    # One device's snapshot keeps its cap for a replay: here none set, and the GPU's total.
    kept = allocator_ext.snapshot(0)["allocwatch_recording"]
    assert kept == {"memory_fraction": None,
                    "device_total_bytes": torch.cuda.mem_get_info(0)[1]}, kept
    return f"memory_allocated={a}, summary {len(summary)} chars, viewer html {len(html)} chars"


def mempool() -> str:
    """torch.cuda.MemPool: use counts, its own plain segments, no-split, release of its cache."""
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        a = torch.empty(80 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(80 * MiB, dtype=torch.uint8, device="cuda")
    assert pool.use_count() == 1
    segments = torch.cuda.memory.memory_snapshot(pool.id)
    assert [s["total_size"] for s in segments] == [80 * MiB, 80 * MiB], segments
    no_split = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(no_split):
        c = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        d = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    assert all(len(s["blocks"]) == 1 for s in no_split.snapshot())
    reserved = torch.cuda.memory_reserved()
    del a, b, c, d, pool, no_split
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved - 160 * MiB
    return f"pool segments {[s['total_size'] >> 20 for s in segments]} MiB, released with the pool"


def _from_virtual_memory(ptr: int) -> bool:
    """Whether the CUDA driver's virtual memory API (cuMemCreate, as ncclMemAlloc uses it)
    made the allocation at `ptr`; cudaMalloc's is not."""
    driver = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_ulonglong()
    if driver.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)) != 0:
        return False
    driver.cuMemRelease(handle)
    return True


def _nccl_pool_allocator(folder: Path) -> tuple[object, object]:
    """ncclMemAlloc and ncclMemFree behind a CUDAPluggableAllocator, built here against the
    NCCL that torch runs with (nccl_pool_allocator.py), and what it counts."""
    import nccl_pool_allocator

    try:
        library = nccl_pool_allocator.build_into(folder)
    except nccl_pool_allocator.Missing as e:
        raise AssertionError(f"torch has NCCL, but the allocator of its memory cannot be built: "
                             f"{e}") from e
    counters = nccl_pool_allocator.Counters(library)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        str(library), nccl_pool_allocator.ALLOC, nccl_pool_allocator.FREE)
    return pluggable, counters


def _register_mem_pool(backend: object, pool: object) -> str:
    """backend.register_mem_pool(pool): "registered", or torch's refusal where it serves
    registration only with its own mem_allocator (any other failure is raised)."""
    try:
        backend.register_mem_pool(pool)  # type: ignore[attr-defined]
    except RuntimeError as e:
        if "not supported" not in str(e):
            raise
        return f"registration refused by torch ({str(e).splitlines()[0]})"
    return "registered"


def nccl_mempool() -> str:
    """A torch.cuda.MemPool whose segments come from NCCL's allocator, on a one-rank NCCL group:
    ProcessGroupNCCL.mem_allocator (as NCCL buffer registration and symmetric memory make such
    pools), or, where torch refuses it (it asks for a device with multicast, which one GPU
    without NVLink fabric lacks), ncclMemAlloc and ncclMemFree behind a CUDAPluggableAllocator,
    as vLLM and Megatron build theirs. Its segment is NCCL's (counted by that allocator, or a
    virtual-memory allocation where a pool without an allocator of its own has cudaMalloc's),
    the pool registers with the communicator, an all_reduce runs on a tensor of it, and
    deleting the pool gives the segment back to NCCL. Skipped only where torch has no NCCL."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise Unavailable(f"torch {torch.__version__} is built without NCCL")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
    counters = None
    try:
        allocator = backend.mem_allocator
        source = "ProcessGroupNCCL.mem_allocator"
    except RuntimeError as e:  # "NCCL mem allocator is not supported in this NCCL version"
        with tempfile.TemporaryDirectory() as folder:  # the library stays loaded
            pluggable, counters = _nccl_pool_allocator(Path(folder))
        allocator = pluggable.allocator()
        source = (f"ncclMemAlloc through a pluggable allocator (NCCL {counters.version()}; "
                  f"mem_allocator refused: {str(e).splitlines()[0]})")
    ours = torch.cuda.MemPool()
    nccl = torch.cuda.MemPool(allocator)
    with torch.cuda.use_mem_pool(ours):
        plain = torch.ones(16 * MiB // 4, device="cuda")
    with torch.cuda.use_mem_pool(nccl):
        t = torch.ones(16 * MiB // 4, device="cuda")
    segments = nccl.snapshot()
    assert len(segments) == 1 and not segments[0]["is_expandable"], segments
    base, size = segments[0]["address"], segments[0]["total_size"]
    assert base == t.data_ptr(), (hex(base), hex(t.data_ptr()))
    virtual = _from_virtual_memory(base)
    if counters is None:
        assert virtual, "the pool's segment is not ncclMemAlloc's"
    else:
        assert counters.segment(base) == "live" and counters.live() == 1, \
            (counters.segment(base), counters.live(), counters.last_error())
    assert not _from_virtual_memory(plain.data_ptr())
    reserved = torch.cuda.memory_reserved()
    registered = _register_mem_pool(backend, nccl)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert float(t[0].item()) == 1.0
    if registered == "registered":
        backend.deregister_mem_pool(nccl)
    del t, nccl, plain, ours
    assert torch.cuda.memory_reserved() <= reserved - size  # the deleted pool's segment went
    if counters is not None:
        assert counters.segment(base) == "freed" and counters.live() == 0, \
            (counters.segment(base), counters.live(), counters.last_error())
    dist.destroy_process_group()
    return (f"a {size >> 20} MiB segment of {source}, {'cuMem' if virtual else 'cudaMalloc'}-"
            f"backed, {registered}, all_reduced, given back to NCCL")


def graph_trees() -> str:
    """torch.compile(mode="reduce-overhead"): checkpointed pool state and live-allocation
    checks of CUDA graph trees, with results equal to eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    for step in range(6):
        x = torch.randn(64 if step % 2 else 32, 256, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    return "6 steps of two shapes through CUDA graph trees match eager"


def checkpoint_state() -> str:
    """getCheckpointState / setCheckpointPoolState as TestBlockStateAbsorption drives them."""
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        small = [torch.empty(512, dtype=torch.uint8, device="cuda") for _ in range(11)]
        out = small[5].add_(2)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)

    def segments() -> list[tuple[int, int, list[tuple[int, str]]]]:
        return [(x["address"], x["total_size"], [(b["size"], b["state"]) for b in x["blocks"]])
                for x in torch.cuda.memory._snapshot()["segments"]
                if tuple(x["segment_pool_id"]) == tuple(g.pool())]

    before = segments()
    state = torch._C._cuda_getCheckpointState(0, g.pool())
    torch._C._cuda_setCheckpointPoolState(0, state, [], [])
    assert segments() == before, (before, segments())
    assert torch._C._cuda_checkPoolLiveAllocations(0, g.pool(), {t.untyped_storage().data_ptr()
                                                                 for t in small})
    del out
    return f"{len(before)} segment(s) of the graph's pool restored to the same layout"


def cudnn_benchmark() -> str:
    """cuDNN benchmark mode (cacheInfo) through the back end: same results as without it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    results = {}
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        results[benchmark] = [conv(torch.randn(4, 16, side, side, device="cuda",
                                               generator=torch.Generator("cuda").manual_seed(side)))
                              .float().sum().item() for side in (32, 48, 64)]
    for a, b in zip(results[False], results[True], strict=True):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), (a, b)
    return "benchmark mode ran 3 shapes, sums match"


def fraction_and_settings() -> str:
    """Memory fraction get and set; _set_allocator_settings with PyTorch's keys and allocwatch's,
    with PyTorch's semantics (the keys its parser resets go back to their defaults unless
    named, the others keep their values); a bad key is a ValueError."""
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    torch.cuda.set_per_process_memory_fraction(0.25)
    assert torch.cuda.get_per_process_memory_fraction() == 0.25
    limit = core_stats()["memory_limit_bytes"]
    assert abs(limit - 0.25 * torch.cuda.get_device_properties(0).total_memory) < MiB
    torch.cuda.set_per_process_memory_fraction(1.0)
    a = _core.torch_allocator(0)
    before = a.config()
    torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")
    torch.cuda.memory._set_allocator_settings("expandable_chunk_mb:8")
    after = a.config()
    assert after["expandable_chunk"] == 8 * MiB
    assert after["max_split_size"] == -1  # not named: back to its default, as PyTorch's parser
    assert after["expandable_segments"] == before["expandable_segments"]  # not named: kept
    try:
        torch.cuda.memory._set_allocator_settings("expandable_chunk_mb:3")
    except ValueError as e:
        assert "expandable_chunk_mb:3" in str(e), str(e)
    else:
        raise AssertionError("a bad value was accepted")
    assert a.config()["expandable_chunk"] == 8 * MiB
    return f"fraction 0.25 = {limit >> 20} MiB; settings named changed, others as PyTorch's"


def every_setting() -> str:
    """Every key of allocwatch's settings table through torch.cuda.memory._set_allocator_settings
    and torch._C._accelerator_setAllocatorSettings on the GPU: PyTorch accepts each, each value
    reaches the core and the allocator serves under it, the keys a call does not name keep
    their values or return to their defaults as the table says, and a bad value is a
    ValueError that changes nothing in allocwatch."""
    cases = runpy.run_path(str(Path(__file__).resolve().parents[1] / "support" /
                               "settings_cases.py"))
    rows = cases["ROWS"]
    torch.empty(1, device="cuda")  # device 0's allocator
    a = _core.torch_allocator(0)
    native = dict(_core.config_items("native"))
    busy = cases["busy_settings"]().removeprefix("native,")

    def items() -> dict[str, str]:
        return dict(_core.config_items(a.config_string()))

    tried = 0
    setters = (torch.cuda.memory._set_allocator_settings,
               torch._C._accelerator_setAllocatorSettings)
    for row in rows:
        key = row["key"]
        for value, _ in cases["good_values"](row):
            if row["range"]["kind"] == "bool" and value not in ("True", "False"):
                continue  # PyTorch's parser reads its own keys' booleans as True or False only
            setter = setters[tried % 2]
            setter(busy)
            before = items()
            setter(f"{key}:{value}")
            after = items()
            assert after[key] == dict(_core.config_items(f"native,{key}:{value}"))[key], \
                (key, value, after[key])
            for other in rows:
                name = other["key"]
                resets = other["on_pytorch_call"] == "resets"
                if name != key:
                    expected = native[name] if resets else before[name]
                    assert after[name] == expected, (key, value, name, after[name], expected)
            kept = [torch.empty(size, dtype=torch.uint8, device="cuda")
                    for size in (512, 3 * MiB, 45 * MiB)]
            torch.cuda.synchronize()
            del kept
            tried += 1
        setters[0](busy)
        before = items()
        for value, _ in cases["bad_values"](row):
            try:
                torch.cuda.memory._set_allocator_settings(f"{key}:{value}")
            except (ValueError, RuntimeError, IndexError):
                pass  # IndexError: PyTorch's own parser reads its keys first (std::stoull)
            else:
                raise AssertionError(f"{key}:{value} was accepted")
            assert items() == before, (key, value)
    torch.cuda.memory._set_allocator_settings("")
    after = items()
    assert all(after[row["key"]] == native[row["key"]] for row in rows
               if row["on_pytorch_call"] == "resets")
    return f"{len(rows)} keys, {tried} values through both setters"


def raw_alloc_statistics() -> str:
    """torch.cuda.caching_allocator_alloc goes through the core and counts in its statistics."""
    torch.cuda.init()  # memory_stats() is empty until CUDA is initialised
    start = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
    ptr = torch.cuda.caching_allocator_alloc(MiB)
    assert torch.cuda.memory_stats()["requested_bytes.all.allocated"] - start == MiB
    torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.memory.caching_allocator_enable(False)
    ptr = torch.cuda.caching_allocator_alloc(MiB)  # uncached: not counted
    assert torch.cuda.memory_stats()["requested_bytes.all.allocated"] - start == MiB
    torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.memory.caching_allocator_enable(True)
    return "raw allocations counted; uncached ones not"


def _ipc_child(queue: object, done: object) -> None:
    t = queue.get()  # type: ignore[attr-defined]
    done.put(float(t.sum().item()))  # type: ignore[attr-defined]


def ipc() -> str:
    """torch.multiprocessing passing CUDA tensors: served for plain segments; for expandable
    segments served, or refused with the setting that avoids it."""
    import torch.multiprocessing as mp

    # The receiving processes run allocwatch too, as under `allocwatch run`.
    autostart = Path(allocator_ext.__file__).resolve().parent / "_autostart"
    os.environ["ALLOCWATCH_RUN"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(autostart), os.environ.get("PYTHONPATH", "")])
    ctx = mp.get_context("spawn")
    results = {}
    for settings in ("expandable_segments:False", "expandable_segments:True"):
        torch.cuda.memory._set_allocator_settings(settings)
        queue, done = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_ipc_child, args=(queue, done))
        child.start()
        t = torch.full((MiB,), 2.0, device="cuda")
        try:
            queue.put(t)
            results[settings] = f"sum {done.get(timeout=120)}"
        except RuntimeError as e:
            assert "expandable_segments:False" in str(e), str(e)
            results[settings] = "refused, naming expandable_segments:False"
            child.terminate()
        child.join(60)
    assert results["expandable_segments:False"] == f"sum {2.0 * MiB}", results
    return json.dumps(results)


# TraceEntry::Action, c10/core/CachingDeviceAllocator.h
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE = range(5)


def _trace_tracker_probe(folder: Path) -> ctypes.CDLL:
    """tests/pytorch/trace_tracker_probe.cpp, built as the native back end is (same compiler,
    flags, headers and libraries: allocator_ext.native.build's plan for this torch)."""
    from allocator_ext.native import build

    source = Path(__file__).resolve().with_name("trace_tracker_probe.cpp")
    output = folder / "trace_tracker_probe.so"
    units = set(map(str, build.UNITS))
    command = []
    for part in build.plan(torch).command:
        if part in units:  # the back end's sources give way to the probe's, once
            if str(source) not in command:
                command.append(str(source))
        else:
            command.append(part.replace("{output}", str(output)))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = ctypes.CDLL(str(output))
    probe.probe_entry.restype = ctypes.c_bool
    probe.probe_entry.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
    return probe


def _tracked(probe: ctypes.CDLL) -> list[tuple[int, int, int]]:
    action, addr, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    return [(action.value, addr.value, size.value) for i in range(probe.probe_count())
            if probe.probe_entry(i, ctypes.byref(action), ctypes.byref(addr), ctypes.byref(size))]


def _segment_of(ptr: int) -> tuple[int, int]:
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return segment["address"], segment["total_size"]
    raise AssertionError(f"no segment holds {ptr:#x}")


def trace_trackers() -> str:
    """The trace hooks NCCL's buffer registration uses (run with plain segments, the hook asked
    for: ENVIRONMENT below). A tracker attached through attachAllocatorTraceTracker, as
    ProcessGroupNCCL attaches its own, is told of each segment allocwatch creates and frees and
    of each block, with their addresses and sizes. Then a one-rank NCCL process group with
    TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 registers the segments it finds and the one
    created after it, and deregisters it when empty_cache frees it (PyTorch's deregistration
    refuses a segment it never registered)."""
    import torch.distributed as dist

    assert os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK") == "1", \
        "install() switched NCCL's registration hook off under plain segments"
    with tempfile.TemporaryDirectory() as folder:
        probe = _trace_tracker_probe(Path(folder))
    probe.probe_attach()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert not _core.torch_allocator(0).config()["expandable_segments"]
    base, size = _segment_of(x.data_ptr())
    seen = _tracked(probe)
    assert (SEGMENT_ALLOC, base, size) in seen, seen
    assert (ALLOC, x.data_ptr(), 64 * MiB) in seen, seen
    ptr = x.data_ptr()
    del x
    torch.cuda.empty_cache()
    seen = _tracked(probe)
    assert (FREE_REQUESTED, ptr, 64 * MiB) in seen and (SEGMENT_FREE, base, size) in seen, seen

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    y = torch.ones(8 * MiB, device="cuda")
    dist.all_reduce(y)  # the communicator starts: the segments there are registered
    z = torch.ones(24 * MiB, device="cuda")  # a segment of its own, registered when created
    dist.all_reduce(z)
    torch.cuda.synchronize()
    assert float(z[0].item()) == 1.0
    z_base, z_size = _segment_of(z.data_ptr())
    del y, z
    torch.cuda.empty_cache()  # each segment freed is deregistered first
    dist.destroy_process_group()
    seen = _tracked(probe)
    assert (SEGMENT_ALLOC, z_base, z_size) in seen and (SEGMENT_FREE, z_base, z_size) in seen
    return (f"{len(seen)} entries tracked; a one-rank NCCL group registered and deregistered "
            f"a {z_size >> 20} MiB segment")


def page_moves_off_thread() -> str:
    """page_moves with unmap_off_thread:True (ENVIRONMENT below): the old places are unmapped
    by the allocator's own thread."""
    return page_moves()


def page_moves() -> str:
    """Free pages of a side stream's block move to the main stream's growth while the side
    stream still writes them: the main stream waits on the device (its result is never
    overwritten by the side stream's late writes), the host waits for nothing, and the old
    mapping goes once the side stream is done (Note [moving pages] in core/expandable.cpp)."""
    torch.empty(1, device="cuda")                         # device 0's allocator exists
    side = torch.cuda.Stream()
    checked = 0
    for i in range(20):
        before = core_stats()
        with torch.cuda.stream(side):
            x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(20_000_000)                # the side stream is slow
            x.fill_(7)                                   # its last write lands late
        del x                                            # free on its own stream at once
        # Past the most ever reserved: the growth takes the side stream's free pages back.
        grow = 64 * MiB + (i + 1) * 64 * MiB
        y = torch.empty(grow, dtype=torch.uint8, device="cuda")
        y.fill_(1)
        moved = core_stats()
        assert moved["num_stream_waits"] > before["num_stream_waits"], (i, moved)
        for scope in ("device", "stream", "event"):
            key = f"num_host_waits.{scope}"
            assert moved[key] == before[key], (i, key, moved[key], before[key])
        torch.cuda.synchronize()
        # Checked by reductions to one element: `y != 1` would allocate y's size again and
        # raise the high-water mark, so that the next pass's growth creates pages, moving none.
        assert int(y.min().item()) == int(y.max().item()) == 1, (
            f"pass {i}: the side stream's writes reached y")
        del y
        checked += 1
    # Allocations poll: the one that finds a move's events complete unmaps its old place, or,
    # with unmap_off_thread, hands it to the allocator's own thread, and a later one finds it
    # gone.
    deadline = time.monotonic() + 10
    while True:
        torch.empty(512, device="cuda")
        after = core_stats()
        if after["pending_unmap_bytes"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    assert after["pending_unmap_bytes"] == 0, after["pending_unmap_bytes"]
    # Each move recorded an event on the donor and the receiver waited on it; the polls that
    # found them done had the old addresses unmapped.
    assert after["num_device_calls.event_record"] >= checked, after
    assert after["num_device_calls.event_query"] > 0 and after["num_device_calls.unmap"] > 0, after
    off_thread = _core.torch_allocator(0).config()["unmap_off_thread"]
    assert (after["num_unmaps_off_thread"] > 0) == off_thread, after
    return (f"{checked} moves checked; stream waits {after['num_stream_waits']}, unmaps off the "
            f"thread {after['num_unmaps_off_thread']}, host waits "
            f"{after['num_host_waits.device']}/{after['num_host_waits.stream']}/"
            f"{after['num_host_waits.event']}")


# Set before install(), which reads them (a scenario's own settings).
ENVIRONMENT = {
    "waiting_frees_off": {"ALLOCWATCH_ALLOC_CONF": "reuse_waiting_frees:False"},
    "page_moves_off_thread": {"ALLOCWATCH_ALLOC_CONF": "unmap_off_thread:True"},
    "trace_trackers": {"ALLOCWATCH_ALLOC_CONF": "expandable_segments:False",
                       "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"},
}


if __name__ == "__main__":
    name = sys.argv[1]
    os.environ.update(ENVIRONMENT.get(name, {}))
    assert allocator_ext.install(), "install() fell back to PyTorch's allocator"
    if os.environ.get("ALLOCWATCH_NATIVE") != "0":
        assert allocator_ext.torch_integration.native(), "the native back end did not install"
    try:
        print(f"PASS {name}: {globals()[name]()}", flush=True)
    except Unavailable as e:
        print(f"SKIP {name}: {e}", flush=True)
