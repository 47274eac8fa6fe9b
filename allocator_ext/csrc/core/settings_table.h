// The allocator's settings, one row each: the only list of them. The struct AllocatorConfig
// (config.h), the parser and its unknown-key message, items() and to_string(), the Python
// binding's dictionary and SETTINGS table, the keys the native back end registers with
// PyTorch's settings parser, and the settings table of docs/torch.md are all made from it.
// Adding a setting is one row here plus its behaviour.
//
// Header-only and free of std::string, so that the native back end (built against torch on
// the user's machine) reads the same rows without linking against the core.
#pragma once

#include <cstddef>
#include <limits>

#include "sizes.h"

namespace allocwatch {

constexpr std::size_t kNoMaxSplit = std::numeric_limits<std::size_t>::max();

// PyTorch's allocator back end: allocwatch replaces the native one, so that is the only value.
enum class AllocatorBackend { native };

// Which values a setting takes, beyond its C++ type (bool: True or False; RoundupDivisions:
// PyTorch's list syntax; AllocatorBackend: native). For whole numbers and reals; built with the
// functions below, e.g. mebibytes(2).multiple_of(2).or_zero().
struct ValueRange {
  bool in_mebibytes = false;  // written in MiB, held in bytes
  std::size_t min = 0;        // whole numbers: the least, in the unit written
  std::size_t max = 0;        // whole numbers: the most (0: no bound)
  std::size_t multiple = 1;   // whole numbers: a multiple of this
  bool power_of_two = false;  // whole numbers
  bool zero = false;          // whole numbers: 0 (off) allowed besides the range
  bool unlimited = false;     // whole numbers: kNoMaxSplit, shown as "unlimited", is the default
  double above = 0, below = 0;  // reals: strictly between these

  constexpr ValueRange multiple_of(std::size_t n) const {
    ValueRange r = *this;
    r.multiple = n;
    return r;
  }
  constexpr ValueRange or_zero() const {
    ValueRange r = *this;
    r.zero = true;
    return r;
  }
  constexpr ValueRange or_unlimited() const {
    ValueRange r = *this;
    r.unlimited = true;
    return r;
  }
};

constexpr ValueRange any_value() { return ValueRange{}; }
constexpr ValueRange mebibytes(std::size_t at_least) {
  ValueRange r;
  r.in_mebibytes = true;
  r.min = at_least;
  return r;
}
constexpr ValueRange power_of_two_up_to(std::size_t most) {
  ValueRange r;
  r.min = 1;
  r.max = most;
  r.power_of_two = true;
  return r;
}
constexpr ValueRange strictly_between(double low, double high) {
  ValueRange r;
  r.above = low;
  r.below = high;
  return r;
}

// Whose key it is: PyTorch's (its settings parser knows it) or allocwatch's alone (the native
// back end registers it with PyTorch's parser, so that _set_allocator_settings accepts it).
enum class SettingOrigin { pytorch, allocwatch };

// What torch.cuda.memory._set_allocator_settings does to the setting when the call does not
// name it, as PyTorch's parser does to its own keys (c10/core/AllocatorConfig.cpp, parseArgs:
// max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold, and
// max_non_split_rounding_mb, set back to large_segment_size_mb, return to their defaults; the
// other keys keep their values). allocwatch's own keys keep theirs, as PyTorch's other
// switches do. allocwatch's own changes (set_config, `allocwatch ctl set`) change only the keys
// they name.
enum class OnPytorchCall { resets, keeps };

// ALLOCWATCH_SETTINGS(X) calls X once per setting, in the order items(), to_string() and the
// docs list them:
//
//   X(Type, field, key, range, native_default, allocwatch_default, origin, on_pytorch_call, help)
//
// Type and field: the member of AllocatorConfig; key: its name in settings strings;
// native_default: PyTorch's default (the preset `native`); allocwatch_default: allocwatch's
// own (no settings at all), chosen by the measures of DESIGN.md and long runs on the recorded
// traces (docs/benchmarks.md; the page policy: expandable.cpp, Note [page policy]).
// help: one line, for the docs' table and the binding.
#define ALLOCWATCH_SETTINGS(X)                                                                    \
  /* PyTorch's keys for its device allocator */                                                   \
  X(std::size_t, max_split_size, "max_split_size_mb",                                             \
    mebibytes(20).or_unlimited(), kNoMaxSplit, kNoMaxSplit, pytorch, resets,                      \
    "blocks this large or larger are never split, and a smaller request never takes one")         \
  X(std::size_t, max_non_split_rounding, "max_non_split_rounding_mb",                             \
    mebibytes(20), kLargeBuffer, kLargeBuffer, pytorch, resets,                                   \
    "a request of max_split_size_mb or more takes a cached block at most this much larger")       \
  X(double, garbage_collection_threshold, "garbage_collection_threshold",                         \
    strictly_between(0.0, 1.0), 0.0, 0.0, pytorch, resets,                                        \
    "under a memory fraction, old unsplit cached blocks are released while reserved memory "      \
    "exceeds this share of the allowed memory (0: off)")                                          \
  X(bool, expandable_segments, "expandable_segments",                                             \
    any_value(), false, true, pytorch, keeps,                                                     \
    "segments reserve address space once and map physical pages as they grow")                    \
  X(RoundupDivisions, roundup_power2_divisions, "roundup_power2_divisions",                       \
    any_value(), RoundupDivisions{}, RoundupDivisions{}, pytorch, resets,                         \
    "requests are rounded up to one of this many steps between powers of two: one number, "       \
    "or one per size interval in MiB ([256:1,512:2,>:4]); 0: 512-byte rounding")                  \
  /* allocwatch's own keys (PyTorch has none of these; `native` leaves them off) */               \
  X(std::size_t, expandable_large_page, "expandable_large_page_mb",                               \
    mebibytes(2).multiple_of(2), kLargeBuffer, 2 * kMiB, allocwatch, keeps,                       \
    "page size of the large pool's expandable segments (PyTorch maps 20 MiB at a time)")          \
  X(std::size_t, expandable_grow, "expandable_grow_mb",                                           \
    mebibytes(2).multiple_of(2).or_zero(), 0, 0, allocwatch, keeps,                               \
    "least growth of a large-pool expandable segment, mapped as one chunk (0: page by page)")     \
  X(std::size_t, expandable_chunk, "expandable_chunk_mb",                                         \
    mebibytes(2).multiple_of(2).or_zero(), 0, 10 * kMiB, allocwatch, keeps,                       \
    "large-pool growth maps physical chunks of this size where a whole one fits, single "         \
    "pages for the rest (0, or under a memory fraction below 1: pages only)")                   \
  X(bool, reuse_free_pages, "reuse_free_pages",                                                   \
    any_value(), false, true, allocwatch, keeps,                                                  \
    "before an expandable segment grows past reserved memory's high-water mark, wholly free "     \
    "pages are taken back from elsewhere for it")                                                 \
  X(bool, settle_page_moves, "settle_page_moves",                                                 \
    any_value(), false, true, allocwatch, keeps,                                                  \
    "with reuse_free_pages: a take-back that repeats one already made creates pages "             \
    "instead, once, so that a repeating workload stops moving pages")                             \
  X(bool, align_to_pages, "align_to_pages",                                                       \
    any_value(), false, false, allocwatch, keeps,                                                 \
    "where growth maps single pages, the large block it serves starts at a page boundary if "     \
    "that needs no more pages, so that it spans no extra page once its neighbours are gone")       \
  X(bool, unmap_off_thread, "unmap_off_thread",                                                   \
    any_value(), false, false, allocwatch, keeps,                                                 \
    "a moved page's old place is unmapped by a thread of the allocator's own once the device "    \
    "is done with it, not by the allocating thread (where the device allows: CUDA)")              \
  X(bool, reuse_waiting_frees, "reuse_waiting_frees",                                           \
    any_value(), false, true, allocwatch, keeps,                                                  \
    "where reserved memory cannot grow, blocks still waiting for other streams' uses "            \
    "(record_stream) serve before anything cached is released: the request's stream's that fits " \
    "best, else all of them, each one's stream ordered after those uses on the device, not the "  \
    "host after every stream")                                                                    \
  X(bool, alias_pages, "alias_pages",                                                             \
    any_value(), false, false, allocwatch, keeps,                                                 \
    "large-pool growth on any stream maps physical pages in use nowhere at one more address "     \
    "before it moves or creates any; a page is then used through one address at a time, a use "   \
    "on another stream after the last on the device")                                             \
  X(bool, alias_pages_under_limit, "alias_pages_under_limit",                                     \
    any_value(), false, false, allocwatch, keeps,                                                 \
    "alias_pages for the large pool's segments made while a memory fraction below the whole "     \
    "device (or a memory limit) is set and none of them exists, until all are released: "         \
    "growth there maps single pages anyway, and a moved page costs an unmap each time")           \
  /* PyTorch's keys for parts it keeps: accepted so that a job's settings keep working */         \
  X(AllocatorBackend, backend, "backend",                                                         \
    any_value(), AllocatorBackend::native, AllocatorBackend::native, pytorch, keeps,              \
    "PyTorch's allocator back end: allocwatch replaces native, the only value it accepts")        \
  X(bool, release_lock_on_cudamalloc, "release_lock_on_cudamalloc",                               \
    any_value(), false, false, pytorch, keeps,                                                    \
    "PyTorch's: its lock released around cudaMalloc; accepted, not read by allocwatch")           \
  X(bool, pinned_use_cuda_host_register, "pinned_use_cuda_host_register",                         \
    any_value(), false, false, pytorch, keeps,                                                    \
    "PyTorch's pinned host allocator: pin with cudaHostRegister")                                 \
  X(std::size_t, pinned_num_register_threads, "pinned_num_register_threads",                      \
    power_of_two_up_to(128), 1, 1, pytorch, keeps,                                                \
    "PyTorch's pinned host allocator: threads that register pinned memory")                       \
  X(bool, pinned_use_background_threads, "pinned_use_background_threads",                         \
    any_value(), false, false, pytorch, keeps,                                                    \
    "PyTorch's pinned host allocator: process its events on a background thread")

// One row's description, for the code that lists or registers the keys.
struct SettingInfo {
  const char* key;
  const char* field;  // AllocatorConfig's member, and the binding's dictionary key
  const char* type;   // the C++ type, as the table spells it
  ValueRange range;
  SettingOrigin origin;
  OnPytorchCall on_pytorch_call;
  const char* help;
};

inline constexpr SettingInfo kSettings[] = {
#define ALLOCWATCH_SETTING_INFO(Type, field, key, range, native_default, allocwatch_default, \
                                origin, on_pytorch_call, help)                               \
  {key, #field, #Type, range, SettingOrigin::origin, OnPytorchCall::on_pytorch_call, help},
    ALLOCWATCH_SETTINGS(ALLOCWATCH_SETTING_INFO)
#undef ALLOCWATCH_SETTING_INFO
};

}  // namespace allocwatch
