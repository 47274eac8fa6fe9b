"""The entry points PyTorch calls (torch_shim.cpp: the pluggable path's functions and the native
shim's additions), exercised through ctypes on the simulated device (ALLOCWATCH_SHIM_DEVICE=sim)
since this machine has no GPU; on the GPU the same functions are driven by PyTorch itself
(tests/pytorch/test_torch_gpu.py). Each case runs in a fresh process: the shim's allocators live
as long as the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

MiB = 1 << 20

PRELUDE = textwrap.dedent("""\
    import ctypes
    import allocator_ext._core as core

    lib = ctypes.CDLL(core.__file__)
    lib.allocwatch_torch_malloc.restype = ctypes.c_void_p
    lib.allocwatch_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.allocwatch_torch_try_malloc.restype = ctypes.c_void_p
    lib.allocwatch_torch_try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.c_char_p, ctypes.c_size_t]
    lib.allocwatch_torch_free_any.argtypes = [ctypes.c_void_p]
    lib.allocwatch_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.allocwatch_torch_largest_free_block.restype = ctypes.c_size_t
    EMIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64)

    def stats(device=0):
        found = {}
        emit = EMIT(lambda _ctx, key, value: found.__setitem__(key.decode(), value))
        if not lib.allocwatch_torch_stats(device, emit, None):
            return None
        return found
    """)


def run(body: str, capacity: int = 0) -> str:
    env = {**os.environ, "ALLOCWATCH_SHIM_DEVICE": "sim",
           "ALLOCWATCH_SHIM_SIM_BYTES": str(capacity)}
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_statistics_follow_allocations_through_the_entry_points() -> None:
    run(f"""
        assert stats(0) is None                        # no allocator before torch uses the device
        p = lib.allocwatch_torch_malloc({8 * MiB}, 0, None)
        assert p
        s = stats(0)
        assert s["allocated_bytes.all.current"] == {8 * MiB}
        assert s["allocated_bytes.large_pool.current"] == {8 * MiB}
        lib.allocwatch_torch_free_any(p)               # the native shim's deleter: no device
        s = stats(0)
        assert s["allocated_bytes.all.current"] == 0 and s["allocated_bytes.all.peak"] == {8 * MiB}
        lib.allocwatch_torch_reset_peak(0)
        assert stats(0)["allocated_bytes.all.peak"] == 0
        lib.allocwatch_torch_reset_accumulated(0)
        assert stats(0)["allocation.all.allocated"] == 0
        assert stats(1) is None                        # other devices untouched
        """)


def test_free_any_finds_the_device_that_owns_the_pointer() -> None:
    run(f"""
        on0 = lib.allocwatch_torch_malloc({MiB}, 0, None)
        on1 = lib.allocwatch_torch_malloc({3 * MiB}, 1, None)
        lib.allocwatch_torch_free_any(on1)
        assert stats(1)["allocated_bytes.all.current"] == 0
        assert stats(0)["allocated_bytes.all.current"] == {MiB}
        lib.allocwatch_torch_free_any(on0)
        assert stats(0)["allocated_bytes.all.current"] == 0
        """)


def test_out_of_memory_is_a_null_pointer_and_an_explanation_for_the_shim() -> None:
    out = run(f"""
        message = ctypes.create_string_buffer(2048)
        p = lib.allocwatch_torch_try_malloc({512 * MiB}, 0, None, message, len(message))
        assert p is None
        print(message.value.decode())
        ok = lib.allocwatch_torch_try_malloc({16 * MiB}, 0, None, message, len(message))
        assert ok                                      # the allocator carries on
        assert stats(0)["num_ooms"] == 1
        """, capacity=256 * MiB)
    assert "out of memory" in out and "Tried to allocate" in out


def test_largest_free_block_and_record_stream() -> None:
    run(f"""
        assert lib.allocwatch_torch_largest_free_block(0) == 0
        big = lib.allocwatch_torch_malloc({40 * MiB}, 0, None)
        lib.allocwatch_torch_record_stream(big, 7)      # also used on another stream
        lib.allocwatch_torch_free_any(big)
        s = stats(0)
        assert s["pending_events"] == 1                 # not reusable before stream 7's work
        assert lib.allocwatch_torch_largest_free_block(0) == 0
        """)
