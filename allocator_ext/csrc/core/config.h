// Allocator settings in the syntax of PYTORCH_CUDA_ALLOC_CONF.
//
//   "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:512"
//   "native"                              PyTorch's defaults
//   "native,expandable_segments:True"     PyTorch's defaults, then the keys that follow
//
// An update changes only the keys it names (PyTorch's own parser resets the others, a known
// pitfall when tuning a running job). A bad key or value throws ConfigError naming it, and the
// settings passed in are left untouched: parse into a copy, then swap.
#pragma once

#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sizes.h"

namespace allocwatch {

class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

constexpr std::size_t kNoMaxSplit = std::numeric_limits<std::size_t>::max();

struct AllocatorConfig {
  // --- PyTorch's keys, with PyTorch's defaults ---
  std::size_t max_split_size = kNoMaxSplit;          // max_split_size_mb
  std::size_t max_non_split_rounding = kLargeBuffer;  // max_non_split_rounding_mb
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;
  RoundupDivisions roundup_power2_divisions{};      // all 0: plain 512-byte rounding
  // Accepted so that a job's existing PYTORCH_CUDA_ALLOC_CONF keeps working; they steer
  // PyTorch's pinned host allocator or lock handling, which this allocator does not replace.
  bool release_lock_on_cudamalloc = false;
  bool pinned_use_cuda_host_register = false;
  std::size_t pinned_num_register_threads = 1;
  bool pinned_use_background_threads = false;

  // --- allocwatch's own keys (PyTorch has none of these; "native" leaves them off) ---
  // Page size of large-pool expandable segments. PyTorch maps 20 MiB at a time; smaller pages
  // waste less at the end of a segment at the price of more map calls.
  std::size_t expandable_large_page = kLargeBuffer;  // expandable_large_page_mb
  // Minimum growth of a large-pool expandable segment, mapped as one chunk (0: PyTorch's way,
  // one physical allocation and one map call per page).
  std::size_t expandable_grow = 0;  // expandable_grow_mb
  // Large-pool growth maps physical chunks of this size where a whole one fits, and single
  // pages for the rest (0: pages only).
  std::size_t expandable_chunk = 0;  // expandable_chunk_mb
  // Before an expandable segment grows past reserved memory's high-water mark, take wholly
  // free pages back from elsewhere, so that the growth reuses their memory instead of raising
  // reserved memory (expandable.cpp, Note [page policy]).
  bool reuse_free_pages = false;
  // With reuse_free_pages: a take-back that repeats one already made (the same request on the
  // same stream with the same bytes allocated) creates pages instead, once, where the fewest
  // are needed, so that a repeating workload stops moving pages (expandable.cpp, Note [page
  // policy], repeated moves).
  bool settle_page_moves = false;

  static AllocatorConfig native();     // PyTorch's defaults
  static AllocatorConfig allocwatch();  // allocwatch's defaults (chosen by the measures)

  bool operator==(const AllocatorConfig& other) const;

  // The settings as a string that parses back to them: "native" plus every key that differs
  // from PyTorch's defaults.
  std::string to_string() const;
  // Every key with its value, for reports and the agent.
  std::vector<std::pair<std::string, std::string>> items() const;
};

// Applies `text` on top of `base` and returns the result; throws ConfigError.
AllocatorConfig apply_config(const AllocatorConfig& base, const std::string& text);

// Splits a PyTorch settings string (PYTORCH_CUDA_ALLOC_CONF, _set_allocator_settings) into the
// entries this allocator knows, returned as a settings string, and the others ("key" and its
// value as written, lists included), which steer parts of PyTorch it does not replace
// (pinned memory, graph capture) or are PyTorch's own (per_process_memory_fraction). Nothing
// is validated here; apply_config does that.
std::string known_settings(const std::string& text,
                           std::vector<std::pair<std::string, std::string>>* others);

}  // namespace allocwatch
