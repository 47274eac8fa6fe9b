"""The allocator of NCCL's memory that the GPU scenario nccl_mempool builds where
ProcessGroupNCCL refuses its own (nccl_pool_allocator.cpp), with or without a GPU: it compiles
against NCCL's header, links NCCL's library and loads with every symbol bound; it exports the
two functions CUDAPluggableAllocator is given; the NCCL it runs with has ncclMemAlloc (2.19 on);
where NCCL cannot allocate (no GPU) it answers null, PyTorch's "no room", with NCCL's reason
kept, and on a GPU a segment it hands out is counted live, then freed. Skipped, saying what is
missing, where NCCL's wheel or a CUDA toolkit is absent."""

from __future__ import annotations

import ctypes
from pathlib import Path

import nccl_pool_allocator as npa
import pytest
import torch


def test_the_nccl_pool_allocator_builds_against_nccl_and_loads(tmp_path: Path) -> None:
    try:
        npa.nccl_root()
        npa.cuda_include_dirs()
    except npa.Missing as e:
        pytest.skip(str(e))
    counters = npa.Counters(npa.build_into(tmp_path))
    assert counters.version() >= 21900, counters.version()
    alloc, free = getattr(counters.lib, npa.ALLOC), getattr(counters.lib, npa.FREE)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert (counters.allocations(), counters.frees(), counters.live()) == (0, 0, 0)
    assert counters.segment(0x1000) == "not its own"
    ptr = alloc(1 << 21, 0, None)
    if not torch.cuda.is_available():
        assert ptr is None  # no GPU: NCCL cannot allocate, and says why
        assert counters.last_error(), "NCCL's reason was not kept"
        assert (counters.allocations(), counters.live()) == (0, 0)
        return
    assert ptr is not None, counters.last_error()
    assert (counters.allocations(), counters.segment(ptr)) == (1, "live")
    free(ptr, 1 << 21, 0, None)
    assert (counters.frees(), counters.live(), counters.segment(ptr)) == (1, 0, "freed"), \
        counters.last_error()
