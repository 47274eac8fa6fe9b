#include "expandable_segment.h"

#include <cassert>
#include <vector>

namespace allocwatch {

ExpandableSegment::ExpandableSegment(Device& device, StreamId stream, std::size_t address_space,
                                     std::size_t page_size)
    : device_(device),
      stream_(stream),
      page_size_(page_size),
      max_pages_((address_space + page_size - 1) / page_size) {
  // Alignment 0: the driver's granularity. Pages need no more (20 MiB pages could not ask for
  // theirs: the driver takes only power-of-two alignments).
  base_ = device_.reserve_address(page_size_ * max_pages_, 0);
}

ExpandableSegment::~ExpandableSegment() {
  // The allocator releases a segment only once every chunk is unmapped; this is a safety net
  // for teardown, where the device may already be gone, so errors are swallowed.
  try {
    for (const auto& [first, chunk] : chunks_) {
      device_.unmap(base_ + first * page_size_, chunk.pages * page_size_);
      device_.release_physical(chunk.handle, chunk.pages * page_size_);
    }
    device_.free_address(base_, page_size_ * max_pages_);
  } catch (...) {
  }
}

Range ExpandableSegment::map(Range r, std::size_t chunk_pages, std::vector<PhysicalHandle>* spare) {
  const std::size_t begin = page_floor(r.ptr);
  const std::size_t end = page_ceil(r.ptr + r.size);
  assert(base_ + begin * page_size_ == r.ptr);
  if (begin == end) return pages(begin, end);
  const std::size_t chunk = chunk_pages == 0 ? 1 : chunk_pages;
  std::vector<std::size_t> made;
  for (std::size_t first = begin, n = 0; first < end; first += n) {
    n = end - first >= chunk ? chunk : 1;
    PhysicalHandle handle = 0;
    if (n == 1 && spare != nullptr && !spare->empty()) {
      handle = spare->back();
      spare->pop_back();
    } else if (!device_.create_physical(n * page_size_, &handle)) {
      // Out of memory: give back what this call created, so nothing half-mapped remains.
      for (std::size_t f : made) {
        device_.release_physical(chunks_[f].handle, chunks_[f].pages * page_size_);
        chunks_.erase(f);
      }
      return pages(begin, begin);
    }
    chunks_[first] = Chunk{handle, n};
    made.push_back(first);
  }
  std::vector<Device::Mapping> mappings;
  for (std::size_t f : made) mappings.push_back({chunks_[f].pages * page_size_, chunks_[f].handle});
  device_.map_range(base_ + begin * page_size_, mappings);
  return pages(begin, end);
}

Range ExpandableSegment::unmap(Range r, std::size_t limit, std::vector<PhysicalHandle>* keep) {
  const std::size_t lo = page_ceil(r.ptr);
  const std::size_t hi = page_floor(r.ptr + r.size);
  if (lo >= hi) return Range{r.ptr, 0};
  // Chunks tile the mapped pages, so those wholly inside [lo, hi) form one contiguous run.
  std::vector<std::map<std::size_t, Chunk>::iterator> run;
  std::size_t bytes = 0;
  for (auto it = chunks_.lower_bound(lo); it != chunks_.end() && it->first + it->second.pages <= hi;
       ++it) {
    if (limit > 0 && bytes >= limit) break;
    run.push_back(it);
    bytes += it->second.pages * page_size_;
  }
  if (run.empty()) return Range{r.ptr, 0};
  // Unmapping does not wait for kernels still using the memory: the stream must be idle.
  device_.synchronize_stream(stream_);
  const std::size_t first = run.front()->first;
  for (auto it : run) {
    const std::size_t n = it->second.pages * page_size_;
    device_.unmap(base_ + it->first * page_size_, n);
    if (keep != nullptr && it->second.pages == 1) {
      keep->push_back(it->second.handle);
    } else {
      device_.release_physical(it->second.handle, n);
    }
    chunks_.erase(it);
  }
  return Range{base_ + first * page_size_, bytes};
}

std::size_t ExpandableSegment::mapped_bytes() const {
  std::size_t n = 0;
  for (const auto& [first, chunk] : chunks_) n += chunk.pages * page_size_;
  return n;
}

}  // namespace allocwatch
