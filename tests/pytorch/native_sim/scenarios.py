"""Scenarios of the native back end on the simulated device, one per fresh process, driven
through PyTorch's C++ allocator interface (allocator_calls.cpp) as torch's own callers reach it.
Run by tests/pytorch/test_native_sim.py:

    ALLOCWATCH_TORCH_DEVICE=sim LD_PRELOAD=<cuda runtime stand-in> \\
        python scenarios.py BACKEND_SO CALLS_SO NAME       prints "PASS NAME: ..." or raises
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

from allocator_ext import _core, native

MiB = 1 << 20
GiB = 1 << 30
CAPACITY = 2 * GiB  # the simulated device's (test_native_sim.py sets it)
# Values for every row of the settings table (loaded by path: this runs as a script).
SETTINGS_CASES = Path(__file__).resolve().parents[2] / "support" / "settings_cases.py"


class Calls:
    """allocator_calls.cpp: each call returns (code, message); 0 is success."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.aw_name.restype = ctypes.c_char_p
        self.lib.aw_stat.restype = ctypes.c_longlong
        self.lib.aw_address.restype = ctypes.c_size_t
        self.lib.aw_pytorch_max_split_size.restype = ctypes.c_size_t
        self.lib.aw_pool_allocator_calls.restype = ctypes.c_longlong
        self.lib.aw_pool_allocator_owns.argtypes = [ctypes.c_size_t]
        self.lib.aw_pool_allocator_room.argtypes = [ctypes.c_size_t]
        self.lib.aw_pool_allocator_seen.restype = ctypes.c_longlong
        for name in ("aw_mempool_create", "aw_mempool_destroy"):
            getattr(self.lib, name).argtypes = (
                [ctypes.c_ulonglong, ctypes.c_ulonglong]
                + ([ctypes.c_int] * 3 if name == "aw_mempool_create" else [])
                + [ctypes.c_char_p, ctypes.c_size_t])
        self.lib.aw_use_stream.argtypes = [ctypes.c_long]
        self.lib.aw_record_stream.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_char_p,
                                              ctypes.c_size_t]
        self.lib.aw_settings.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.aw_oom_call.restype = ctypes.c_longlong
        self.lib.aw_set_fraction.argtypes = [ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.aw_alloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.aw_raw_alloc.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                          ctypes.c_char_p, ctypes.c_size_t]
        self.lib.aw_raw_delete.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        for name in ("aw_begin_pool", "aw_end_pool"):
            getattr(self.lib, name).argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong,
                                                ctypes.c_char_p, ctypes.c_size_t]
        self.lib.aw_pool_segments.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong,
                                              ctypes.POINTER(ctypes.c_int)]
        self.lib.aw_config_keys.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.keys_before_install: set[str] = set()

    def _call(self, name: str, *args: object) -> tuple[int, str]:
        message = ctypes.create_string_buffer(4096)
        code = getattr(self.lib, name)(*args, message, len(message))
        return code, message.value.decode()

    def ok(self, name: str, *args: object) -> None:
        code, message = self._call(name, *args)
        assert code == 0, (name, code, message)

    def alloc(self, size: int) -> tuple[int, str]:
        return self._call("aw_alloc", size)

    def stat(self, key: str) -> int:
        return int(self.lib.aw_stat(key.encode()))

    def config_keys(self) -> set[str]:
        """The keys PyTorch's settings parser accepts."""
        out = ctypes.create_string_buffer(1 << 16)
        self.lib.aw_config_keys(out, len(out))
        return set(out.value.decode().split(","))

    def settings(self, text: str) -> tuple[int, str]:
        """torch.cuda.memory._set_allocator_settings(text)."""
        return self._call("aw_settings", text.encode())

    def pool_segments(self, pool: tuple[int, int]) -> tuple[int, int]:
        expandable = ctypes.c_int(0)
        count = self.lib.aw_pool_segments(pool[0], pool[1], ctypes.byref(expandable))
        return count, expandable.value


def out_of_memory(c: Calls) -> str:
    """PyTorch's exception type (c10::OutOfMemoryError, torch.cuda.OutOfMemoryError in Python)
    and opening words, allocwatch's advice after them; the observers are told first; the
    allocator serves the next request as if nothing happened."""
    c.lib.aw_attach_oom_observer()
    c.ok("aw_alloc", MiB)
    code, message = c.alloc(1024 * 1024 * 1024 * 800000000)
    assert code == 1, (code, message)
    assert message.startswith("CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has "
                              "a total capacity of 2.00 GiB of which "), message
    assert " is reserved by PyTorch but unallocated. allocwatch: Settings in force: " in message
    assert c.lib.aw_oom_calls() == 1
    device, allocation, total, _free = (c.lib.aw_oom_call(0, i) for i in range(4))
    assert (device, allocation, total) == (0, 1024 * 1024 * 1024 * 800000000, CAPACITY)
    code, message = c.alloc(1024 * 1024 * 1024 * 8000000000)
    assert code == 1 and "Tried to allocate more than 1EB memory" in message, (code, message)
    assert c.stat("num_ooms") == 1  # the exabyte request never reaches the allocator
    c.ok("aw_alloc", 4 * MiB)
    assert c.stat("allocated_bytes.all.current") == 5 * MiB
    return message[:60]


def out_of_memory_under_fraction(c: Calls) -> str:
    """A request past the memory fraction: out of memory naming what is allowed, and the
    observers get the allowed bytes as the device's total (as PyTorch's do)."""
    c.lib.aw_attach_oom_observer()
    c.ok("aw_set_fraction", 0.25)
    c.ok("aw_alloc", 256 * MiB)
    code, message = c.alloc(400 * MiB)
    assert code == 1, (code, message)
    assert "512.00 MiB allowed; " in message, message
    assert c.lib.aw_oom_call(0, 2) == CAPACITY // 4
    c.ok("aw_set_fraction", 1.0)
    c.ok("aw_alloc", 400 * MiB)
    return "400 MiB refused under 0.25, served under 1.0"


def out_of_memory_in_a_private_pool(c: Calls) -> str:
    """Out of memory while a CUDA graph's pool serves the thread (torch.cuda.graph's capture):
    the same error, and the pool goes on serving."""
    c.ok("aw_begin_pool", 7, 0)
    code, message = c.alloc(2**42)
    assert code == 1 and message.startswith("CUDA out of memory."), (code, message)
    c.ok("aw_alloc", 4 * MiB)
    c.ok("aw_end_pool", 7, 0)
    assert c.pool_segments((7, 0))[0] == 1
    return "4 TiB refused inside the pool; 4 MiB served there after"


def private_pools_have_plain_segments(c: Calls) -> str:
    """CUDA graphs' and MemPool's pools: one device allocation per segment, as PyTorch's
    default makes them, while the ordinary pools use allocwatch's expandable segments."""
    c.ok("aw_begin_pool", 3, 0)
    for _ in range(3):
        c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_alloc", 512)
    c.ok("aw_end_pool", 3, 0)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_alloc", 20 * MiB)
    assert c.pool_segments((3, 0)) == (4, 0), c.pool_segments((3, 0))
    _, expandable = c.pool_segments((0, 0))
    assert expandable >= 1  # the ordinary large pool's one mapped range
    return "a graph pool of 3 large + 1 small plain segments"


def empty_cache_leaves_no_segment(c: Calls) -> str:
    """torch.cuda.empty_cache() with nothing allocated: the snapshot has no segment left, of
    the ordinary pools' expandable segments or of a released private pool."""
    c.ok("aw_begin_pool", 9, 0)
    c.ok("aw_alloc", MiB)
    c.ok("aw_end_pool", 9, 0)  # and released: nothing uses the pool any more
    for size in (512, MiB, 30 * MiB):
        c.ok("aw_alloc", size)
    assert c.pool_segments((0, 0))[0] >= 3
    c.lib.aw_free_all()
    c.ok("aw_empty_cache")
    assert c.pool_segments((0, 0)) == (0, 0), c.pool_segments((0, 0))
    assert c.stat("segment.all.current") == 0
    return "no segment after empty_cache"


def nested_pools_serve_the_innermost(c: Calls) -> str:
    """torch.cuda.use_mem_pool contexts nest: the latest pool begun serves the thread."""
    outer, middle, inner = (0, 11), (0, 12), (0, 13)
    c.ok("aw_begin_pool", *outer)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_begin_pool", *middle)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_begin_pool", *inner)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_end_pool", *inner)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_end_pool", *middle)
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_end_pool", *outer)
    counts = [c.pool_segments(p)[0] for p in (outer, middle, inner)]
    assert counts == [2, 2, 1], counts
    return f"segments per pool {counts}"


def _capture_with_a_side_stream(c: Calls, settings: bytes) -> tuple[int, int, int]:
    """test_graph_capture_reclaim_2_streams's capture: data1 is read on s2 (record_stream) and
    freed; data2 is allocated before s1 joins s2, data3 after. Their addresses."""
    graph = ctypes.CDLL(None)  # the stand-in runtime's scripted capture (LD_PRELOAD)
    s1, s2 = 0x10000, 0x20000
    c.ok("aw_settings", settings)
    c.ok("aw_begin_pool", 5, 0)
    graph.stand_in_capture_begin(s1, 77)
    c.lib.aw_use_stream(s1)
    c.ok("aw_alloc", 32)  # sink1
    c.ok("aw_alloc", 32)
    data1 = c.lib.aw_held() - 1
    data1_ptr = c.lib.aw_address(data1)
    graph.stand_in_wait(s2, s1)  # s2.wait_stream(s1)
    c.lib.aw_use_stream(s2)
    c.ok("aw_alloc", 32)  # buf2
    graph.stand_in_node(s2)  # torch.add(data1, 2.0, out=buf2)
    c.ok("aw_record_stream", data1, s2)
    c.lib.aw_use_stream(s1)
    c.lib.aw_free(data1)
    c.ok("aw_alloc", 32)
    data2_ptr = c.lib.aw_address(c.lib.aw_held() - 1)
    graph.stand_in_wait(s1, s2)  # s1.wait_stream(s2)
    graph.stand_in_node(s1)  # sink1.fill_(1.0)
    c.ok("aw_alloc", 32)
    data3_ptr = c.lib.aw_address(c.lib.aw_held() - 1)
    graph.stand_in_capture_end(s1)
    graph.stand_in_capture_end(s2)
    c.lib.aw_use_stream(0)
    c.ok("aw_end_pool", 5, 0)
    return data1_ptr, data2_ptr, data3_ptr


def reuse_in_a_capture_once_the_graph_orders_the_uses(c: Calls) -> str:
    """graph_capture_record_stream_reuse:True: a block freed while another stream used it is
    not reused before the capture joins that stream's work, and is reused after."""
    data1, data2, data3 = _capture_with_a_side_stream(c, b"graph_capture_record_stream_reuse:True")
    assert data2 != data1 and data3 == data1, (data1, data2, data3)
    return "data1's block: not reused before the join, reused after"


def reuse_in_a_capture_once_every_use_is_joined(c: Calls) -> str:
    """test_graph_capture_reclaim_4_streams's capture: data1 read on s2, s3 and s4; after s1
    joins s2 and s3 joins s4 the block still waits (s1 has not joined s3), after s1 joins s3
    it serves s1 again."""
    graph = ctypes.CDLL(None)
    s1, s2, s3, s4 = 0x10000, 0x20000, 0x30000, 0x40000
    c.ok("aw_settings", b"graph_capture_record_stream_reuse:True")
    c.ok("aw_begin_pool", 6, 0)
    graph.stand_in_capture_begin(s1, 78)
    c.lib.aw_use_stream(s1)
    c.ok("aw_alloc", 32)  # data1
    data1 = c.lib.aw_held() - 1
    data1_ptr = c.lib.aw_address(data1)
    c.ok("aw_alloc", 32)  # sink1
    c.ok("aw_alloc", 32)  # sink3
    for side in (s2, s3, s4):
        graph.stand_in_wait(side, s1)
        c.lib.aw_use_stream(side)
        c.ok("aw_alloc", 32)  # buf2, buf3, buf4
        graph.stand_in_node(side)  # torch.add(data1, ..., out=buf)
        c.ok("aw_record_stream", data1, side)
    c.lib.aw_use_stream(s1)
    c.lib.aw_free(data1)
    graph.stand_in_wait(s1, s2)
    graph.stand_in_node(s1)  # sink1.fill_
    graph.stand_in_wait(s3, s4)
    graph.stand_in_node(s3)  # sink3.fill_
    c.ok("aw_alloc", 32)
    data2_ptr = c.lib.aw_address(c.lib.aw_held() - 1)
    graph.stand_in_wait(s1, s3)
    graph.stand_in_node(s1)  # sink1.add_(sink3)
    c.ok("aw_alloc", 32)
    data3_ptr = c.lib.aw_address(c.lib.aw_held() - 1)
    for stream in (s1, s2, s3, s4):
        graph.stand_in_capture_end(stream)
    c.lib.aw_use_stream(0)
    c.ok("aw_end_pool", 6, 0)
    assert data2_ptr != data1_ptr and data3_ptr == data1_ptr, (data1_ptr, data2_ptr, data3_ptr)
    return "data1's block: not reused after partial joins, reused after the full join"


def no_reuse_in_a_capture_without_the_setting(c: Calls) -> str:
    """Without graph_capture_record_stream_reuse such a block waits for the capture's end."""
    data1, data2, data3 = _capture_with_a_side_stream(c, b"graph_capture_record_stream_reuse:False")
    assert data1 not in (data2, data3), (data1, data2, data3)
    return "data1's block waits for the capture's end"


def raw_allocations_are_counted(c: Calls) -> str:
    """caching_allocator_alloc's path (raw_alloc / raw_delete) goes through the core."""
    start = c.stat("requested_bytes.all.allocated")
    ptr = ctypes.c_void_p()
    c.ok("aw_raw_alloc", MiB, ctypes.byref(ptr))
    assert c.stat("requested_bytes.all.allocated") - start == MiB
    c.ok("aw_raw_delete", ptr)
    code, message = c._call("aw_raw_delete", ptr)
    assert code == 2 and "invalid device pointer" in message, (code, message)
    return "1 MiB counted; a second delete refused"


def _items() -> dict[str, str]:
    """The settings in force in allocwatch's allocator of device 0, as items() writes them."""
    allocator = _core.torch_allocator(0)
    assert allocator is not None
    return dict(_core.config_items(allocator.config_string()))


def every_setting_through_set_allocator_settings(c: Calls) -> str:
    """torch.cuda.memory._set_allocator_settings takes every key of allocwatch's settings table:
    PyTorch's parser knows each (the back end registered exactly the keys it lacked, which are
    the table's allocwatch rows), each value reaches the core, the keys a call does not name
    keep their values or return to their defaults as the table says, and a bad value is
    refused and changes nothing in allocwatch."""
    cases = runpy.run_path(str(SETTINGS_CASES))
    rows = cases["ROWS"]
    table = {row["key"] for row in rows}
    known = c.config_keys()
    assert table <= known, table - known
    registered = known - c.keys_before_install
    assert registered == {row["key"] for row in rows if row["origin"] == "allocwatch"}, registered
    c.ok("aw_alloc", MiB)  # device 0's allocator
    # Every value PyTorch's parser also takes (it is the first to read its own keys, and
    # reads booleans as True or False only); "native" is allocwatch's preset, not a key.
    busy = cases["busy_settings"]().removeprefix("native,")
    native = dict(_core.config_items("native"))
    tried = 0
    for row in rows:
        key = row["key"]
        for value, _ in cases["good_values"](row):
            if row["range"]["kind"] == "bool" and value not in ("True", "False"):
                continue
            c.ok("aw_settings", busy.encode())
            before = _items()
            c.ok("aw_settings", f"{key}:{value}".encode())
            after = _items()
            assert after[key] == dict(_core.config_items(f"native,{key}:{value}"))[key], \
                (key, value, after[key])
            for other in rows:
                if other is row:
                    continue
                name = other["key"]
                expected = native[name] if other["on_pytorch_call"] == "resets" else before[name]
                assert after[name] == expected, (key, value, name, after[name], expected)
            tried += 1
        c.ok("aw_settings", busy.encode())
        before = _items()
        for value, named in cases["bad_values"](row):
            code, message = c.settings(f"{key}:{value}")
            assert code != 0, (key, value)
            if row["origin"] == "allocwatch" and value:  # PyTorch's parser passes it on
                assert named in message, (key, value, message)
            assert _items() == before, (key, value)
    c.ok("aw_settings", b"")
    reset = _items()
    assert all(reset[row["key"]] == native[row["key"]] for row in rows
               if row["on_pytorch_call"] == "resets")
    return f"{len(table)} keys, {tried} values; registered {sorted(registered)}"


def _power2_div(size: int, div_factor: int) -> int:
    """PyTorch's test_allocator_settings' expected rounding."""
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 // 2 // div_factor
    ret = pow2 // 2
    while ret < size:
        ret += step
    return ret


def pytorchs_settings_tests_in_one_process(c: Calls) -> str:
    """PyTorch's test_allocator_settings, then test_max_split_expandable in the same process
    (test/test_cuda.py, the acceptance pair for _set_allocator_settings' semantics), with the
    simulated device in place of the GPU and allocwatch's defaults."""
    key = "active_bytes.all.allocated"
    nbytes, nbytes_big = 4 * 21 * MiB, 4 * 100 * MiB

    def grows_by(settings: str | None, size: int) -> int:
        if settings is not None:
            c.ok("aw_settings", settings.encode())
        start = c.stat(key)
        c.ok("aw_alloc", size)
        return c.stat(key) - start

    c.ok("aw_empty_cache")
    assert grows_by("", nbytes) == nbytes
    assert grows_by("roundup_power2_divisions:4", nbytes) == _power2_div(nbytes, 4)
    c.ok("aw_settings", b"garbage_collection_threshold:0.5")
    c.ok("aw_settings", b"garbage_collection_threshold:0.5,max_split_size_mb:40")
    c.ok("aw_empty_cache")
    assert grows_by(None, nbytes) == nbytes  # the divisions were reset
    c.ok("aw_empty_cache")
    assert grows_by("garbage_collection_threshold:0.5,"
                    "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
                    nbytes) == _power2_div(nbytes, 8)
    c.ok("aw_empty_cache")
    assert grows_by(None, nbytes_big) == _power2_div(nbytes_big, 2)
    c.ok("aw_empty_cache")
    assert grows_by("release_lock_on_cudamalloc:True", nbytes) == nbytes
    for bad in ("foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2",
                "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none",
                "pinned_num_register_threads:none", "pinned_num_register_threads:1024"):
        code, message = c.settings(bad)
        # c10::ValueError, or std::invalid_argument from PyTorch's number parsing: both
        # ValueError in Python, as the test expects.
        assert code in (2, 3), (bad, code, message)
    c.lib.aw_free_all()

    # test_max_split_expandable
    c.ok("aw_empty_cache")
    total_allowed = 120 * MiB + c.stat("reserved_bytes.all.current")
    c.ok("aw_set_fraction", total_allowed / CAPACITY)
    c.ok("aw_settings", b"expandable_segments:False,max_split_size_mb:40")
    c.ok("aw_alloc", 40 * MiB)
    c.ok("aw_settings", b"expandable_segments:True,max_split_size_mb:40")
    c.ok("aw_alloc", 40 * MiB)
    c.ok("aw_settings", b"expandable_segments:False,max_split_size_mb:40")
    c.ok("aw_alloc", 40 * MiB)
    code, message = c.alloc(40 * MiB)
    assert code == 1, (code, message)  # torch.OutOfMemoryError
    c.lib.aw_free_all()
    c.ok("aw_alloc", 120 * MiB)  # releases cached blocks, expandable ones among them
    c.ok("aw_set_fraction", 1.0)
    return "both pass"


def _in_mempool(c: Calls, pool: tuple[int, int], size: int) -> int:
    """An allocation under torch.cuda.use_mem_pool(pool); its index among those held."""
    c.ok("aw_begin_pool", *pool)
    c.ok("aw_alloc", size)
    c.ok("aw_end_pool", *pool)
    return c.lib.aw_held() - 1


def a_pool_with_its_own_allocator(c: Calls) -> str:
    """torch.cuda.MemPool(allocator=...), as at::cuda::MemPool asks c10's allocator, with a
    stand-in for the user's allocator (allocator_calls.cpp's PoolAllocator, as NCCL's or a
    CUDAPluggableAllocator would be): the pool's segments come from that allocator and go back
    to it when the pool is deleted; a deleted pool's segment goes back once its tensor is freed
    and the cache emptied, and the pool keeps the allocator alive until then (2.11 on, where
    PyTorch hands it over shared)."""
    calls = c.lib.aw_pool_allocator_calls
    first = (0, 41)
    c.ok("aw_mempool_create", *first, 1, 0, 0)
    small = c.lib.aw_address(_in_mempool(c, first, MiB))
    large = c.lib.aw_address(_in_mempool(c, first, 30 * MiB))
    assert (calls(0), calls(2)) == (2, 2), (calls(0), calls(2))
    assert c.lib.aw_pool_allocator_owns(small) and c.lib.aw_pool_allocator_owns(large)
    assert c.pool_segments(first) == (2, 0)  # plain segments
    assert c.stat("reserved_bytes.all.current") == 32 * MiB
    c.lib.aw_free_all()
    c.ok("aw_empty_cache")  # the pool is in use: its cache stays
    assert calls(1) == 0
    c.ok("aw_mempool_destroy", *first)
    assert (calls(1), calls(2)) == (2, 0), (calls(1), calls(2))
    assert c.stat("reserved_bytes.all.current") == 0

    second = (0, 42)
    c.ok("aw_mempool_create", *second, 1, 0, 0)
    _in_mempool(c, second, 4 * MiB)
    c.ok("aw_mempool_destroy", *second)  # while its tensor lives
    shared = c.lib.aw_torch_minor() >= 11
    if shared:
        c.lib.aw_pool_allocator_drop()  # `del allocator`: the pool still holds it
    assert (calls(1), calls(3)) == (2, 0), (calls(1), calls(3))
    c.lib.aw_free_all()
    c.ok("aw_empty_cache")
    assert (calls(1), calls(2)) == (3, 0), (calls(1), calls(2))
    assert calls(3) == (1 if shared else 0), calls(3)  # dropped with the pool's last segment
    return f"3 segments from the pool's allocator, 3 back to it (torch 2.{c.lib.aw_torch_minor()})"


def _without_deadlock(what: str, run: Callable[[], str], seconds: float = 60.0) -> str:
    """run() on a thread of its own (ctypes lets go of the GIL in each call): a call still
    waiting after `seconds` is a deadlock, and the process says so and ends at once, rather
    than hanging until the test's time runs out."""
    result: list[str] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            result.append(run())
        except BaseException as e:  # raised again on this thread
            errors.append(e)

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        print(f"FAIL: {what}: still waiting after {seconds:.0f} s, deadlocked", flush=True)
        os._exit(3)
    if errors:
        raise errors[0]
    return result[0]


def a_pool_allocator_that_calls_back_into_pytorch(c: Calls) -> str:
    """A pool's own allocator that calls PyTorch's allocator from inside its raw_alloc and
    raw_delete (its statistics, as a Python allocator logging torch.cuda.memory_allocated()
    would; an allocation and free of its own while freeing) is never called under the core's
    lock, which is not re-entrant (Note [pool allocators outside the lock] in
    core/allocator.h): each call completes and sees the allocator's state as it stands. And a
    pool's segment released by the out-of-memory path goes back to its allocator before the
    attempt that needs its room, as PyTorch frees before it tries again."""
    calls = c.lib.aw_pool_allocator_calls

    def calling_back() -> str:
        c.lib.aw_pool_allocator_reenter(1)
        pool = (0, 81)
        c.ok("aw_mempool_create", *pool, 1, 0, 0)
        _in_mempool(c, pool, MiB)
        _in_mempool(c, pool, 30 * MiB)
        seen = [c.lib.aw_pool_allocator_seen(i) for i in range(3)]
        assert seen == [0, MiB, -1], seen  # the second call saw the first's 1 MiB
        assert calls(5) == 2, calls(5)
        c.lib.aw_free_all()
        c.ok("aw_mempool_destroy", *pool)  # both segments back, each free calling back
        assert (calls(1), calls(2), calls(5)) == (2, 0, 4), (calls(1), calls(2), calls(5))
        c.lib.aw_pool_allocator_reenter(0)
        return f"{calls(5)} calls back into PyTorch's allocator"

    def room_before_the_attempt() -> str:
        c.ok("aw_settings", b"max_split_size_mb:30")  # a 60 MiB block is oversize
        c.lib.aw_pool_allocator_room(80 * MiB)
        pool = (0, 82)
        c.ok("aw_mempool_create", *pool, 1, 0, 0)
        _in_mempool(c, pool, 60 * MiB)
        c.lib.aw_free_all()  # cached in the pool, which is still in use
        retries = c.stat("num_alloc_retries")
        # 40 MiB: the cached 60 MiB block is beyond max_non_split_rounding of it, and 60 + 40
        # exceed the room; releasing the oversize block makes room, once it is freed.
        big = c.lib.aw_address(_in_mempool(c, pool, 40 * MiB))
        assert c.lib.aw_pool_allocator_owns(big)
        assert (calls(0), calls(1), calls(2), calls(6)) == (4, 3, 1, 40 * MiB), \
            [calls(i) for i in (0, 1, 2, 6)]
        assert c.stat("num_alloc_retries") == retries  # served at the second attempt
        c.lib.aw_free_all()
        c.ok("aw_mempool_destroy", *pool)
        c.ok("aw_settings", b"")
        assert (calls(1), calls(2), calls(6)) == (4, 0, 0), [calls(i) for i in (1, 2, 6)]
        return "the released segment freed before the attempt that needed its room"

    return (_without_deadlock("a pool's allocator calling back", calling_back) + "; "
            + _without_deadlock("a pool's allocator out of room", room_before_the_attempt))


def pools_used_on_oom(c: Calls) -> str:
    """PyTorch's test_mempool_limited_memory_with_allocator then
    test_deleted_mempool_not_used_on_oom, through c10's interface under a memory fraction."""
    c.ok("aw_empty_cache")
    c.ok("aw_set_fraction", (80 * MiB + c.stat("reserved_bytes.all.current")) / CAPACITY)
    do_not_use, use = (0, 51), (0, 52)
    c.ok("aw_mempool_create", *do_not_use, 1, 0, 0)
    c.ok("aw_mempool_create", *use, 1, 1, 0)
    _in_mempool(c, do_not_use, 40 * MiB)
    b = c.lib.aw_address(_in_mempool(c, use, 40 * MiB))
    code, message = c.alloc(40 * MiB)
    assert code == 1, (code, message)
    c.lib.aw_free_all()
    c.ok("aw_alloc", 30 * MiB)  # out of room elsewhere: the use_on_oom pool's free block
    assert c.lib.aw_address(0) == b
    code, message = c.alloc(30 * MiB)
    assert code == 1, (code, message)  # never the other pool's
    c.lib.aw_free_all()
    assert c.lib.aw_address(_in_mempool(c, use, 20 * MiB)) == b
    c.lib.aw_free_all()
    c.ok("aw_mempool_destroy", *use)
    c.ok("aw_mempool_destroy", *do_not_use)
    # Pools marked use_on_oom and deleted are not used again; the one made after them is
    # (under 40 MiB, as that test has it).
    c.ok("aw_empty_cache")
    c.ok("aw_set_fraction", (40 * MiB + c.stat("reserved_bytes.all.current")) / CAPACITY)
    for n in range(3):
        pool = (0, 60 + n)
        c.ok("aw_mempool_create", *pool, 1, 1, 0)
        _in_mempool(c, pool, 40 * MiB)
        c.lib.aw_free_all()
        c.ok("aw_mempool_destroy", *pool)
    fresh = (0, 70)
    c.ok("aw_mempool_create", *fresh, 1, 1, 0)
    whole = c.lib.aw_address(_in_mempool(c, fresh, 40 * MiB))
    c.lib.aw_free_all()
    c.ok("aw_alloc", 20 * MiB)
    c.ok("aw_alloc", 20 * MiB)
    assert {c.lib.aw_address(0), c.lib.aw_address(1)} == {whole, whole + 20 * MiB}
    c.lib.aw_free_all()
    c.ok("aw_mempool_destroy", *fresh)
    c.ok("aw_set_fraction", 1.0)
    return "c took b's block; the other pool and the deleted ones were never used"


def set_allocator_settings_as_torch_calls_it(c: Calls) -> str:
    """torch.cuda.memory._set_allocator_settings of this release (the C++ call its binding
    makes: on 2.9 PyTorch's CUDA parser alone, which install() routes on to allocwatch; later
    the parser hook the back end registers) changes PyTorch's settings and allocwatch's, its own
    keys included, with PyTorch's semantics; a key no parser knows is refused."""
    from allocator_ext import torch_integration

    memory = types.SimpleNamespace(
        _set_allocator_settings=lambda env: c.ok("aw_cuda_settings", env.encode()))
    if c.lib.aw_torch_minor() < 10:
        torch_integration.route_set_allocator_settings(memory)
    c.ok("aw_alloc", MiB)  # device 0's allocator
    memory._set_allocator_settings("max_split_size_mb:40,expandable_large_page_mb:4,"
                                   "roundup_power2_divisions:[256:2,>:1]")
    assert c.lib.aw_pytorch_max_split_size() == 40 * MiB
    items = _items()
    assert (items["max_split_size_mb"], items["expandable_large_page_mb"]) == ("40", "4"), items
    memory._set_allocator_settings("garbage_collection_threshold:0.5")
    items = _items()
    native_items = dict(_core.config_items("native"))
    assert items["max_split_size_mb"] == native_items["max_split_size_mb"], items  # reset
    assert items["expandable_large_page_mb"] == "4", items  # allocwatch's key: kept
    assert items["garbage_collection_threshold"] == "0.5", items
    try:
        memory._set_allocator_settings("expandable_large_page_mb:4,no_such_key:1")
    except AssertionError as refused:
        assert "no_such_key" in str(refused), refused
    else:
        raise AssertionError("an unknown key was accepted")
    return f"torch 2.{c.lib.aw_torch_minor()}: PyTorch's and allocwatch's settings changed"


if __name__ == "__main__":
    backend, calls_path, name = sys.argv[1:4]
    # Loaded first, as torch is before install(): c10's parser knows PyTorch's keys alone.
    calls = Calls(calls_path)
    calls.keys_before_install = calls.config_keys()
    native.install(_core.__file__, so=Path(backend))
    calls.ok("aw_init", 1)
    assert calls.lib.aw_name() == b"native"
    print(f"PASS {name}: {globals()[name](calls)}", flush=True)
