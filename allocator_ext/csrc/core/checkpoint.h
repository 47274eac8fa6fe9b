// The layout of a private pool, as CUDA graph trees checkpoint it: every segment of the pool
// with its blocks in address order, which are allocated and which free. Restoring it frees
// whatever the pool has allocated now and carves the checkpointed blocks again at the same
// addresses, so that a recorded graph's tensors are where the graph expects them
// (CachingAllocator::checkpoint_pool / restore_pool, checkpoint.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "device.h"

namespace allocwatch {

struct BlockCheckpoint {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  bool allocated = false;
};

// One segment as the snapshot counts them: a contiguous mapped range (an ordinary segment, or
// a mapped run of an expandable one).
struct SegmentCheckpoint {
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  StreamId stream = 0;
  bool is_small = false;
  bool is_expandable = false;
  std::vector<BlockCheckpoint> blocks;
};

struct PoolCheckpoint {
  std::pair<std::uint64_t, std::uint64_t> pool{0, 0};
  std::vector<SegmentCheckpoint> segments;
};

// What a restore changed: the pointers it freed (allocated before, whatever their fate in the
// checkpoint) and the blocks it allocated (address, size), which the caller now owns.
struct CheckpointRestore {
  std::vector<std::uintptr_t> freed;
  std::vector<std::pair<std::uintptr_t, std::size_t>> allocated;
};

}  // namespace allocwatch
