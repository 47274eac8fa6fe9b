"""allocwatch's allocator as PyTorch's CUDA allocator.

``install()`` makes the core PyTorch's allocator through the native back end
(allocator_ext/native/): allocwatch's implementation of PyTorch's C++ allocator interface,
built once against the installed torch, so that every caller reaches the core. Where the back
end cannot be built or loaded it falls back, with a warning naming what then does not work, to
``torch.cuda.memory.CUDAPluggableAllocator`` with every hook PyTorch offers (record_stream,
empty_cache, memory fraction, CUDA graph pools), and makes PyTorch's statistics functions
report the core's figures, since PyTorch raises for pluggable allocators.

Settings, each layer overriding the keys it names: allocwatch's defaults, then the keys of
``PYTORCH_CUDA_ALLOC_CONF`` (so a job's existing settings keep working), then
``ALLOCWATCH_ALLOC_CONF``, then the ``config`` argument. ``ALLOCWATCH_DISABLE=1``, a torch
release the native back end does not serve (allocator_ext/native/releases.py), a CPU build of
torch, a missing driver or ``backend:cudaMallocAsync`` leave PyTorch's allocator in place, with
a warning that says why; the agent then reports PyTorch's
own allocator. ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK`` is switched off, with a warning,
where NCCL's registrations could not follow the allocator (paged segments, the pluggable path).
Nothing here calls the CUDA driver: the allocator is installed before CUDA starts, and CUDA
starts when the program first uses it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import Any

from allocator_ext import _core
from allocator_ext.native import releases
from allocator_ext.protocol.service import check_settings_text

_EXPORTS = {
    "set_init_fn": "allocwatch_torch_init",
    "set_reset_fn": "allocwatch_torch_empty_cache",
    "set_memory_fraction_fn": "allocwatch_torch_memory_fraction",
    "set_record_stream_fn": "allocwatch_torch_record_stream",
    "set_begin_allocate_to_pool": "allocwatch_torch_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "allocwatch_torch_end_allocate_to_pool",
    "set_release_pool": "allocwatch_torch_release_pool",
}
_STAT_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")

# What the pluggable path cannot serve (docs/torch.md), for the fallback's warning.
PLUGGABLE_LIMITS = (
    "C++ callers of the statistics and torch.accelerator.memory_stats(), cuDNN benchmark mode "
    "(cacheInfo), memory history and snapshots with stacks, torch.compile's CUDA graph trees "
    "(mode=\"reduce-overhead\"), torch.cuda.MemPool, CUDA IPC, NCCL's allocator hooks, "
    "get_per_process_memory_fraction, torch.cuda.OutOfMemoryError")

_installed = False
_native = False  # through the native back end rather than the pluggable path


class InstallError(RuntimeError):
    """install() cannot do what was asked (for example, CUDA is already initialised)."""


def installed() -> bool:
    """Whether install() made allocwatch's allocator PyTorch's in this process."""
    return _installed


def native() -> bool:
    """Whether the native back end (not the pluggable path) serves PyTorch."""
    return _native


def _layers(config: str | None) -> list[tuple[str, str]]:
    """The settings layers, lowest first, with where each came from."""
    layers = []
    pytorch_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    for origin, text in (("PYTORCH_CUDA_ALLOC_CONF", pytorch_conf),
                         ("ALLOCWATCH_ALLOC_CONF", os.environ.get("ALLOCWATCH_ALLOC_CONF")),
                         ("config", config)):
        if text:
            layers.append((origin, text))
    return layers


def _no_cuda_reason(torch: Any) -> str | None:
    """Why this process can have no CUDA device, found without a driver call (CUDA starts
    where the program first uses it); None where it may have one."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    try:
        ctypes.CDLL("libcuda.so.1")  # loads the library only: no driver call
    except OSError as e:
        return f"no NVIDIA driver found ({e})"
    return None


def _fallback(reason: str) -> bool:
    warnings.warn(f"allocwatch: keeping PyTorch's CUDA allocator: {reason}", stacklevel=3)
    return False


def install(config: str | None = None, native: bool | None = None) -> bool:
    """Makes allocwatch's allocator PyTorch's CUDA allocator; True when it did.

    Must run before CUDA is initialised (before the first CUDA tensor); raises InstallError
    after that, and ValueError (naming the key) for a bad setting, changing nothing.
    native: through the native back end (default; ALLOCWATCH_NATIVE=0 asks for the pluggable
    path); where it cannot be built, a warning says why and the pluggable path serves.
    """
    global _installed, _native
    if _installed:
        return True
    import torch

    if os.environ.get("ALLOCWATCH_DISABLE", "") not in ("", "0"):
        return _fallback("ALLOCWATCH_DISABLE is set")
    if releases.supported(torch.__version__) is None:
        return _fallback(unsupported_release(torch.__version__))
    if torch.cuda.is_initialized():
        raise InstallError(
            "allocwatch.install() must run before CUDA is initialised: call it at the top of "
            "the training script, before any CUDA tensor, or start the job with "
            "`allocwatch run -- python train.py ...`")
    layers = _layers(config)
    if any("cudaMallocAsync" in text for _, text in layers):
        return _fallback("the settings ask for backend:cudaMallocAsync")
    ours, pytorch_only = _split_layers(layers)
    base = None
    for text in ours:  # validate every layer before changing anything
        base = _core.parse_config(check_settings_text(text), base)["string"]
    no_cuda = _no_cuda_reason(torch)
    if no_cuda:
        return _fallback(no_cuda)

    for text in ours:
        _core.torch_configure(text)
    library = _core.__file__
    if native is None:
        native = os.environ.get("ALLOCWATCH_NATIVE", "1") != "0"
    _native = native and _install_native(library, pytorch_only)
    if _native and releases.parse(torch.__version__) < (2, 10):
        route_set_allocator_settings(torch.cuda.memory)
    if not _native:
        try:
            _install_pluggable(torch, library)
        except (AttributeError, RuntimeError, OSError) as e:
            return _fallback(f"neither the native back end nor the pluggable path could be "
                             f"installed ({type(e).__name__}: {e})")
        _patch_statistics(torch)
        reason = "ALLOCWATCH_NATIVE=0" if not native else "the native back end is unavailable"
        warnings.warn(f"allocwatch: serving PyTorch through its pluggable path ({reason}), "
                      f"which does not serve: {PLUGGABLE_LIMITS} (docs/torch.md)", stacklevel=2)
    paged = bool(_core.parse_config(base or "")["expandable_segments"])
    conflict = nccl_registration_conflict(os.environ, native=_native, paged=paged)
    if conflict:
        # Read by PyTorch's NCCL process group when it is created, after this.
        os.environ[NCCL_REGISTER_HOOK] = "0"
        warnings.warn(f"allocwatch: {NCCL_REGISTER_HOOK} switched off: {conflict} (docs/torch.md, "
                      "\"NCCL buffer registration\")", stacklevel=2)
    _installed = True
    _start_agent_for_ours()
    return True


def unsupported_release(version: str) -> str:
    """Why a torch release outside allocator_ext/native/releases.py keeps PyTorch's allocator."""
    newer = releases.parse(version) > releases.RELEASES[-1].line
    return (f"torch {version} is {'newer than' if newer else 'older than'} the releases "
            f"allocwatch's native back end is built for ({releases.supported_range()}): its "
            f"allocator interface is not known to allocwatch, so allocwatch does not replace "
            f"its allocator (the agent reports PyTorch's own)")


NCCL_REGISTER_HOOK = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


def nccl_registration_conflict(environ: Any, native: bool, paged: bool) -> str | None:
    """Why NCCL's buffer registration through the allocator's trace hooks, asked for in
    `environ`, cannot work with allocwatch's allocator as installed; None where it can or is
    not asked for. PyTorch switches the hook off only for its own expandable segments."""
    if environ.get(NCCL_REGISTER_HOOK, "").strip().lower() in ("", "0", "false", "no", "n",
                                                               "off"):
        return None
    if not native:
        return ("the pluggable path has no trace trackers, and PyTorch's NCCL process group "
                "would fail attaching them")
    if paged:
        return ("NCCL's registrations do not yet follow allocwatch's paged segments "
                "(expandable_segments:True): they would outlive the pages unmapped under them")
    return None


def _split_layers(layers: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Each layer's settings for the core; PyTorch's own keys of PYTORCH_CUDA_ALLOC_CONF that
    the native back end serves besides (per_process_memory_fraction) as "key:value". Other keys
    of PyTorch's (pinned memory, graph capture) stay PyTorch's; allocwatch's own layers are the
    core's syntax, where an unknown key is an error."""
    ours, pytorch_only = [], []
    for origin, text in layers:
        if origin != "PYTORCH_CUDA_ALLOC_CONF":
            ours.append(text)
            continue
        known, others = _core.known_settings(text)
        if known:
            ours.append(known)
        pytorch_only += [f"{key}:{value}" for key, value in others
                         if key == "per_process_memory_fraction"]
    return ours, pytorch_only


def _install_native(library: str, pytorch_only: list[str]) -> bool:
    """Through the native back end; False (with a warning saying why) where it cannot be
    built or installed."""
    from allocator_ext import native

    try:
        native.install(library)
        for settings in pytorch_only:
            native.apply_settings(settings)
    except native.NativeError as err:
        warnings.warn(f"allocwatch: native back end unavailable: {err}", stacklevel=3)
        return False
    return True


def settings_items(text: str) -> list[str]:
    """The "key:value" items of a settings string, split at the commas outside brackets
    (roundup_power2_divisions:[256:1,512:2] is one item)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth <= 0:
            if text[start:i].strip():
                items.append(text[start:i].strip())
            start = i + 1
    return items


def route_set_allocator_settings(memory: Any, apply: Any = None) -> None:
    """torch 2.9's torch.cuda.memory._set_allocator_settings reaches its CUDA parser alone;
    later releases call the parser hook the native back end registers (backend.cpp). On 2.9
    the call is wrapped: PyTorch's parser gets the string without allocwatch's own keys (which
    it refuses), then allocwatch's core gets all of it, as the hook would give it (`apply`:
    native.set_allocator_settings)."""
    if apply is None:
        from allocator_ext import native

        apply = native.set_allocator_settings
    original = memory._set_allocator_settings
    ours_only = {row["key"] for row in _core.SETTINGS if row["origin"] == "allocwatch"}

    def _set_allocator_settings(env: str) -> None:
        for_pytorch = [item for item in settings_items(env)
                       if item.split(":", 1)[0].strip() not in ours_only]
        original(",".join(for_pytorch))
        apply(env)  # native.NativeError is the RuntimeError PyTorch's own parser raises

    _set_allocator_settings.__doc__ = original.__doc__
    memory._set_allocator_settings = _set_allocator_settings


def _install_pluggable(torch: Any, library: str) -> None:
    """Through torch.cuda.memory.CUDAPluggableAllocator, with every hook it offers."""
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        library, "allocwatch_torch_malloc", "allocwatch_torch_free")
    handle = ctypes.CDLL(library)
    inner = pluggable.allocator()
    for setter, symbol in _EXPORTS.items():
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
        getattr(inner, setter)(address)
    torch.cuda.memory.change_current_allocator(pluggable)


def allocator(device: int = 0) -> Any:
    """The allocwatch Allocator serving PyTorch on `device` (None before torch used it)."""
    return _core.torch_allocator(device)


def snapshot(device: int | None = None) -> dict[str, Any]:
    """A snapshot in the layout of torch.cuda.memory._snapshot(), which PyTorch's memory
    viewer (pytorch.org/memory_viz) and torch.cuda._memory_viz open. One device's keeps its cap
    (the memory fraction and the device's total, allocwatch_recording) for a replay."""
    from allocator_ext.protocol.snapshots import RECORDING_KEY

    devices = [device] if device is not None else _core.torch_devices()
    result: dict[str, Any] = {"segments": [], "device_traces": [], "external_annotations": []}
    for d in devices:
        a = _core.torch_allocator(d)
        if a is None:
            result["device_traces"].append([])
            continue
        snap = a.snapshot()
        for seg in snap["segments"]:
            seg["device"] = d
        result["segments"].extend(snap["segments"])
        result["device_traces"].append(snap["device_traces"][0])
        result["allocator_settings"] = snap["allocator_settings"]
        if len(devices) == 1:  # the cap is one device's (allocator_ext.replay.cap)
            result[RECORDING_KEY] = snap[RECORDING_KEY]
    return result


# --- drop-in statistics ------------------------------------------------------------------------

def _device_index(torch: Any, device: Any) -> int:
    if device is None:
        return int(torch.cuda.current_device())
    return int(torch.cuda._utils._get_device_index(device, optional=True))


def _nested_stats(flat: dict[str, int]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name in _STAT_ARRAYS:
        nested[name] = {pool: {field: flat.get(f"{name}.{pool}.{field}", 0)
                               for field in ("current", "peak", "allocated", "freed")}
                        for pool in ("all", "small_pool", "large_pool")}
    for name in ("oversize_allocations", "oversize_segments"):
        nested[name] = {field: flat.get(f"{name}.{field}", 0)
                        for field in ("current", "peak", "allocated", "freed")}
    for key, value in flat.items():
        if "." not in key:
            nested[key] = value
    return nested


def _patch_statistics(torch: Any) -> None:
    """PyTorch raises for a pluggable allocator's statistics; every Python name for them
    (torch.cuda.memory_stats, memory_allocated, memory_reserved, max_memory_*, reset_*,
    memory_summary, torch.cuda.memory._snapshot) goes through these functions of torch._C."""
    c = torch._C

    def memory_stats(device: Any) -> dict[str, Any]:
        a = _core.torch_allocator(_device_index(torch, device))
        return _nested_stats(a.stats() if a is not None else {})

    def reset_peak(device: Any) -> None:
        a = _core.torch_allocator(_device_index(torch, device))
        if a is not None:
            a.reset_peak_stats()

    def reset_accumulated(device: Any) -> None:
        a = _core.torch_allocator(_device_index(torch, device))
        if a is not None:
            a.reset_accumulated_stats()

    def memory_snapshot(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        return snapshot()

    c._cuda_memoryStats = memory_stats
    c._cuda_resetPeakMemoryStats = reset_peak
    c._cuda_resetAccumulatedMemoryStats = reset_accumulated
    c._cuda_memorySnapshot = memory_snapshot


def start_agent_at_first_cuda_use(torch: Any, start: Any) -> None:
    """Calls `start` (which starts the agent) when this process first uses CUDA: PyTorch runs
    the calls queued with torch.cuda._lazy_call right after its lazy initialisation has
    initialised CUDA, which every first use passes through, from Python or C++ callers (or at
    once, where CUDA is initialised already). A launcher that imports torch and starts the
    trainers, or a DataLoader worker that never touches CUDA, starts no agent and does not even
    import it. Only with ALLOCWATCH_TARGET set; ALLOCWATCH_AGENT_CONNECT=start starts it at once.
    """
    if not os.environ.get("ALLOCWATCH_TARGET"):
        return

    def guarded() -> None:
        # Raised here, an exception would fail the program's CUDA initialisation.
        try:
            start()
        except Exception as err:  # noqa: BLE001 - the training process comes first
            print(f"allocwatch: the agent did not start in pid {os.getpid()}: {err}",
                  file=sys.stderr)

    lazy_call = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    if os.environ.get("ALLOCWATCH_AGENT_CONNECT") == "start" or lazy_call is None:
        guarded()
    else:
        lazy_call(guarded)


def _start_agent_for_ours() -> None:
    """With ALLOCWATCH_TARGET set, the agent publishes this allocator's counters, from the
    process's first CUDA use."""
    import torch

    start_agent_at_first_cuda_use(torch, _start_agent_now)


def _start_agent_now() -> None:
    try:
        from allocator_ext.agent import maybe_start_from_env, set_default_source_factory
        from allocator_ext.agent.sources import AllocatorSource
    except ImportError:
        return

    class TorchAllocatorSource(AllocatorSource):
        """The per-device allocators serving PyTorch, as torch creates them."""

        def __init__(self) -> None:
            super().__init__({})

        @property  # type: ignore[override]
        def _allocators(self) -> dict[int, Any]:
            return {d: _core.torch_allocator(d) for d in _core.torch_devices()}

        @_allocators.setter
        def _allocators(self, _value: Any) -> None:
            pass  # the set of devices is torch's to decide

        def set_config(self, settings: str) -> None:
            # Process-wide: the allocators torch uses now and those of devices it starts using
            # later take the change (the named keys only; a bad one changes nothing).
            _core.torch_configure(settings)

    set_default_source_factory(TorchAllocatorSource)
    maybe_start_from_env()


def install_at_startup() -> None:
    """For `allocwatch run`, right after the program imported torch: install, and start the
    agent either way at the process's first CUDA use (with PyTorch's allocator as its source
    where allocwatch's is not in). What install() warns is said in one line each on stderr:
    a warning's usual second line, the source line it points at, is allocwatch's own code
    here, not the user's."""
    keep = os.environ.get("ALLOCWATCH_ALLOCATOR", "1") == "0"
    with warnings.catch_warnings(record=True) as caught:
        installed = not keep and install()
    for warning in caught:
        if str(warning.message).startswith("allocwatch: "):
            print(warning.message, file=sys.stderr)
        else:  # someone else's (torch's, say): as it would have been shown
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)
    if keep:
        import torch

        no_gpu = _no_cuda_reason(torch)
        if no_gpu:
            print(f"allocwatch: keeping PyTorch's CUDA allocator, as asked; {no_gpu}, so there "
                  "is no GPU memory to watch and the agent does not start", file=sys.stderr)
    if not installed:
        import torch

        def start_for_pytorchs() -> None:
            from allocator_ext.agent import maybe_start_from_env

            maybe_start_from_env(source="pytorch")

        start_agent_at_first_cuda_use(torch, start_for_pytorchs)
