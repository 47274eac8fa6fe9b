// The per-device allocators that serve PyTorch through the pluggable path (torch_shim.cpp),
// for the Python binding: settings, statistics and snapshots of the allocator torch uses.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"

namespace allocwatch::torch_shim {

// Settings for allocators made from now on, and applied to those that exist (named keys only).
void configure(const std::string& settings);
// The allocator of `device`; with create=false, nullptr if torch has not used the device yet.
std::shared_ptr<CachingAllocator> get(int device, bool create);
std::vector<std::shared_ptr<CachingAllocator>> all();

}  // namespace allocwatch::torch_shim
