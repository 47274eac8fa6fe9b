"""GPU scenarios for allocwatch's allocator inside PyTorch, one per fresh process (the
allocator must be installed before CUDA starts). Run by tests/pytorch/test_torch_gpu.py:

    python tests/gpu/scenarios.py NAME        prints "PASS NAME ..." or raises
"""

from __future__ import annotations

import sys

import torch

import allocator_ext

MiB = 1 << 20


def record_stream() -> str:
    """A producer and a consumer on two streams; without record_stream's events, the
    producer's next buffer would reuse memory the consumer is still reading."""
    side = torch.cuda.Stream()
    checked = 0
    for i in range(200):
        x = torch.full((4 * MiB,), float(i), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000)                # the consumer is slow
            total = x.sum()
        x.record_stream(side)
        del x                                           # freed while the side stream reads
        y = torch.full((4 * MiB,), -1.0, device="cuda")  # would overwrite x's memory
        side.synchronize()
        assert total.item() == float(i) * 4 * MiB, (i, total.item())
        del y
        checked += 1
    stats = allocator_ext.allocator(0).stats()
    syncs = stats["num_sync_all_streams"]
    return f"{checked} iterations checked, num_sync_all_streams={syncs}"


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
    s = allocator_ext.allocator(0).stats()
    assert s["reserved_bytes.all.current"] >= 8 * 300 * MiB
    assert free0 - free1 >= 8 * 300 * MiB, (free0, free1)
    del xs
    torch.cuda.empty_cache()
    free2, _ = torch.cuda.mem_get_info()
    s = allocator_ext.allocator(0).stats()
    assert s["reserved_bytes.all.current"] == 0, s["reserved_bytes.all.current"]
    assert free2 - free1 >= 8 * 300 * MiB, (free1, free2)
    assert s["num_device_free"] > 0
    cfg = allocator_ext.allocator(0).config()
    return (f"mapped {(free0 - free1) >> 20} MiB, returned {(free2 - free1) >> 20} MiB, "
            f"expandable={cfg['expandable_segments']}")


def out_of_memory() -> str:
    """Asking for more than the GPU has raises a clear error and the process carries on."""
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(int(total * 1.5), dtype=torch.uint8, device="cuda")
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        msg = str(e)
        assert "out of memory" in msg and "Tried to allocate" in msg, msg
        if allocator_ext.torch_integration.native():  # the shim raises PyTorch's own type
            assert isinstance(e, torch.cuda.OutOfMemoryError), type(e)
    else:
        raise AssertionError("no error for 1.5x the device's memory")
    x = torch.ones(1024, device="cuda")
    assert x.sum().item() == 1024
    return "raised: " + msg.split(".")[0]


def statistics() -> str:
    """torch.cuda's statistics functions report allocwatch's figures under every name."""
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    a = torch.cuda.memory_allocated()
    assert a == torch.cuda.memory.memory_allocated() >= 64 * MiB
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
    return f"memory_allocated={a}, summary {len(summary)} chars, viewer html {len(html)} chars"


def cudnn_benchmark() -> str:
    """cuDNN benchmark mode sizes its workspace with the allocator's cacheInfo(), which only
    the native shim serves: convolutions of changing shapes give the same results as without
    benchmark mode."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    results = {}
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        outs = []
        for side in (32, 48, 64):
            torch.manual_seed(side)
            x = torch.randn(4, 16, side, side, device="cuda")
            outs.append(conv(x).float().sum().item())
        results[benchmark] = outs
    for a, b in zip(results[False], results[True], strict=True):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), (a, b)
    return f"benchmark mode ran {len(results[True])} shapes, sums match"


if __name__ == "__main__":
    import os

    name = sys.argv[1]
    assert allocator_ext.install(), "install() fell back to PyTorch's allocator"
    if os.environ.get("ALLOCWATCH_NATIVE") == "1":
        assert allocator_ext.torch_integration.native(), "the native shim did not install"
    print(f"PASS {name}: {globals()[name]()}", flush=True)
