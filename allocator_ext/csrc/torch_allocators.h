// The process-wide registry of the per-device allocators that serve PyTorch, through the
// pluggable path (pluggable_exports.cpp) or the native back end (native_core.h): one registry
// for both and for the Python binding (settings, statistics and snapshots of the allocator
// torch uses).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"

namespace allocwatch::torch_allocators {

// Settings for allocators made from now on, and applied to those that exist (named keys only).
void configure(const std::string& settings);
// The same as torch.cuda.memory._set_allocator_settings takes them: the keys PyTorch resets
// return to their defaults unless named (config.h, apply_pytorch_settings).
void configure_as_pytorch(const std::string& settings);
// The settings allocators made from now on get.
AllocatorConfig current_config();
// The allocator of `device`; with create=false, nullptr if torch has not used the device yet.
std::shared_ptr<CachingAllocator> get(int device, bool create);
std::vector<std::shared_ptr<CachingAllocator>> all();
// Room for `count` devices, as torch's init hook announces them (their allocators come with
// first use).
void ensure_devices(int count);
// The hot path's lookup: the device's allocator, made on first use.
CachingAllocator& hot(int device);
// free() of a pointer whose device the caller does not know (a DataPtr's deleter): false when
// no device's allocator handed it out.
bool free_any(void* ptr);

// Process-wide, for the allocators that exist and those made later: the history's recording
// (clear: drop what was recorded), observers of every trace event (with the device's index),
// and the memory fraction that new allocators start with (PyTorch's per_process_memory_fraction;
// default_memory_fraction() is negative while none is set).
void set_history(bool enabled, std::size_t max_entries, bool clear, std::uint32_t skipped);
void add_trace_observer(std::function<void(int device, const TraceEntry&)> observer);
void set_default_memory_fraction(double fraction);
// How every allocator asks about CUDA graph captures (capture_graphs.h; nullptr: it does not).
void set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs);
double default_memory_fraction();

}  // namespace allocwatch::torch_allocators
