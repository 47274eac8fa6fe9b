"""The functions the pluggable path hands PyTorch (pluggable_exports.cpp, named in
allocator_ext/torch_integration.py), exercised through ctypes on the simulated device
(ALLOCWATCH_TORCH_DEVICE=sim) since this machine has no GPU; on the GPU PyTorch itself drives them
(tests/pytorch/test_torch_gpu.py). Statistics are read where the pluggable path's replacement of
torch.cuda.memory_stats reads them (allocator_ext._core.torch_allocator). Each case runs in a
fresh process: the allocators serving PyTorch live as long as the process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from allocator_ext.torch_integration import _EXPORTS as PLUGGABLE_HOOKS

MiB = 1 << 20

PRELUDE = textwrap.dedent("""\
    import ctypes
    import allocator_ext._core as core

    lib = ctypes.CDLL(core.__file__)
    lib.allocwatch_torch_malloc.restype = ctypes.c_void_p
    lib.allocwatch_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.allocwatch_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_void_p]
    lib.allocwatch_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.allocwatch_torch_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]

    def stats(device=0):
        a = core.torch_allocator(device)
        return None if a is None else a.stats()
    """)


def run(body: str, capacity: int = 0) -> str:
    env = {**os.environ, "ALLOCWATCH_TORCH_DEVICE": "sim",
           "ALLOCWATCH_TORCH_SIM_BYTES": str(capacity)}
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_every_function_the_pluggable_path_names_is_exported() -> None:
    names = sorted({"allocwatch_torch_malloc", "allocwatch_torch_free",
                    *PLUGGABLE_HOOKS.values()})
    out = run(f"print(sorted(n for n in {names!r} if not hasattr(lib, n)))")
    assert out.strip() == "[]"


def test_the_extension_exports_its_entry_points_and_nothing_else() -> None:
    # Anything else exported (the core's functions, std:: instantiations) is somewhere the
    # process's other libraries can bind their own calls to once the module is in the global
    # scope, slowing them (docs/benchmarks.md, "End to end": with the libraries loaded and
    # unused, a convnet's steps run as fast as without them).
    import allocator_ext._core as core

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed, so the dynamic symbols cannot be listed")
    listed = subprocess.run([nm, "-D", "--defined-only", core.__file__], capture_output=True,
                            text=True, check=True).stdout.split("\n")
    exported = {line.split()[-1] for line in listed if line.strip()}
    assert "PyInit__core" in exported and "allocwatch_native_core" in exported
    assert set(PLUGGABLE_HOOKS.values()) <= exported
    others = sorted(n for n in exported if n != "PyInit__core" and not n.startswith("allocwatch_"))
    assert others == [], f"{len(others)} symbols exported besides the entry points: {others[:5]}"


def test_statistics_follow_allocations_per_device() -> None:
    run(f"""
        lib.allocwatch_torch_init(2)
        assert stats(0) is None                        # no allocator before torch uses the device
        on0 = lib.allocwatch_torch_malloc({8 * MiB}, 0, None)
        on1 = lib.allocwatch_torch_malloc({3 * MiB}, 1, None)
        assert on0 and on1
        assert stats(0)["allocated_bytes.all.current"] == {8 * MiB}
        assert stats(0)["allocated_bytes.large_pool.current"] == {8 * MiB}
        assert stats(1)["allocated_bytes.all.current"] == {3 * MiB}
        lib.allocwatch_torch_free(on1, {3 * MiB}, 1, None)
        assert stats(1)["allocated_bytes.all.current"] == 0
        assert stats(0)["allocated_bytes.all.current"] == {8 * MiB}
        lib.allocwatch_torch_free(on0, {8 * MiB}, 0, None)
        s = stats(0)
        assert s["allocated_bytes.all.current"] == 0 and s["allocated_bytes.all.peak"] == {8 * MiB}
        assert s["reserved_bytes.all.current"] > 0     # cached
        lib.allocwatch_torch_empty_cache()             # torch.cuda.empty_cache()
        assert stats(0)["reserved_bytes.all.current"] == 0
        assert stats(1)["reserved_bytes.all.current"] == 0
        """)


def test_memory_fraction_limits_the_device_for_the_allocators_that_serve_torch() -> None:
    out = run(f"""
        lib.allocwatch_torch_memory_fraction(0.5, 0)   # torch.cuda.set_per_process_memory_fraction
        a = core.torch_allocator(0)
        assert a.stats()["memory_limit_bytes"] == {128 * MiB}
        try:
            a.malloc({200 * MiB})
        except core.OutOfMemoryError as e:
            print(e)
        else:
            raise AssertionError("200 MiB served under a limit of 128 MiB")
        assert lib.allocwatch_torch_malloc({16 * MiB}, 0, None)  # the allocator carries on
        """, capacity=256 * MiB)
    assert "Tried to allocate" in out and "allowed" in out, out


def test_record_stream_keeps_a_freed_block_from_reuse_until_its_stream_is_done() -> None:
    run(f"""
        big = lib.allocwatch_torch_malloc({40 * MiB}, 0, None)
        lib.allocwatch_torch_record_stream(big, 7)     # also used on another stream
        lib.allocwatch_torch_free(big, {40 * MiB}, 0, None)
        s = stats(0)
        assert s["pending_events"] == 1                # not reusable before stream 7's work
        assert core.torch_allocator(0).largest_free_block() == 0
        """)


def test_a_settings_change_reaches_the_devices_torch_uses_now_and_later() -> None:
    """What `allocwatch ctl set` does where allocwatch serves torch (the agent's source calls
    _core.torch_configure): every key of the settings table, each value changing that key only,
    on the device torch uses now and on one it starts using afterwards."""
    cases = Path(__file__).resolve().parents[1] / "support" / "settings_cases.py"
    out = run(f"""
        import runpy
        cases = runpy.run_path({str(cases)!r})

        def items(device):
            return dict(core.config_items(core.torch_allocator(device).config_string()))

        assert lib.allocwatch_torch_malloc({MiB}, 0, None)  # device 0's allocator
        count = 0
        for row in cases["ROWS"]:
            key = row["key"]
            for value, _ in cases["good_values"](row):
                before = items(0)
                core.torch_configure(f"{{key}}:{{value}}")
                after = items(0)
                assert after[key] == dict(core.config_items(f"native,{{key}}:{{value}}"))[key]
                assert {{k: v for k, v in after.items() if k != key}} == \\
                    {{k: v for k, v in before.items() if k != key}}, key
                count += 1
            for value, named in cases["bad_values"](row):
                before = items(0)
                try:
                    core.torch_configure(f"{{key}}:{{value}}")
                except ValueError as e:
                    assert named in str(e), (key, value, str(e))
                else:
                    raise AssertionError(f"{{key}}:{{value}} accepted")
                assert items(0) == before
        assert lib.allocwatch_torch_malloc({MiB}, 1, None)  # a device used from now on
        assert items(1) == items(0)
        print(count)
        """)
    assert int(out) > 30, out
